"""The steps of one block of CUDA flash-decoding, as device functions.

:mod:`nbkv.kernels.cuda_attention` describes the algorithm and compiles one kernel per
:class:`~nbkv.kernels.cuda_attention.Spec`; this module holds the block's body.
:func:`build_block` assembles it from builders, each closing over the spec's
compile-time constants (rows per block ``R``, ``head_dim``, vector widths, layout):

- :func:`_setup_steps`: the queries into shared memory, each row's visible positions and
  running state, and (``append_attend``) the new positions no query sees;
- :func:`_score_step`, :func:`_value_steps`: one tile of ``TILE`` positions: stage K
  and score (steps 1-2), the online softmax (3), the weighted V rows (4);
- :func:`_output_steps`, :func:`_combine_step`: the split's result gathered over the
  block, written as the output (one split) or as a partial, and the combine the last
  block of a (KV head, row chunk) runs.

Every device function is inlined at Numba IR level (``inline=True``), so the kernel
compiles as if it were written in one piece: per-row arrays keep constant sizes and
indices, and stay in registers. A step that holds a barrier (``cuda.syncthreads``) says
so: every thread of the block must call it.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .. import _config
from .cuda_vec import block_reducers, copier, loader, reduction_width, widener

THREADS = _config.ATTENTION_THREADS  # threads per block, and positions per tile
TILE = THREADS
# the reduction buffer's width: one slot per warp (shuffles), per thread (simulator)
RED_WIDTH = reduction_width(THREADS)
_NEG_INF = np.float32(-np.inf)
_NAN = np.float32(np.nan)
LOG2E = np.float32(1.4426950408889634)
_ZERO = np.float32(0.0)


@cuda.jit(device=True, inline=True)
def scaled_log2(m):
    """``m * log2 e`` rounded once, by an FMA nothing can contract further: a split's
    weights are relative to this value, and the combine recomputes exactly the same one
    from the stored ``m``, so the rounding cancels."""
    return cuda.fma(m, LOG2E, _ZERO)


@cuda.jit(device=True, inline=True)
def _finite_or_zero(x):
    return x if x != _NEG_INF else _ZERO


@cuda.jit(device=True, inline=True)
def split_span(seq_len, first, window, split, num_splits):
    """``(lo, start, end)``: the first position any query sees, and this split's share
    ``[start, end)`` of the visible positions (splits of equal length, the last short)."""
    lo = max(0, first - window + 1) if window > 0 else 0
    per_split = -(-(seq_len - lo) // num_splits)
    start = lo + split * per_split
    end = min(seq_len, start + per_split)
    return lo, start, end


@cuda.jit(device=True, inline=True)
def last_to_finish(counters, last, task, chunk, num_splits, t):
    """True on every thread of the last block of (``task``, ``chunk``) to arrive, after
    a fence (its partial results visible to that block); ``last``: one shared int32.
    Holds barriers."""
    cuda.threadfence()
    cuda.syncthreads()
    if t == 0:
        done = cuda.atomic.add(counters, (task, chunk), 1)
        last[0] = 1 if done == num_splits - 1 else 0
    cuda.syncthreads()
    if last[0] == 0:
        return False
    cuda.threadfence()
    return True


def _indexer(bshd: bool):
    """``at(b, h, j, d)``: the index of head ``h``, position ``j``, dimension ``d`` of
    batch row ``b`` in a cache (or new rows) of the layout."""

    @cuda.jit(device=True, inline=True)
    def at(b, h, j, d):
        if bshd:
            return (b, j, h, d)
        return (b, h, j, d)

    return at


def _setup_steps(spec, geo, at):
    """``(load_queries, init_rows, copy_hidden)``: what a block does before its tiles."""
    R, D = spec.rows, spec.head_dim
    NQ = -(-(R * D) // THREADS)  # (row, dimension) pairs per thread
    NACC = R * geo.per_thread * geo.vv

    @cuda.jit(device=True, inline=True)
    def load_queries(q, qs, scale, b, kvh, group, n_q, r0, rows, t):
        """The chunk's queries into shared memory, scale folded in (rows past the
        chunk: 0)."""
        qscale = np.float32(scale)
        for i in range(NQ):
            idx = t + i * THREADS
            if idx < R * D:
                r = idx // D
                d = idx - r * D
                x = _ZERO
                if r < rows:
                    row = r0 + r
                    x = np.float32(q[b, kvh * group + row // n_q, row % n_q, d]) * qscale
                qs[r, d] = x

    @cuda.jit(device=True, inline=True)
    def init_rows(bounds, m, lsum, acc, causal, window, r0, rows, n_q, first, start, end, t):
        """Row ``r`` sees positions ``[bounds[r, 0], bounds[r, 1]]`` of this split (none
        for a row past the chunk; thread 0 writes ``bounds``: visible after the next
        barrier); running maxima, sums and accumulators start empty."""
        for r in range(R):
            row = r0 + r
            p = first + row % n_q
            hi = end - 1
            if causal:
                hi = min(hi, p)
            lo_r = start
            if window > 0:
                lo_r = max(lo_r, p - window + 1)
            if r >= rows:  # no such row in this chunk: sees nothing
                lo_r, hi = 1, 0
            if t == 0:
                bounds[r, 0] = lo_r
                bounds[r, 1] = hi
            m[r] = _NEG_INF
            lsum[r] = _ZERO
        for i in range(NACC):
            acc[i] = _ZERO

    @cuda.jit(device=True, inline=True)
    def copy_hidden(k, v, k_cache, v_cache, b, kvh, pos, lo, seq_len, split, num_splits, t):
        """New positions before the window (append_attend with more new positions than
        window + n_q - 1): no query sees them, so no split reads them, but they must
        still reach the cache; chunk 0's blocks of the task copy them, split-strided."""
        hidden = min(lo, seq_len) - pos
        for jj in range(split, hidden, num_splits):
            for d in range(t, D, THREADS):
                k_cache[at(b, kvh, pos + jj, d)] = k[at(b, kvh, jj, d)]
                v_cache[at(b, kvh, pos + jj, d)] = v[at(b, kvh, jj, d)]

    return load_queries, init_rows, copy_hidden


