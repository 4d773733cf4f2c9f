"""CUDA flash-decoding: attention over a K/V cache, split across blocks, in one launch.

Grid ``(num_splits, batch * num_kv_heads, row_chunks)``, one block of ``THREADS`` threads
each. A block takes one KV head of one batch row, one chunk of up to ``R`` query rows of
that head's group (row ``r = g * n_q + i``: query ``i`` of group member ``g``), and one
contiguous split of the visible positions, so that batch 1 at long context still fills
the GPU. The kernels are *specialised*: :func:`attention_kernel` compiles one per
:class:`Spec` (rows per block ``R``, ``head_dim``, storage dtype, vector width, layout,
fused or not), so every per-row array has a constant size and every loop over rows,
dimensions or vector elements a constant trip count: accumulators live in registers.
A block walks its split in tiles of ``TILE`` positions:

1. stage: the block copies the tile's K rows into shared memory, neighbouring threads on
   neighbouring 16-byte pieces of a row (coalesced vector loads; the row pitch is an odd
   number of pieces, so the reads in step 2 hit distinct banks);
2. scores: thread ``t`` takes position ``j0 + t`` and computes its dot product with every
   query row (queries sit in shared memory, scale folded in); masked scores are -inf;
3. online softmax, spread over the block: each row's tile maximum is reduced by warp
   shuffles (shared memory under the simulator); every thread turns its own scores into
   weights ``2 ** (s * log2 e - m * log2 e)`` (one fused multiply-add and ``exp2``) and
   keeps its own partial sums, rescaled when the maximum rises;
4. values: thread ``t`` owns ``VV`` consecutive dimensions of one of ``PG`` position
   groups; a warp reads whole V rows with vector loads, and each thread keeps ``R * VV``
   accumulators in registers.

Each block writes its partial result (maximum, sum, accumulator; the partial sums and the
position groups reduced over the block) to scratch; the last block of a (KV head, row
chunk) to finish (an atomic counter, after a memory fence) combines the splits, with the
block's threads spread over splits and then over (row, dimension) pairs, writes the
output, and resets the counter for the next launch. A launch of one split writes the
output directly. No second launch is needed.

``append_attend`` kernels also write the ``n`` new positions: the chunk-0 block whose
split holds position ``j >= pos`` copies it from ``k``/``v`` into the cache while staging
it, and every block reads it from ``k``/``v`` itself, so the write needs no grid-wide
barrier before the attention reads it. New positions that no query can see (before a
``window``) are copied by the task's chunk-0 blocks, split-strided, since no split holds
them.

NaN and infinities flow through as IEEE arithmetic says: a NaN score makes its row's
output NaN, a ``-inf`` score gets weight 0, a row with nothing finite gives NaN.

16-bit storage: float16 caches are read as float16 and widened by the hardware
conversion; bfloat16 caches arrive as ``uint16`` bit patterns and are widened by a
16-bit shift and a bit cast (:mod:`nbkv.kernels.cuda_vec`). ``table`` stays in the
signature for compatibility and is not read. Arithmetic is float32 throughout; the
output has q's dtype (float16, float32 or float64). ``part_stats[..., 0]`` holds each
split's running maximum of the scores in natural units, ``part_stats[..., 1]`` its sum
of ``exp(score - maximum)``.

``attend_kernel`` and its siblings are :class:`KernelFamily` objects: ``kernel[grid,
THREADS](...)`` picks the specialisation from the arguments (what a hand-made launch, as
in :mod:`nbkv.tutorial.cuda`, wants); :meth:`KernelFamily.specialise` returns the
compiled kernel of one :class:`Spec` (what the backend caches in its launch plan).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import cuda

from .. import _config
from .cuda_vec import SIMULATOR, copier, loader, vector_width, widener

__all__ = [
    "attend_kernel",
    "attend_bshd_kernel",
    "append_attend_kernel",
    "append_attend_bshd_kernel",
    "attention_kernel",
    "rows_per_block",
    "shared_bytes",
    "Spec",
    "KernelFamily",
    "THREADS",
    "TILE",
    "ROWS",
    "MAX_HEAD_DIM",
]

THREADS = _config.ATTENTION_THREADS  # threads per block, and positions per tile
TILE = THREADS
ROWS = _config.ATTENTION_ROWS  # the most query rows per block
MAX_HEAD_DIM = _config.ATTENTION_MAX_HEAD_DIM
WARPS = THREADS // 32 if not SIMULATOR else 1
# registers a thread spends on value accumulators (rows x dimensions) at most
_ACC_BUDGET = 16
# static shared memory one block may use (the hardware limit is 48 KiB)
_SHARED_BUDGET = 46 * 1024
_NEG_INF = np.float32(-np.inf)
_NAN = np.float32(np.nan)
_LOG2E = np.float32(1.4426950408889634)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_FULL_MASK = 0xFFFFFFFF
# the reduction buffer's width: one slot per warp (shuffles), per thread (simulator)
_RED_WIDTH = THREADS if SIMULATOR else WARPS


class Spec(NamedTuple):
    """What one compiled attention kernel is specialised on (all compile-time)."""

    rows: int  # query rows per block (R): accumulators per thread are R x VV
    head_dim: int
    dtype: str  # the cache's kernel dtype: float16, uint16 (bfloat16 bits), float32, float64
    vec: int  # elements per vector access of the cache (1: element by element)
    bshd: bool  # layout [batch, seq, kv_heads, head_dim] (else [batch, kv_heads, seq, ...])
    fused: bool  # append_attend (k, v, pos after q) or attend


class _Geometry(NamedTuple):
    vv: int  # value dimensions per thread
    lanes: int  # head_dim // vv
    groups: int  # position groups in step 4 (PG)
    per_thread: int  # dimension lanes per thread when lanes > THREADS
    chunk: int  # head dimensions staged at a time (DC)
    pitch: int  # shared row pitch of the K tile, in elements
    shared: int  # bytes of static shared memory


def rows_per_block(group: int, n_q: int) -> int:
    """Query rows one block takes: the power of two holding ``group * n_q``, at most ROWS
    (so the number of row chunks is ``ceil(group * n_q / ROWS)`` whatever it is).

    >>> rows_per_block(4, 1), rows_per_block(6, 1), rows_per_block(8, 5)
    (4, 8, 16)
    """
    need = group * n_q
    r = 1
    while r < need and r < ROWS:
        r *= 2
    return r


def _geometry(spec: Spec) -> _Geometry:
    rows, dim, vec = spec.rows, spec.head_dim, spec.vec
    itemsize = np.dtype(spec.dtype).itemsize
    vv = vec
    while vv > 1 and rows * vv > _ACC_BUDGET:
        vv //= 2
    lanes = dim // vv
    if lanes >= THREADS:
        groups, per_thread = 1, -(-lanes // THREADS)
    else:
        groups, per_thread = THREADS // lanes, 1
    fixed = 4 * (rows * dim + TILE * rows + rows * _RED_WIDTH + 2 * rows) + 64
    chunk, pitch = vec, vec  # the fallback: one piece at a time
    for dc in range(dim, 0, -vec):
        if dim % dc or dc % vec:
            continue
        units = dc // vec
        p = (units + 1 - units % 2) * vec  # an odd number of vector pieces per row
        if TILE * p * itemsize <= _SHARED_BUDGET - fixed:
            chunk, pitch = dc, p
            break
    shared = fixed + TILE * pitch * itemsize
    return _Geometry(vv, lanes, groups, per_thread, chunk, pitch, shared)


def shared_bytes(spec: Spec) -> int:
    """Static shared memory of one block of ``spec``'s kernel, in bytes."""
    return _geometry(spec).shared


