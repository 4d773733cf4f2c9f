"""CUDA (``@cuda.jit``) twins of :mod:`nbkv.kernels.cpu_quant`: the quantized cache (KIVI)
quantizes on append, dequantizes for ``get_kv`` and attends over its codes on the GPU.

The storage, the quantizer and the argument order are those of :mod:`nbkv.kernels.cpu_quant`
(its module docstring is the spec); codes, scales, zero points and dequantized values are
bit-identical to the CPU kernels'. Each kernel has a ``_bshd`` twin whose ``k``, ``v``
(``quant_append``) or ``k_out``, ``v_out`` (``dequantize``) are ``[batch, n, heads,
head_dim]``; the storage is always ``[batch, heads, ...]``.

- ``quant_append_kernel[(batch * heads, splits), THREADS](k, v, held, q_len, new_q, k_bits,
  v_bits, group, v_group, kind, table, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
  k_win, v_win)``: block ``(task, split)`` quantizes the groups ``split, split + splits,
  ...`` of ``[q_len, new_q)`` of one (batch row, head): per channel (K) and per position
  and channel group (V) the scales first, then, after a barrier, the packed codes. The
  new positions past ``new_q`` go to the window ring, each to a slot no other takes; a
  slot whose old row one of the groups reads is written by that group's block after its
  last read (so no grid-wide barrier is needed), the others by all splits, split-strided.
  That needs what a quantized cache keeps true: ``held - q_len <= W`` and ``held + n -
  new_q <= W`` (``W`` the ring's rows); then every byte written equals the CPU kernel's,
  whatever order the blocks run in. ``splits``: one per group to quantize (at most
  65,535: then blocks take several), else 1.
- ``dequantize_kernel[blocks, threads](k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
  k_win, v_win, q_len, p0, p1, k_bits, v_bits, kind, table, k_out, v_out)``: one element
  of K and of V per thread, grid-stride (:func:`nbkv.launch.launch_config` of
  ``batch * heads * (p1 - p0) * head_dim``).
- ``attend_quant_kernel[(batch * num_kv_heads, chunks), THREADS](q, k_codes, k_scale,
  k_zero, v_codes, v_scale, v_zero, k_win, v_win, q_len, seq_len, k_bits, v_bits, scale,
  causal, window, table, out)``: attention over the codes, tile by tile, in
  :mod:`nbkv.kernels.cuda_quant_attend` (its docstring describes it), imported here with
  its sizes ``THREADS``, ``TILE``, ``ROWS`` and ``MAX_HEAD_DIM``.

Positions, and a tile's or a group's elements, are counted in unsigned 32-bit ints
(:class:`nbkv.quant_cuda.CUDAQuant` checks that they fit).

16-bit data (a float16/bfloat16 window, every scale and zero point) travels as uint16 bits
and is widened by ``table`` (:func:`nbkv.dtypes.widen_table` of the scales' type, as on the
CPU); arithmetic is float32 throughout (IEEE division, ``rint`` ties to even); ``q`` may be
float16, float32 or float64, ``out`` has q's dtype.

The bit-level device functions these kernels share (``narrow16``, ``_widen``,
``_code_in``, unsigned ``_div`` / ``_mod``, and the intrinsics under them) are in
:mod:`nbkv.kernels.cuda_quant_bits`.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .cuda import unravel
from .cuda_quant_attend import MAX_HEAD_DIM, ROWS, THREADS, TILE, attend_quant_kernel
from .cuda_quant_bits import _code_in, _div, _holds_bits, _mod, _mul_rn, _rint, _widen, narrow16

__all__ = [
    "narrow16",
    "quant_append_kernel",
    "quant_append_bshd_kernel",
    "dequantize_kernel",
    "dequantize_bshd_kernel",
    "attend_quant_kernel",
    "THREADS",
    "TILE",
    "ROWS",
    "MAX_HEAD_DIM",
]


@cuda.jit(device=True, inline=True)
def _put(a, b, h, j, d, value, kind):
    """a[b, h, j, d] = float32 ``value`` in a's dtype (uint16: the bits of type ``kind``)."""
    if _holds_bits(a):
        a[b, h, j, d] = narrow16(value, kind)
    else:
        a[b, h, j, d] = value


@cuda.jit(device=True, inline=True)
def _code(x, scale, zero, levels):
    """The code of ``x``: rint((x - zero) / scale) clipped to [0, levels]; 0 if scale is 0."""
    if scale == np.float32(0):
        return 0
    c = _rint(np.float32(x - zero) / scale)  # IEEE division (div.rn.f32)
    if c < np.float32(0):
        return 0
    if c > np.float32(levels):
        return levels
    return np.int64(c)


