"""Device helpers of the CUDA kernels: wide loads and copies, and 16-bit widening.

Numba indexes an array one element at a time, so a warp reading 16-bit values issues
2-byte loads. These helpers read or copy ``n`` consecutive elements of the last axis as
one vector access (``ld.global.v4.u32``: 16 bytes a thread) and widen them to float32:

- ``loader(n)``: ``load(arr, (i0, ..., d)) -> (float32,) * n``, elements ``d .. d + n - 1``;
- ``copier(n)``: ``copy(src, (i0, ..., d), dst, (j0, ..., e))``, the raw bits;
- ``widener(dtype)``: one stored value as float32;
- ``block_reducers(rows, threads)``: the maximum and the sum of per-thread values over a
  block, every thread receiving the result.

Widening: float16 by the hardware conversion (``cvt.f32.f16``), bfloat16 (stored as
``uint16`` bits) by a 16-bit shift and a bit cast, float64 by rounding, no table.

A vector access needs its address aligned to its size: the first element's offset and
every stride of the array in bytes must be multiples of ``n * itemsize`` (the caller
checks, on the host, with :func:`vector_width`). Under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) the same names are plain Python functions.
"""

from __future__ import annotations

import os

import numpy as np
from numba import cuda

__all__ = [
    "SIMULATOR",
    "loader",
    "copier",
    "widener",
    "vector_width",
    "VECTOR_BYTES",
    "block_reducers",
    "reduction_width",
]

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
VECTOR_BYTES = 16  # the widest load a thread issues (ld.global.v4.u32)
_FULL_MASK = 0xFFFFFFFF


def vector_width(itemsize: int, head_dim: int, arrays=()) -> int:
    """Elements per vector access along ``head_dim`` for these arrays: the most, up to
    ``VECTOR_BYTES``, that divide ``head_dim`` and keep every access aligned (1 if none).

    >>> vector_width(2, 128), vector_width(2, 72), vector_width(4, 6), vector_width(8, 3)
    (8, 8, 2, 1)
    """
    n = VECTOR_BYTES // itemsize
    while n > 1:
        nbytes = n * itemsize
        if head_dim % n == 0 and all(_aligned(x, nbytes) for x in arrays):
            return n
        n //= 2
    return 1


def _aligned(x, nbytes: int) -> bool:
    """Every element ``[..., d]`` with ``d % n == 0`` starts on an ``nbytes`` boundary."""
    if x.strides[-1] != x.dtype.itemsize:
        return False
    if any(s % nbytes for s in x.strides[:-1]):
        return False
    pointer = getattr(x, "device_ctypes_pointer", None)  # a Numba device array
    if pointer is not None:
        address = pointer.value or 0  # as its __cuda_array_interface__ says, 10x cheaper
    else:  # the simulator's arrays are NumPy arrays
        address = x.__array_interface__["data"][0]
    return address % nbytes == 0


# -- the simulator: plain Python -------------------------------------------------------


def _widen_py(x):
    if isinstance(x, np.uint16):  # bfloat16 bits: the upper half of a float32
        return np.array(int(x) << 16, np.uint32).view(np.float32)[()]
    return np.float32(x)


def _loader_py(n: int):
    def load(arr, idx):
        *lead, d = idx
        return tuple(_widen_py(arr[(*lead, d + e)]) for e in range(n))

    return load


def _copier_py(n: int):
    def copy(src, sidx, dst, didx):
        *slead, s = sidx
        *dlead, d = didx
        for e in range(n):
            dst[(*dlead, d + e)] = src[(*slead, s + e)]

    return copy


# -- the GPU: intrinsics ---------------------------------------------------------------


