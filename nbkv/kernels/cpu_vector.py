"""LLVM vector IR building blocks for the CPU kernels' explicit SIMD
(:mod:`nbkv.kernels.cpu_simd`'s tiles), and the row maximum of the online softmax.

The blocks: how many float32 lanes a vector has on the CPU Numba compiles for
(:func:`tile_lanes`; :data:`LANES` is AVX-512's 16), a pointer to an element of a 2-D array
(:func:`row_pointer`), a vector load that widens 16-bit floats and 8-bit codes
(:func:`load_lanes`, and :func:`stored_type`, the dtype of what it loads), a contractible
multiply-add (:func:`fma`), a broadcast (:func:`splat`), a shuffle mask
(:func:`shuffle_mask`), a lane-wise maximum that never takes a NaN (:func:`greater`), and
:func:`typed_2d`, whether Numba types are 2-D arrays of given dtypes.

:func:`row_max` is the largest score of a row of a block: the loop vectoriser leaves a
maximum by select (``best = x if x > best else best``) scalar unless it may assume no NaN
(``fastmath`` ``nnan``), and the attention's scores may hold NaN (which must not be
taken: the row's output becomes NaN by its weights instead). Written here as vectors of
partial maxima it took the float32 online softmax of a 512-position block from 3.4 to 1.45
ns per position at group 4 (one thread, the Zen 4 of 2026-12-05).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from .cpu_math import half_to_float_ir, target_features

__all__ = [
    "LANES",
    "fma",
    "greater",
    "load_lanes",
    "row_max",
    "row_pointer",
    "shuffle_mask",
    "splat",
    "stored_type",
    "tile_lanes",
    "typed_2d",
]

LANES = 16  # float32 lanes per vector (AVX-512)


def shuffle_mask(lanes):
    """A shufflevector mask: the lanes picked, in order (0..15 first operand, 16..31 second)."""
    return ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes)


def row_pointer(context, builder, aty, ary, row, col):
    """An ``i8*`` to ``ary[row, col]`` (a 2-D array), from its data pointer and strides."""
    strides = cgutils.unpack_tuple(builder, ary.strides)
    i8p = ir.IntType(8).as_pointer()
    base = builder.bitcast(ary.data, i8p)
    off = builder.add(
        builder.mul(row, strides[0]),
        builder.mul(col, context.get_constant(types.intp, aty.dtype.bitwidth // 8)),
    )
    return builder.gep(base, [off])


def load_lanes(builder, ptr, fmt, lanes=LANES):
    """``lanes`` elements at ``ptr`` (``i8*``) as ``<lanes x float>``; ``fmt``: "f32",
    "f16", "bf16", or "u8" (8-bit codes, their integer values)."""
    f32v = ir.VectorType(ir.FloatType(), lanes)
    if fmt == "f32":
        return builder.load(builder.bitcast(ptr, f32v.as_pointer()), align=4)
    if fmt == "u8":
        i8v = ir.VectorType(ir.IntType(8), lanes)
        return builder.uitofp(builder.load(builder.bitcast(ptr, i8v.as_pointer()), align=1), f32v)
    i16v = ir.VectorType(ir.IntType(16), lanes)
    bits = builder.load(builder.bitcast(ptr, i16v.as_pointer()), align=2)
    if fmt == "f16":
        return half_to_float_ir(builder, bits)  # fpext where the CPU converts float16
    i32v = ir.VectorType(ir.IntType(32), lanes)
    wide = builder.shl(builder.zext(bits, i32v), ir.Constant(i32v, 16))
    return builder.bitcast(wide, f32v)


def typed_2d(*pairs):
    """Whether every (numba type, dtype) pair is a 2-D array of that dtype."""
    return all(isinstance(t, types.Array) and t.ndim == 2 and t.dtype == d for t, d in pairs)


def stored_type(fmt):
    """The Numba dtype of an element stored as ``fmt`` (see :func:`load_lanes`)."""
    return {"f32": types.float32, "u8": types.uint8}.get(fmt, types.uint16)


def tile_lanes() -> int:
    """float32 lanes per vector in the vector-IR kernels (:func:`row_max`,
    :func:`nbkv.kernels.cpu_simd.score_tile` and the others) for the CPU Numba compiles for: 16
    with AVX-512 (32 registers of 16), 8 with AVX (16 registers of 8), 4 otherwise (SSE,
    NEON). A group of K rows takes ``lanes // 4`` of them, so that the 4 x ``lanes // 4``
    accumulators reduce to one vector and fit the registers: 16 accumulators of 16 lanes
    on AVX2 spilled, 1.9x slower than the plain loop."""
    features = target_features()
    if "+avx512f" in features:
        return 16
    return 8 if "+avx" in features else 4


def fma(builder, x, y, acc):
    """``acc + x * y``, contractible into one fused multiply-add."""
    prod = builder.fmul(x, y)
    prod.flags.append("contract")
    total = builder.fadd(acc, prod)
    total.flags.append("contract")
    return total


def splat(builder, x, lanes):
    """A float broadcast to every lane of a ``<lanes x float>``."""
    f32v = ir.VectorType(ir.FloatType(), lanes)
    one = builder.insert_element(ir.Constant(f32v, None), x, ir.IntType(32)(0))
    return builder.shuffle_vector(one, ir.Constant(f32v, None), shuffle_mask([0] * lanes))


# vectors of partial maxima in flight in :func:`row_max`: a select's latency (2 cycles)
# and two per cycle ask for four; one lane at a time (the plain loop: a compare and a
# select per score in one chain) took 1.9 ns per position of a block at group 4 on the
# Zen 4 of 2026-12-05, against its whole online softmax's 3.4
_MAX_CHAINS = 4


@intrinsic
def _max_prefix(typingctx, s, r, n):
    """The largest of ``s[r, :n]`` by ``x > best`` (a NaN is never taken; ``-inf`` when
    ``n`` is 0), ``n`` a multiple of ``_MAX_CHAINS * tile_lanes()``: that many vectors of
    partial maxima, folded together and then across lanes."""
    if not typed_2d((s, types.float32)):
        return None

    def codegen(context, builder, signature, args):
        sty, rty, nty = signature.args
        sa = context.make_array(sty)(context, builder, args[0])
        intp = context.get_value_type(types.intp)
        row = context.cast(builder, args[1], rty, types.intp)
        n = context.cast(builder, args[2], nty, types.intp)
        lanes = tile_lanes()
        f32v = ir.VectorType(ir.FloatType(), lanes)
        lowest = ir.Constant(f32v, [float("-inf")] * lanes)
        base = row_pointer(context, builder, sty, sa, row, intp(0))
        entry = builder.basic_block
        loop = builder.append_basic_block("max.loop")
        done = builder.append_basic_block("max.done")
        builder.cbranch(builder.icmp_signed(">", n, intp(0)), loop, done)
        builder.position_at_end(loop)
        j = builder.phi(intp)
        best = [builder.phi(f32v) for _ in range(_MAX_CHAINS)]
        new = []
        for c, b in enumerate(best):
            ptr = builder.gep(base, [builder.mul(builder.add(j, intp(c * lanes)), intp(4))])
            new.append(greater(builder, load_lanes(builder, ptr, "f32", lanes), b))
        j_next = builder.add(j, intp(_MAX_CHAINS * lanes))
        builder.cbranch(builder.icmp_signed("<", j_next, n), loop, done)
        j.add_incoming(intp(0), entry)
        j.add_incoming(j_next, loop)
        for phi, v in zip(best, new, strict=True):
            phi.add_incoming(lowest, entry)
            phi.add_incoming(v, loop)
        builder.position_at_end(done)
        last = [builder.phi(f32v) for _ in new]  # the chains' maxima (-inf: no loop)
        for phi, v in zip(last, new, strict=True):
            phi.add_incoming(lowest, entry)
            phi.add_incoming(v, loop)
        acc = last[0]
        for v in last[1:]:
            acc = greater(builder, v, acc)
        width = lanes
        while width > 1:  # the upper half of the lanes against the lower
            width //= 2
            high = builder.shuffle_vector(
                acc,
                ir.Constant(f32v, None),
                shuffle_mask(list(range(width, 2 * width)) * (lanes // width)),
            )
            acc = greater(builder, high, acc)
        return builder.extract_element(acc, ir.IntType(32)(0))

    return types.float32(s, r, n), codegen


def greater(builder, x, best):
    """``x`` where ``x > best``, else ``best``, lane by lane (a NaN ``x`` is never taken)."""
    return builder.select(builder.fcmp_ordered(">", x, best), x, best)


def row_max(s, r, nb):
    """The largest of ``s[r, :nb]`` (``-inf`` for none, or ``nb`` <= 0), a NaN never taken,
    as the scalar loop ``best = x if x > best else best`` gives it (up to the sign of a zero
    maximum: the loop keeps the first of +0.0 and -0.0, the vectors may keep either; both
    give the same weights ``exp(s - max)``): float32 rows of unit stride by vectors
    of partial maxima (:data:`_MAX_CHAINS` of :func:`tile_lanes` lanes), the positions
    past their last whole multiple one by one; other arrays by that loop. By the
    overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


@njit(cache=True)
def _max_from(s, r, nb, j, best):
    """The larger of ``best`` and ``s[r, j:nb]``'s largest, one by one (a NaN never taken)."""
    for jj in range(j, nb):
        x = s[r, jj]
        best = x if x > best else best
    return best


@overload(row_max, jit_options={"cache": True})
def _row_max_impl(s, r, nb):
    if not typed_2d((s, types.float32)):
        return lambda s, r, nb: _max_from(s, r, nb, 0, s.dtype.type(-np.inf))
    step = _MAX_CHAINS * tile_lanes()

    def vectors(s, r, nb):
        if s.strides[1] != 4:
            return _max_from(s, r, nb, 0, np.float32(-np.inf))
        n = max(nb, 0)
        n -= n % step  # the vectors' share; nb <= 0: none, and -inf
        return _max_from(s, r, nb, n, _max_prefix(s, r, n))

    return vectors
