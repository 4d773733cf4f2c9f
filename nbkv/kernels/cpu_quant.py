"""CPU (``@njit``) kernels of the quantized cache (KIVI): quantize on append, dequantize,
and attend over the codes, dequantizing block by block inside the loop.

Storage of one layer, always ``[batch, num_kv_heads, ...]`` (the user's layout is a view
at the boundary). ``G`` is the group size, ``Gv = min(G, head_dim)`` V's channel group,
``n_groups = max_seq_len // G`` (only whole groups are ever quantized), ``W`` the window:

- ``k_codes``: uint8 ``[batch, heads, n_groups * G, k_row]``: position ``p``'s K, its
  channel ``d`` in byte ``d // per`` at bit ``(d % per) * k_bits`` (``per = 8 // k_bits``
  codes a byte, ``k_row = ceil(head_dim / per)``);
- ``k_scale``, ``k_zero``: uint16 bits ``[batch, heads, n_groups, head_dim]``: one scale
  and zero point per channel per group of ``G`` positions (K per channel);
- ``v_codes``: uint8 ``[batch, heads, n_groups * G, v_row]``, packed the same way;
- ``v_scale``, ``v_zero``: uint16 bits ``[batch, heads, n_groups * G, head_dim // Gv]``:
  one per position per ``Gv`` channels (V per token);
- ``k_win``, ``v_win``: the window, ``[batch, heads, W, head_dim]`` in the cache's dtype
  (float32, or uint16 bits of float16/bfloat16): position ``p`` at slot ``p % W``.

Positions ``[0, q_len)`` are codes, ``[q_len, seq_len)`` the window. Scales and zero
points are 16-bit floats, ``kind`` 0 (float16) or 1 (bfloat16), widened by ``table``
(:func:`nbkv.dtypes.widen_table` of that 16-bit type), which also widens a 16-bit window.

The quantizer, over a group's float32 values: ``scale = (max - min) / (2**bits - 1)`` and
``zero = min`` (float32 arithmetic), each rounded to the 16-bit type (to nearest, ties to
even) before use; ``code = clip(rint((x - zero) / scale), 0, 2**bits - 1)``, 0 where the
rounded scale is 0; ``x_hat = zero + code * scale`` in float32. ``nbkv.reference`` holds the
same in NumPy (``quantize_groups``), and the tests compare codes exactly.

The attention over the codes (``attend_quant``, ``attend_quant_serial``) and the block
dequantizers it shares with :func:`dequantize` live in :mod:`nbkv.kernels.cpu_quant_attend`
and are imported here: ``nbkv.kernels.cpu_quant.attend_quant`` is the same function.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.core import types
from numba.extending import overload

from .cpu_attention import _BLOCK
from .cpu_math import bits32, kind16, widen16
from .cpu_quant_attend import _add_rows as _add_rows  # re-exported (tests), not in __all__
from .cpu_quant_attend import (
    _dequant_k,
    _dequant_v,
    _group_scales,
    attend_quant,
    attend_quant_serial,
)
from .cpu_quant_attend import _fold_k_group as _fold_k_group  # re-exported (tests)

__all__ = [
    "quant_append",
    "dequantize",
    "attend_quant",
    "attend_quant_serial",
    "narrow16",
]


@njit(cache=True)
def narrow16(x, kind):
    """float32 ``x`` rounded to the nearest 16-bit float (ties to even), as its bits:
    float16 (``kind`` 0) or bfloat16 (``kind`` 1). Values past float16's range give inf."""
    u = np.uint32(bits32(np.float32(x)))
    if kind == 1:  # bfloat16: the upper half, rounded on the lower (NaN kept a NaN)
        if (u & 0x7FFFFFFF) > 0x7F800000:
            return np.uint16((u >> 16) | 0x40)
        return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    sign = np.uint32((u >> 16) & 0x8000)
    e = np.int64((u >> 23) & 0xFF)
    m = np.uint32(u & 0x7FFFFF)
    if e == 255:  # inf or NaN
        return np.uint16(sign | 0x7C00 | (0x200 if m else 0))
    exp = e - 112  # float16's biased exponent (127 - 15 = 112)
    if exp >= 31:
        return np.uint16(sign | 0x7C00)
    if exp <= 0:  # a float16 subnormal (or zero): shift the implicit one in
        if exp < -10:
            return np.uint16(sign)
        m = m | 0x800000
        shift = np.uint32(14 - exp)
        half = m >> shift
        rest = m & ((np.uint32(1) << shift) - 1)
        mid = np.uint32(1) << (shift - 1)
        if rest > mid or (rest == mid and (half & 1)):
            half += 1
        return np.uint16(sign | half)
    half = np.uint32(sign | (np.uint32(exp) << 10) | (m >> 13))
    rest = m & 0x1FFF
    if rest > 0x1000 or (rest == 0x1000 and (half & 1)):
        half += 1  # a carry into the exponent is right (up to inf)
    return np.uint16(half)


