"""PagedStep: what ``PagedKVCache.reserve`` returns, the int32 arrays one forward pass needs.

A step packs the new positions of several sequences into one ragged batch (no padding):
sequence ``i`` (``seq_ids[i]``) contributes positions ``q_indptr[i] .. q_indptr[i + 1] -
1`` of the packed arrays. Each new token has its ``position`` (for rotary embeddings) and
its ``slot`` (``block * block_size + offset``, where its K/V go). After the step every
sequence holds ``seq_lens[i]`` positions, in the pages ``kv_indices[kv_indptr[i] :
kv_indptr[i + 1]]``.

Two other libraries' dialects of the same tables are one call away:

- :meth:`PagedStep.flashinfer`: ``qo_indptr``, ``paged_kv_indptr``, ``paged_kv_indices``,
  ``paged_kv_last_page_len`` (FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper.plan``
  and ``BatchDecodeWithPagedKVCacheWrapper.plan`` take them: CSR page indices, and the
  number of entries in each sequence's last page, 1 to ``page_size``);
- :meth:`PagedStep.vllm`: ``block_tables`` (``[num_seqs, max_blocks]``, padded with 0),
  ``seq_lens``, ``slot_mapping`` (int64, as ``reshape_and_cache`` takes it) and
  ``query_start_loc`` (the cumulative query lengths, ``[num_seqs + 1]``).

On a CUDA cache the arrays are device arrays (copied once, when the step is made). A
step is valid until its cache next changes (a successful ``reserve``, ``add``, ``fork``,
``trim`` or ``free``); its arrays stay readable, but ``write`` and attention refuse it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PagedStep"]


class PagedStep:
    """The arrays of one step of a :class:`nbkv.PagedKVCache` (see the module docstring).

    Attributes
    ----------
    seq_ids, q_indptr, positions, slot_mapping, seq_lens : int32 arrays
    kv_indptr, kv_indices, last_page_len : int32 arrays, the page tables after the step
    num_tokens : int
        New positions in the step (``q_indptr[-1]``).
    """

    __slots__ = (
        "_owner", "_version", "_host", "_device", "block_size",
        "seq_ids", "q_indptr", "positions", "slot_mapping", "seq_lens",
        "kv_indptr", "kv_indices", "last_page_len", "num_tokens",
    )  # fmt: skip

    def __init__(self, owner: int, version: int, host: dict, to_device, block_size: int):
        self._owner, self._version, self._host = owner, version, host
        self._device = to_device
        self.block_size = block_size
        for name, arr in host.items():
            setattr(self, name, to_device(arr))
        self.num_tokens = int(host["q_indptr"][-1])

    @property
    def cache_id(self) -> int:
        """A number naming the cache that made the step, unique in the process."""
        return self._owner

    @property
    def version(self) -> int:
        """The cache's version when the step was made (it is stale once they differ)."""
        return self._version

    def host(self, name: str) -> np.ndarray:
        """The host copy of one of the step's arrays (the same array on a CPU cache)."""
        return self._host[name]

    def __repr__(self) -> str:
        h = self._host
        return (
            f"PagedStep(seq_ids={h['seq_ids'].tolist()}, new positions "
            f"{np.diff(h['q_indptr']).tolist()}, seq_lens={h['seq_lens'].tolist()}, "
            f"block_size={self.block_size})"
        )

    def flashinfer(self) -> dict[str, Any]:
        """The tables in FlashInfer's names (all int32)."""
        return {
            "qo_indptr": self.q_indptr,
            "paged_kv_indptr": self.kv_indptr,
            "paged_kv_indices": self.kv_indices,
            "paged_kv_last_page_len": self.last_page_len,
        }

    def vllm(self) -> dict[str, Any]:
        """The tables in vLLM's names: ``block_tables`` int32 ``[num_seqs, max_blocks]``
        padded with 0, ``seq_lens`` int32, ``slot_mapping`` int64, ``query_start_loc``
        int32."""
        h = self._host
        counts = np.diff(h["kv_indptr"])
        tables = np.zeros((len(counts), max(int(counts.max()), 1)), np.int32)
        for i, (start, n) in enumerate(zip(h["kv_indptr"][:-1], counts, strict=True)):
            tables[i, :n] = h["kv_indices"][start : start + n]
        return {
            "block_tables": self._device(tables),
            "seq_lens": self.seq_lens,
            "slot_mapping": self._device(h["slot_mapping"].astype(np.int64)),
            "query_start_loc": self.q_indptr,
        }
