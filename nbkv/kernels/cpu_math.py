"""Scalar float32 building blocks for the CPU kernels, written so that LLVM vectorises the
loops that call them: bit casts, a float32 ``exp``, and 16-bit floats widened without a
lookup table.

Why these exist: Numba's pip build of llvmlite has no SVML
(``llvmlite.binding.targets.has_svml()`` is False), so a loop calling ``math.exp`` stays
scalar, one libm call per element; and a ``table[bits]`` lookup is a gather the
vectoriser will not emit. The functions below are branch-free arithmetic on float32 and
uint32 that compile to a handful of SIMD instructions per 8 or 16 elements once inlined
into the caller's loop.

- :func:`exp32` is ``exp`` for float32 arguments: the range reduction ``x = n ln2 + r``
  with ``|r| <= ln2 / 2`` (``ln2`` in two parts, Cody and Waite, so ``n ln2`` is exact),
  a degree-7 polynomial for ``exp(r)`` (Cephes' ``expf`` coefficients) and ``2**n`` built
  from its bits. Within 8 ulp of float64's ``exp`` over ``[-86.98, 88.72]`` (tested);
  below that 0 (results under 1.8e-38 are flushed, which a softmax weight never
  notices), above it infinity; ``-inf`` gives exactly 0, ``NaN`` gives NaN.
- :func:`widen16` turns the ``uint16`` bits of a float16 (``kind`` 0) into float32 by
  the CPU's own conversion (``vcvtph2ps`` with F16C, exact for every pattern: subnormals,
  infinities and NaN payloads), or where the target CPU has none (``NUMBA_CPU_NAME=
  generic``) by integer arithmetic that is exact too (:func:`half_to_float_ir`); and
  those of a bfloat16 (``kind`` 1) by a 16-bit shift.
- :func:`kind16` tells the two formats apart from a widening table
  (:func:`nbkv.dtypes.widen_table`), the argument the kernels have always taken.

Safe under the kernels' ``fastmath`` flags (which Numba passes on to what a fastmath
function calls): the rounding in :func:`exp32` is ``floor`` and an integer conversion,
which no reassociation touches. Where the CPU has FMA, the two steps of the reduction
contract into FMAs and stay exact; where it has none (``NUMBA_CPU_NAME=generic``), LLVM
may reassociate them into ``x - (n ln2_hi + n ln2_lo)``, rounding ``n ln2`` to float32:
up to ``|x| * 2**-24`` more relative error (68 ulp at ``x = -72``, a weight of 5e-32;
under 1.2e-6 where ``|x| < 20``, the weights that count).
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit
from numba.core import cgutils, config, types
from numba.extending import intrinsic, overload

__all__ = [
    "exp32",
    "exp_of",
    "widen16",
    "kind16",
    "bits32",
    "float32_of",
    "prefetch",
    "prefetch_ahead",
    "touch_rows",
    "hardware_half",
    "half_to_float_ir",
    "target_features",
]


@intrinsic
def bits32(typingctx, x):
    """The IEEE bits of a float32, as a uint32 (a bit cast: no conversion)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def float32_of(typingctx, u):
    """The float32 whose IEEE bits are the uint32 ``u`` (a bit cast)."""
    if u != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


def hardware_half() -> bool:
    """Whether the CPU Numba compiles for converts float16 to float32 in one instruction:
    x86 with F16C (``vcvtph2ps``, every x86-64 CPU since 2013), or 64-bit Arm. Read from
    the target Numba compiles for, not the host: ``NUMBA_CPU_NAME=generic`` (portable
    caches) has no F16C. Where this is False, LLVM would lower ``fpext half`` to a call
    of compiler-rt's ``__extendhfsf2``, which Numba's JIT cannot resolve: the process
    aborts. :func:`half_to_float_ir` then converts by integer arithmetic instead."""
    arch = llvm.get_process_triple().split("-")[0]
    if arch in ("aarch64", "arm64"):
        return True
    return arch in ("x86_64", "amd64") and "+f16c" in target_features()


def target_features() -> frozenset[str]:
    """The LLVM feature flags (``"+avx2"``, ``"+f16c"``, ...) of the CPU Numba compiles
    for: ``NUMBA_CPU_FEATURES`` where set (empty under ``NUMBA_CPU_NAME=generic``), else
    the host's, whatever the CPU name (Numba's own rule)."""
    features = config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return frozenset(f for f in features.split(",") if f)


# 2**-14, float16's smallest normal: a subnormal's bits, given that exponent, minus it
_HALF_MAGIC = 2.0**-14


