"""Helpers of notebook 06 (paging): a picture of a block pool, and the memory that
contiguous and paged allocation reserve for a spread of request lengths.

Everything here reads a :class:`nbkv.PagedKVCache` through its public methods only
(``seq_ids``, ``seq_len``, ``block_table``, ``block_refs``, ``cached_blocks``, ``stats``).

>>> import nbkv
>>> from nbkv.tutorial.paging import pool_map
>>> cache = nbkv.PagedKVCache(6, 4, num_kv_heads=1, head_dim=2, dtype="float32")
>>> a = cache.add(); _ = cache.reserve({a: 6})
>>> m = pool_map(cache)
>>> m.owner.tolist(), m.fill.tolist()
([0, 0, -1, -1, -1, -1], [4, 2, 0, 0, 0, 0])
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ..errors import InvalidArgumentError

__all__ = [
    "PoolMap",
    "pool_map",
    "draw_pool",
    "request_lengths",
    "reserved_over_data",
    "paged_copy",
]

FREE, CACHED = -1, -2  # PoolMap.owner of a block no sequence holds


class PoolMap(NamedTuple):
    """Per block of a pool: ``owner`` (the first live sequence whose table holds it;
    ``FREE`` = -1, ``CACHED`` = -2 for an evictable prefix block), ``refs`` (how many
    tables hold it: above 1 it is shared) and ``fill`` (positions held in it)."""

    owner: np.ndarray
    refs: np.ndarray
    fill: np.ndarray


def pool_map(cache: Any) -> PoolMap:
    """Who holds each block of ``cache`` and how full it is (see :class:`PoolMap`)."""
    n, bs = cache.num_blocks, cache.block_size
    owner = np.full(n, FREE, np.int64)
    owner[cache.cached_blocks()] = CACHED
    fill = np.zeros(n, np.int64)
    for sid in cache.seq_ids:
        length = cache.seq_len(sid)
        for i, b in enumerate(cache.block_table(sid).tolist()):
            if owner[b] < 0:
                owner[b] = sid
            fill[b] = max(fill[b], min(bs, length - i * bs))
    return PoolMap(owner, cache.block_refs().astype(np.int64), fill)


def draw_pool(ax: Any, cache: Any, title: str | None = None, *, per_row: int = 16) -> None:
    """Draw the pool on a matplotlib ``ax``: one square per block, coloured by its owner
    (grey: free; hatched white: cached), filled from the bottom as far as it holds
    positions, a bold edge and the count where several sequences share it."""
    import matplotlib.patches as patches
    import matplotlib.pyplot as plt

    m = pool_map(cache)
    colours = plt.get_cmap("tab10")
    bs = cache.block_size
    rows = math.ceil(cache.num_blocks / per_row)
    for b in range(cache.num_blocks):
        x, y = b % per_row, rows - 1 - b // per_row
        own = int(m.owner[b])
        face = "0.92" if own == FREE else "white" if own == CACHED else colours(own % 10)
        ax.add_patch(patches.Rectangle((x, y), 0.9, 0.9, facecolor="white", edgecolor="0.6"))
        if own >= 0:
            h = 0.9 * m.fill[b] / bs
            ax.add_patch(patches.Rectangle((x, y), 0.9, h, facecolor=face, edgecolor="none"))
        elif own == CACHED:
            ax.add_patch(patches.Rectangle((x, y), 0.9, 0.9, facecolor="white", hatch="///",
                                           edgecolor="0.5"))  # fmt: skip
        else:
            ax.add_patch(patches.Rectangle((x, y), 0.9, 0.9, facecolor=face, edgecolor="0.8"))
        if m.refs[b] > 1:
            ax.add_patch(patches.Rectangle((x, y), 0.9, 0.9, fill=False, linewidth=2.5,
                                           edgecolor="black"))  # fmt: skip
            ax.text(x + 0.45, y + 0.45, f"x{m.refs[b]}", ha="center", va="center", fontsize=8)
        ax.text(x + 0.05, y + 0.72, str(b), fontsize=6, color="0.3")
    handles = [
        patches.Patch(facecolor=colours(sid % 10), label=f"sequence {sid}") for sid in cache.seq_ids
    ]
    handles.append(patches.Patch(facecolor="0.92", edgecolor="0.8", label="free"))
    if cache.prefix_caching:
        handles.append(patches.Patch(facecolor="white", hatch="///", edgecolor="0.5",
                                     label="cached (evictable)"))  # fmt: skip
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_xlim(-0.1, per_row)
    ax.set_ylim(-0.1, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)


def request_lengths(n: int, *, median: float, sigma: float, cap: int, seed: int = 0) -> np.ndarray:
    """``n`` request lengths (prompt + output, in positions) from a lognormal distribution
    of this ``median`` and ``sigma``, clipped to ``[1, cap]``: a long tail, as the request
    lengths of chat traffic have (int64).

    >>> request_lengths(5, median=100, sigma=1.0, cap=1000, seed=0).tolist()
    [113, 87, 189, 111, 58]
    """
    if n < 1 or cap < 1 or median <= 0 or sigma < 0:
        raise InvalidArgumentError(
            f"need n >= 1, cap >= 1, median > 0, sigma >= 0; got {n}, {cap}, {median}, {sigma}"
        )
    rng = np.random.default_rng(seed)
    return np.clip(np.exp(rng.normal(math.log(median), sigma, n)).astype(np.int64), 1, cap)


def reserved_over_data(lengths: np.ndarray, block_sizes) -> dict:
    """Bytes reserved over bytes holding data when every request of ``lengths`` is held
    at once: ``"contiguous"`` (one buffer per request sized to the longest, as the rows
    of a batched ``LayerKVCache``) and, per block size, a real ``PagedKVCache`` holding
    them (one KV head of head_dim 1: the ratio does not depend on the sizes), read from
    its ``stats()``.

    >>> r = reserved_over_data(np.array([3, 10]), [1, 4])
    >>> r["contiguous"], r[1], r[4]
    (1.5384615384615385, 1.0, 1.2307692307692308)
    """
    from ..paged import PagedKVCache  # the tutorial package imports nothing heavy at import

    lengths = np.asarray(lengths, np.int64)
    out: dict = {"contiguous": float(len(lengths) * lengths.max() / lengths.sum())}
    for bs in block_sizes:
        blocks = int(sum(-(-lengths // bs)))
        cache = PagedKVCache(blocks, int(bs), num_kv_heads=1, head_dim=1, dtype="float32")
        for n in lengths.tolist():
            cache.reserve({cache.add(): n})
        s = cache.stats()
        out[int(bs)] = s["bytes_reserved"] / s["bytes_data"]
    return out


def paged_copy(K: np.ndarray, V: np.ndarray, block_size: int = 16, *, grow_by: int | None = None,
               layout: str = "nhd", new: int = 1):  # fmt: skip
    """A one-layer ``PagedKVCache`` holding the K/V of a contiguous batch, and the step of
    its last ``new`` positions: ``(cache, step)``, ready for ``nbkv.paged_attention`` with
    ``new`` queries per sequence (1: a decode step; more: the end of a prefill).

    K, V: ``[seqs, num_kv_heads, seq_len, head_dim]`` float arrays ("bhsd", as a
    ``LayerKVCache`` holds them). ``grow_by``: the sequences grow together this many
    positions per step (``block_size`` interleaves their blocks in the pool, as decoding
    sequences leave them) before the last step; None: each is prefilled in one step (its
    blocks consecutive). ``new``: 1 to ``seq_len``.

    >>> import numpy as np
    >>> K = np.arange(2 * 1 * 5 * 2, dtype=np.float32).reshape(2, 1, 5, 2)
    >>> cache, step = paged_copy(K, -K, 2, grow_by=2)
    >>> cache.block_table(0).tolist(), cache.block_table(1).tolist(), step.seq_lens.tolist()
    ([0, 2, 4], [1, 3, 5], [5, 5])
    >>> bool((cache.get_kv(0, 1)[0] == K[1]).all())
    True
    >>> paged_copy(K, -K, 2, new=3)[1].q_indptr.tolist()  # three new positions each
    [0, 3, 6]
    """
    from ..paged import PagedKVCache

    seqs, kv_heads, seq_len, head_dim = K.shape
    if not 1 <= new <= seq_len:
        raise InvalidArgumentError(f"new must be 1 to seq_len ({seq_len}), got {new!r}")
    cache = PagedKVCache(
        seqs * -(-seq_len // block_size), block_size, num_kv_heads=kv_heads,
        head_dim=head_dim, dtype=K.dtype, layout=layout,
    )  # fmt: skip
    sids = [cache.add() for _ in range(seqs)]

    def rows(X, lo, hi):  # [seqs * n, kv_heads, head_dim], sequence by sequence
        return np.ascontiguousarray(X[:, :, lo:hi].transpose(0, 2, 1, 3)).reshape(
            -1, kv_heads, head_dim
        )

    held = seq_len - new  # positions written before the last step
    chunk = grow_by or max(held, 1)
    for at in range(0, held, chunk):
        n = min(chunk, held - at)
        step = cache.reserve(dict.fromkeys(sids, n))
        cache.write(0, step, rows(K, at, at + n), rows(V, at, at + n))
    step = cache.reserve(dict.fromkeys(sids, new))
    cache.write(0, step, rows(K, held, seq_len), rows(V, held, seq_len))
    return cache, step