def _intrinsics():
    from llvmlite import ir
    from numba.cuda import cgutils, types
    from numba.cuda.extending import intrinsic

    i16, i32, f32 = ir.IntType(16), ir.IntType(32), ir.FloatType()

    def pointer(context, builder, aryty, ary_val, idxty, idx_val):
        ary = context.make_array(aryty)(context, builder, ary_val)
        inds = cgutils.unpack_tuple(builder, idx_val, len(idxty))
        inds = [context.cast(builder, i, t, types.intp) for i, t in zip(inds, idxty, strict=True)]
        return cgutils.get_item_pointer(context, builder, aryty, ary, inds, wraparound=False)

    def widen_bits(builder, dtype, x):
        """An element (as its data type) to float32."""
        if dtype == types.float16:  # data type i16: bits -> half -> float
            return builder.fpext(builder.bitcast(x, ir.HalfType()), f32)
        if dtype == types.uint16:  # bfloat16 bits: shift into a float32's upper half
            return builder.bitcast(builder.shl(builder.zext(x, i32), ir.Constant(i32, 16)), f32)
        if dtype == types.float64:
            return builder.fptrunc(x, f32)
        if dtype == types.float32:
            return x
        raise TypeError(f"no widening of {dtype}")

    def load_vector(builder, ptr, elt, count, align):
        vty = ir.VectorType(elt, count)
        vptr = builder.bitcast(ptr, vty.as_pointer(ptr.type.addrspace))
        vec = builder.load(vptr, align=align)
        return [builder.extract_element(vec, ir.Constant(i32, e)) for e in range(count)]

    def make_loader(n: int):
        @intrinsic
        def load(typingctx, arr, idx):
            def codegen(context, builder, sig, args):
                aryty, idxty = sig.args
                ptr = pointer(context, builder, aryty, args[0], idxty, args[1])
                size = aryty.dtype.bitwidth // 8
                if size == 2 and n >= 2:  # 16-bit pairs in 32-bit words (v2/v4.u32)
                    words = load_vector(builder, ptr, i32, n // 2, n * size)
                    elems = []
                    for w in words:
                        elems.append(builder.trunc(w, i16))
                        elems.append(builder.trunc(builder.lshr(w, ir.Constant(i32, 16)), i16))
                else:
                    elt = context.get_data_type(aryty.dtype)
                    elems = load_vector(builder, ptr, elt, n, n * size)
                out = [widen_bits(builder, aryty.dtype, x) for x in elems]
                return context.make_tuple(builder, sig.return_type, out)

            return types.UniTuple(types.float32, n)(arr, idx), codegen

        return load

    def make_copier(n: int):
        @intrinsic
        def copy(typingctx, src, sidx, dst, didx):
            def codegen(context, builder, sig, args):
                sty, sidxty, dty, didxty = sig.args
                sp = pointer(context, builder, sty, args[0], sidxty, args[1])
                dp = pointer(context, builder, dty, args[2], didxty, args[3])
                nbytes = n * (sty.dtype.bitwidth // 8)
                if nbytes % 4 == 0:  # as 32-bit words: one v2/v4 access
                    elt, count = i32, nbytes // 4
                else:
                    elt, count = context.get_data_type(sty.dtype), n
                vty = ir.VectorType(elt, count) if count > 1 else elt
                vsp = builder.bitcast(sp, vty.as_pointer(sp.type.addrspace))
                vdp = builder.bitcast(dp, vty.as_pointer(dp.type.addrspace))
                builder.store(builder.load(vsp, align=nbytes), vdp, align=nbytes)
                return context.get_dummy_value()

            return types.void(src, sidx, dst, didx), codegen

        return copy

    return make_loader, make_copier


_LOADERS: dict[int, object] = {}
_COPIERS: dict[int, object] = {}


def loader(n: int):
    """``load(arr, idx) -> (float32,) * n``: ``n`` elements from ``arr[idx]`` on."""
    if n not in _LOADERS:
        if SIMULATOR:
            _LOADERS[n] = _loader_py(n)
        else:
            _LOADERS[n] = _intrinsics()[0](n)
    return _LOADERS[n]


def copier(n: int):
    """``copy(src, sidx, dst, didx)``: ``n`` elements' bits, in one vector access."""
    if n not in _COPIERS:
        if SIMULATOR:
            _COPIERS[n] = _copier_py(n)
        else:
            _COPIERS[n] = _intrinsics()[1](n)
    return _COPIERS[n]


def widener(dtype: np.dtype):
    """A device function: one stored value of ``dtype`` (bfloat16 as ``uint16``) as float32."""
    dtype = np.dtype(dtype)
    if dtype == np.uint16:
        return _bf16
    return _cast


@cuda.jit(device=True, inline=True)
def _cast(x):
    return np.float32(x)


if SIMULATOR:

    def _bf16(x):
        return _widen_py(np.uint16(x))

else:

    @cuda.jit(device=True, inline=True)
    def _bf16(x):
        # the bits of a bfloat16 are the upper half of a float32's
        return _as_float32(np.uint32(x) << np.uint32(16))

    def _bitcast():
        from llvmlite import ir
        from numba.cuda import types
        from numba.cuda.extending import intrinsic

        @intrinsic
        def as_float32(typingctx, x):
            def codegen(context, builder, sig, args):
                return builder.bitcast(args[0], ir.FloatType())

            return types.float32(types.uint32), codegen

        return as_float32

    _as_float32 = _bitcast()


def reduction_width(threads: int) -> int:
    """Slots per row of :func:`block_reducers`' buffer: one per warp on a GPU, one per
    thread under the simulator."""
    return threads if SIMULATOR else threads // 32


def block_reducers(R: int, threads: int):
    """``(block_max, block_sum)``: ``reduce(vals, buf, t)`` over a block of ``threads``
    threads of ``R`` float32 values each (``vals``, a local array); every thread ends with
    the block's result in ``vals``. ``buf``: shared float32 ``[R, reduction_width(threads)]``.
    Warp shuffles then one slot per warp on a GPU; one slot per thread under the
    simulator, which has no shuffles. Every thread must call it (two barriers inside)."""
    width = reduction_width(threads)

    def make(op):
        @cuda.jit(device=True, inline=True)
        def gather(vals, buf):
            """Every slot of ``buf`` reduced into ``vals`` (the same on every thread)."""
            for r in range(R):
                acc = buf[r, 0]
                for w in range(1, width):
                    acc = op(acc, buf[r, w])
                vals[r] = acc
            cuda.syncthreads()

        if SIMULATOR:

            @cuda.jit(device=True, inline=True)
            def reduce(vals, buf, t):
                for r in range(R):
                    buf[r, t] = vals[r]
                cuda.syncthreads()
                gather(vals, buf)

        else:

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
                gather(vals, buf)  # lane 0's values only

        return reduce

    @cuda.jit(device=True, inline=True)
    def _max(a, b):
        return max(a, b)

    @cuda.jit(device=True, inline=True)
    def _add(a, b):
        return a + b

    return make(_max), make(_add)
