"""The paged kernels' prefill: a task of more than 32 query rows per KV head
(``cpu_attention._FEW_ROWS``: a decode step up to group 32 keeps the page tiles, 1.35-1.47x
as fast at groups 12-16 as this path on the Zen 3 guest of 2026-12-07) takes the
contiguous kernel's matrix products (:mod:`nbkv.kernels.cpu_prefill`) over each head's
positions, gathered from their pages into two small buffers first.

Scored page by page through the decode step's tiles (``nbkv.kernels.cpu_paged``'s path
for a few rows), a prefill of 512 queries over 4,096 positions took 413 ms ("nhd", block
16) and 315 ("hnd") on the Zen 2 guest (AVX2) of 2026-12-06, against the contiguous
kernel's 217: none of the contiguous prefill's work reached it. Gathered, 233-234 ms in
either layout, against 219 (``benchmarks/bench_paged.py``, "The prefill part" in
``benchmarks/README.md``).
The copy is small beside the arithmetic: a step's 128 positions of one head are 64 KiB
of K and of V at head_dim 128, against 4 x 128 FLOP per position and query row, and 256
query rows per task at group 4. Where :func:`cpu_prefill.applies` does not hold
(AVX-512 targets, float64, head_dims not a multiple of 16), the tiles take it.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from .. import _config
from .cpu_attention import _mask, _online_softmax
from .cpu_prefill import accumulate_outer, applies, scores_outer, transpose_rows

__all__ = ["outer_ok", "outer_positions"]


def _head_rows(pool, page, off, n, h, heads):
    """Head ``h``'s rows at offsets ``off .. off + n - 1`` of ``page`` (``heads``: KV heads
    per page), [n, head_dim]: of an "hnd" pool as ``_paged_task`` takes it ([blocks *
    heads, block_size, head_dim]) or of an "nhd" one. By the overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


@overload(_head_rows, inline="always", jit_options={"cache": True})
def _head_rows_impl(pool, page, off, n, h, heads):
    if pool.ndim == 3:
        return lambda pool, page, off, n, h, heads: pool[page * heads + h, off : off + n]
    return lambda pool, page, off, n, h, heads: pool[page, off : off + n, h]


@njit(cache=True)
def _gather_head(k_pages, v_pages, pages, bs, h, heads, j0, j1, kind, kt, vg):
    """Head ``h``'s positions ``j0 .. j1 - 1`` (at most ``kt``'s columns), page by page:
    K transposed and widened into ``kt[:, j - j0]`` (:func:`transpose_rows`), V rows as
    stored into ``vg[j - j0]``. Mutates ``kt`` and ``vg``."""
    at = j0
    while at < j1:
        page, off = pages[at // bs], at % bs
        n = min(bs - off, j1 - at)
        c = at - j0
        transpose_rows(_head_rows(k_pages, page, off, n, h, heads), kind, kt[:, c:])
        vg[c : c + n] = _head_rows(v_pages, page, off, n, h, heads)
        at += n


@njit(cache=True)
def outer_ok(qs, k_pages, v_pages, acc, s, bs):
    """Whether :func:`outer_positions` can take a task with query rows ``qs`` and
    accumulators ``acc`` [heads, rows, head_dim] and score buffer ``s`` [heads, rows,
    positions per step] over these pools of pages of ``bs`` positions: ``applies``, asked
    of the first page's rows (every page's have the same strides)."""
    heads = qs.shape[0]
    k_rows = _head_rows(k_pages, 0, 0, bs, 0, heads)
    v_rows = _head_rows(v_pages, 0, 0, bs, 0, heads)
    return applies(qs[0], k_rows, v_rows, acc[0], s.shape[2])


@njit(cache=True, fastmath=_config.FASTMATH, error_model="numpy")
def outer_positions(
    qs, k_pages, v_pages, pages, bs, start, end, first, n_q, all_lo, window, kind,
    s, m, denom, acc,
):  # fmt: skip
    """A prefill chunk's online softmax over positions ``start .. end - 1`` of the pages
    ``pages`` (its first query at ``first``, ``n_q`` queries; ``all_lo``, ``window``,
    ``kind``: as ``_paged_task``'s), as the contiguous kernel takes one: per step of
    ``s.shape[2]`` positions and per head, the head's K rows gathered transposed and its V
    rows gathered (:func:`_gather_head`), then the score and V passes as matrix products
    (``cpu_prefill``). Only where :func:`outer_ok` holds. Mutates ``s``, ``m``, ``denom``
    and ``acc``."""
    heads, dim, step = qs.shape[0], qs.shape[2], s.shape[2]
    kt = np.empty((dim, step), np.float32)  # a head's K rows, transposed
    vg = np.empty((step, dim), v_pages.dtype)  # and its V rows, as stored
    for j0 in range(start, end, step):
        j1 = min(j0 + step, end)
        nb = j1 - j0
        for h in range(heads):
            _gather_head(k_pages, v_pages, pages, bs, h, heads, j0, j1, kind, kt, vg)
            scores_outer(qs[h], kt, s[h], 0, nb)
            if j0 < all_lo or j1 > first + 1:
                _mask(s[h], nb, j0, first, n_q, True, window)
            _online_softmax(s[h], nb, m[h], denom[h], acc[h])
            accumulate_outer(s[h], vg[:nb], acc[h], 0, kind)
