"""Bit-level device functions the quantized cache's CUDA kernels share
(:mod:`nbkv.kernels.cuda_quant`, :mod:`nbkv.kernels.cuda_quant_attend`).

- :func:`narrow16`: float32 to the bits of float16 or bfloat16, rounded to nearest, the
  twin of :func:`nbkv.kernels.cpu_quant.narrow16` bit for bit; ``_widen``: an element as
  float32 (16-bit bits through the widening ``table``).
- ``_code_in``: one channel's code in a position's packed bytes.
- ``_div``, ``_mod``: unsigned 32-bit division and remainder of positions and indices.
- ``_bits32``, ``_holds_bits``, ``_rint``, ``_mul_rn``: a bit cast, a compile-time dtype
  test, round-half-even and a product never fused into an FMA: LLVM intrinsics and
  libdevice on a GPU, NumPy under the simulator (``NUMBA_ENABLE_CUDASIM=1``, read at
  import).

Every function here is a device function, inlined (``inline=True``) into the kernels.
"""

from __future__ import annotations

import os

import numpy as np
from numba import cuda

__all__ = ["narrow16"]

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
def _code_in(row, d, bits):
    """Channel ``d``'s code in the packed bytes ``row`` (codes of one position)."""
    shift = 0 if bits == 8 else (1 if bits == 4 else (2 if bits == 2 else 3))  # log2(8 // bits)
    byte = np.int32(row[d >> shift])
    return (byte >> ((d & ((1 << shift) - 1)) * bits)) & ((1 << bits) - 1)