def _widen_row(src, table, dst):
    """dst[d] = src[d] as float32 (16-bit bits widened as ``table``'s format says). By the
    overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


@overload(_widen_row, jit_options={"cache": True})
def _widen_row_impl(src, table, dst):
    if src.dtype == types.uint16:

        def widen(src, table, dst):
            kind = kind16(table)  # the CPU's float16 conversion, or bfloat16's shift
            for d in range(src.shape[0]):
                dst[d] = widen16(src[d], kind)

        return widen

    def copy(src, table, dst):
        for d in range(src.shape[0]):
            dst[d] = src[d]

    return copy


@njit(cache=True)
def _scale_zero(lo, hi, levels, kind, table):
    """The 16-bit scale and zero point of a group spanning ``[lo, hi]``, and their
    float32 values as the codes use them: (scale bits, zero bits, scale, zero)."""
    s16 = narrow16(np.float32(hi - lo) / np.float32(levels), kind)
    z16 = narrow16(lo, kind)
    return s16, z16, table[s16], table[z16]


@njit(cache=True)
def _code(x, scale, zero, levels):
    """The code of ``x`` (float32 arithmetic): rint((x - zero) / scale), clipped."""
    if scale == 0:
        return 0
    c = np.rint(np.float32(x - zero) / scale)
    if c < 0:
        return 0
    if c > levels:
        return levels
    return int(c)


@njit(cache=True)
def _pack(codes, bits, out):
    """Pack ``codes`` (ints < 2**bits, one per channel) into the bytes ``out``."""
    per = 8 // bits
    dim = codes.shape[0]
    for i in range(out.shape[0]):
        byte = 0
        for t in range(per):
            d = i * per + t
            if d < dim:
                byte |= codes[d] << (t * bits)
        out[i] = byte


@njit(cache=True)
def _quant_k_group(xb, bits, kind, table, codes, k_codes, k_scale, k_zero):
    """Quantize one group of K rows ``xb`` ([G, head_dim] float32) per channel: write the
    codes of its G positions into ``k_codes`` [G, k_row] and the group's 16-bit scale and
    zero of each channel into ``k_scale``, ``k_zero`` [head_dim]. ``codes`` is scratch
    [G, head_dim]. Mutates ``codes``, ``k_codes``, ``k_scale``, ``k_zero``."""
    levels = (1 << bits) - 1
    g, dim = xb.shape
    for d in range(dim):
        lo = xb[0, d]
        hi = lo
        for j in range(1, g):
            lo = min(lo, xb[j, d])
            hi = max(hi, xb[j, d])
        s16, z16, scale, zero = _scale_zero(lo, hi, levels, kind, table)
        k_scale[d], k_zero[d] = s16, z16
        for j in range(g):
            codes[j, d] = _code(xb[j, d], scale, zero, levels)
    for j in range(g):
        _pack(codes[j], bits, k_codes[j])


@njit(cache=True)
def _quant_v_rows(xb, bits, kind, v_group, table, codes, v_codes, v_scale, v_zero):
    """Quantize V rows ``xb`` ([n, head_dim] float32) per position over groups of
    ``v_group`` channels: codes into ``v_codes`` [n, v_row], scales and zeros into
    ``v_scale``, ``v_zero`` [n, head_dim // v_group]. Mutates them and ``codes``."""
    levels = (1 << bits) - 1
    n, dim = xb.shape
    for j in range(n):
        for c in range(dim // v_group):
            d0 = c * v_group
            lo = xb[j, d0]
            hi = lo
            for d in range(d0 + 1, d0 + v_group):
                lo = min(lo, xb[j, d])
                hi = max(hi, xb[j, d])
            s16, z16, scale, zero = _scale_zero(lo, hi, levels, kind, table)
            v_scale[j, c], v_zero[j, c] = s16, z16
            for d in range(d0, d0 + v_group):
                codes[j, d] = _code(xb[j, d], scale, zero, levels)
        _pack(codes[j], bits, v_codes[j])


@njit(cache=True)
def _gather(x, win, held, p0, table, xb):
    """Rows of positions ``p0 .. p0 + len(xb) - 1`` as float32 into ``xb``: from the window
    ring ``win`` [W, head_dim] below ``held``, else from the new rows ``x`` [n, head_dim]
    (position ``held + i`` is ``x[i]``). Mutates ``xb``."""
    w = win.shape[0]
    for j in range(xb.shape[0]):
        p = p0 + j
        if p < held:
            _widen_row(win[p % w], table, xb[j])
        else:
            _widen_row(x[p - held], table, xb[j])


@njit(cache=True, nogil=True)
def quant_append(
    k, v, held, q_len, new_q, k_bits, v_bits, group, v_group, kind, table,
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_win, v_win,
):  # fmt: skip
    """Append ``n`` positions after the ``held`` a quantized layer holds.

    k, v: shape [batch, heads, n, head_dim], the cache's dtype (16-bit as uint16 bits),
        any strides. Position ``held + i`` is row ``i``.
    held, q_len, new_q: positions held, codes held (``[0, q_len)``) and codes held after
        (a multiple of ``group``, ``q_len <= new_q <= held + n``).
    The groups ``[q_len, new_q)`` are quantized (their rows from the window or from k/v),
    then the new positions past ``new_q`` are copied into the window ring, in that order,
    so that a ring slot is overwritten only once its old row is in codes.

    Mutates the codes, scales and zero points of those groups, and the window.
    """
    batch, heads, n, dim = k.shape
    xb = np.empty((group, dim), np.float32)
    codes = np.empty((group, dim), np.int64)
    w = k_win.shape[2]
    for b in range(batch):
        for h in range(heads):
            for g0 in range(q_len, new_q, group):
                _gather(k[b, h], k_win[b, h], held, g0, table, xb)
                _quant_k_group(
                    xb, k_bits, kind, table, codes,
                    k_codes[b, h, g0 : g0 + group], k_scale[b, h, g0 // group],
                    k_zero[b, h, g0 // group],
                )  # fmt: skip
                _gather(v[b, h], v_win[b, h], held, g0, table, xb)
                _quant_v_rows(
                    xb, v_bits, kind, v_group, table, codes,
                    v_codes[b, h, g0 : g0 + group], v_scale[b, h, g0 : g0 + group],
                    v_zero[b, h, g0 : g0 + group],
                )  # fmt: skip
            for p in range(max(new_q, held), held + n):
                for d in range(dim):
                    k_win[b, h, p % w, d] = k[b, h, p - held, d]
                    v_win[b, h, p % w, d] = v[b, h, p - held, d]


def _store_row(src, kind, dst):
    """dst[d] = float32 src[d] in ``dst``'s dtype: float32 as is, uint16 as the bits of
    the 16-bit type ``kind`` (rounded to nearest). By the overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


@overload(_store_row, jit_options={"cache": True})
def _store_row_impl(src, kind, dst):
    if dst.dtype == types.uint16:

        def narrow(src, kind, dst):
            for d in range(src.shape[0]):
                dst[d] = narrow16(src[d], kind)

        return narrow

    def copy(src, kind, dst):
        for d in range(src.shape[0]):
            dst[d] = src[d]

    return copy


@njit(cache=True, nogil=True)
def dequantize(
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_win, v_win, q_len, p0, p1,
    k_bits, v_bits, kind, table, k_out, v_out,
):  # fmt: skip
    """K and V of positions ``[p0, p1)`` as ``get_kv`` gives them: coded positions
    (below ``q_len``) dequantized and rounded to the cache's dtype, window positions as
    held. k_out, v_out: shape [batch, heads, p1 - p0, head_dim], any strides, the cache's
    dtype (float32, or uint16 bits of the 16-bit type ``kind``). Mutates both."""
    batch, heads = k_codes.shape[0], k_codes.shape[1]
    dim = k_out.shape[3]
    w = k_win.shape[2]
    group = k_codes.shape[2] // max(k_scale.shape[2], 1)
    scale = np.empty(dim, np.float32)
    zero = np.empty(dim, np.float32)
    rows = np.empty((_BLOCK, dim), np.float32)
    for b in range(batch):
        for h in range(heads):
            j0 = p0
            while j0 < min(p1, q_len):
                g = j0 // group
                j1 = min(p1, q_len, (g + 1) * group, j0 + _BLOCK)
                _group_scales(k_scale[b, h, g], k_zero[b, h, g], table, scale, zero)
                kb = _dequant_k(k_codes[b, h, j0:j1], scale, zero, k_bits, rows)
                for j in range(j1 - j0):
                    _store_row(kb[j], kind, k_out[b, h, j0 - p0 + j])
                vb = _dequant_v(
                    v_codes[b, h, j0:j1], v_scale[b, h, j0:j1], v_zero[b, h, j0:j1],
                    v_bits, table, rows,
                )  # fmt: skip
                for j in range(j1 - j0):
                    _store_row(vb[j], kind, v_out[b, h, j0 - p0 + j])
                j0 = j1
            for p in range(max(p0, q_len), p1):  # the window, as held
                for d in range(dim):
                    k_out[b, h, p - p0, d] = k_win[b, h, p % w, d]
                    v_out[b, h, p - p0, d] = v_win[b, h, p % w, d]
