"""CPU (``@njit``) kernels of the paged cache: writes through a slot mapping, attention
through page tables, block copies. Pure functions over pools and int32 tables.

Pools: one K and one V pool per layer, ``[num_blocks, block_size, num_kv_heads,
head_dim]`` ("nhd") or ``[num_blocks, num_kv_heads, block_size, head_dim]`` ("hnd", the
``_hnd`` twins). A position's *slot* is ``block * block_size + offset``. Packed ragged
batches: the ``total`` new positions of every sequence one after the other, sequence
``s``'s at ``[q_indptr[s], q_indptr[s + 1])``, and its pages (block ids in position
order) at ``kv_indices[kv_indptr[s] : kv_indptr[s + 1]]`` (FlashInfer's CSR layout).

16-bit pools travel as ``uint16`` bits, widened by ``table`` (``nbkv.dtypes.widen_table``
of the pools' dtype) as in :mod:`nbkv.kernels.cpu_attention`; float32 and float64 pools
need none.

Example: a sequence of 5 positions in blocks 2 and 0 of a 4-position pool, one query.

>>> import numpy as np
>>> from nbkv.kernels import write_paged, paged_attend
>>> k_pool = np.zeros((3, 4, 1, 2), np.float32); v_pool = np.zeros_like(k_pool)
>>> k = np.ones((5, 1, 2), np.float32); v = np.arange(10, dtype=np.float32).reshape(5, 1, 2)
>>> slots = np.array([8, 9, 10, 11, 0], np.int32)  # block 2 (offsets 0-3), then block 0
>>> write_paged(k, v, slots, k_pool, v_pool)
>>> out = np.empty((1, 1, 2), np.float32)
>>> q = np.zeros((1, 1, 2), np.float32)  # equal scores: the mean of the 5 values
>>> paged_attend(q, k_pool, v_pool, np.array([0, 1], np.int32), np.array([0, 2], np.int32),
...              np.array([2, 0], np.int32), np.array([5], np.int32), 1.0, 0, out)
>>> out[0, 0].tolist()
[4.0, 5.0]
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import _config
from .cpu_attention import _FEW_ROWS, _mask, _online_softmax
from .cpu_math import kind16
from .cpu_paged_pages import accumulate_page, score_page
from .cpu_paged_prefill import outer_ok, outer_positions

# _FEW_ROWS (32 since 2026-12-07): a task of more query rows per KV head takes
# cpu_paged_prefill's gathered matrix products. Numba caches its value with this module's
# functions and does not see it change in cpu_attention: touch this file with it

__all__ = [
    "write_paged",
    "write_paged_hnd",
    "copy_blocks",
    "paged_attend",
    "paged_attend_hnd",
    "paged_attend_serial",
    "paged_attend_hnd_serial",
]

# queries per task: a long prefill is cut into chunks of them, which run in parallel
QUERY_CHUNK = 64
# positions ahead whose K/V rows are prefetched as a position's are read, wherever their
# page lies (the hardware prefetchers lose a stream of addresses at every page). Decode
# over 8 x 4,096 positions at block 16 (2 cores, Zen 4): 0.64x the contiguous kernel's
# throughput without, 0.87-0.91x with 32 ("nhd"); 16 and 64 did no better (benchmarks/)
PREFETCH_POSITIONS = 32
_CHUNK = 128  # positions scored per step of the online softmax (several blocks if small)
# "nhd" pools: runs of at most this many positions, every head each, so that a large page
# too is read in memory order (a 128-position page read head by head, its rows 4 KiB
# apart: 0.55x the contiguous kernel's throughput against 0.85x; one thread, 32 MiB)
_NHD_RUN = 16


@njit(cache=True, nogil=True)
def write_paged(k, v, slot_mapping, k_pool, v_pool):
    """Write new K/V rows into the pools at their slots; layout "nhd".

    k, v: [total, num_kv_heads, head_dim], any strides. slot_mapping: int [total]; a
    negative slot is skipped (vLLM's padding). k_pool, v_pool: [num_blocks, block_size,
    num_kv_heads, head_dim]. Mutates the pools.
    """
    bs = k_pool.shape[1]
    heads, dim = k.shape[1], k.shape[2]
    for t in range(k.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        b = slot // bs
        o = slot - b * bs
        for h in range(heads):
            for d in range(dim):
                k_pool[b, o, h, d] = k[t, h, d]
            for d in range(dim):
                v_pool[b, o, h, d] = v[t, h, d]


@njit(cache=True, nogil=True)
def write_paged_hnd(k, v, slot_mapping, k_pool, v_pool):
    """:func:`write_paged` for "hnd" pools [num_blocks, num_kv_heads, block_size,
    head_dim]. Mutates the pools."""
    bs = k_pool.shape[2]
    heads, dim = k.shape[1], k.shape[2]
    for t in range(k.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        b = slot // bs
        o = slot - b * bs
        for h in range(heads):
            for d in range(dim):
                k_pool[b, h, o, d] = k[t, h, d]
            for d in range(dim):
                v_pool[b, h, o, d] = v[t, h, d]


@njit(cache=True, nogil=True)
def copy_blocks(src, dst, k_pool, v_pool):
    """Copy whole blocks ``src[i]`` to ``dst[i]`` in both pools (copy-on-write), either
    layout. src, dst: int [n]. Mutates the pools."""
    for i in range(src.shape[0]):
        k_pool[dst[i]] = k_pool[src[i]]
        v_pool[dst[i]] = v_pool[src[i]]


@njit(cache=True)
def _segment(pages, bs, page_rows, at, j1, end, most):
    """``(page, off, n, ahead)``: the positions ``at .. at + n - 1`` (before ``j1``) lie
    at offsets ``off ..`` of one page, and so do the positions ``PREFETCH_POSITIONS`` on
    from them (rounded up to whole pages where a page is smaller), ``ahead`` rows of a
    head's rows away (``page_rows``: a page's; 0: those lie at or past ``end``, where
    this task stops). A page larger than the distance thus goes in two runs at least:
    its rows prefetched from itself, then from the next page; a smaller one in one.
    At most ``most`` positions a run."""
    page, off = pages[at // bs], at % bs
    n = min(bs - off, j1 - at, most)
    by = PREFETCH_POSITIONS
    if bs <= by:  # whole pages on: the positions ahead share the page's offsets
        by = -(-by // bs) * bs
    t = at + by
    if t >= end:
        return page, off, n, 0
    to = t % bs
    return page, off, min(n, bs - to), (pages[t // bs] - page) * page_rows + to - off


@njit(cache=True, fastmath=_config.FASTMATH, error_model="numpy")
def _paged_task(
    q, k_pages, v_pages, num_kv_heads, bs, q_indptr, kv_indptr, kv_indices, seq_lens,
    scale, window, table, splits, qchunks, task, part_acc, part_stats,
):  # fmt: skip
    """One (sequence, chunk of up to ``QUERY_CHUNK`` of its queries, split of the
    positions they see), every KV head: the online softmax over the split, left as
    partial (max, sum, accumulator) rows in ``part_*[token, query head, split]``.
    ``task = (sequence * qchunks + chunk) * splits + split``; ``k_pages``, ``v_pages``
    as :func:`nbkv.kernels.cpu_paged_pages.score_page` takes them.

    A task takes every head of its sequence, run by run (:func:`_segment`: a page, or a
    piece of a large one), so that it reads the pool in memory order (one task per head
    read a page in pieces a head apart: 0.8x the contiguous kernel's speed at block size
    16, measured), and prefetches ``PREFETCH_POSITIONS`` ahead (see there). A chunk of
    queries sees what its last query sees: the sequence as if it ended there. A prefill's
    chunk goes as :mod:`nbkv.kernels.cpu_paged_prefill` says, where that applies."""
    num_heads, dim = q.shape[1], q.shape[2]
    heads = num_kv_heads
    group = num_heads // heads
    sp = task % splits
    qc = (task // splits) % qchunks
    s_id = task // (splits * qchunks)
    n_all = q_indptr[s_id + 1] - q_indptr[s_id]
    i0 = qc * QUERY_CHUNK
    if i0 >= n_all:  # a chunk this sequence does not have
        return
    n_q = min(QUERY_CHUNK, n_all - i0)
    q0 = q_indptr[s_id] + i0
    seq_len = seq_lens[s_id] - (n_all - i0 - n_q)  # ends at the chunk's last query
    rows = group * n_q
    first = seq_len - n_q  # position of the chunk's first query
    lo = max(0, first - window + 1) if window > 0 else 0
    all_lo = max(0, seq_len - window) if window > 0 else 0
    per = -(-(seq_len - lo) // splits)
    start = lo + sp * per
    end = min(seq_len, start + per)
    qs, m, denom, acc = _task_state(q, q0, n_q, heads, scale)
    s = np.empty((heads, rows, _CHUNK), q.dtype)
    # 16-bit rows widened for _scores_heads ("nhd" pools only: "hnd" ones need none)
    buf = np.empty((min(bs, _CHUNK) if k_pages.ndim == 4 else 0, heads, dim), q.dtype)
    pages = kv_indices[kv_indptr[s_id] : kv_indptr[s_id + 1]]
    page_rows = heads * bs if k_pages.ndim == 3 else bs  # a page, in rows of a head
    most = bs if k_pages.ndim == 3 else _NHD_RUN  # positions per run (_segment)
    kind = -1 if table is None else kind16(table)  # 16-bit pools: float16 0, bfloat16 1
    prefill = start < end and rows > _FEW_ROWS and outer_ok(qs, k_pages, v_pages, acc, s, bs)
    if prefill:  # each head's positions gathered, as matrix products (cpu_paged_prefill)
        outer_positions(qs, k_pages, v_pages, pages, bs, start, end, first, n_q, all_lo,
                        window, kind, s, m, denom, acc)  # fmt: skip
    j0 = end if prefill else start
    while j0 < end:
        # a chunk of up to _CHUNK positions, page by page: score each page's rows into
        # their columns of s, one softmax update per head, then the V rows
        j1 = min(j0 + _CHUNK, end)
        at = j0
        while at < j1:
            page, off, n, ahead = _segment(pages, bs, page_rows, at, j1, end, most)
            score_page(qs, k_pages, page, off, n, kind, table, buf, s, at - j0, ahead)
            at += n
        nb = j1 - j0
        for h in range(heads):
            if j0 < all_lo or j1 > first + 1:
                _mask(s[h], nb, j0, first, n_q, True, window)
            _online_softmax(s[h], nb, m[h], denom[h], acc[h])
        at = j0
        while at < j1:
            page, off, n, ahead = _segment(pages, bs, page_rows, at, j1, end, most)
            accumulate_page(s, v_pages, page, off, n, kind, table, buf, acc, at - j0, ahead)
            at += n
        j0 = j1
    for h in range(heads):
        for r in range(rows):
            token, qh = q0 + r % n_q, h * group + r // n_q
            part_stats[token, qh, sp, 0] = m[h, r]
            part_stats[token, qh, sp, 1] = denom[h, r]
            for d in range(dim):
                part_acc[token, qh, sp, d] = acc[h, r, d]


@njit(cache=True)
def _task_state(q, q0, n_q, heads, scale):
    """Per KV head, a task's query rows ``qs`` (row ``g * n_q + i``: query ``q0 + i`` of
    the head's ``g``-th query head, scaled), maxima (-inf), sums and accumulators (0)."""
    num_heads, dim = q.shape[1], q.shape[2]
    group = num_heads // heads
    rows = group * n_q
    qs = np.empty((heads, rows, dim), q.dtype)
    for h in range(heads):
        for g in range(group):
            for i in range(n_q):
                for d in range(dim):
                    qs[h, g * n_q + i, d] = q[q0 + i, h * group + g, d] * scale
    m = np.full((heads, rows), -np.inf, q.dtype)
    denom = np.zeros((heads, rows), q.dtype)
    acc = np.zeros((heads, rows, dim), q.dtype)
    return qs, m, denom, acc