def _append_steps(bshd: bool):
    """``(row_of, k_scales, v_scales, pack)``: the device functions of quant_append for
    ``k``, ``v`` in "bhsd" or "bshd" (a compile-time flag)."""

    @cuda.jit(device=True, inline=True)
    def row_of(x, b, h, j, d):
        if bshd:
            return x[b, j, h, d]
        return x[b, h, j, d]

    @cuda.jit(device=True, inline=True)
    def value(x, win, held, table, b, h, p, d):
        """Position ``p``'s channel ``d`` as float32: the ring below ``held``, else x."""
        if p < held:
            return _widen(win[b, h, _mod(p, win.shape[2]), d], win, table)
        return _widen(row_of(x, b, h, p - held, d), x, table)

    @cuda.jit(device=True, inline=True)
    def k_scales(k, k_win, held, g0, group, levels, kind, table, b, h, k_scale, k_zero):
        """The 16-bit scale and zero point of every channel of K's group at ``g0``.
        Mutates ``k_scale``, ``k_zero``."""
        g = _div(g0, group)
        for d in range(cuda.threadIdx.x, k_win.shape[3], cuda.blockDim.x):
            lo = value(k, k_win, held, table, b, h, g0, d)
            hi = lo
            for j in range(1, group):
                x = value(k, k_win, held, table, b, h, g0 + j, d)
                lo = x if x < lo else lo  # Python's min and max, as in the CPU kernel
                hi = x if x > hi else hi
            k_scale[b, h, g, d] = narrow16(np.float32(hi - lo) / np.float32(levels), kind)
            k_zero[b, h, g, d] = narrow16(lo, kind)

    @cuda.jit(device=True, inline=True)
    def v_scales(v, v_win, held, g0, group, v_group, levels, kind, table, b, h, v_scale, v_zero):
        """The 16-bit scale and zero point of every position and channel group of V's
        group at ``g0``. Mutates ``v_scale``, ``v_zero``."""
        n_c = v_win.shape[3] // v_group
        for e in range(cuda.threadIdx.x, group * n_c, cuda.blockDim.x):
            j = _div(e, n_c)
            c = e - j * n_c
            lo = value(v, v_win, held, table, b, h, g0 + j, c * v_group)
            hi = lo
            for d in range(c * v_group + 1, (c + 1) * v_group):
                x = value(v, v_win, held, table, b, h, g0 + j, d)
                lo = x if x < lo else lo
                hi = x if x > hi else hi
            v_scale[b, h, g0 + j, c] = narrow16(np.float32(hi - lo) / np.float32(levels), kind)
            v_zero[b, h, g0 + j, c] = narrow16(lo, kind)

    @cuda.jit(device=True, inline=True)
    def pack(x, win, held, bits, g0, group, per_pos, scale, zero, table, b, h, codes):
        """The packed codes of the group at ``g0`` from its 16-bit scales and zeros, K's
        per channel or (``per_pos``) V's per position and channel group. Mutates
        ``codes``."""
        dim = win.shape[3]
        levels = (1 << bits) - 1
        per = 8 // bits
        row = codes.shape[3]
        v_group = dim // scale.shape[3]
        for e in range(cuda.threadIdx.x, group * row, cuda.blockDim.x):
            j = _div(e, row)
            i = e - j * row
            byte = 0
            for s in range(per):
                d = i * per + s
                if d < dim:
                    if per_pos:
                        c = _div(d, v_group)
                        sb, zb = scale[b, h, g0 + j, c], zero[b, h, g0 + j, c]
                    else:
                        sb, zb = scale[b, h, _div(g0, group), d], zero[b, h, _div(g0, group), d]
                    sc, ze = table[np.int32(sb)], table[np.int32(zb)]
                    x_d = value(x, win, held, table, b, h, g0 + j, d)
                    byte |= _code(x_d, sc, ze, levels) << (s * bits)
            codes[b, h, g0 + j, i] = np.uint8(byte)

    return row_of, k_scales, v_scales, pack


