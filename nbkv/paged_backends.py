"""The paged half of the backends: what :class:`nbkv.PagedKVCache` and paged attention
ask of a backend, for the CPU (:mod:`nbkv.kernels.cpu_paged`) and CUDA
(:mod:`nbkv.kernels.cuda_paged`).

A paged cache takes the backend of its device bound to the layout its blocks have as
rows (``"nhd"`` blocks are ``"bshd"`` rows, ``"hnd"`` blocks ``"bhsd"`` ones), so the
kernels of its layout are chosen once, as for the contiguous caches. Every array passed
here is in kernel form on the backend's device; the int32 tables are a step's.

``hint`` is ``(num_seqs, longest new run, longest visible span)`` from the step's host
arrays: the launch geometry, known without reading device memory.
"""

from __future__ import annotations

from typing import Any, Protocol

import numba
import numpy as np

from . import _config
from .errors import InvalidArgumentError
from .kernels import cpu_paged
from .launch import attention_grid, launch_config

__all__ = ["PagedBackend", "CPUPaged", "CUDAPaged"]

_GRID_YZ = 65_535  # CUDA's limit on gridDim.y and gridDim.z


class PagedBackend(Protocol):
    """What a paged cache and paged attention may ask of a backend (beyond
    :class:`nbkv.backends.Backend`)."""

    def write_paged(self, k: Any, v: Any, slot_mapping: Any, k_pool: Any, v_pool: Any) -> None:
        """Rows ``k``, ``v`` [total, num_kv_heads, head_dim] into the pools at their slots."""

    def copy_blocks(self, src: Any, dst: Any, k_pool: Any, v_pool: Any) -> None:
        """Blocks ``src[i]`` copied to ``dst[i]`` in both pools of one layer."""

    def paged_attend(
        self, q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens, scale, window,
        table, out, hint,
    ) -> None:  # fmt: skip
        """Attention of the packed queries over the pages; writes ``out``."""

    def paged_append_attend(
        self, q, k, v, slot_mapping, k_pool, v_pool, q_indptr, kv_indptr, kv_indices,
        seq_lens, scale, window, table, out, hint,
    ) -> None:  # fmt: skip
        """``write_paged`` then ``paged_attend`` (one launch on CUDA)."""


