"""CPU (``@njit``) attention over a quantized layer's codes (KIVI): the codes
``[0, q_len)`` dequantized block by block inside the loop, then the window, so the cache
is never materialised in float.

The storage, the quantizer and the argument order are :mod:`nbkv.kernels.cpu_quant`'s
(its module docstring is the spec), which imports the kernels here:
``nbkv.kernels.cpu_quant.attend_quant`` is this module's ``attend_quant``.

- :func:`attend_quant`: parallel over (batch row, KV head); :func:`attend_quant_serial`
  the same on the calling thread (small work). Each task walks blocks of ``_BLOCK``
  positions that never cross a K group or the ring's end, with the online softmax of
  :mod:`nbkv.kernels.cpu_attention`.
- :func:`_dequant_k`, :func:`_dequant_v`, :func:`_group_scales`: a block of codes as
  float32 rows, what the attention runs in its loop and
  :func:`nbkv.kernels.cpu_quant.dequantize` reuses for ``get_kv``.
- :func:`_fold_k_group`, :func:`_add_rows`: 8-bit K is never dequantized; its group's
  scales and zero points are folded into the queries, and the scores read the codes.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import _config
from .cpu_attention import _AHEAD, _BLOCK, _accumulate, _mask, _online_softmax, _rows, _scores
from .cpu_math import prefetch_ahead

__all__ = ["attend_quant", "attend_quant_serial"]


@njit(cache=True)
def _dequant_k(codes, scale, zero, bits, out, ahead=0):
    """K rows from codes [nb, k_row] and one group's float32 ``scale``, ``zero``
    [head_dim]: out[j, d] = zero[d] + code * scale[d] (float32). Mutates ``out``; returns
    the rows written. ``ahead`` > 0: row ``j + ahead`` of the codes is prefetched as row
    ``j`` is dequantized (past the block: the next one's, when ``codes`` is a slice)."""
    nb = codes.shape[0]
    dim = scale.shape[0]
    rows = out[:nb]
    if bits == 8:
        for j in range(nb):
            prefetch_ahead(codes, j, 1, ahead)
            for d in range(dim):
                rows[j, d] = zero[d] + np.float32(codes[j, d]) * scale[d]
    elif bits == 4:
        for j in range(nb):
            prefetch_ahead(codes, j, 1, ahead)
            for i in range(dim // 2):
                c = codes[j, i]
                rows[j, 2 * i] = zero[2 * i] + np.float32(c & 15) * scale[2 * i]
                rows[j, 2 * i + 1] = zero[2 * i + 1] + np.float32(c >> 4) * scale[2 * i + 1]
            if dim % 2:
                d = dim - 1
                rows[j, d] = zero[d] + np.float32(codes[j, d // 2] & 15) * scale[d]
    else:
        for j in range(nb):
            src, dst = codes[j], rows[j]
            for i in range(dim // 4):
                c = src[i]
                dst[4 * i] = zero[4 * i] + np.float32(c & 3) * scale[4 * i]
                dst[4 * i + 1] = zero[4 * i + 1] + np.float32((c >> 2) & 3) * scale[4 * i + 1]
                dst[4 * i + 2] = zero[4 * i + 2] + np.float32((c >> 4) & 3) * scale[4 * i + 2]
                dst[4 * i + 3] = zero[4 * i + 3] + np.float32(c >> 6) * scale[4 * i + 3]
            for d in range(dim - dim % 4, dim):
                c = (codes[j, d // 4] >> ((d % 4) * 2)) & 3
                rows[j, d] = zero[d] + np.float32(c) * scale[d]
    return rows


@njit(cache=True)
def _dequant_v(codes, scale, zero, bits, table, out, ahead=0):
    """V rows from codes [nb, v_row] and their 16-bit ``scale``, ``zero`` bits
    [nb, head_dim // v_group]: out[j, d] = zero + code * scale of d's channel group.
    Mutates ``out``; returns the rows written; ``ahead`` prefetches as in :func:`_dequant_k`.

    One loop nest per bit width, each inner loop counting from 0 over slices: a call
    per row (reference counts on its views) or Numba's negative-index check on
    ``d0 + i`` kept it from vectorising (10-30x slower, measured)."""
    nb = codes.shape[0]
    dim = out.shape[1]
    n_c = scale.shape[1]
    vg = dim // n_c
    per = 8 // bits
    rows = out[:nb]
    if bits == 8:
        for j in range(nb):
            prefetch_ahead(codes, j, 1, ahead)
            for c in range(n_c):
                s, z = table[scale[j, c]], table[zero[j, c]]
                src, dst = codes[j, c * vg : (c + 1) * vg], rows[j, c * vg : (c + 1) * vg]
                for i in range(vg):
                    dst[i] = z + np.float32(src[i]) * s
    elif bits == 4 and vg % 2 == 0:
        h = vg // 2
        for j in range(nb):
            prefetch_ahead(codes, j, 1, ahead)
            for c in range(n_c):
                s, z = table[scale[j, c]], table[zero[j, c]]
                src, dst = codes[j, c * h : (c + 1) * h], rows[j, c * vg : (c + 1) * vg]
                for i in range(h):
                    b = src[i]
                    dst[2 * i] = z + np.float32(b & 15) * s
                    dst[2 * i + 1] = z + np.float32(b >> 4) * s
    elif bits == 2 and vg % 4 == 0:
        h = vg // 4
        for j in range(nb):
            for c in range(n_c):
                s, z = table[scale[j, c]], table[zero[j, c]]
                src, dst = codes[j, c * h : (c + 1) * h], rows[j, c * vg : (c + 1) * vg]
                for i in range(h):
                    b = src[i]
                    dst[4 * i] = z + np.float32(b & 3) * s
                    dst[4 * i + 1] = z + np.float32((b >> 2) & 3) * s
                    dst[4 * i + 2] = z + np.float32((b >> 4) & 3) * s
                    dst[4 * i + 3] = z + np.float32(b >> 6) * s
    else:  # groups that do not start or end on a byte
        mask = (1 << bits) - 1
        for j in range(nb):
            for d in range(dim):
                c = d // vg
                code = (codes[j, d // per] >> ((d % per) * bits)) & mask
                rows[j, d] = table[zero[j, c]] + np.float32(code) * table[scale[j, c]]
    return rows


@njit(cache=True)
def _group_scales(k_scale, k_zero, table, scale, zero):
    """Widen one group's 16-bit K scales and zeros [head_dim] into float32. Mutates both."""
    for d in range(scale.shape[0]):
        scale[d] = table[k_scale[d]]
        zero[d] = table[k_zero[d]]


@njit(cache=True, fastmath=_config.FASTMATH)
def _fold_k_group(qs, scale, zero, q_sc, q_ze):
    """For 8-bit K: a score ``qs[r] . (zero + code * scale)`` is ``q_ze[r] + q_sc[r] .
    code``, so the group's scales and zero points go into the queries once per group
    (``q_sc = qs * scale``, ``q_ze = qs . zero``) and no K row is dequantized. Mutates
    ``q_sc``, ``q_ze``."""
    for r in range(qs.shape[0]):
        z = np.float32(0.0)
        for d in range(qs.shape[1]):
            q_sc[r, d] = qs[r, d] * scale[d]
            z += qs[r, d] * zero[d]
        q_ze[r] = z


@njit(cache=True)
def _add_rows(s, nb, x):
    """``s[r, :nb] += x[r]`` for every row. Mutates ``s``."""
    for r in range(s.shape[0]):
        for j in range(nb):
            s[r, j] += x[r]


# error_model="numpy": as in cpu_attention, IEEE results, never an exception
@njit(cache=True, error_model="numpy")
def _attend_quant_task(
    q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_win, v_win, q_len, seq_len,
    k_bits, v_bits, scale, causal, window, table, out, task,
):  # fmt: skip
    """:func:`attend_quant` for one (batch row, KV head), ``task = b * heads + kvh``."""
    batch, num_heads, n_q, dim = q.shape
    num_kv_heads = k_codes.shape[1]
    group = num_heads // num_kv_heads
    k_group = k_codes.shape[2] // max(k_scale.shape[2], 1)
    rows = group * n_q
    first = seq_len - n_q
    lo = max(0, first - window + 1) if window > 0 else 0
    all_lo = max(0, seq_len - window) if window > 0 else 0
    all_hi = first + 1 if causal else seq_len
    b = task // num_kv_heads
    kvh = task - b * num_kv_heads
    qs = np.empty((rows, dim), q.dtype)
    for g in range(group):
        for i in range(n_q):
            for d in range(dim):
                qs[g * n_q + i, d] = q[b, kvh * group + g, i, d] * scale
    m = np.full(rows, -np.inf, q.dtype)
    denom = np.zeros(rows, q.dtype)
    acc = np.zeros((rows, dim), q.dtype)
    s = np.empty((rows, _BLOCK), q.dtype)
    k_buf = np.empty((_BLOCK, dim), np.float32)  # this block's rows, dequantized
    v_buf = np.empty((_BLOCK, dim), np.float32)
    k_sc = np.empty(dim, np.float32)  # the current K group's scales and zeros
    k_ze = np.empty(dim, np.float32)
    q_sc = np.empty((rows, dim), np.float32)  # 8-bit K: the queries times the scales,
    q_ze = np.empty(rows, np.float32)  # and their dot products with the zero points
    w = k_win.shape[2]
    current = -1
    j0 = lo
    while j0 < seq_len:
        if j0 < q_len:
            # coded positions: a block never crosses a K group, whose scales it shares
            g = j0 // k_group
            j1 = min(q_len, (g + 1) * k_group, j0 + _BLOCK)
            if g != current:
                _group_scales(k_scale[b, kvh, g], k_zero[b, kvh, g], table, k_sc, k_ze)
                current = g
                if k_bits == 8:
                    _fold_k_group(qs, k_sc, k_ze, q_sc, q_ze)
            nb = j1 - j0
            if k_bits == 8:  # scores over the codes themselves, scale and zero folded in
                _scores(q_sc, k_codes[b, kvh, j0:j1], s, 0, -1, _AHEAD)  # rows on their way
                _add_rows(s, nb, q_ze)
            else:
                codes = k_codes[b, kvh, j0:j1]
                _scores(qs, _dequant_k(codes, k_sc, k_ze, k_bits, k_buf, _AHEAD), s, 0)
        else:
            # the window: a block never crosses the ring's end
            slot = j0 % w
            j1 = min(seq_len, j0 + _BLOCK, j0 + w - slot)
            nb = j1 - j0
            _scores(qs, _rows(k_win[b, kvh, slot : slot + j1 - j0], table, k_buf), s, 0)
        if j0 < all_lo or j1 > all_hi:
            _mask(s, nb, j0, first, n_q, causal, window)
        _online_softmax(s, nb, m, denom, acc)
        if j0 < q_len:
            vb = _dequant_v(
                v_codes[b, kvh, j0:j1], v_scale[b, kvh, j0:j1], v_zero[b, kvh, j0:j1],
                v_bits, table, v_buf, _AHEAD,
            )  # fmt: skip
        else:
            slot = j0 % w
            vb = _rows(v_win[b, kvh, slot : slot + nb], table, v_buf)
        _accumulate(s, vb, acc, 0)
        j0 = j1
    for r in range(rows):
        h = kvh * group + r // n_q
        inv = 1.0 / denom[r]
        for d in range(dim):
            out[b, h, r % n_q, d] = acc[r, d] * inv


@njit(parallel=True, cache=True)
def attend_quant(
    q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_win, v_win, q_len, seq_len,
    k_bits, v_bits, scale, causal, window, table, out,
):  # fmt: skip
    """Attention of ``q`` over a quantized layer's ``seq_len`` positions: codes
    ``[0, q_len)``, dequantized block by block, then the window (module docstring).

    q: shape [batch, num_heads, n_q, head_dim], float32 (the accumulator type); the queries
        are the last ``n_q`` positions. scale, causal, window: as
        :func:`nbkv.kernels.cpu_attention.attend`. table: widens the 16-bit scales (and a
        16-bit window). out: shape of q. Mutated.
    """
    for task in prange(q.shape[0] * k_codes.shape[1]):
        _attend_quant_task(
            q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_win, v_win, q_len,
            seq_len, k_bits, v_bits, scale, causal, window, table, out, task,
        )  # fmt: skip


@njit(cache=True)
def attend_quant_serial(
    q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_win, v_win, q_len, seq_len,
    k_bits, v_bits, scale, causal, window, table, out,
):  # fmt: skip
    """:func:`attend_quant` on the calling thread alone (small work). Mutates ``out``."""
    for task in range(q.shape[0] * k_codes.shape[1]):
        _attend_quant_task(
            q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_win, v_win, q_len,
            seq_len, k_bits, v_bits, scale, causal, window, table, out, task,
        )  # fmt: skip
