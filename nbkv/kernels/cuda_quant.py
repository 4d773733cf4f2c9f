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

Positions, and a tile's or a group's elements, are counted in unsigned 32-bit ints
(:class:`nbkv.quant_cuda.CUDAQuant` checks that they fit).

16-bit data (a float16/bfloat16 window, every scale and zero point) travels as uint16 bits
and is widened by ``table`` (:func:`nbkv.dtypes.widen_table` of the scales' type, as on the
CPU); arithmetic is float32 throughout (IEEE division, ``rint`` ties to even); ``q`` may be
float16, float32 or float64, ``out`` has q's dtype.
"""

from __future__ import annotations

import math
import os

import numpy as np
from numba import cuda

from .. import _config
from .cuda import unravel

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

# -- bit-level helpers: LLVM intrinsics and libdevice on a GPU, NumPy in the simulator ---

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":

    def _bits32(x):
        """The IEEE bits of a float32 (a bit cast), as an int."""
        return np.int64(np.float32(x).view(np.uint32))

    def _holds_bits(a):
        """Whether ``a`` holds 16-bit floats as uint16 bits (known when compiled)."""
        return a.dtype == np.uint16

    def _rint(x):
        """``x`` rounded to an integral float32, ties to even."""
        return np.rint(np.float32(x))

    def _mul_rn(a, b):
        """float32 ``a * b``, rounded, never fused into an FMA."""
        return np.float32(a) * np.float32(b)

else:
    from llvmlite import ir
    from numba.cuda import libdevice, types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _bits32(typingctx, x):
        if x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

        return types.int64(types.float32), codegen

    @intrinsic
    def _holds_bits(typingctx, a):
        flag = isinstance(a, types.Array) and a.dtype == types.uint16

        def codegen(context, builder, signature, args):
            return context.get_constant(types.boolean, flag)

        return types.boolean(a), codegen

    _rint = libdevice.rintf  # cvt.rni.f32.f32
    _mul_rn = libdevice.fmul_rn  # mul.rn.f32: ptxas never contracts it into an FMA


@cuda.jit(device=True, inline=True)
def narrow16(x, kind):
    """float32 ``x`` rounded to the nearest 16-bit float (ties to even), as its bits:
    float16 (``kind`` 0) or bfloat16 (``kind`` 1); the twin of
    :func:`nbkv.kernels.cpu_quant.narrow16`, bit for bit. A device function."""
    u = _bits32(np.float32(x))
    if kind == 1:  # bfloat16: the upper half, rounded on the lower (NaN kept a NaN)
        if (u & 0x7FFFFFFF) > 0x7F800000:
            return np.uint16((u >> 16) | 0x40)
        return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    sign = (u >> 16) & 0x8000
    e = (u >> 23) & 0xFF
    m = u & 0x7FFFFF
    if e == 255:  # inf or NaN
        return np.uint16(sign | 0x7C00 | (0x200 if m != 0 else 0))
    exp = e - 112  # float16's biased exponent (127 - 15 = 112)
    if exp >= 31:
        return np.uint16(sign | 0x7C00)
    if exp <= 0:  # a float16 subnormal (or zero): shift the implicit one in
        if exp < -10:
            return np.uint16(sign)
        m = m | 0x800000
        shift = 14 - exp
        half = m >> shift
        rest = m & ((1 << shift) - 1)
        mid = 1 << (shift - 1)
        if rest > mid or (rest == mid and (half & 1) != 0):
            half += 1
        return np.uint16(sign | half)
    half = sign | (exp << 10) | (m >> 13)
    rest = m & 0x1FFF
    if rest > 0x1000 or (rest == 0x1000 and (half & 1) != 0):
        half += 1  # a carry into the exponent is right (up to inf)
    return np.uint16(half)


@cuda.jit(device=True, inline=True)
def _div(a, b):
    """a // b for 0 <= a, b < 2**32, in unsigned 32-bit arithmetic (a 64-bit signed
    division costs a long ptxas sequence and many registers)."""
    return np.int64(np.uint32(a) // np.uint32(b))


@cuda.jit(device=True, inline=True)
def _mod(a, b):
    """a % b for 0 <= a, b < 2**32 (as :func:`_div`)."""
    return np.int64(np.uint32(a) % np.uint32(b))


@cuda.jit(device=True, inline=True)
def _widen(x, a, table):
    """An element ``x`` of array ``a`` as float32: uint16 bits through ``table``."""
    if _holds_bits(a):
        return table[np.int32(x)]
    return np.float32(x)


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


@cuda.jit(device=True, inline=True)
def _code_in(row, d, bits):
    """Channel ``d``'s code in the packed bytes ``row`` (codes of one position)."""
    shift = 0 if bits == 8 else (1 if bits == 4 else (2 if bits == 2 else 3))  # log2(8 // bits)
    byte = np.int32(row[d >> shift])
    return (byte >> ((d & ((1 << shift) - 1)) * bits)) & ((1 << bits) - 1)


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


# -- attention over the codes -------------------------------------------------------------


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