def _score_step(spec, geo, at):
    """``score_tile``: steps 1-2 of one tile."""
    R, D, VEC, fused, DC = spec.rows, spec.head_dim, spec.vec, spec.fused, geo.chunk
    NC = D // DC  # staging rounds per tile
    UC = DC // VEC  # vector pieces per staged row
    NU = -(-(TILE * UC) // THREADS)  # pieces per thread per round
    KR = VEC  # elements per shared-memory read of K in step 2
    while KR > 1 and R * KR > 32:
        KR //= 2
    load_kr, copy_vec = loader(KR), copier(VEC)

    @cuda.jit(device=True, inline=True)
    def score_tile(
        qs, ks, dots, bounds, k, v, pos, k_cache, v_cache, b, kvh, chunk, j0, end, t,
    ):  # fmt: skip
        """Steps 1-2: ``dots[r]``, thread ``t``'s position ``j0 + t`` scored against row
        ``r`` (-inf where the row does not see it). Holds barriers."""
        j = j0 + t
        for r in range(R):
            dots[r] = _ZERO
        for c in range(NC):
            # 1. stage K[j0 : j0 + TILE, c * DC : (c + 1) * DC]: piece u of the tile is
            # row u // UC, piece u % UC; neighbouring threads, neighbouring pieces
            for ui in range(NU):
                u = t + ui * THREADS
                if u < TILE * UC:
                    i = u // UC
                    d = c * DC + (u - i * UC) * VEC
                    js = j0 + i
                    if js < end:
                        if fused and js >= pos:  # a new position: from k (any strides)
                            for e in range(VEC):
                                x = k[at(b, kvh, js - pos, d + e)]
                                ks[i, d - c * DC + e] = x
                                if chunk == 0:  # ... and into the cache, once
                                    k_cache[at(b, kvh, js, d + e)] = x
                                    v_cache[at(b, kvh, js, d + e)] = v[at(b, kvh, js - pos, d + e)]
                        else:
                            copy_vec(k_cache, at(b, kvh, js, d), ks, (i, d - c * DC))
                    else:  # past the split (masked): finite, so nothing warns
                        for e in range(VEC):
                            ks[i, d - c * DC + e] = 0
            cuda.syncthreads()
            # 2. scores: thread t dots its position's row with every query row (KR
            # elements a read: small enough that the loop over rows unrolls)
            for dd in range(DC // KR):
                kv = load_kr(ks, (t, dd * KR))
                for r in range(R):
                    s = dots[r]
                    for e in range(KR):
                        s += qs[r, c * DC + dd * KR + e] * kv[e]
                    dots[r] = s
            if NC > 1:
                cuda.syncthreads()  # the next piece overwrites ks
        for r in range(R):
            if j < bounds[r, 0] or j > bounds[r, 1]:
                dots[r] = _NEG_INF

    return score_tile


def _value_steps(spec, geo, at):
    """``(softmax_tile, accumulate_tile)``: steps 3-4 of one tile."""
    R, fused = spec.rows, spec.fused
    VV, LANES, PG, NDL = geo.vv, geo.lanes, geo.groups, geo.per_thread
    NI = -(-TILE // PG)  # positions per thread per tile in step 4
    load_v, widen = loader(VV), widener(np.dtype(spec.dtype))
    block_max, _ = block_reducers(R, THREADS)

    @cuda.jit(device=True, inline=True)
    def softmax_tile(dots, corr, red, m, lsum, pw, acc, t):
        """Step 3: the tile's maximum per row over the block, thread ``t``'s weights
        into ``pw[t, :]``, its sums and step 4's accumulators rescaled. Ends with a
        barrier."""
        for r in range(R):
            corr[r] = dots[r]
        block_max(corr, red, t)
        for r in range(R):
            m_new = max(m[r], corr[r])
            shift = _finite_or_zero(scaled_log2(m_new))  # nothing finite yet: 0, not -inf
            c_r = math.exp2(scaled_log2(m[r]) - shift)  # 0 on the first tile
            # log2 e folded into one fused multiply-add per score; 0 for a -inf score
            w = math.exp2(cuda.fma(dots[r], LOG2E, -shift))
            lsum[r] = lsum[r] * c_r + w
            m[r] = m_new
            pw[t, r] = w
            for i in range(NDL * VV):  # step 4's accumulators, rescaled now
                acc[r * NDL * VV + i] *= c_r
        cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def accumulate_tile(v, v_cache, pw, acc, b, kvh, pos, j0, end, pg, lane0):
        """Step 4: position group ``pg``'s weighted V pieces (dimension lanes ``lane0``,
        ``lane0 + THREADS``, ...) added to ``acc``. Ends with a barrier."""
        if pg < PG:
            for ii in range(NI):
                i = pg + ii * PG
                jv = j0 + i
                if i < TILE and jv < end:
                    for n in range(NDL):
                        lane = lane0 + n * THREADS
                        if lane < LANES:
                            d = lane * VV
                            if fused and jv >= pos:  # a new position: from v
                                for e in range(VV):
                                    x = widen(v[at(b, kvh, jv - pos, d + e)])
                                    for r in range(R):
                                        acc[(r * NDL + n) * VV + e] += pw[i, r] * x
                            else:
                                vals = load_v(v_cache, at(b, kvh, jv, d))
                                for r in range(R):
                                    w = pw[i, r]
                                    for e in range(VV):
                                        acc[(r * NDL + n) * VV + e] += w * vals[e]
        cuda.syncthreads()

    return softmax_tile, accumulate_tile


def _output_steps(spec, geo):
    """``(gather, write_rows, write_partial)``: a split's result, after its tiles."""
    R, D = spec.rows, spec.head_dim
    VV, LANES, PG, NDL = geo.vv, geo.lanes, geo.groups, geo.per_thread
    ND = -(-D // THREADS)  # dimensions per thread of one row, in the output

    @cuda.jit(device=True, inline=True)
    def gather(acc, qs, pg, lane0):
        """The split's accumulators summed over the position groups into ``qs``. Ends
        with a barrier."""
        if PG > 1:
            for g in range(PG):  # one group at a time adds its accumulators into qs
                if pg == g:
                    for r in range(R):
                        for e in range(VV):
                            d = lane0 * VV + e
                            x = acc[r * VV + e]
                            qs[r, d] = x if g == 0 else qs[r, d] + x
                cuda.syncthreads()
        else:
            for r in range(R):
                for n in range(NDL):
                    lane = lane0 + n * THREADS
                    if lane < LANES:
                        for e in range(VV):
                            qs[r, lane * VV + e] = acc[(r * NDL + n) * VV + e]
            cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def write_rows(out, qs, lsum, b, kvh, group, n_q, r0, rows, t):
        """One split holds the whole sequence: ``qs / lsum`` is the output."""
        for r in range(R):
            if r < rows:
                row = r0 + r
                h = kvh * group + row // n_q
                total = lsum[r]
                for kk in range(ND):
                    d = t + kk * THREADS
                    if d < D:
                        # nothing finite anywhere: NaN (0 / 0; the simulator would raise)
                        x = qs[r, d] / total if total != _ZERO else _NAN
                        out[b, h, row % n_q, d] = x

    @cuda.jit(device=True, inline=True)
    def write_partial(part_acc, part_stats, qs, m, lsum, b, kvh, group, n_q, r0, rows, split, t):
        """The split's accumulators, maxima and sums to scratch."""
        for r in range(R):
            if r < rows:
                row = r0 + r
                h = kvh * group + row // n_q
                for kk in range(ND):
                    d = t + kk * THREADS
                    if d < D:
                        part_acc[b, h, row % n_q, split, d] = qs[r, d]
        if t == 0:  # m and the reduced sums are the same on every thread
            for r in range(R):
                if r < rows:
                    row = r0 + r
                    h = kvh * group + row // n_q
                    part_stats[b, h, row % n_q, split, 0] = m[r]
                    part_stats[b, h, row % n_q, split, 1] = lsum[r]

    return gather, write_rows, write_partial


def _combine_step(spec):
    """``combine``: what the last block of a (KV head, row chunk) adds to its own."""
    R, D = spec.rows, spec.head_dim
    ND = -(-D // THREADS)  # dimensions per thread of one row, in the output
    NNUM = R * ND
    block_max, block_sum = block_reducers(R, THREADS)

    @cuda.jit(device=True, inline=True)
    def combine(
        part_acc, part_stats, out, m, lsum, corr, pw, red, b, kvh, group, n_q, r0, rows,
        num_splits, t,
    ):  # fmt: skip
        """Every split's partial result, weighed by its maximum, into the output. Holds
        barriers."""
        # a. each row's largest split maximum, threads spread over the splits (loops
        # over rows innermost, so that they unroll and m stays in registers)
        for r in range(R):
            m[r] = _NEG_INF
        for sp in range(t, num_splits, THREADS):
            for r in range(R):
                if r < rows:
                    row = r0 + r
                    h = kvh * group + row // n_q
                    m[r] = max(m[r], part_stats[b, h, row % n_q, sp, 0])
        block_max(m, red, t)
        num = cuda.local.array(NNUM, np.float32)
        for i in range(NNUM):
            num[i] = _ZERO
        for r in range(R):
            lsum[r] = _ZERO
            corr[r] = _finite_or_zero(scaled_log2(m[r]))
        # b. splits THREADS at a time: thread t weighs split s0 + t of every row (into
        # pw), then every thread adds the weighted accumulators of its dimensions
        for s0 in range(0, num_splits, THREADS):
            sp = s0 + t
            for r in range(R):
                w = _ZERO
                if sp < num_splits and r < rows:
                    row = r0 + r
                    h = kvh * group + row // n_q
                    mx = part_stats[b, h, row % n_q, sp, 0]
                    w = math.exp2(scaled_log2(mx) - corr[r])  # 0 for an empty split
                    lsum[r] += w * part_stats[b, h, row % n_q, sp, 1]
                pw[t, r] = w
            cuda.syncthreads()
            n_here = min(THREADS, num_splits - s0)
            for s in range(n_here):
                for r in range(R):
                    if r < rows:
                        row = r0 + r
                        h = kvh * group + row // n_q
                        w = pw[s, r]
                        for kk in range(ND):
                            d = t + kk * THREADS
                            if d < D:
                                x = part_acc[b, h, row % n_q, s0 + s, d]
                                num[r * ND + kk] += w * x
            cuda.syncthreads()
        block_sum(lsum, red, t)
        for r in range(R):
            if r < rows:
                row = r0 + r
                h = kvh * group + row // n_q
                total = lsum[r]
                for kk in range(ND):
                    d = t + kk * THREADS
                    if d < D:
                        # nothing finite anywhere: NaN (0 / 0 on a GPU; the simulator raises)
                        x = num[r * ND + kk] / total if total != _ZERO else _NAN
                        out[b, h, row % n_q, d] = x

    return combine


def build_block(spec, geo):
    """The block body of ``spec``'s kernel (``geo``: its
    :class:`~nbkv.kernels.cuda_attention._Geometry`), a device function both kernel
    forms call: ``attend`` passes the cache as ``k``, ``v`` and ``pos = seq_len``."""
    R, D, fused, bshd = spec.rows, spec.head_dim, spec.fused, spec.bshd
    LANES, PG, PITCH, NACC = geo.lanes, geo.groups, geo.pitch, R * geo.per_thread * geo.vv
    storage, at = np.dtype(spec.dtype), _indexer(bshd)
    load_queries, init_rows, copy_hidden = _setup_steps(spec, geo, at)
    score_tile = _score_step(spec, geo, at)
    softmax_tile, accumulate_tile = _value_steps(spec, geo, at)
    gather, write_rows, write_partial = _output_steps(spec, geo)
    combine = _combine_step(spec)
    _, block_sum = block_reducers(R, THREADS)

    @cuda.jit(device=True, inline=True)
    def block(
        q, k, v, pos, k_cache, v_cache, seq_len, scale, causal, window, part_acc,
        part_stats, counters, out,
    ):  # fmt: skip
        t = cuda.threadIdx.x
        split = cuda.blockIdx.x
        num_splits = cuda.gridDim.x
        task = cuda.blockIdx.y
        chunk = cuda.blockIdx.z
        n_q = q.shape[2]
        num_kv_heads = k_cache.shape[2] if bshd else k_cache.shape[1]
        group = q.shape[1] // num_kv_heads
        b = task // num_kv_heads
        kvh = task - b * num_kv_heads
        r0 = chunk * R
        rows = min(R, group * n_q - r0)
        first = seq_len - n_q  # position of the first query
        lo, start, end = split_span(seq_len, first, window, split, num_splits)

        qs = cuda.shared.array((R, D), np.float32)  # queries; later the group reduction
        ks = cuda.shared.array((TILE, PITCH), storage)  # one staged piece of a K tile
        pw = cuda.shared.array((TILE, R), np.float32)  # weights; later the combine's
        red = cuda.shared.array((R, RED_WIDTH), np.float32)
        last = cuda.shared.array(1, np.int32)
        dots = cuda.local.array(R, np.float32)
        m = cuda.local.array(R, np.float32)  # running maximum per row (the same everywhere)
        lsum = cuda.local.array(R, np.float32)  # this thread's share of the running sum
        corr = cuda.local.array(R, np.float32)
        # positions row r sees: [bounds[r, 0], bounds[r, 1]] (shared: fewer registers)
        bounds = cuda.shared.array((R, 2), np.int32)
        acc = cuda.local.array(NACC, np.float32)

        load_queries(q, qs, scale, b, kvh, group, n_q, r0, rows, t)
        init_rows(bounds, m, lsum, acc, causal, window, r0, rows, n_q, first, start, end, t)
        # step 4's place: dimension lanes and position group of this thread
        pg = t // LANES if PG > 1 else 0
        lane0 = t - pg * LANES
        if fused and chunk == 0:
            copy_hidden(k, v, k_cache, v_cache, b, kvh, pos, lo, seq_len, split, num_splits, t)
        cuda.syncthreads()

        j0 = start
        while j0 < end:
            score_tile(qs, ks, dots, bounds, k, v, pos, k_cache, v_cache, b, kvh, chunk, j0, end, t)
            softmax_tile(dots, corr, red, m, lsum, pw, acc, t)
            accumulate_tile(v, v_cache, pw, acc, b, kvh, pos, j0, end, pg, lane0)
            j0 += TILE

        block_sum(lsum, red, t)  # the split's sum over the block
        gather(acc, qs, pg, lane0)
        if num_splits == 1:  # the whole sequence in this block: the output itself
            write_rows(out, qs, lsum, b, kvh, group, n_q, r0, rows, t)
            return
        write_partial(part_acc, part_stats, qs, m, lsum, b, kvh, group, n_q, r0, rows, split, t)
        if not last_to_finish(counters, last, task, chunk, num_splits, t):
            return
        combine(
            part_acc, part_stats, out, m, lsum, corr, pw, red, b, kvh, group, n_q, r0, rows,
            num_splits, t,
        )  # fmt: skip
        if t == 0:
            counters[task, chunk] = 0  # ready for the next launch

    return block