class CPUPaged:
    """Mixed into :class:`nbkv.backends.CPUBackend`: the ``@njit`` kernels themselves."""

    _PAGED = {  # layout -> (write, parallel attention, serial attention)
        "bshd": (cpu_paged.write_paged, cpu_paged.paged_attend, cpu_paged.paged_attend_serial),
        "bhsd": (
            cpu_paged.write_paged_hnd,
            cpu_paged.paged_attend_hnd,
            cpu_paged.paged_attend_hnd_serial,
        ),
    }
    layout: str

    def _bind_paged(self) -> None:
        self.write_paged, self._paged_attend, self._paged_serial = self._PAGED[self.layout]
        self.copy_blocks = cpu_paged.copy_blocks

    def paged_attend(
        self, q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens, scale, window,
        table, out, hint,
    ) -> None:  # fmt: skip
        """Small work runs on the calling thread (``ATTENTION_PARALLEL_MIN``, as
        contiguous attention). Otherwise a task is one sequence (a chunk of up to
        ``QUERY_CHUNK`` of its queries), every KV head; the positions are split when
        there are too few tasks to keep the thread pool busy."""
        num_seqs, max_new, longest = hint
        total, num_heads, dim = q.shape
        splits = _config.ATTENTION_SPLITS  # forced (tests, teaching), else automatic
        if splits is None:
            # elements of K/V read times the query rows each serves, at most
            if total * num_heads * longest * dim < _config.ATTENTION_PARALLEL_MIN:
                self._paged_serial(
                    q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens, scale,
                    window, out, table,
                )  # fmt: skip
                return
            # tasks: (sequence, chunk of QUERY_CHUNK queries); split the positions when
            # there are too few to keep every thread busy (a decode of a few sequences)
            tasks = num_seqs * -(-max_new // cpu_paged.QUERY_CHUNK)
            threads = numba.get_num_threads()
            splits = 1
            if tasks < 2 * threads and longest >= 256:
                splits = min(-(-2 * threads // tasks), longest // 128)
        self._paged_attend(
            q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens, scale, window, out,
            table, splits,
        )  # fmt: skip

    def paged_append_attend(
        self, q, k, v, slot_mapping, k_pool, v_pool, q_indptr, kv_indptr, kv_indices,
        seq_lens, scale, window, table, out, hint,
    ) -> None:  # fmt: skip
        # two kernels back to back: on the CPU one call buys nothing more
        self.write_paged(k, v, slot_mapping, k_pool, v_pool)
        self.paged_attend(
            q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens, scale, window,
            table, out, hint,
        )  # fmt: skip


class CUDAPaged:
    """Mixed into :class:`nbkv.cuda_backend.CUDABackend`: launches of
    :mod:`nbkv.kernels.cuda_paged` (compiled on first use)."""

    _dev: Any
    _bshd: bool

    def _paged(self):
        from .kernels import cuda_paged  # compiled on first use

        return cuda_paged

    def write_paged(self, k, v, slot_mapping, k_pool, v_pool) -> None:
        pk = self._paged()
        kernel = pk.write_paged_kernel if self._bshd else pk.write_paged_hnd_kernel
        blocks, threads = launch_config(int(np.prod(k.shape)))
        kernel[blocks, threads](k, v, slot_mapping, k_pool, v_pool)

    def copy_blocks(self, src, dst, k_pool, v_pool) -> None:
        per = int(np.prod(k_pool.shape[1:]))
        blocks, threads = launch_config(int(src.shape[0]) * per)
        self._paged().copy_blocks_kernel[blocks, threads](src, dst, k_pool, v_pool)

    def _paged_launch(self, kernel, q, k_pool, hint, args, out) -> None:
        """Size the grid and scratch, launch, and if anything fails, forget the scratch
        (its counters may be left part-way)."""
        attn = self._dev.attention_kernels()
        total, num_heads, dim = (int(x) for x in q.shape)
        kv_heads = int(k_pool.shape[2 if self._bshd else 1])
        num_seqs, max_new, span = hint
        grid = attention_grid(
            num_seqs, num_heads, kv_heads, max_new, span, sm_count=self._dev.sm_count(),
            tile=attn.TILE,
        )  # fmt: skip
        if max(grid.tasks, grid.chunks) > _GRID_YZ:
            raise InvalidArgumentError(
                f"the step needs a grid of {grid.tasks} (sequences x KV heads) by {grid.chunks} "
                f"(query-row chunks) blocks, but CUDA allows {_GRID_YZ} in each; run fewer "
                "sequences, or fewer new positions, per step"
            )
        part = self._dev.scratch(self._paged().paged_scratch_shapes(total, num_heads, dim, grid))
        try:
            kernel[tuple(grid), attn.THREADS](*args, *part, out)
        except BaseException:
            self._dev.drop_scratch()
            raise

    def paged_attend(
        self, q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens, scale, window,
        table, out, hint,
    ) -> None:  # fmt: skip
        pk = self._paged()
        kernel = pk.paged_attend_kernel if self._bshd else pk.paged_attend_hnd_kernel
        args = (q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens, scale, window)
        self._paged_launch(kernel, q, k_pool, hint, (*args, table), out)

    def paged_append_attend(
        self, q, k, v, slot_mapping, k_pool, v_pool, q_indptr, kv_indptr, kv_indices,
        seq_lens, scale, window, table, out, hint,
    ) -> None:  # fmt: skip
        pk = self._paged()
        kernel = pk.paged_append_attend_kernel if self._bshd else pk.paged_append_attend_hnd_kernel
        args = (q, k, v, slot_mapping, k_pool, v_pool, q_indptr, kv_indptr, kv_indices)
        self._paged_launch(kernel, q, k_pool, hint, (*args, seq_lens, scale, window, table), out)