@njit(cache=True, error_model="numpy")
def _combine(part_acc, part_stats, out, row):
    """out[token, head] for ``row = token * num_heads + head``: the splits' partials,
    rescaled to their common maximum. One ``exp`` per split, not per split and element
    (that took 1 us per row at head_dim 128: 11% of a one-thread decode step over 8 x 512
    positions, 2.3 ms); the weighted rows are summed in ``out``'s dtype (float64 before;
    the weights' sum still is)."""
    token, h = row // out.shape[1], row % out.shape[1]
    splits, o = part_acc.shape[2], out[token, h]
    top = -np.inf
    poisoned = False
    for sp in range(splits):
        mx = part_stats[token, h, sp, 0]
        poisoned |= mx != mx
        top = max(top, mx)
    o[:] = 0.0
    total = 0.0
    for sp in range(splits):
        mx = part_stats[token, h, sp, 0]
        if mx != -np.inf:  # a split that saw nothing adds nothing
            w = np.exp(mx - top)
            total += w * part_stats[token, h, sp, 1]
            a = part_acc[token, h, sp]
            for d in range(o.shape[0]):
                o[d] += w * a[d]
    inv = np.nan if poisoned else 1.0 / total  # nothing seen: 0 * inf = NaN
    for d in range(o.shape[0]):
        o[d] *= inv