def half_to_float_ir(builder, bits, hardware=None):
    """The float32 values of float16 bits ``bits`` (an LLVM ``i16`` or ``<n x i16>``):
    ``fpext`` where :func:`hardware_half` (or ``hardware``) says the CPU converts, else
    branch-free integer arithmetic, exact for every pattern (F. Giesen's conversion:
    shift exponent and mantissa into place, rebias the exponent, give infinities and
    NaNs the top exponent, renormalise subnormals by one float subtraction; NaN payloads
    kept). Both vectorise."""
    n = bits.type.count if isinstance(bits.type, ir.VectorType) else None

    def ty(t):
        return t if n is None else ir.VectorType(t, n)

    f32 = ty(ir.FloatType())
    if hardware_half() if hardware is None else hardware:
        return builder.fpext(builder.bitcast(bits, ty(ir.HalfType())), f32)
    i32 = ty(ir.IntType(32))

    def c(v):
        return ir.Constant(i32, v)

    h = builder.zext(bits, i32)
    o = builder.shl(builder.and_(h, c(0x7FFF)), c(13))  # exponent and mantissa
    e = builder.and_(o, c(0x7C00 << 13))
    normal = builder.add(o, c((127 - 15) << 23))
    special = builder.add(normal, c((128 - 16) << 23))  # infinity and NaN: exponent 255
    tiny = builder.bitcast(builder.add(normal, c(1 << 23)), f32)
    tiny = builder.bitcast(builder.fsub(tiny, ir.Constant(f32, _HALF_MAGIC)), i32)
    r = builder.select(builder.icmp_unsigned("==", e, c(0x7C00 << 13)), special, normal)
    r = builder.select(builder.icmp_unsigned("==", e, c(0)), tiny, r)
    r = builder.or_(r, builder.shl(builder.and_(h, c(0x8000)), c(16)))  # the sign
    return builder.bitcast(r, f32)


@intrinsic
def _half_to_float(typingctx, u):
    """float16 bits (uint16) to float32 (:func:`half_to_float_ir`)."""
    if u != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return half_to_float_ir(builder, args[0])

    return types.float32(types.uint16), codegen


# exp32's constants, float32: log2(e), ln2 split so that n * _LN2_HI is exact for |n| < 2**9
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
# the range computed: below _LOW the result is 0 (exp(-86.98) = 1.8e-38 is 1.5 times
# float32's smallest normal), above _HIGH (log of float32's largest) infinity
_LOW = np.float32(-86.98)
_HIGH = np.float32(88.72283)
_INF = np.float32(np.inf)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)
_ZERO = np.float32(0.0)


@njit(cache=True)
def exp32(x):
    """``exp(x)`` of a float32, vectorisable (see the module docstring). Returns float32."""
    x = np.float32(x)
    # clamp into the range where 2**n is a normal float32 (NaN too: it is put back last)
    xc = x if x >= _LOW else _LOW
    xc = _HIGH if xc > _HIGH else xc
    # n = round(x / ln2); floor and the int conversion are vector instructions
    n = np.floor(xc * _LOG2E + _HALF)
    ni = np.int32(n)
    r = xc - n * _LN2_HI
    r = r - n * _LN2_LO
    # exp(r) on [-ln2/2, ln2/2]: 1 + r + r^2 * P(r)
    p = _P0
    p = p * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    er = p * (r * r) + r + _ONE
    # 2**(n - 1) from its bits: n - 1 + 127 stays in [1, 254] over the clamped range;
    # then exp(x) = exp(r) * 2 * 2**(n - 1)
    scale = float32_of(np.uint32((ni + 126) << 23))
    y = (er + er) * scale
    y = _ZERO if x < _LOW else y
    y = _INF if x > _HIGH else y
    return y if x == x else x  # NaN in, NaN out


