"""CUDA flash-decoding: attention over a K/V cache, split across blocks, in one launch.

Grid ``(num_splits, batch * num_kv_heads, row_chunks)``, one block of ``THREADS`` threads
each. A block takes one KV head of one batch row, one chunk of up to ``ROWS`` query rows
of that head's group (row ``r = g * n_q + i``: query ``i`` of group member ``g``), and one
contiguous split of the visible positions, so that batch 1 at long context still fills
the GPU. It walks its split in tiles of ``TILE`` positions:

1. scores: thread ``t`` takes position ``j0 + t`` and computes its dot product with every
   query row (queries sit in shared memory, scale folded in); masked scores are -inf;
2. online softmax: thread ``r`` updates row ``r``'s running maximum and sum and turns
   the tile's scores into weights;
3. values: thread ``t`` owns dimensions ``t, t + THREADS, ...`` and adds the weighted V
   rows of the tile to its accumulators; consecutive threads read consecutive elements
   of a V row, so the reads are coalesced.

Each block writes its partial result (maximum, sum, accumulator) to scratch; the last
block of a (KV head, row chunk) to finish (an atomic counter, after a memory fence)
combines the splits and writes the output, then resets the counter for the next launch.
No second launch is needed.

``append_attend_kernel`` also writes the ``n`` new positions: the block whose split holds
position ``j >= pos`` copies it from ``k``/``v`` into the cache and reads it from ``k``/``v``
itself, so the write needs no grid-wide barrier before the attention reads it. New
positions that no query can see (before a ``window``) are copied by the task's chunk-0
blocks, split-strided, since no split holds them.

NaN and infinities flow through as IEEE arithmetic says: a NaN score makes its row's
output NaN, a ``-inf`` score gets weight 0, a row with nothing finite gives NaN.

16-bit storage: float16 caches are read as float16; bfloat16 caches arrive as ``uint16``
bit patterns and are widened by a float32 lookup table (``table``; empty otherwise).
Accumulation is float32. The output has q's dtype (float16, float32 or float64).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .. import _config

__all__ = [
    "attend_kernel",
    "attend_bshd_kernel",
    "append_attend_kernel",
    "append_attend_bshd_kernel",
    "THREADS",
    "ROWS",
    "MAX_HEAD_DIM",
]

THREADS = _config.ATTENTION_THREADS  # threads per block, and positions per tile
TILE = THREADS
ROWS = _config.ATTENTION_ROWS  # query rows per block
MAX_HEAD_DIM = _config.ATTENTION_MAX_HEAD_DIM
_DIMS_PER_THREAD = -(-MAX_HEAD_DIM // THREADS)
_ACC_SIZE = ROWS * _DIMS_PER_THREAD  # local arrays need a constant size
_NEG_INF = -math.inf


@cuda.jit(device=True, inline=True)
def _widen(x, table):
    """A stored value as float32: 16-bit bit patterns through ``table``, floats by cast."""
    if table.shape[0] == 0:
        return np.float32(x)
    return table[np.int32(x)]


@cuda.jit(device=True, inline=True)
def _tile_softmax(s, m, den, corr, t):
    """Step 2 of a tile, for query row ``t``: raise its running maximum ``m[t]`` to the
    tile's, rescale its sum ``den[t]`` (the factor left in ``corr[t]`` for the
    accumulators) and turn its scores ``s[t, :]`` into weights. A row with nothing finite
    in the tile gets weights 0 (and NaN throughout if a score was NaN)."""
    tile_max = _NEG_INF
    for i in range(TILE):
        tile_max = max(tile_max, s[t, i])
    if tile_max == _NEG_INF:  # nothing finite in this row of the tile
        poisoned = False
        for i in range(TILE):
            poisoned = poisoned or s[t, i] != s[t, i]
            s[t, i] = 0.0
        corr[t] = 1.0
        if poisoned:  # a NaN score (max() drops NaN): the row's output is NaN
            m[t] = math.nan
            den[t] = math.nan
            corr[t] = math.nan
    else:
        m_new = max(m[t], tile_max)
        c = math.exp(m[t] - m_new)  # exp(-inf) = 0 on the first tile
        total = den[t] * c
        for i in range(TILE):
            w = math.exp(s[t, i] - m_new)
            s[t, i] = w
            total += w
        den[t] = total
        m[t] = m_new
        corr[t] = c


def _make(bshd: bool):
    """The two kernels of one layout (``bshd`` is a compile-time constant)."""

    @cuda.jit(device=True, inline=True)
    def load(x, b, h, j, d):
        if bshd:
            return x[b, j, h, d]
        return x[b, h, j, d]

    @cuda.jit(device=True, inline=True)
    def store(x, b, h, j, d, value):
        if bshd:
            x[b, j, h, d] = value
        else:
            x[b, h, j, d] = value

    # inlined into both kernels (an out-of-line device call would need a GPU to compile)
    @cuda.jit(device=True, inline=True)
    def block(
        q,
        k,
        v,
        pos,
        k_cache,
        v_cache,
        seq_len,
        scale,
        causal,
        window,
        table,
        part_acc,
        part_stats,
        counters,
        out,
    ):
        t = cuda.threadIdx.x
        split = cuda.blockIdx.x
        num_splits = cuda.gridDim.x
        task = cuda.blockIdx.y
        chunk = cuda.blockIdx.z
        n_q = q.shape[2]
        dim = q.shape[3]
        num_kv_heads = k_cache.shape[2] if bshd else k_cache.shape[1]
        group = q.shape[1] // num_kv_heads
        b = task // num_kv_heads
        kvh = task - b * num_kv_heads
        r0 = chunk * ROWS
        rows = min(ROWS, group * n_q - r0)
        first = seq_len - n_q  # position of the first query
        lo = max(0, first - window + 1) if window > 0 else 0
        per_split = -(-(seq_len - lo) // num_splits)
        start = lo + split * per_split
        end = min(seq_len, start + per_split)

        qs = cuda.shared.array((ROWS, MAX_HEAD_DIM), np.float32)
        s = cuda.shared.array((ROWS, TILE), np.float32)
        m = cuda.shared.array(ROWS, np.float32)  # running maximum per row
        den = cuda.shared.array(ROWS, np.float32)  # running sum of exp(score - m)
        corr = cuda.shared.array(ROWS, np.float32)  # this tile's rescaling per row
        last = cuda.shared.array(1, np.int32)
        acc = cuda.local.array(_ACC_SIZE, np.float32)
        dots = cuda.local.array(ROWS, np.float32)

        # the chunk's queries into shared memory, scale folded in
        for idx in range(t, rows * dim, THREADS):
            r = idx // dim
            d = idx - r * dim
            row = r0 + r
            qs[r, d] = np.float32(q[b, kvh * group + row // n_q, row % n_q, d]) * scale
        if t < rows:
            m[t] = _NEG_INF
            den[t] = 0.0
        for i in range(_ACC_SIZE):
            acc[i] = 0.0
        # new positions before the window (append_attend with more new positions than
        # window + n_q - 1): no query sees them, so no split reads them, but they must
        # still reach the cache; chunk 0's blocks of this task copy them, split-strided
        if chunk == 0:
            hidden = min(lo, seq_len) - pos
            for idx in range(split * THREADS + t, hidden * dim, num_splits * THREADS):
                jj = idx // dim
                d = idx - jj * dim
                store(k_cache, b, kvh, pos + jj, d, load(k, b, kvh, jj, d))
                store(v_cache, b, kvh, pos + jj, d, load(v, b, kvh, jj, d))
        cuda.syncthreads()

        for j0 in range(start, end, TILE):
            # 1. scores: thread t scores position j for every row
            j = j0 + t
            if j < end:
                for r in range(rows):
                    dots[r] = 0.0
                for d in range(dim):
                    if j >= pos:  # a new position: read it from k, and write it to the cache
                        raw = load(k, b, kvh, j - pos, d)
                        if chunk == 0:
                            store(k_cache, b, kvh, j, d, raw)
                            store(v_cache, b, kvh, j, d, load(v, b, kvh, j - pos, d))
                    else:
                        raw = load(k_cache, b, kvh, j, d)
                    kd = _widen(raw, table)
                    for r in range(rows):
                        dots[r] += qs[r, d] * kd
                for r in range(rows):
                    p = first + (r0 + r) % n_q
                    if (causal and j > p) or (window > 0 and j <= p - window):
                        s[r, t] = _NEG_INF
                    else:
                        s[r, t] = dots[r]
            else:
                for r in range(rows):
                    s[r, t] = _NEG_INF
            cuda.syncthreads()
            # 2. online softmax: thread r rescales row r and turns scores into weights
            if t < rows:
                _tile_softmax(s, m, den, corr, t)
            cuda.syncthreads()
            # 3. values: thread t owns dimensions t, t + THREADS, ...; reads are coalesced
            n_tile = min(TILE, end - j0)
            for k_i in range(_DIMS_PER_THREAD):
                d = t + k_i * THREADS
                if d < dim:
                    for r in range(rows):
                        acc[r * _DIMS_PER_THREAD + k_i] *= corr[r]
                    for i in range(n_tile):
                        jv = j0 + i
                        if jv >= pos:
                            vd = _widen(load(v, b, kvh, jv - pos, d), table)
                        else:
                            vd = _widen(load(v_cache, b, kvh, jv, d), table)
                        for r in range(rows):
                            acc[r * _DIMS_PER_THREAD + k_i] += s[r, i] * vd
            cuda.syncthreads()

        # this split's partial result
        for r in range(rows):
            row = r0 + r
            h = kvh * group + row // n_q
            i = row % n_q
            for k_i in range(_DIMS_PER_THREAD):
                d = t + k_i * THREADS
                if d < dim:
                    part_acc[b, h, i, split, d] = acc[r * _DIMS_PER_THREAD + k_i]
            if t == 0:
                part_stats[b, h, i, split, 0] = m[r]
                part_stats[b, h, i, split, 1] = den[r]
        # the last block of this (KV head, row chunk) to finish combines the splits
        cuda.threadfence()
        cuda.syncthreads()
        if t == 0:
            done = cuda.atomic.add(counters, (task, chunk), 1)
            last[0] = 1 if done == num_splits - 1 else 0
        cuda.syncthreads()
        if last[0] == 1:
            cuda.threadfence()
            for idx in range(t, rows * dim, THREADS):
                r = idx // dim
                d = idx - r * dim
                row = r0 + r
                h = kvh * group + row // n_q
                i = row % n_q
                top = _NEG_INF
                for sp in range(num_splits):
                    top = max(top, part_stats[b, h, i, sp, 0])
                num = 0.0
                total = 0.0
                for sp in range(num_splits):
                    mx = part_stats[b, h, i, sp, 0]
                    if mx != _NEG_INF:
                        w = math.exp(mx - top)
                        num += w * part_acc[b, h, i, sp, d]
                        total += w * part_stats[b, h, i, sp, 1]
                # nothing finite anywhere: NaN (0 / 0 on a GPU; the simulator would raise)
                out[b, h, i, d] = num / total if total != 0.0 else math.nan
            if t == 0:
                counters[task, chunk] = 0  # ready for the next launch

    @cuda.jit
    def attend(
        q,
        k_cache,
        v_cache,
        seq_len,
        scale,
        causal,
        window,
        table,
        part_acc,
        part_stats,
        counters,
        out,
    ):
        """Attention of q [batch, num_heads, n_q, head_dim] over the first seq_len
        positions of the cache. Mutates part_acc, part_stats, counters (left at zero), out."""
        block(
            q,
            k_cache,
            v_cache,
            seq_len,
            k_cache,
            v_cache,
            seq_len,
            scale,
            causal,
            window,
            table,
            part_acc,
            part_stats,
            counters,
            out,
        )

    @cuda.jit
    def append_attend(
        q,
        k,
        v,
        pos,
        k_cache,
        v_cache,
        scale,
        causal,
        window,
        table,
        part_acc,
        part_stats,
        counters,
        out,
    ):
        """Write k, v (n new positions) at pos, then attend over the pos + n held, in one
        launch. Mutates k_cache, v_cache, part_acc, part_stats, counters, out."""
        n = k.shape[1] if bshd else k.shape[2]
        block(
            q,
            k,
            v,
            pos,
            k_cache,
            v_cache,
            pos + n,
            scale,
            causal,
            window,
            table,
            part_acc,
            part_stats,
            counters,
            out,
        )

    return attend, append_attend


attend_kernel, append_attend_kernel = _make(False)
attend_bshd_kernel, append_attend_bshd_kernel = _make(True)