@njit(cache=True)
def _scratch(q, q_indptr, splits):
    """Partial results of every (packed query, head, split): accumulators and (max, sum);
    and the query chunks per sequence."""
    longest = 1
    for s_id in range(q_indptr.shape[0] - 1):
        longest = max(longest, q_indptr[s_id + 1] - q_indptr[s_id])
    total, num_heads, dim = q.shape
    return (
        np.empty((total, num_heads, splits, dim), q.dtype),
        np.empty((total, num_heads, splits, 2), q.dtype),
        -(-longest // QUERY_CHUNK),
    )


# Both entry points hold their own prange loops: a cache=True function that calls a
# parallel=True one crashed when Numba loaded it back from its cache (numba 0.68).
@njit(parallel=True, cache=True)
def paged_attend_hnd(
    q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens, scale, window, out,
    table=None, splits=1,
):  # fmt: skip
    """Attention of each sequence's new positions over every position it holds, "hnd".

    q: [total, num_heads, head_dim], float32 or float64 (the accumulator type); sequence
    ``s``'s queries are rows ``q_indptr[s] .. q_indptr[s + 1] - 1``, its last positions.
    k_pool, v_pool: [num_blocks, num_kv_heads, block_size, head_dim], C-contiguous
    (uint16 bits of 16-bit pools, widened by ``table``). kv_indptr, kv_indices: each
    sequence's pages. seq_lens: positions each holds (its queries included). scale: the
    scores' factor. window: > 0 limits each query to the last ``window`` positions, its
    own included. splits: each sequence's positions are cut into this many ranges,
    attended in parallel and combined (for few, long sequences). Causal. Mutates ``out``
    [total, num_heads, head_dim], q's dtype.
    """
    nb, num_kv_heads, bs, dim = k_pool.shape
    k_pages = k_pool.reshape(nb * num_kv_heads, bs, dim)  # (block, head) pairs: no copy
    v_pages = v_pool.reshape(nb * num_kv_heads, bs, dim)
    part_acc, part_stats, qchunks = _scratch(q, q_indptr, splits)
    for task in prange(seq_lens.shape[0] * qchunks * splits):
        _paged_task(
            q, k_pages, v_pages, num_kv_heads, bs, q_indptr, kv_indptr, kv_indices,
            seq_lens, scale, window, table, splits, qchunks, task, part_acc, part_stats,
        )  # fmt: skip
    for row in prange(out.shape[0] * out.shape[1]):
        _combine(part_acc, part_stats, out, row)


@njit(parallel=True, cache=True)
def paged_attend(
    q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens, scale, window, out,
    table=None, splits=1,
):  # fmt: skip
    """:func:`paged_attend_hnd` for "nhd" pools [num_blocks, block_size, num_kv_heads,
    head_dim] (any strides; C-contiguous is the fast case). Mutates ``out``."""
    bs, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    part_acc, part_stats, qchunks = _scratch(q, q_indptr, splits)
    for task in prange(seq_lens.shape[0] * qchunks * splits):
        _paged_task(
            q, k_pool, v_pool, num_kv_heads, bs, q_indptr, kv_indptr, kv_indices,
            seq_lens, scale, window, table, splits, qchunks, task, part_acc, part_stats,
        )  # fmt: skip
    for row in prange(out.shape[0] * out.shape[1]):
        _combine(part_acc, part_stats, out, row)


@njit(cache=True)
def _attend_serial(
    q, k_pages, v_pages, num_kv_heads, bs, q_indptr, kv_indptr, kv_indices, seq_lens,
    scale, window, out, table,
):  # fmt: skip
    part_acc, part_stats, qchunks = _scratch(q, q_indptr, 1)
    for task in range(seq_lens.shape[0] * qchunks):
        _paged_task(
            q, k_pages, v_pages, num_kv_heads, bs, q_indptr, kv_indptr, kv_indices,
            seq_lens, scale, window, table, 1, qchunks, task, part_acc, part_stats,
        )  # fmt: skip
    for row in range(out.shape[0] * out.shape[1]):
        _combine(part_acc, part_stats, out, row)


@njit(cache=True)
def paged_attend_serial(
    q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens, scale, window, out,
    table=None,
):  # fmt: skip
    """:func:`paged_attend` on the calling thread alone ("nhd"): for small steps (a decode
    step of a small model), where waking a thread pool costs more than it saves; and
    inside a user's own parallel loop. Mutates ``out``."""
    _attend_serial(
        q, k_pool, v_pool, k_pool.shape[2], k_pool.shape[1], q_indptr, kv_indptr,
        kv_indices, seq_lens, scale, window, out, table,
    )  # fmt: skip


@njit(cache=True)
def paged_attend_hnd_serial(
    q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens, scale, window, out,
    table=None,
):  # fmt: skip
    """:func:`paged_attend_serial` for "hnd" pools (C-contiguous). Mutates ``out``."""
    nb, num_kv_heads, bs, dim = k_pool.shape
    _attend_serial(
        q, k_pool.reshape(nb * num_kv_heads, bs, dim), v_pool.reshape(nb * num_kv_heads, bs, dim),
        num_kv_heads, bs, q_indptr, kv_indptr, kv_indices, seq_lens, scale, window, out, table,
    )  # fmt: skip