@cuda.jit(device=True, inline=True)
def _log2(m):
    """``m * log2 e`` rounded once, by an FMA nothing can contract further: a split's
    weights are relative to this value, and the combine recomputes exactly the same one
    from the stored ``m``, so the rounding cancels."""
    return cuda.fma(m, _LOG2E, _ZERO)


@cuda.jit(device=True, inline=True)
def _finite_or_zero(x):
    return x if x != _NEG_INF else _ZERO


def _block_reducers(R: int):
    """``(block_max, block_sum)`` over the block of ``R`` per-thread values each: every
    thread ends with the block's result in ``vals``. Warp shuffles then one slot per
    warp on a GPU; one slot per thread under the simulator, which has no shuffles."""
    if SIMULATOR:

        def make(op):
            @cuda.jit(device=True, inline=True)
            def reduce(vals, buf, t):
                for r in range(R):
                    buf[r, t] = vals[r]
                cuda.syncthreads()
                for r in range(R):
                    acc = buf[r, 0]
                    for w in range(1, _RED_WIDTH):
                        acc = op(acc, buf[r, w])
                    vals[r] = acc
                cuda.syncthreads()

            return reduce

    else:

        def make(op):
            @cuda.jit(device=True, inline=True)
            def reduce(vals, buf, t):
                lane = t & 31
                warp = t >> 5
                for r in range(R):
                    x = vals[r]
                    for off in (16, 8, 4, 2, 1):  # butterfly: every lane gets the result
                        x = op(x, cuda.shfl_xor_sync(_FULL_MASK, x, off))
                    if lane == 0:
                        buf[r, warp] = x
                cuda.syncthreads()
                for r in range(R):  # lane 0's values only: the same on every thread
                    acc = buf[r, 0]
                    for w in range(1, _RED_WIDTH):
                        acc = op(acc, buf[r, w])
                    vals[r] = acc
                cuda.syncthreads()

            return reduce

    @cuda.jit(device=True, inline=True)
    def _max(a, b):
        return max(a, b)

    @cuda.jit(device=True, inline=True)
    def _add(a, b):
        return a + b

    return make(_max), make(_add)


