"""CUDA (``@cuda.jit``) attention over a quantized layer's codes, the twin of
:func:`nbkv.kernels.cpu_quant_attend.attend_quant`.

The storage and the argument order are :mod:`nbkv.kernels.cuda_quant`'s (its module
docstring has the rest: 16-bit data, counts in unsigned 32-bit ints), and that module
imports the kernel and the sizes here: ``cuda_quant.attend_quant_kernel`` is this one.

- ``attend_quant_kernel[(batch * num_kv_heads, chunks), THREADS](q, k_codes, k_scale,
  k_zero, v_codes, v_scale, v_zero, k_win, v_win, q_len, seq_len, k_bits, v_bits, scale,
  causal, window, table, out)``: a block takes one KV head of one batch row and a chunk of
  up to ``ROWS`` query rows of its group (``chunks = ceil(group * n_q / ROWS)``; row ``r =
  g * n_q + i``), and walks the visible positions in tiles of up to ``TILE`` that never
  cross a K group or the ring's end, as the CPU kernel does: (1) the tile's K is
  dequantized into shared memory (the group's scales widened once per group); (2) thread
  pairs (row, position) take dot products with the queries (scale folded in), masked
  scores -inf; (3) thread ``r`` runs row ``r``'s online softmax while every thread
  dequantizes the tile's V into the same shared buffer; (4) thread ``t`` adds the
  weighted V rows to its accumulators, dimensions ``t, t + THREADS, ...`` of every row,
  held in registers. The cache is never materialised in float. ``head_dim <=
  MAX_HEAD_DIM``. NaN and infinities follow IEEE arithmetic as on the CPU: a -inf score
  weighs 0, a row that sees nothing finite gives NaN. One block walks every visible
  position of its (KV head, chunk): no split of the sequence across blocks (as
  :mod:`nbkv.kernels.cuda_attention` does), so a small batch at long context fills few SMs.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .. import _config
from .cuda_quant_bits import _code_in, _div, _mod, _widen

__all__ = ["attend_quant_kernel", "THREADS", "TILE", "ROWS", "MAX_HEAD_DIM"]

THREADS = _config.ATTENTION_THREADS  # threads per block (32 under the simulator)
ROWS = _config.ATTENTION_ROWS  # query rows per attention block
MAX_HEAD_DIM = _config.ATTENTION_MAX_HEAD_DIM
# positions per attention tile: its dequantized K (then V) rows, the queries and the
# scores fit the 48 KiB of static shared memory a block may have at head_dim 256
TILE = 16
_PAD = MAX_HEAD_DIM + 1  # shared rows one float longer: a column's reads hit 32 banks
_DIMS = -(-MAX_HEAD_DIM // THREADS)  # accumulated dimensions per thread (and query row)
_PAIRS = -(-ROWS * TILE // THREADS)  # (row, position) scores per thread and tile
_NEG_INF = np.float32(-np.inf)
_NAN = np.float32(np.nan)


@cuda.jit(device=True, inline=True)
def _load_tile(codes, is_k, sc, ze, v_scale, v_zero, win, coded, j0, nb, slot, bits, table, kv):
    """Rows ``j0 .. j0 + nb - 1`` of one head's K (``is_k``) or V as float32 into shared
    ``kv`` [TILE, _PAD]: coded ones (``codes`` [n, row]) dequantized, K by ``sc``, ``ze``
    (its group's widened scales per channel), V by the 16-bit ``v_scale``, ``v_zero``
    [n, head_dim // v_group] of each position; else the ring's rows ``win`` [W, head_dim]
    from ``slot``. Mutates ``kv``."""
    dim = win.shape[1]
    v_group = dim // v_scale.shape[1]
    t = cuda.threadIdx.x
    # element e = t + THREADS * i of the tile is (row j, channel d): step (j, d) along
    j = _div(t, dim)
    d = t - j * dim
    j_step = _div(THREADS, dim)
    d_step = THREADS - j_step * dim
    while j < nb:
        if not coded:
            kv[j, d] = _widen(win[slot + j, d], win, table)
        elif is_k:  # K: one scale per channel for the whole group
            kv[j, d] = ze[d] + np.float32(_code_in(codes[j0 + j], d, bits)) * sc[d]
        else:  # V: one scale per position and channel group
            c = _div(d, v_group)
            scale = table[np.int32(v_scale[j0 + j, c])]
            zero = table[np.int32(v_zero[j0 + j, c])]
            kv[j, d] = zero + np.float32(_code_in(codes[j0 + j], d, bits)) * scale
        d += d_step
        j += j_step
        if d >= dim:
            d -= dim
            j += 1


@cuda.jit(device=True, inline=True)
def _softmax_row(s, r, nb, m, den, corr):
    """The online softmax of row ``r`` over one tile (as the CPU kernel's): raise its
    running maximum ``m[r]`` to the tile's, rescale its sum ``den[r]`` (the factor left in
    ``corr[r]`` for the accumulators) and turn its scores ``s[r, :nb]`` into weights. A
    row with nothing finite in the tile gets weights 0, and NaN throughout if a score was
    NaN. Mutates ``s``, ``m``, ``den``, ``corr``."""
    top = _NEG_INF
    for j in range(nb):
        x = s[r, j]
        top = x if x > top else top  # Python's max: a NaN is seen below, not here
    if top == _NEG_INF:
        poisoned = False
        for j in range(nb):
            poisoned = poisoned or s[r, j] != s[r, j]
            s[r, j] = np.float32(0)
        corr[r] = np.float32(1)
        if poisoned:
            m[r] = _NAN
            den[r] = _NAN
            corr[r] = _NAN
        return
    m_old = m[r]
    m_new = top if top > m_old else m_old
    c = math.exp(m_old - m_new)  # exp(-inf) = 0 on the first tile
    total = den[r] * c
    for j in range(nb):
        x = math.exp(s[r, j] - m_new)
        s[r, j] = x
        total += x
    den[r] = total
    m[r] = m_new
    corr[r] = c


@cuda.jit(device=True, inline=True)
def _start_rows(q, qs, m, den, qpos, acc, scale, b, kvh, group, r0, rows, first):
    """The chunk's queries into ``qs``, scale folded in (as float32), each row's query
    position into ``qpos``; running maxima, sums and accumulators empty."""
    t = cuda.threadIdx.x
    n_q, dim = q.shape[2], q.shape[3]
    f_scale = np.float32(scale)
    for e in range(t, rows * dim, THREADS):
        r = _div(e, dim)
        d = e - r * dim
        row = r0 + r
        qs[r, d] = np.float32(q[b, kvh * group + _div(row, n_q), _mod(row, n_q), d]) * f_scale
    if t < ROWS:
        m[t] = _NEG_INF
        den[t] = np.float32(0)
        qpos[t] = first + _mod(r0 + t, n_q)  # row t's query position
    for r in range(ROWS):
        for i in range(_DIMS):
            acc[r, i] = np.float32(0)


@cuda.jit(device=True, inline=True)
def _score_tile(qs, kv, s, qpos, rows, nb, dim, j0, causal, window):
    """Step 2: thread t takes the (row, position) pairs t, t + THREADS, ... of the tile;
    a score its row may not see is -inf. Mutates ``s``."""
    t = cuda.threadIdx.x
    for i in range(_PAIRS):
        e = t + i * THREADS
        r = e // TILE
        j = e - r * TILE
        if r < rows and j < nb:
            dot = np.float32(0)
            for d in range(dim):
                dot += qs[r, d] * kv[j, d]
            p = qpos[r]
            if (causal and j0 + j > p) or (window > 0 and j0 + j <= p - window):
                dot = _NEG_INF
            s[r, j] = dot


@cuda.jit(device=True, inline=True)
def _accumulate_tile(acc, s, kv, corr, rows, nb, dim):
    """Step 4: thread t's dimensions t, t + THREADS, ... of every row, rescaled by
    ``corr``, then the tile's weighted V rows (in ``kv``) added. Mutates ``acc``."""
    t = cuda.threadIdx.x
    for r in range(ROWS):
        if r < rows:
            for i in range(_DIMS):
                acc[r, i] *= corr[r]
    for j in range(nb):
        for i in range(_DIMS):
            d = t + i * THREADS
            if d < dim:
                x = kv[j, d]
                for r in range(ROWS):
                    if r < rows:
                        acc[r, i] += s[r, j] * x


@cuda.jit(device=True, inline=True)
def _write_rows(out, acc, corr, den, b, kvh, group, r0, rows):
    """``acc / den`` of every row into ``out`` (NaN for a row with nothing finite).
    Holds a barrier: every thread of the block calls it."""
    t = cuda.threadIdx.x
    n_q, dim = out.shape[2], out.shape[3]
    if t < rows:
        corr[t] = np.float32(1) / den[t]  # inf when nothing was finite: 0 * inf = NaN
    cuda.syncthreads()
    for r in range(ROWS):
        if r < rows:
            row = r0 + r
            h = kvh * group + _div(row, n_q)
            for i in range(_DIMS):
                d = t + i * THREADS
                if d < dim:
                    out[b, h, _mod(row, n_q), d] = acc[r, i] * corr[r]


@cuda.jit
def attend_quant_kernel(
    q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_win, v_win, q_len, seq_len,
    k_bits, v_bits, scale, causal, window, table, out,
):  # fmt: skip
    """Attention of q [batch, num_heads, n_q, head_dim] over a quantized layer's seq_len
    positions: codes [0, q_len) dequantized tile by tile, then the window (the queries
    are the last n_q positions). scale: float32 (a float64 works, at float64's cost).
    Mutates ``out`` [batch, num_heads, n_q, head_dim], q's dtype."""
    t = cuda.threadIdx.x
    n_q, dim = q.shape[2], q.shape[3]
    num_kv_heads = k_codes.shape[1]
    group = _div(q.shape[1], num_kv_heads)
    b = _div(cuda.blockIdx.x, num_kv_heads)
    kvh = cuda.blockIdx.x - b * num_kv_heads
    r0 = cuda.blockIdx.y * ROWS
    rows = min(ROWS, group * n_q - r0)
    k_group = max(_div(k_codes.shape[2], max(k_scale.shape[2], 1)), 1)
    w = k_win.shape[2]
    first = seq_len - n_q  # position of the first query
    lo = max(0, first - window + 1) if window > 0 else 0
    # this head's arrays: views with fewer sizes to keep in registers than the 4-D ones
    kc, vc, vs, vz = k_codes[b, kvh], v_codes[b, kvh], v_scale[b, kvh], v_zero[b, kvh]
    kw, vw = k_win[b, kvh], v_win[b, kvh]

    qs = cuda.shared.array((ROWS, _PAD), np.float32)  # the queries, scale folded in
    kv = cuda.shared.array((TILE, _PAD), np.float32)  # the tile's K rows, then its V rows
    s = cuda.shared.array((ROWS, TILE), np.float32)  # scores, then weights
    sc = cuda.shared.array(MAX_HEAD_DIM, np.float32)  # the current K group's scales
    ze = cuda.shared.array(MAX_HEAD_DIM, np.float32)  # and zero points
    m = cuda.shared.array(ROWS, np.float32)  # running maximum per row
    den = cuda.shared.array(ROWS, np.float32)  # running sum of exp(score - m)
    corr = cuda.shared.array(ROWS, np.float32)  # this tile's rescaling per row
    qpos = cuda.shared.array(ROWS, np.int64)  # each row's query position
    acc = cuda.local.array((ROWS, _DIMS), np.float32)  # constant indices: registers

    _start_rows(q, qs, m, den, qpos, acc, scale, b, kvh, group, r0, rows, first)
    current = -1
    j0 = lo
    while j0 < seq_len:
        coded = j0 < q_len
        slot = _mod(j0, w)
        if coded:  # a tile never crosses a K group, whose scales it shares
            g = _div(j0, k_group)
            j1 = min(q_len, (g + 1) * k_group, j0 + TILE)
            if g != current:
                for d in range(t, dim, THREADS):
                    sc[d] = table[np.int32(k_scale[b, kvh, g, d])]
                    ze[d] = table[np.int32(k_zero[b, kvh, g, d])]
                current = g
                cuda.syncthreads()
        else:  # the window: a tile never crosses the ring's end
            j1 = min(seq_len, j0 + TILE, j0 + w - slot)
        nb = j1 - j0
        # 1. the tile's K, dequantized into shared memory
        _load_tile(kc, True, sc, ze, vs, vz, kw, coded, j0, nb, slot, k_bits, table, kv)
        cuda.syncthreads()
        _score_tile(qs, kv, s, qpos, rows, nb, dim, j0, causal, window)  # 2. scores
        cuda.syncthreads()
        # 3. thread r: row r's softmax; every thread: the tile's V over its K
        if t < rows:
            _softmax_row(s, t, nb, m, den, corr)
        _load_tile(vc, False, sc, ze, vs, vz, vw, coded, j0, nb, slot, v_bits, table, kv)
        cuda.syncthreads()
        _accumulate_tile(acc, s, kv, corr, rows, nb, dim)  # 4. the values
        cuda.syncthreads()  # before the next tile overwrites kv, s and corr
        j0 = j1
    _write_rows(out, acc, corr, den, b, kvh, group, r0, rows)