def _make_append(bshd: bool):
    """quant_append's kernel for ``k``, ``v`` in "bhsd" or "bshd" (a compile-time flag)."""
    row_of, k_scales, v_scales, pack = _append_steps(bshd)

    @cuda.jit
    def quant_append(
        k, v, held, q_len, new_q, k_bits, v_bits, group, v_group, kind, table,
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_win, v_win,
    ):  # fmt: skip
        """Quantize the groups [q_len, new_q) (rows from the window below ``held``, else
        from k, v [batch, heads, n, head_dim] or [batch, n, heads, head_dim]) and put the
        new positions past new_q in the window. Mutates those groups' codes, scales and
        zero points, and the window (see the module docstring)."""
        t, nt = cuda.threadIdx.x, cuda.blockDim.x
        heads = k_codes.shape[1]
        b = _div(cuda.blockIdx.x, heads)
        h = cuda.blockIdx.x - b * heads
        split, splits = cuda.blockIdx.y, cuda.gridDim.y
        dim, w = k_win.shape[3], k_win.shape[2]
        total = held + (k.shape[1] if bshd else k.shape[2])
        read_hi = min(new_q, held)  # ring rows [q_len, read_hi) are read by the groups
        win_lo = max(new_q, held)  # positions [win_lo, total) go to the ring
        for g0 in range(q_len + split * group, new_q, splits * group):
            lk, lv = (1 << k_bits) - 1, (1 << v_bits) - 1
            k_scales(k, k_win, held, g0, group, lk, kind, table, b, h, k_scale, k_zero)
            v_scales(v, v_win, held, g0, group, v_group, lv, kind, table, b, h, v_scale, v_zero)
            cuda.syncthreads()  # other threads of the block read the scales
            pack(k, k_win, held, k_bits, g0, group, False, k_scale, k_zero, table, b, h, k_codes)
            pack(v, v_win, held, v_bits, g0, group, True, v_scale, v_zero, table, b, h, v_codes)
            cuda.syncthreads()  # every read of this group's ring rows is done
            # a new position whose slot a row of this group held: this block writes it
            for e in range(t, group * dim, nt):
                j = _div(e, dim)
                d = e - j * dim
                if g0 + j < read_hi:
                    p = win_lo + _mod(_mod(g0 + j, w) + w - _mod(win_lo, w), w)  # the same slot
                    if p < total:
                        k_win[b, h, _mod(p, w), d] = row_of(k, b, h, p - held, d)
                        v_win[b, h, _mod(p, w), d] = row_of(v, b, h, p - held, d)
        # the other new positions (their slots hold no row a group reads): split-strided
        for e in range(split * nt + t, (total - win_lo) * dim, splits * nt):
            i = _div(e, dim)
            d = e - i * dim
            p = win_lo + i
            if q_len + _mod(p - q_len, w) >= read_hi:
                k_win[b, h, _mod(p, w), d] = row_of(k, b, h, p - held, d)
                v_win[b, h, _mod(p, w), d] = row_of(v, b, h, p - held, d)

    return quant_append


quant_append_kernel = _make_append(False)
quant_append_bshd_kernel = _make_append(True)


@cuda.jit(device=True, inline=True)
def _dequant(code, scale, zero):
    """zero + code * scale in float32, the product rounded on its own as on the CPU.

    On a GPU, NVVM contracts a plain ``zero + code * scale`` into one ``fma.rn.f32`` (seen
    in this module's PTX): a single rounding, which can differ from the CPU's two in the
    last bit of the float32 (and, rarely, of a 16-bit result). ``_mul_rn`` keeps the two
    roundings, so ``get_kv`` is bit-identical on both devices; attention contracts (it
    only needs float32 accuracy)."""
    return zero + _mul_rn(np.float32(code), scale)


def _make_dequantize(bshd: bool):
    @cuda.jit
    def dequantize(
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_win, v_win, q_len, p0, p1,
        k_bits, v_bits, kind, table, k_out, v_out,
    ):  # fmt: skip
        """K and V of positions [p0, p1) as ``get_kv`` gives them: codes (below q_len)
        dequantized and rounded to the cache's dtype, window positions as held. k_out,
        v_out: [batch, heads, p1 - p0, head_dim] (or [batch, p1 - p0, heads, head_dim]),
        float32 or uint16 bits of type ``kind``. Mutates both."""
        batch, heads, dim = k_codes.shape[0], k_codes.shape[1], k_win.shape[3]
        w = k_win.shape[2]
        group = max(k_codes.shape[2] // max(k_scale.shape[2], 1), 1)
        v_group = dim // max(v_scale.shape[3], 1)
        span = p1 - p0
        for idx in range(cuda.grid(1), batch * heads * span * dim, cuda.gridsize(1)):
            if bshd:
                b, s, h, d = unravel(idx, span, heads, dim)
            else:
                b, h, s, d = unravel(idx, heads, span, dim)
            p = p0 + s
            if p < q_len:
                g, c = _div(p, group), _div(d, v_group)
                sk, zk = table[np.int32(k_scale[b, h, g, d])], table[np.int32(k_zero[b, h, g, d])]
                sv, zv = table[np.int32(v_scale[b, h, p, c])], table[np.int32(v_zero[b, h, p, c])]
                kx = _dequant(_code_in(k_codes[b, h, p], d, k_bits), sk, zk)
                vx = _dequant(_code_in(v_codes[b, h, p], d, v_bits), sv, zv)
                if bshd:
                    _put(k_out, b, s, h, d, kx, kind)
                    _put(v_out, b, s, h, d, vx, kind)
                else:
                    _put(k_out, b, h, s, d, kx, kind)
                    _put(v_out, b, h, s, d, vx, kind)
            elif bshd:
                k_out[b, s, h, d] = k_win[b, h, _mod(p, w), d]
                v_out[b, s, h, d] = v_win[b, h, _mod(p, w), d]
            else:
                k_out[b, h, s, d] = k_win[b, h, _mod(p, w), d]
                v_out[b, h, s, d] = v_win[b, h, _mod(p, w), d]

    return dequantize


dequantize_kernel = _make_dequantize(False)
dequantize_bshd_kernel = _make_dequantize(True)