def exp_of(x):
    """exp(x) in x's precision: float32 by :func:`exp32` (which vectorises), float64 by
    ``np.exp``. By the overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


@overload(exp_of, jit_options={"cache": True})
def _exp_of_impl(x):
    if x == types.float32:
        return lambda x: exp32(x)
    return lambda x: np.exp(x)


@njit(cache=True)
def widen16(u, kind):
    """The float32 value of 16-bit float bits ``u`` (uint16): float16 when ``kind`` is 0
    (the CPU's conversion), bfloat16 when 1 (the upper half of a float32)."""
    if kind == 0:
        return _half_to_float(u)
    return float32_of(np.uint32(np.uint32(u) << np.uint32(16)))


@njit(cache=True)
def kind16(table):
    """0 if ``table`` widens float16 bits, 1 if bfloat16 (float16's 0x3C00 is 1.0;
    bfloat16's is 2**-7), -1 for an empty table (a 32- or 64-bit cache)."""
    if table.shape[0] <= 0x3C00:
        return -1
    return 0 if table[0x3C00] == 1.0 else 1


# llvm.prefetch's locality: 1 is x86's prefetcht2 (to L2, not L1). On the AMD EPYC of
# 2026-12-03 (Zen 4) prefetcht0 (3) filled L1's few miss buffers: the score and V passes
# over a 32k cache, one thread, took 45 and 56 ns per row with it, 29 and 28 with 1 or 2
# (t1); the 32k decode step went from 17.7 to 9.9 ms (`python -m benchmarks --only
# attention --tag cpu-zen4`, before and after; benchmarks/README.md). On the Intel guest
# of 2026-12-02 t0, t1 and t2 were alike; nta (0) doubled the step.
PREFETCH_LOCALITY = 1


def prefetch_ir(builder, ptr):
    """Emit ``llvm.prefetch`` of the line holding ``ptr`` (an ``i8*``): a read, into the
    caches :data:`PREFETCH_LOCALITY` names. Shared by :func:`prefetch` and the vector-IR
    kernels of :mod:`nbkv.kernels.cpu_simd`."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    builder.call(fn, [ptr, i32(0), i32(PREFETCH_LOCALITY), i32(1)])  # read, data cache


def _line_op(emit):
    """An intrinsic ``(a, i, j)`` that passes the address of ``a[i, j]`` (a 2-D array), as
    an ``i8*`` and with no bounds check, to ``emit(builder, ptr)``."""

    @intrinsic
    def op(typingctx, a, i, j):
        if not (isinstance(a, types.Array) and a.ndim == 2):
            return None
        if not (isinstance(i, types.Integer) and isinstance(j, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            aty = signature.args[0]
            ary = context.make_array(aty)(context, builder, args[0])
            idx = [
                context.cast(builder, v, t, types.intp)
                for v, t in zip(args[1:], signature.args[1:], strict=True)
            ]
            ptr = cgutils.get_item_pointer2(
                context,
                builder,
                ary.data,
                cgutils.unpack_tuple(builder, ary.shape),
                cgutils.unpack_tuple(builder, ary.strides),
                aty.layout,
                idx,
            )
            emit(builder, builder.bitcast(ptr, ir.IntType(8).as_pointer()))
            return context.get_dummy_value()

        return types.none(a, i, j), codegen

    return op


# prefetch(a, i, j): ask the CPU to bring the cache line holding a[i, j] into its caches
# ahead of use (llvm.prefetch: a hint, never a fault, even out of bounds). Attention over
# a long cache alternates memory-bound reads with arithmetic on what was read; without a
# hint, no read is in flight while the arithmetic runs. Prefetching rows a fixed distance
# ahead as each row is computed keeps the memory busy throughout
prefetch = _line_op(prefetch_ir)

# touch(a, i, j): read the byte at a[i, j] and drop it, a load the compiler keeps (atomic,
# monotonic: an ordinary mov on x86-64, ldrb on ARM), so that the line holding it is in
# the caches by the time it returns. Only for elements that exist (no bounds check)
touch = _line_op(lambda builder, ptr: builder.load_atomic(ptr, "monotonic", 1))


@njit(cache=True)
def touch_rows(x):
    """Read a byte of every cache line of ``x``'s rows ([rows, head_dim]), row after row
    in memory order: a plain stream the CPU's own prefetchers follow, which leaves the
    rows in L1 (up to its size) for passes that then read them in another order.

    On the Zen 2 guest of 2026-12-06 (AVX2, 8-lane vectors) the V pass reads a block of
    float32 rows in eight passes of one 64-byte line per row (its accumulators must fit 16
    registers), a stride of 512 bytes that memory served at 7.4 GB/s a thread against
    18 GB/s for the same bytes read in order; software prefetches of each pass's own line
    of the rows ahead changed nothing there (:data:`PREFETCH_LOCALITY` 0, 1 or 3,
    distances 16 to 256 rows). Read in pieces of 64
    rows, each first touched by this, the 32k float32 decode step took 14.1 ms against
    17.1 (``benchmarks/README.md``, "On an AMD EPYC Zen 2"). The paged kernels' runs
    still read their pages' rows this way; the contiguous kernel's V pass has since gone
    to :func:`nbkv.kernels.cpu_simd.accumulate_lines`, whose reads overlap its arithmetic
    (the touch and the passes here take turns). Unit-stride rows get every line read;
    rows whose elements are strided, one per ``64 // itemsize`` elements."""
    step = max(1, 64 // x.itemsize)  # elements per 64-byte line
    last = x.shape[1] - 1  # a row's last element: its last line, where rows straddle two
    if last < 0:
        return
    for t in range(x.shape[0]):
        for d in range(0, last, step):
            touch(x, t, d)
        touch(x, t, last)


@njit(cache=True)
def prefetch_ahead(x, j, n, ahead):
    """Prefetch rows ``j + ahead .. j + ahead + n - 1`` of ``x`` ([rows, head_dim]), line
    by line; nothing when ``ahead`` is 0. Rows past ``x``'s end (or, ``ahead`` < 0, before
    its start) are the memory there, at ``x``'s row stride (a prefetch never faults)."""
    if ahead != 0:
        step = max(1, 64 // x.itemsize)  # elements per 64-byte cache line
        for t in range(j + ahead, j + ahead + n):
            for d in range(0, x.shape[1], step):
                prefetch(x, t, d)
