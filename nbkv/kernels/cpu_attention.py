"""CPU (``@njit``) attention over a K/V cache: decode and prefill chunks, grouped-query.

One task per (batch row, KV head), run in parallel: the task reads each cached K and V
row once and uses it for every query head of its group (query head ``h`` reads KV head
``h // group``), so K/V are never repeated. The sequence is walked in blocks with an
online (streaming) softmax: per query row a running maximum ``m``, a running sum ``l`` of
``exp(score - m)`` and an accumulator of weighted V rows, rescaled whenever ``m`` grows.

Array parameters carry their shape. Queries are the last ``n_q`` of the ``seq_len``
positions held: query ``i`` sits at position ``p = seq_len - n_q + i`` and sees positions
``j <= p`` (``causal``) and ``j > p - window`` (``window > 0``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.core import types
from numba.extending import overload

from .. import _config
from .cpu import write_kv, write_kv_bshd
from .cpu_loops import accumulate_4x8, scores_4x4, value_of
from .cpu_math import exp_of, kind16, prefetch_ahead, widen16
from .cpu_prefill import accumulate_outer, scores_outer, transpose_rows
from .cpu_prefill import applies as outer_applies
from .cpu_simd import (
    LANES,
    accumulate_lines,
    accumulate_pieces,
    accumulate_rows,
    packed,
    score_tile,
    tile_lanes,
    tile_ok,
)
from .cpu_vector import row_max

__all__ = ["attend", "attend_serial", "attend_bshd", "append_attend", "append_attend_bshd"]

# positions scored per step of the online softmax, for a chunk of more than _FEW_ROWS
# query rows (a prefill chunk): a block of K (or V) rows, 32 KiB of float32 at head_dim
# 128, stays in L1/L2 while every query row of the group uses it. Also the piece of a
# longer block that a 16-bit cache's V pass takes at a time (_accumulate_block), except
# for rows one after another where vectors are narrower than AVX-512's (pieces of 32)
_BLOCK = 64
# query rows per chunk (group x queries): 128 rows of accumulators at head_dim 128 are
# 64 KiB, which stay in L2 while the chunk walks the cache
_CHUNK_ROWS = 128
# a chunk of at most _FEW_ROWS query rows (a decode step of one token's group, or a short
# chunk) walks blocks of up to _LONG_BLOCK positions, _LONG_BYTES of K (and of V) at most:
# 512 positions of float32 or 16-bit K/V at head_dim 128, in L2 (float64 or float32 at
# head_dim 256: 256). On the Zen 4 of 2026-12-05 the float32 step at 16k took 3.28 ms
# instead of 3.70 with the read ceiling at 2.29 ms in both runs (paired share 63% -> 72%;
# benchmarks/README.md); 1,024 was no better, 2,048 and up worse (K and V blocks outgrow
# L2). 16-bit caches, bound by their arithmetic, gained only with their V pass in pieces
# of _BLOCK (whole blocks of 512 were up to 7% slower than blocks of 64; in pieces, 7-10%
# faster with fast memory, the same with slow)
_LONG_BLOCK = 512
_LONG_BYTES = 256 * 1024
# up to 32 rows: a decode step at any group up to 32 (Llama-3-405B's 16, Mistral Large's
# 12), or a few queries at once (speculative decoding's checks: 4-8 queries at group 4).
# More rows take cpu_prefill's matrix products where they apply (AVX2 and narrower): on
# the Zen 3 guest of 2026-12-07 the tiles were 1.20-1.53x as fast at 12-16 rows, 1.13-1.25x
# at 32 (benchmarks/probe_few_rows.py); at 48-64 an ad hoc probe found no more than its
# noise (benchmarks/README.md, "bench_groups.py"). cpu_paged imports it: Numba's disk
# cache does not see a change made here, so touch cpu_paged.py with it
_FEW_ROWS = 32
# rows prefetched (into L2: cpu_math.PREFETCH_LOCALITY) ahead of the row computed, spread
# over the arithmetic (a whole block's 1,024 lines asked for at once stalled: 9.7 ms for
# 32k float16 decode against 4.2)
_AHEAD = 64

# where the V pass's vectors are narrower than AVX-512's (tile_lanes: AVX2's 8 lanes, or
# 4), each of its passes over a block would read one line of every row (8 passes at
# head_dim 128, float32): _accumulate_block takes the rows in short pieces instead, each
# pass (float32: cpu_simd.accumulate_lines) or each position of a pass (16-bit:
# accumulate_pieces) asking for rows ahead; those functions say what that saved
_LINE_PASSES = tile_lanes() < LANES
# float32 K and V rows prefetched ahead on those targets: 16 rows (8 KiB at head_dim 128)
# rather than _AHEAD. On the Zen 2 guest of 2026-12-06 the K pass alone (scores and
# softmax, 8 heads x 32k, cold) took 6.2-6.5 ms at 16 rows, 7.1-7.4 at 64, 6.7-6.8 with
# none (8 rows: no better; benchmarks/README.md, "On an AMD EPYC Zen 2"); on the Zen 3
# guest of 2026-12-07 accumulate_lines did as well at 8-16 rows ahead and worse at 24-32.
# 16-bit K keeps _AHEAD: with K and V both at 16 rows the float16 step took 7.4-7.5 ms
# against 6.4-6.6 at 64 (Zen 2)
_AHEAD_32 = 16 if _LINE_PASSES else _AHEAD


def _rows(src, table, buf):
    """Cached rows ``src`` (``[n, head_dim]``, or ``[n, num_kv_heads, head_dim]`` for the
    paged cache's "nhd" pages) as an array of ``buf``'s dtype and rank. By the overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


@overload(_rows, jit_options={"cache": True})
def _rows_impl(src, table, buf):
    if src.dtype == types.uint16:
        # 16-bit floats arrive as bit patterns, widened into the buffer by the CPU's
        # float16 conversion or bfloat16's shift (vectorised; the table only names which)
        if src.ndim == 3:

            def widen_heads(src, table, buf):
                kind = kind16(table)
                out = buf[: src.shape[0]]
                for j in range(src.shape[0]):
                    for h in range(src.shape[1]):
                        row, dst = src[j, h], out[j, h]
                        for d in range(src.shape[2]):
                            dst[d] = widen16(row[d], kind)
                return out

            return widen_heads

        def widen(src, table, buf):
            kind = kind16(table)
            out = buf[: src.shape[0]]
            for j in range(src.shape[0]):
                row, dst = src[j], out[j]
                for d in range(src.shape[1]):
                    dst[d] = widen16(row[d], kind)
            return out

        return widen
    return lambda src, table, buf: src  # float32/float64 rows are read in place


@njit(cache=True, fastmath=_config.FASTMATH)
def _scores(qs, kb, s, c0, kind=-1, ahead=0):
    """s[r, c0 + j] = qs[r] . kb[j] for every query row r and cached row j of the block
    (``c0`` > 0: the block is a page of a longer chunk, as in the paged kernels). ``kb``
    may be 16-bit bits, widened as they are loaded (``kind``, see
    :func:`nbkv.kernels.cpu_loops.value_of`): no widened copy is written and read back
    (that pass took a third of a decode step).
    ``ahead`` not 0: as row ``j`` is scored, row ``j + ahead`` is prefetched (in this
    block, or past it: the next block of contiguous rows, or a paged kernel's page ahead,
    in strides).

    Four query rows by four K rows per pass: each K element loaded feeds four dot
    products and each query element four. Where :func:`nbkv.kernels.cpu_simd.tile_ok`
    holds (float32 queries, head_dim a multiple of 16, unit-stride rows) the pass is
    :func:`~nbkv.kernels.cpu_simd.score_tile`, in vector IR with one reduction for its
    16 sums; otherwise the loop below, which LLVM vectorises with a reduction per sum.
    (One K row per pass took 2.2x as long at head_dim 128, group 4.)
    """
    rows, dim = qs.shape
    nb = kb.shape[0]
    simd = tile_ok(qs, kb)  # float32 queries, head_dim a multiple of 16, unit strides
    # 16-bit K: the tile prefetches as it reads (its 32k decode step 10% faster with fast
    # memory); float32 K lines are all asked for before each tile (10% slower the
    # other way: that step is bound by the memory)
    narrow = kb.itemsize == 2
    r = 0
    while r + 4 <= rows:
        q0, q1, q2, q3 = qs[r], qs[r + 1], qs[r + 2], qs[r + 3]
        j = 0
        while simd and j + 4 <= nb:  # the tile in vector IR (nbkv.kernels.cpu_simd)
            if r == 0 and not narrow:
                prefetch_ahead(kb, j, 4, ahead)
            score_tile(qs, r, kb, j, s, c0 + j, kind, ahead if r == 0 and narrow else 0)
            j += 4
        while j + 4 <= nb:
            if r == 0:  # the first rows' pass reads the block from memory
                prefetch_ahead(kb, j, 4, ahead)
            scores_4x4(qs, kb, s, c0, kind, r, j)
            j += 4
        while j < nb:  # the last rows of a block not a multiple of four
            if r == 0:
                prefetch_ahead(kb, j, 1, ahead)
            ka = kb[j]
            a0 = a1 = a2 = a3 = qs.dtype.type(0.0)
            for d in range(dim):
                x = value_of(ka[d], kind)
                a0 += q0[d] * x
                a1 += q1[d] * x
                a2 += q2[d] * x
                a3 += q3[d] * x
            s[r, c0 + j], s[r + 1, c0 + j], s[r + 2, c0 + j], s[r + 3, c0 + j] = a0, a1, a2, a3
            j += 1
        r += 4
    while r < rows:  # the rows left over, one at a time
        qr = qs[r]
        for j in range(nb):
            if r == 0:  # fewer than four rows: this pass is the first
                prefetch_ahead(kb, j, 1, ahead)
            kr = kb[j]
            a0 = qr.dtype.type(0.0)
            for d in range(dim):
                a0 += qr[d] * value_of(kr[d], kind)
            s[r, c0 + j] = a0
        r += 1


# error_model="numpy": a division by zero gives inf or NaN as IEEE says, never an exception
@njit(cache=True, fastmath=_config.FASTMATH, error_model="numpy")
def _attend_task(q, k_cache, v_cache, seq_len, scale, causal, window, table, out, task):
    """:func:`attend` for one (batch row, KV head) pair, ``task = b * num_kv_heads + kvh``.

    The queries go in chunks of ``_CHUNK_ROWS // group`` (a decode step is one chunk):
    a chunk's running state (``acc``: 64 KiB at head_dim 128) stays in the L1/L2 caches
    while it walks the positions its queries see, which a prefill's whole group would not
    (512 queries at group 4: 1 MiB of accumulators, rewritten once per block). The walk
    goes in blocks of :func:`_block_size` positions: 512 for a decode step over float32 or
    16-bit K/V at head_dim 128, 64 for a prefill chunk."""
    batch, num_heads, n_q, dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    first = seq_len - n_q  # position of the first query (the last is seq_len - 1)
    b = task // num_kv_heads
    kvh = task - b * num_kv_heads
    chunk = max(1, min(n_q, _CHUNK_ROWS // group))  # queries per chunk
    size = group * chunk  # query rows per chunk: row r = g * n_c + i
    qs_buf = np.empty((size, dim), q.dtype)  # the chunk's queries, scale folded in
    m_buf = np.empty(size, q.dtype)  # running maximum score per row
    denom_buf = np.empty(size, q.dtype)  # running sum of exp(score - m)
    acc_buf = np.empty((size, dim), q.dtype)  # running sum of exp(score - m) * V
    kind = kind16(table)  # 16-bit caches: float16 (0) or bfloat16 (1), widened as loaded
    block = _block_size(size, dim * k_cache.itemsize)  # positions per softmax step
    s_buf = np.empty((size, block), q.dtype)  # a block's scores, then weights
    k_rows, v_rows = k_cache[b, kvh], v_cache[b, kvh]
    ahead = _rows_ahead(k_cache)  # rows prefetched ahead, K's and V's (the same dtype)
    # chunks of more than _FEW_ROWS rows take their passes as matrix products where
    # vectors are narrower than AVX-512's (cpu_prefill): K's block copied transposed into kt
    outer = size > _FEW_ROWS and outer_applies(qs_buf, k_rows, v_rows, acc_buf, block)
    kt = np.empty((dim, block if outer else 0), np.float32)
    for i0 in range(0, n_q, chunk):
        n_c = min(chunk, n_q - i0)
        rows = group * n_c
        qs, m, denom = qs_buf[:rows], m_buf[:rows], denom_buf[:rows]
        acc, s = acc_buf[:rows], s_buf[:rows]
        for g in range(group):
            for i in range(n_c):
                for d in range(dim):
                    qs[g * n_c + i, d] = q[b, kvh * group + g, i0 + i, d] * scale
        m[:] = -np.inf
        denom[:] = 0.0
        acc[:] = 0.0
        wide = outer and rows > _FEW_ROWS  # this chunk as matrix products (cpu_prefill)
        p0 = first + i0  # the chunk's first query position, and its last
        p1 = p0 + n_c - 1
        # the positions any query of the chunk can see, and those every query sees
        lo = max(0, p0 - window + 1) if window > 0 else 0
        hi = p1 + 1 if causal else seq_len
        all_lo = max(0, p1 - window + 1) if window > 0 else 0
        all_hi = p0 + 1 if causal else seq_len
        for j0 in range(lo, hi, block):
            j1 = min(j0 + block, hi)
            nb = j1 - j0
            if wide:
                transpose_rows(k_rows[j0:j1], kind, kt)
                scores_outer(qs, kt, s, 0, nb)
            else:  # the rows `ahead` past each one start on their way while it is computed
                _scores(qs, k_rows[j0:j1], s, 0, kind, ahead)
            if j0 < all_lo or j1 > all_hi:
                # a block at the edge of the causal mask or the window: mask per row
                _mask(s, nb, j0, p0, n_c, causal, window)
            _online_softmax(s, nb, m, denom, acc)
            if wide:
                accumulate_outer(s, v_rows[j0:j1], acc, 0, kind)
            else:
                _accumulate_block(s, v_rows[j0:j1], acc, kind, ahead)
        for r in range(rows):
            h = kvh * group + r // n_c
            inv = 1.0 / denom[r]  # inf when nothing was finite: 0 * inf = NaN out
            for d in range(dim):
                out[b, h, i0 + r % n_c, d] = acc[r, d] * inv


@njit(cache=True)
def _rows_ahead(rows):
    """Rows ahead that the score and V passes prefetch over cached ``rows``:
    :data:`_AHEAD_32` for float32, :data:`_AHEAD` for any other (16-bit bits, float64)."""
    return _AHEAD_32 if rows.itemsize == 4 else _AHEAD


@njit(cache=True)
def _block_size(rows, row_bytes):
    """Positions per block for a chunk of ``rows`` query rows over cached rows of
    ``row_bytes`` bytes each (one head's K or V at a position; the same rule for 16-bit
    rows, whose V pass goes in pieces, :func:`_accumulate_block`): at most ``_FEW_ROWS``
    rows walk the most whole multiples of ``_BLOCK`` up to ``_LONG_BLOCK`` whose rows fit
    in ``_LONG_BYTES``; more rows walk ``_BLOCK``."""
    if rows > _FEW_ROWS:
        return _BLOCK
    fit = _LONG_BYTES // max(1, row_bytes) // _BLOCK * _BLOCK
    return max(_BLOCK, min(_LONG_BLOCK, fit))


@njit(cache=True)
def _mask(s, nb, j0, first, n_q, causal, window):
    """Scores of positions ``j0 .. j0 + nb - 1`` a query may not see become -inf. Row
    ``r`` is query ``first + r % n_q``. Mutates ``s``."""
    for r in range(s.shape[0]):
        p = first + r % n_q
        for j in range(nb):
            if (causal and j0 + j > p) or (window > 0 and j0 + j <= p - window):
                s[r, j] = -np.inf


@njit(cache=True, fastmath=_config.FASTMATH, error_model="numpy")
def _online_softmax(s, nb, m, denom, acc):
    """One block of the streaming softmax: per row, raise the running maximum ``m`` to the
    block's, rescale ``denom`` and ``acc`` by what that changes, and turn the block's
    scores ``s[:, :nb]`` into weights ``exp(score - m)`` added to ``denom``. Mutates all
    four (``acc`` only by the rescaling; the weighted V rows are the caller's to add).

    The loops over the block are branch-free and keep their sums in locals, so that they
    vectorise: the maximum by :func:`nbkv.kernels.cpu_vector.row_max` (vectors of partial
    maxima; the loop vectoriser leaves a maximum by select scalar without ``nnan``, which
    NaN scores forbid), the weights by :func:`~nbkv.kernels.cpu_math.exp_of` (a float32
    ``exp`` that vectorises; ``np.exp`` stays a scalar libm call here). Elements are
    indexed in two dimensions, never through row views: a view costs a reference count
    taken and dropped, two atomic operations per row per block (a fifth of this
    function's time).
    """
    dim = acc.shape[1]
    for r in range(s.shape[0]):
        block_max = row_max(s, r, nb)  # a NaN is never taken: seen below
        if block_max == -np.inf:  # nothing finite in this row of the block
            poisoned = False
            for j in range(nb):
                poisoned |= s[r, j] != s[r, j]
                s[r, j] = 0.0
            if poisoned:  # a NaN score: the row's output is NaN, as IEEE says
                m[r] = np.nan
                denom[r] = np.nan
            continue
        if block_max > m[r]:  # never for a NaN m: acc is left, the NaN weights poison it
            # rescale what was accumulated under the old maximum (exp(-inf) = 0); most
            # blocks of a long walk do not raise it, and skip this scalar exp
            correction = exp_of(m[r] - block_max)
            if correction != 1.0:
                for d in range(dim):
                    acc[r, d] *= correction
            denom[r] *= correction
            m[r] = block_max
        m_new = m[r]
        total = s.dtype.type(0.0)
        for j in range(nb):
            w = exp_of(s[r, j] - m_new)  # NaN scores give NaN weights: NaN output
            s[r, j] = w
            total += w
        denom[r] += total


@njit(cache=True, fastmath=_config.FASTMATH)
def _accumulate(s, vb, acc, c0, kind=-1, ahead=0):
    """acc[r] += sum over j of s[r, c0 + j] * vb[j], for every query row r of the block
    (``vb`` may be 16-bit bits, widened as loaded, and ``ahead`` rows prefetched, as in
    :func:`_scores`).

    Where :func:`nbkv.kernels.cpu_simd.tile_ok` holds, four rows at a time by
    :func:`~nbkv.kernels.cpu_simd.accumulate_rows` (vector IR: 4 x 64 accumulators in
    registers for the whole block, fewer on narrower targets; 3.4x faster than the loop
    below). Otherwise four rows by eight positions at a time: each V row loaded is used
    by four rows and each accumulator loaded is updated by eight positions, so loads and
    stores per FMA drop eightfold (the plain loop was bound by its stores: 2.5x slower at
    head_dim 128; four positions at a time, 1.35x slower at four rows).

    Where the vectors are narrower than AVX-512's (``_LINE_PASSES``: 8 lanes on AVX2, 4
    on SSE or NEON), each of ``accumulate_rows``' passes reads one 64-byte line of every
    row. float32 rows that come from memory (the caller asks for rows ahead: ``ahead``
    not 0; a quantized kernel's freshly widened buffer does not) then go by
    :func:`~nbkv.kernels.cpu_simd.accumulate_lines`: pieces of 8 positions, pass by pass,
    each pass prefetching its share of the rows ``ahead`` on. The same multiply-adds in
    the same order as one call over the whole block, bit for bit (test_cpu_targets.py).
    """
    rows, dim = acc.shape
    nb = vb.shape[0]
    r = 0
    if tile_ok(acc, vb) and nb > 0:  # four rows at a time in vector IR (cpu_simd)
        if _LINE_PASSES and vb.itemsize == 4 and ahead != 0 and rows >= 4:
            accumulate_lines(s, vb, acc, c0, kind, ahead)
            r = rows - rows % 4
        while r + 4 <= rows:
            accumulate_rows(s, r, vb, nb, acc, c0, kind, ahead if r == 0 else 0)
            r += 4
    while r + 4 <= rows:
        a0, a1, a2, a3 = acc[r], acc[r + 1], acc[r + 2], acc[r + 3]
        s0, s1, s2, s3 = s[r], s[r + 1], s[r + 2], s[r + 3]
        j = 0
        while j + 8 <= nb:
            if r == 0:
                prefetch_ahead(vb, j, 8, ahead)
            accumulate_4x8(s, vb, acc, c0, kind, r, j)
            j += 8
        while j < nb:  # the positions left over
            if r == 0:
                prefetch_ahead(vb, j, 1, ahead)
            v0 = vb[j]
            w00, w10, w20, w30 = s0[c0 + j], s1[c0 + j], s2[c0 + j], s3[c0 + j]
            for d in range(dim):
                x0 = value_of(v0[d], kind)
                a0[d] += w00 * x0
                a1[d] += w10 * x0
                a2[d] += w20 * x0
                a3[d] += w30 * x0
            j += 1
        r += 4
    while r < rows:  # the rows left over, one at a time
        a0, s0 = acc[r], s[r]
        for j in range(nb):
            if r == 0:
                prefetch_ahead(vb, j, 1, ahead)
            w00, v0 = s0[c0 + j], vb[j]
            for d in range(dim):
                a0[d] += w00 * value_of(v0[d], kind)
        r += 1


@njit(cache=True, fastmath=_config.FASTMATH)
def _accumulate_block(s, vb, acc, kind=-1, ahead=0):
    """A block's V pass: :func:`_accumulate` of ``s[:, :len(vb)]`` times the rows ``vb``.
    32- and 64-bit rows in one call (which, on targets narrower than AVX-512, takes float32
    rows in pieces itself); 16-bit rows (``kind`` >= 0) in pieces, so that what a piece's
    passes over head_dim read again is still in L1, while the block's scores and softmax
    run over all of it at once (their per-block costs spread over 512 positions): on
    targets narrower than AVX-512, rows one after another, by
    :func:`~nbkv.kernels.cpu_simd.accumulate_pieces` (pieces of 32 positions, each
    sweeping the next into the caches); otherwise in pieces of ``_BLOCK`` (16 KiB at
    head_dim 128) by :func:`_accumulate`, their rows prefetched ``ahead``. The same
    multiply-adds in the same order every way (the accumulators go to memory between
    pieces): the same result, bit for bit, on the vector path. Mutates ``acc``."""
    nb, rows = vb.shape[0], acc.shape[0]
    if kind < 0:
        _accumulate(s, vb, acc, 0, kind, ahead)
        return
    if _LINE_PASSES and ahead != 0 and rows >= 4 and tile_ok(acc, vb) and packed(vb):
        accumulate_pieces(s, vb, acc, 0, kind)  # the next piece swept in as each goes
        if rows % 4:  # the rows left over
            _accumulate(s[rows - rows % 4 :], vb, acc[rows - rows % 4 :], 0, kind, 0)
        return
    for c in range(0, nb, _BLOCK):
        _accumulate(s, vb[c : min(c + _BLOCK, nb)], acc, c, kind, ahead)


@njit(parallel=True, cache=True)
def attend(q, k_cache, v_cache, seq_len, scale, causal, window, table, out):
    """Attention of ``q`` over the first ``seq_len`` positions of a "bhsd" cache.

    q: shape [batch, num_heads, n_q, head_dim], float32 or float64 (the accumulator type).
    k_cache, v_cache: shape [batch, num_kv_heads, >= seq_len, head_dim], any strides;
        float32, float64, or uint16 bit patterns of float16/bfloat16 widened by ``table``.
    seq_len: positions held (the queries are the last ``n_q`` of them).
    scale: multiplies every score (usually ``head_dim ** -0.5``).
    causal: mask positions after each query's own.
    window: if > 0, each query sees only the last ``window`` positions, its own included.
    table: float32[65536] widening table for uint16 caches (see nbkv.dtypes.widen_table).
    out: shape [batch, num_heads, n_q, head_dim], q's dtype. Mutated.
    """
    for task in prange(q.shape[0] * k_cache.shape[1]):
        _attend_task(q, k_cache, v_cache, seq_len, scale, causal, window, table, out, task)


@njit(cache=True)
def attend_serial(q, k_cache, v_cache, seq_len, scale, causal, window, table, out):
    """:func:`attend` on the calling thread alone: for small work (a decode step of a
    small model), where waking a thread pool costs more than it saves. Mutates ``out``."""
    for task in range(q.shape[0] * k_cache.shape[1]):
        _attend_task(q, k_cache, v_cache, seq_len, scale, causal, window, table, out, task)


# not cache=True: a cached function calling a parallel one crashed when loaded back from
# Numba's disk cache (numba 0.68). These serve users' @njit code; nbkv calls those above
@njit
def attend_bshd(q, k_cache, v_cache, seq_len, scale, causal, window, table, out):
    """:func:`attend` for a "bshd" cache: k_cache, v_cache [batch, >= seq_len, num_kv_heads,
    head_dim]. Mutates ``out``."""
    attend(
        q,
        k_cache.transpose(0, 2, 1, 3),
        v_cache.transpose(0, 2, 1, 3),
        seq_len,
        scale,
        causal,
        window,
        table,
        out,
    )


@njit
def append_attend(q, k, v, pos, k_cache, v_cache, scale, causal, window, table, out):
    """Write ``k``, ``v`` at ``pos`` (as :func:`nbkv.kernels.write_kv`), then attend ``q``
    over the ``pos + n`` positions now held, in one call. Layout "bhsd".

    Mutates ``k_cache``, ``v_cache`` and ``out``.
    """
    write_kv(k, v, pos, k_cache, v_cache)
    attend(q, k_cache, v_cache, pos + k.shape[2], scale, causal, window, table, out)


@njit
def append_attend_bshd(q, k, v, pos, k_cache, v_cache, scale, causal, window, table, out):
    """:func:`append_attend` for layout "bshd". Mutates ``k_cache``, ``v_cache``, ``out``."""
    write_kv_bshd(k, v, pos, k_cache, v_cache)
    attend_bshd(q, k_cache, v_cache, pos + k.shape[1], scale, causal, window, table, out)