def _build(spec: Spec):
    """Compile-time constants of ``spec`` closed over by one kernel."""
    R, D, VEC, bshd, fused = spec.rows, spec.head_dim, spec.vec, spec.bshd, spec.fused
    geo = _geometry(spec)
    VV, LANES, PG, NDL, DC, PITCH = (
        geo.vv, geo.lanes, geo.groups, geo.per_thread, geo.chunk, geo.pitch,
    )  # fmt: skip
    NC = D // DC  # staging rounds per tile
    UC = DC // VEC  # vector pieces per staged row
    NU = -(-(TILE * UC) // THREADS)  # pieces per thread per round
    NI = -(-TILE // PG)  # positions per thread per tile in step 4
    NACC = R * NDL * VV
    NQ = -(-(R * D) // THREADS)  # (row, dim) pairs per thread loading the queries
    ND = -(-D // THREADS)  # dimensions per thread of one row, in the output
    NNUM = R * ND
    storage = np.dtype(spec.dtype)
    KR = VEC  # elements per shared-memory read of K in step 2
    while KR > 1 and R * KR > 32:
        KR //= 2
    load_kr = loader(KR)
    load_v = loader(VV)
    copy_vec = copier(VEC)
    widen = widener(storage)
    block_max, block_sum = _block_reducers(R)

    @cuda.jit(device=True, inline=True)
    def at(b, h, j, d):
        if bshd:
            return (b, j, h, d)
        return (b, h, j, d)

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
        lo = max(0, first - window + 1) if window > 0 else 0
        per_split = -(-(seq_len - lo) // num_splits)
        start = lo + split * per_split
        end = min(seq_len, start + per_split)

        qs = cuda.shared.array((R, D), np.float32)  # queries; later the group reduction
        ks = cuda.shared.array((TILE, PITCH), storage)  # one staged piece of a K tile
        pw = cuda.shared.array((TILE, R), np.float32)  # weights; later the combine's
        red = cuda.shared.array((R, _RED_WIDTH), np.float32)
        last = cuda.shared.array(1, np.int32)
        dots = cuda.local.array(R, np.float32)
        m = cuda.local.array(R, np.float32)  # running maximum per row (the same everywhere)
        lsum = cuda.local.array(R, np.float32)  # this thread's share of the running sum
        corr = cuda.local.array(R, np.float32)
        # positions row r sees: [bounds[r, 0], bounds[r, 1]] (shared: fewer registers)
        bounds = cuda.shared.array((R, 2), np.int32)
        acc = cuda.local.array(NACC, np.float32)

        # the chunk's queries into shared memory, scale folded in (rows past the chunk: 0)
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
        # step 4's place: dimension lanes and position group of this thread
        pg = t // LANES if PG > 1 else 0
        lane0 = t - pg * LANES
        # new positions before the window (append_attend with more new positions than
        # window + n_q - 1): no query sees them, so no split reads them, but they must
        # still reach the cache; chunk 0's blocks of this task copy them, split-strided
        if fused and chunk == 0:
            hidden = min(lo, seq_len) - pos
            for jj in range(split, hidden, num_splits):
                for d in range(t, D, THREADS):
                    k_cache[at(b, kvh, pos + jj, d)] = k[at(b, kvh, jj, d)]
                    v_cache[at(b, kvh, pos + jj, d)] = v[at(b, kvh, jj, d)]
        cuda.syncthreads()

        j0 = start
        while j0 < end:
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
                                        v_cache[at(b, kvh, js, d + e)] = v[
                                            at(b, kvh, js - pos, d + e)
                                        ]
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
            # 3. online softmax: the tile's maximum per row, over the block
            for r in range(R):
                corr[r] = dots[r]
            block_max(corr, red, t)
            for r in range(R):
                m_new = max(m[r], corr[r])
                shift = _finite_or_zero(_log2(m_new))  # nothing finite yet: 0, not -inf
                c_r = math.exp2(_log2(m[r]) - shift)  # 0 on the first tile
                # log2 e folded into one fused multiply-add per score; 0 for a -inf score
                w = math.exp2(cuda.fma(dots[r], _LOG2E, -shift))
                lsum[r] = lsum[r] * c_r + w
                m[r] = m_new
                pw[t, r] = w
                for i in range(NDL * VV):  # step 4's accumulators, rescaled now
                    acc[r * NDL * VV + i] *= c_r
            cuda.syncthreads()
            # 4. values: rescale, then add this thread's positions' weighted V pieces
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
            j0 += TILE

        # the split's sum over the block, and its accumulators over the position groups
        block_sum(lsum, red, t)
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
        if num_splits == 1:  # the whole sequence in this block: the output itself
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
            return
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
        # the last block of this (KV head, row chunk) to finish combines the splits
        cuda.threadfence()
        cuda.syncthreads()
        if t == 0:
            done = cuda.atomic.add(counters, (task, chunk), 1)
            last[0] = 1 if done == num_splits - 1 else 0
        cuda.syncthreads()
        if last[0] == 0:
            return
        cuda.threadfence()
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
            corr[r] = _finite_or_zero(_log2(m[r]))
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
                    w = math.exp2(_log2(mx) - corr[r])  # 0 for an empty split
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
        if t == 0:
            counters[task, chunk] = 0  # ready for the next launch

    return block


def min_blocks_per_sm(spec: Spec) -> int:
    """The resident blocks per SM ``spec``'s kernel is compiled to allow (its launch
    bound caps registers at ``65536 / (THREADS * this)``): ``ATTENTION_MIN_BLOCKS_PER_SM``
    for decode attention, fewer where more per-row state or the fused write's arrays
    would spill at that cap."""
    base = _config.ATTENTION_MIN_BLOCKS_PER_SM
    if spec.rows > 8:
        return max(1, base // 2)
    if spec.fused or spec.rows > 4:
        return max(1, base - 1)
    return base


def launch_bounds(spec: Spec) -> tuple[int, int]:
    """``(threads, min_blocks_per_sm)``, as ``numba.cuda.jit(launch_bounds=...)`` takes."""
    return (THREADS, min_blocks_per_sm(spec))


_KERNELS: dict[Spec, object] = {}


def attention_kernel(spec: Spec):
    """The compiled (lazily, per signature) kernel of one :class:`Spec`, cached.

    ``attend``: ``kernel[grid, THREADS](q, k_cache, v_cache, seq_len, scale, causal,
    window, table, part_acc, part_stats, counters, out)``; ``append_attend``: ``(q, k, v,
    pos, k_cache, v_cache, scale, causal, window, table, part_acc, part_stats, counters,
    out)``. Mutates the scratch, the counters (left at zero), out, and for
    ``append_attend`` the caches.
    """
    kernel = _KERNELS.get(spec)
    if kernel is not None:
        return kernel
    block = _build(spec)
    if spec.fused:

        def append_attend(
            q, k, v, pos, k_cache, v_cache, scale, causal, window, table, part_acc,
            part_stats, counters, out,
        ):  # fmt: skip
            """Write k, v (n new positions) at pos, then attend over the pos + n held, in
            one launch. Mutates k_cache, v_cache, part_acc, part_stats, counters, out."""
            n = k.shape[1] if spec.bshd else k.shape[2]
            block(
                q, k, v, pos, k_cache, v_cache, pos + n, scale, causal, window, part_acc,
                part_stats, counters, out,
            )  # fmt: skip

        fn = append_attend
    else:

        def attend(
            q, k_cache, v_cache, seq_len, scale, causal, window, table, part_acc,
            part_stats, counters, out,
        ):  # fmt: skip
            """Attention of q [batch, num_heads, n_q, head_dim] over the first seq_len
            positions of the cache. Mutates part_acc, part_stats, counters, out."""
            block(
                q, k_cache, v_cache, seq_len, k_cache, v_cache, seq_len, scale, causal,
                window, part_acc, part_stats, counters, out,
            )  # fmt: skip

        fn = attend
    kernel = cuda.jit(fn) if SIMULATOR else cuda.jit(launch_bounds=launch_bounds(spec))(fn)
    _KERNELS[spec] = kernel
    return kernel


def spec_for(q, k_cache, v_cache, *, bshd: bool, fused: bool) -> Spec:
    """The :class:`Spec` a launch over these arrays takes (vector width from alignment)."""
    num_kv_heads = k_cache.shape[2] if bshd else k_cache.shape[1]
    group = q.shape[1] // num_kv_heads
    head_dim = int(q.shape[3])
    dtype = np.dtype(k_cache.dtype)
    vec = vector_width(dtype.itemsize, head_dim, (k_cache, v_cache))
    return Spec(rows_per_block(group, int(q.shape[2])), head_dim, dtype.name, vec, bshd, fused)


class KernelFamily:
    """One of ``attend_kernel``, ``attend_bshd_kernel``, ``append_attend_kernel``,
    ``append_attend_bshd_kernel``: every specialisation of one layout and kind.

    ``family[grid, threads](*args)`` launches the specialisation the arguments need (its
    grid must have ``ceil(group * n_q / ROWS)`` chunks along z, as
    :func:`nbkv.launch.attention_grid` gives); :meth:`specialise` returns the kernel of
    one :class:`Spec`. ``py_func`` is the main case's (group 4, head_dim 128, float16),
    for ``numba.cuda.compile_ptx``.
    """

    def __init__(self, bshd: bool, fused: bool) -> None:
        self.bshd, self.fused = bshd, fused

    def spec(self, q, k_cache, v_cache) -> Spec:
        return spec_for(q, k_cache, v_cache, bshd=self.bshd, fused=self.fused)

    def specialise(self, spec: Spec):
        if (spec.bshd, spec.fused) != (self.bshd, self.fused):
            raise ValueError(f"{spec} is not a specialisation of {self!r}")
        return attention_kernel(spec)

    @property
    def py_func(self):
        return attention_kernel(Spec(4, 128, "float16", 8, self.bshd, self.fused)).py_func

    def __getitem__(self, config):
        def launch(*args):
            if self.fused:
                q, k_cache, v_cache = args[0], args[4], args[5]
            else:
                q, k_cache, v_cache = args[0], args[1], args[2]
            kernel = self.specialise(self.spec(q, k_cache, v_cache))
            scale_at = 6 if self.fused else 4
            args = list(args)
            args[scale_at] = np.float32(args[scale_at])
            kernel[config](*args)

        return launch

    def __repr__(self) -> str:
        kind = "append_attend" if self.fused else "attend"
        return f"<KernelFamily {kind}{'_bshd' if self.bshd else ''}_kernel>"


attend_kernel = KernelFamily(False, False)
append_attend_kernel = KernelFamily(False, True)
attend_bshd_kernel = KernelFamily(True, False)
append_attend_bshd_kernel = KernelFamily(True, True)
