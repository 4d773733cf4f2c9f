"""Explicit SIMD for the CPU attention's score loop: a 4 x 4 tile of dot products written
as LLVM vector IR, where the loop vectoriser leaves half the work on the table.

A score is a dot product along ``head_dim``. Vectorised along ``head_dim`` (the only unit
stride K has), each of a tile's 16 dot products ends as a 16-lane vector of partial sums,
and LLVM sums each one across its lanes alone: four shuffle-and-add steps per score, 64
instructions per tile beside its 128 multiply-adds (at head_dim 128). :func:`score_tile`
sums the 16 vectors together instead, a transposing reduction: each step shuffles two
vectors into one holding half of each, so 16 vectors of 16 lanes become one vector of 16
sums in 15 additions and 30 shuffles.

The vectors are ``<16 x float>`` where the CPU Numba compiles for has AVX-512: a 4 x 4
tile's 16 accumulators and what feeds them fill its 32 registers (float16 K's tile takes
``<8 x float>``, 4 x 4 of them reduced in two halves: :func:`_tile_shape`). Narrower targets have
16 registers, and the same shapes spilled (compiled for AVX2, the tile took 1.9x the
plain loop's time), so the shapes follow the target (:func:`tile_lanes`): with AVX,
groups of 4 x 2 dot products in ``<8 x float>`` and V passes of 16 elements; otherwise
(SSE, NEON) 4 x 1 in ``<4 x float>`` and passes of 8. ``tests/test_cpu_targets.py`` runs
the kernels compiled for AVX2 and for x86-64's SSE2 baseline. Multiplies and adds carry
LLVM's ``contract`` flag, so they fuse into FMAs where the CPU has them. 16-bit K rows
are widened as they are loaded: float16 by ``fpext`` (``vcvtph2ps``; integer arithmetic
where the target has no F16C, see :func:`nbkv.kernels.cpu_math.half_to_float_ir`),
bfloat16 by a 16-bit shift. Asked to, the tile prefetches the K rows a distance ahead
inside its loop over head_dim, a line of each per line read (16-bit K: two passes of 16
lanes a line); ``nbkv.kernels.cpu_attention._scores`` asks it for 16-bit K, whose 32k
decode step took 10% less time with fast memory this way than with the rows' lines
prefetched before each tile (float32 K, bound by memory, lost 10% and keeps the latter).

The summation order differs from the scalar loop's (lanes first, then the vectors), so
scores agree with it to float32 rounding, not bit for bit; the attention tests hold both
to the float64 reference. The building blocks (vector loads that widen, row pointers, the
lanes per target) are :mod:`nbkv.kernels.cpu_vector`'s.
"""

from __future__ import annotations

from types import SimpleNamespace

from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from .cpu_math import prefetch_ir
from .cpu_vector import (
    LANES,
    fma,
    load_lanes,
    row_pointer,
    shuffle_mask,
    splat,
    stored_type,
    tile_lanes,
    typed_2d,
)

# LANES and tile_lanes are cpu_vector's, named here too (where they were first)
__all__ = ["LANES", "accumulate_rows", "score_tile", "tile_lanes", "tile_ok"]

_TILE = 4  # query rows, and K rows, per tile


def _reduce_across(builder, vecs, lanes=LANES):
    """One vector whose lane ``t`` is the sum of ``vecs[t]``'s lanes (``lanes`` vectors of
    ``lanes``)."""
    level = [(v, 1) for v in vecs]  # (vector, items it holds, each over lanes / items)
    while len(level) > 1:
        nxt = []
        for (a, n), (b, _) in zip(level[0::2], level[1::2], strict=True):
            w = lanes // n  # lanes per item now; each item keeps half of them
            low, high = [], []
            for src in (0, lanes):  # a's items, then b's (b's lanes follow a's)
                for k in range(n):
                    base = src + k * w
                    low.extend(range(base, base + w // 2))
                    high.extend(range(base + w // 2, base + w))
            lo = builder.shuffle_vector(a, b, shuffle_mask(low))
            hi = builder.shuffle_vector(a, b, shuffle_mask(high))
            nxt.append((builder.fadd(lo, hi), 2 * n))
        level = nxt
    return level[0][0]


def _make_tile(fmt):
    """The tile intrinsic for K rows stored as ``fmt`` (see :func:`load_lanes`)."""

    @intrinsic
    def tile(typingctx, qs, r, kb, j, s, col, ahead):
        if not typed_2d((qs, types.float32), (kb, stored_type(fmt)), (s, types.float32)):
            return None
        if not isinstance(ahead, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            _tile_codegen(fmt, context, builder, signature, args)
            return context.get_dummy_value()

        return types.none(qs, r, kb, j, s, col, ahead), codegen

    return tile


def _tile_shape(fmt):
    """(lanes, K rows per group) of the score tile over K stored as ``fmt``: on AVX-512,
    groups of four K rows by 16 lanes, float16 by 8 (32 registers hold 16 accumulators
    of either; 8-lane conversions, ``vcvtph2ps`` from 128 bits, made the float16 32k
    decode step 5% faster with fast memory on the Zen 4 of 2026-12-05, where 512-bit
    operations run as two halves; bfloat16's shift and float32 were slower in 8);
    narrower targets (:func:`tile_lanes`) two by 8 lanes (AVX) or one by 4, so that the
    accumulators fit their 16 registers."""
    lanes = tile_lanes()
    if lanes == LANES and fmt == "f16":
        return 8, _TILE
    return lanes, lanes // _TILE


def _tile_codegen(fmt, context, builder, signature, args):
    """The IR of :func:`score_tile`: per group of K rows (:func:`_tile_shape`), a loop
    over head_dim, transposing reductions (one per ``lanes`` sums) and the group's
    stores. Two copies of each group's loop, with prefetches and without, chosen once by
    ``ahead``."""
    qty, rty, kty, jty, sty, cty, hty = signature.args
    qa = context.make_array(qty)(context, builder, args[0])
    intp = context.get_value_type(types.intp)
    r0 = context.cast(builder, args[1], rty, types.intp)
    lanes, cols = _tile_shape(fmt)
    g = SimpleNamespace(
        context=context,
        builder=builder,
        fmt=fmt,
        lanes=lanes,
        intp=intp,
        dim=cgutils.unpack_tuple(builder, qa.shape)[1],
        ksize=stored_type(fmt).bitwidth // 8,
        f32v=ir.VectorType(ir.FloatType(), lanes),
        qrows=[
            row_pointer(context, builder, qty, qa, builder.add(r0, intp(i)), intp(0))
            for i in range(_TILE)
        ],
    )
    ka = context.make_array(kty)(context, builder, args[2])
    sa = context.make_array(sty)(context, builder, args[4])
    j0 = context.cast(builder, args[3], jty, types.intp)
    c0 = context.cast(builder, args[5], cty, types.intp)
    ahead = context.cast(builder, args[6], hty, types.intp)
    for k0 in range(0, _TILE, cols):
        krows = [
            row_pointer(context, builder, kty, ka, builder.add(j0, intp(k0 + k)), intp(0))
            for k in range(cols)
        ]
        far = [  # the rows `ahead` past these, prefetched as these are read
            row_pointer(
                context,
                builder,
                kty,
                ka,
                builder.add(j0, builder.add(ahead, intp(k0 + k))),
                intp(0),
            )
            for k in range(cols)
        ]
        with_pf = builder.append_basic_block("tile.prefetching")
        plain = builder.append_basic_block("tile.plain")
        done = builder.append_basic_block("tile.done")
        builder.cbranch(builder.icmp_signed("!=", ahead, intp(0)), with_pf, plain)
        ends = []
        for block, pf in ((with_pf, far), (plain, None)):
            builder.position_at_end(block)
            sums = _tile_loops(g, krows, pf)
            ends.append((builder.basic_block, sums))
            builder.branch(done)
        builder.position_at_end(done)
        merged = [builder.phi(g.f32v) for _ in range(_TILE * cols)]
        for bb, sums in ends:
            for phi, v in zip(merged, sums, strict=True):
                phi.add_incoming(v, bb)
        # sum n = i * cols + k (row i . K row k0 + k) is lane n % lanes of sums[n // lanes]
        sums = [
            _reduce_across(builder, merged[n : n + lanes], lanes)
            for n in range(0, len(merged), lanes)
        ]
        # row i's `cols` scores are adjacent in s (its rows are unit-stride: the kernels'
        # own buffers) and in `sums`: one store of `cols` lanes each. Sixteen single
        # scores extracted and stored took 32 micro-ops a tile on the Zen 4, these 4
        part_ty = ir.VectorType(ir.FloatType(), cols) if cols > 1 else ir.FloatType()
        for i in range(_TILE):
            ptr = row_pointer(
                context, builder, sty, sa, builder.add(r0, intp(i)), builder.add(c0, intp(k0))
            )
            vec, first = sums[i * cols // lanes], i * cols % lanes
            if cols > 1:
                mine = list(range(first, first + cols))
                part = builder.shuffle_vector(vec, ir.Constant(g.f32v, None), shuffle_mask(mine))
            else:
                part = builder.extract_element(vec, ir.IntType(32)(first))
            builder.store(part, builder.bitcast(ptr, part_ty.as_pointer()), align=4)


def _tile_loops(g, krows, far):
    """The dot products of the tile's query rows with the K rows at ``krows`` along
    head_dim, as ``4 x len(krows)`` vectors of partial sums. ``far`` (row pointers, or
    None): rows to prefetch, one line of each per 64 bytes of a K row read, so that the
    body of the first loop reads one line of each K row (several passes of ``lanes``
    where K elements are narrower than float32) and the second takes what is left of
    head_dim a pass at a time."""
    builder, intp, lanes, f32v = g.builder, g.intp, g.lanes, g.f32v
    sub = max(1, 64 // (lanes * g.ksize)) if far is not None else 1  # passes per line
    step = lanes * sub
    zeros = [ir.Constant(f32v, [0.0] * lanes)] * (_TILE * len(krows))

    def body(d, accs, passes, prefetch):
        if prefetch:
            for p in far:
                prefetch_ir(builder, builder.gep(p, [builder.mul(d, intp(g.ksize))]))
        for u in range(passes):
            du = builder.add(d, intp(u * lanes)) if u else d
            qv = [
                load_lanes(builder, builder.gep(p, [builder.mul(du, intp(4))]), "f32", lanes)
                for p in g.qrows
            ]
            kv = [
                load_lanes(builder, builder.gep(p, [builder.mul(du, intp(g.ksize))]), g.fmt, lanes)
                for p in krows
            ]
            accs = [
                fma(builder, q, k, accs[i * len(krows) + c])
                for i, q in enumerate(qv)
                for c, k in enumerate(kv)
            ]
        return accs

    def loop(name, first, start, steps, prefetch, fits):
        """A loop of ``body(steps)`` from ``first`` (d) and ``start`` (accumulators) while
        ``fits(d)``; entered only where ``fits(first)``. Returns (exit d, exit sums)."""
        entry = builder.basic_block
        head = builder.append_basic_block(f"tile.{name}")
        out = builder.append_basic_block(f"tile.{name}.out")
        builder.cbranch(fits(first), head, out)
        builder.position_at_end(head)
        d = builder.phi(intp)
        accs = [builder.phi(f32v) for _ in zeros]
        new = body(d, accs, steps, prefetch)
        d_next = builder.add(d, intp(lanes * steps))
        builder.cbranch(fits(d_next), head, out)
        d.add_incoming(first, entry)
        d.add_incoming(d_next, head)
        for phi, v0, v in zip(accs, start, new, strict=True):
            phi.add_incoming(v0, entry)
            phi.add_incoming(v, head)
        builder.position_at_end(out)
        d_out = builder.phi(intp)
        d_out.add_incoming(first, entry)
        d_out.add_incoming(d_next, head)
        sums = []
        for v0, v in zip(start, new, strict=True):
            phi = builder.phi(f32v)
            phi.add_incoming(v0, entry)
            phi.add_incoming(v, head)
            sums.append(phi)
        return d_out, sums

    d, sums = loop(
        "lines",
        intp(0),
        zeros,
        sub,
        far is not None,
        lambda d: builder.icmp_signed("<=", builder.add(d, intp(step)), g.dim),
    )
    if sub > 1:  # head_dim not a multiple of a line's elements: the passes left
        d, sums = loop("rest", d, sums, 1, False, lambda d: builder.icmp_signed("<", d, g.dim))
    return sums


_tile_f32 = _make_tile("f32")
_tile_f16 = _make_tile("f16")
_tile_bf16 = _make_tile("bf16")
_tile_u8 = _make_tile("u8")


def score_tile(qs, r, kb, j, s, col, kind, ahead=0):
    """``s[r + i, col + k] = qs[r + i] . kb[j + k]`` for i, k in 0..3, as vector IR.

    qs: float32 [rows, head_dim] (queries); kb: [positions, head_dim] float32, uint16
    bits of float16 (``kind`` 0) or bfloat16 (``kind`` 1), or uint8 codes (their integer
    values: the quantized kernels fold scale and zero point around them); s: float32
    scores, rows of unit stride (the kernels' own buffers: not checked). Only where
    :func:`tile_ok` holds: head_dim a multiple of 16, both rows unit-stride. ``ahead``
    not 0 prefetches rows ``j + ahead .. j + ahead + 3`` (either side of ``kb``, at its
    row stride), one line of each per line of the tile's own K rows read; the scores are
    the same bits either way. Mutates ``s``. By the overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


# inline="always": Numba puts the tile's IR in the caller's own function. Left to LLVM,
# the caller's call was not inlined once the tile carried its two loops, and a call per
# tile (three arrays' fields passed on the stack) took the float32 scores from 10 to 21
# ns per position in cache (the Zen 4 of 2026-12-05)
@overload(score_tile, inline="always", jit_options={"cache": True})
def _score_tile_impl(qs, r, kb, j, s, col, kind, ahead=0):
    if qs.dtype != types.float32:
        return lambda qs, r, kb, j, s, col, kind, ahead=0: None  # tile_ok is False
    if kb.dtype == types.float32:
        return lambda qs, r, kb, j, s, col, kind, ahead=0: _tile_f32(qs, r, kb, j, s, col, ahead)
    if kb.dtype == types.uint8:  # 8-bit codes: scores against their integer values
        return lambda qs, r, kb, j, s, col, kind, ahead=0: _tile_u8(qs, r, kb, j, s, col, ahead)
    if kb.dtype == types.uint16:

        def widened(qs, r, kb, j, s, col, kind, ahead=0):
            if kind == 0:
                _tile_f16(qs, r, kb, j, s, col, ahead)
            else:
                _tile_bf16(qs, r, kb, j, s, col, ahead)

        return widened
    return lambda qs, r, kb, j, s, col, kind, ahead=0: None  # float64 K: tile_ok is False


def tile_ok(qs, kb):
    """Whether :func:`score_tile` and :func:`accumulate_rows` apply to these arrays:
    float32 ``qs``; float32 or 16-bit ``kb``; head_dim a multiple of 16, shared; unit-stride
    rows. By the overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


def _types_ok(a, b):
    """Whether the arrays' types can qualify: float32 ``a``; float32, 16-bit or 8-bit
    codes ``b``."""
    return a.dtype == types.float32 and b.dtype in (types.float32, types.uint16, types.uint8)


@njit(cache=True)
def _shapes_ok(a, b):
    """head_dim a multiple of 16 (and shared), rows unit-stride."""
    dim = a.shape[1]
    return (
        dim >= LANES
        and dim % LANES == 0
        and b.shape[1] == dim
        and a.strides[1] == a.itemsize
        and b.strides[1] == b.itemsize
    )


@overload(tile_ok, jit_options={"cache": True})
def _tile_ok_impl(qs, kb):
    if not _types_ok(qs, kb):  # decided when compiled, for the target
        return lambda qs, kb: False
    return lambda qs, kb: _shapes_ok(qs, kb)


def _make_accumulate(fmt, chunks):
    """The accumulate intrinsic for V rows stored as ``fmt``, ``chunks`` x 16 elements of
    head_dim per pass (4: head_dim a multiple of 64; 1: of 16). Narrower targets
    (:func:`tile_lanes` below 16) take passes of two of their vectors, 16 or 8 elements,
    whichever ``chunks``: 4 x 2 accumulators and what feeds them fit 16 registers."""

    @intrinsic
    def accumulate(typingctx, s, r, vb, nb, acc, c0, ahead):
        if not typed_2d((s, types.float32), (vb, stored_type(fmt)), (acc, types.float32)):
            return None

        def codegen(context, builder, signature, args):
            _accumulate_codegen(fmt, chunks, context, builder, signature, args)
            return context.get_dummy_value()

        return types.none(s, r, vb, nb, acc, c0, ahead), codegen

    return accumulate


def _accumulate_codegen(fmt, chunks, context, builder, signature, args):
    """The IR of :func:`accumulate_rows`: two copies of its loops, with prefetches and
    without, chosen once by ``ahead`` (no test inside them)."""
    sty, rty, vty, nty, aty, cty, hty = signature.args
    intp = context.get_value_type(types.intp)
    r0 = context.cast(builder, args[1], rty, types.intp)
    lanes = tile_lanes()
    g = SimpleNamespace(
        context=context,
        builder=builder,
        fmt=fmt,
        lanes=lanes,
        chunks=chunks if lanes == LANES else 2,  # vectors per row and pass
        intp=intp,
        tys=(sty, vty, aty),
        arrays=[
            context.make_array(t)(context, builder, v)
            for t, v in zip((sty, vty, aty), (args[0], args[2], args[4]), strict=True)
        ],
        rows=[builder.add(r0, intp(i)) for i in range(_TILE)],
        n=context.cast(builder, args[3], nty, types.intp),
        c0=context.cast(builder, args[5], cty, types.intp),
        ahead=context.cast(builder, args[6], hty, types.intp),
        done=builder.append_basic_block("acc.done"),
    )
    with_pf = builder.append_basic_block("acc.prefetching")
    plain = builder.append_basic_block("acc.plain")
    builder.cbranch(builder.icmp_signed("!=", g.ahead, intp(0)), with_pf, plain)
    builder.position_at_end(with_pf)
    _accumulate_loops(g, True)
    builder.position_at_end(plain)
    _accumulate_loops(g, False)
    builder.position_at_end(g.done)


def _accumulate_loops(g, with_prefetch):
    """The loops of :func:`accumulate_rows`, over passes of head_dim and, inside, over the
    block's positions with the pass's accumulators in registers; ends in ``g.done``."""
    context, builder, intp, chunks, lanes = g.context, g.builder, g.intp, g.chunks, g.lanes
    (sty, vty, aty), (sa, va, aa) = g.tys, g.arrays
    vsize = stored_type(g.fmt).bitwidth // 8
    dim = cgutils.unpack_tuple(builder, aa.shape)[1]
    vstride = cgutils.unpack_tuple(builder, va.strides)[0]
    f32v = ir.VectorType(ir.FloatType(), lanes)
    entry = builder.basic_block
    outer = builder.append_basic_block("acc.outer")
    inner = builder.append_basic_block("acc.inner")
    tail = builder.append_basic_block("acc.tail")
    builder.branch(outer)
    builder.position_at_end(outer)
    d = builder.phi(intp)  # the pass's first element of head_dim
    aptr = [
        [
            row_pointer(context, builder, aty, aa, row, builder.add(d, intp(lanes * c)))
            for c in range(chunks)
        ]
        for row in g.rows
    ]
    start = [[load_lanes(builder, p, "f32", lanes) for p in ptrs] for ptrs in aptr]
    builder.branch(inner)
    builder.position_at_end(inner)
    j = builder.phi(intp)  # the position
    sums = [[builder.phi(f32v) for _ in range(chunks)] for _ in g.rows]
    vrow = row_pointer(context, builder, vty, va, j, d)
    if with_prefetch:  # this pass's lines of row j + ahead
        far = builder.gep(vrow, [builder.mul(g.ahead, vstride)])
        for line in range(0, lanes * chunks * vsize, 64):
            prefetch_ir(builder, builder.gep(far, [intp(line)]))
    v = [
        load_lanes(builder, builder.gep(vrow, [intp(lanes * c * vsize)]), g.fmt, lanes)
        for c in range(chunks)
    ]
    new = []
    for i, row in enumerate(g.rows):
        wptr = row_pointer(context, builder, sty, sa, row, builder.add(g.c0, j))
        w = splat(
            builder,
            builder.load(builder.bitcast(wptr, ir.FloatType().as_pointer()), align=4),
            lanes,
        )
        new.append([fma(builder, w, v[c], sums[i][c]) for c in range(chunks)])
    j_next = builder.add(j, intp(1))
    builder.cbranch(builder.icmp_signed("<", j_next, g.n), inner, tail)
    j.add_incoming(intp(0), outer)
    j.add_incoming(j_next, inner)
    for i in range(_TILE):
        for c in range(chunks):
            sums[i][c].add_incoming(start[i][c], outer)
            sums[i][c].add_incoming(new[i][c], inner)
    builder.position_at_end(tail)
    for i in range(_TILE):
        for c in range(chunks):
            builder.store(new[i][c], builder.bitcast(aptr[i][c], f32v.as_pointer()), align=4)
    d_next = builder.add(d, intp(lanes * chunks))
    builder.cbranch(builder.icmp_signed("<", d_next, dim), outer, g.done)
    d.add_incoming(intp(0), entry)
    d.add_incoming(d_next, tail)


_ACCUMULATE = {
    (fmt, chunks): _make_accumulate(fmt, chunks)
    for fmt in ("f32", "f16", "bf16", "u8")
    for chunks in (1, 4)
}
_acc_f32_1, _acc_f32_4 = _ACCUMULATE["f32", 1], _ACCUMULATE["f32", 4]
_acc_f16_1, _acc_f16_4 = _ACCUMULATE["f16", 1], _ACCUMULATE["f16", 4]
_acc_bf16_1, _acc_bf16_4 = _ACCUMULATE["bf16", 1], _ACCUMULATE["bf16", 4]
_acc_u8_1, _acc_u8_4 = _ACCUMULATE["u8", 1], _ACCUMULATE["u8", 4]


def accumulate_rows(s, r, vb, nb, acc, c0, kind, ahead):
    """``acc[r + i] += sum over j < nb of s[r + i, c0 + j] * vb[j]`` for i in 0..3, as vector
    IR: the 4 x 64 accumulators of a pass over head_dim stay in registers while every
    position of the block is added. ``vb``: float32 rows, uint16 bits of float16
    (``kind`` 0) or bfloat16 (1), or uint8 codes (their integer values); ``ahead`` not 0
    prefetches row ``j + ahead`` (either side of ``vb``) as row ``j`` is added. Only
    where :func:`tile_ok` holds for ``(acc, vb)`` and ``nb`` > 0. Mutates ``acc``. By the
    overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


@overload(accumulate_rows, jit_options={"cache": True})
def _accumulate_rows_impl(s, r, vb, nb, acc, c0, kind, ahead):
    if not _types_ok(acc, vb):
        return lambda s, r, vb, nb, acc, c0, kind, ahead: None  # tile_ok is False
    if vb.dtype in (types.float32, types.uint8):
        four_, one_ = (
            (_acc_f32_4, _acc_f32_1) if vb.dtype == types.float32 else (_acc_u8_4, _acc_u8_1)
        )

        def rows32(s, r, vb, nb, acc, c0, kind, ahead):
            if acc.shape[1] % (4 * LANES) == 0:
                four_(s, r, vb, nb, acc, c0, ahead)
            else:
                one_(s, r, vb, nb, acc, c0, ahead)

        return rows32

    def rows16(s, r, vb, nb, acc, c0, kind, ahead):
        four = acc.shape[1] % (4 * LANES) == 0
        if kind == 0:
            if four:
                _acc_f16_4(s, r, vb, nb, acc, c0, ahead)
            else:
                _acc_f16_1(s, r, vb, nb, acc, c0, ahead)
        elif four:
            _acc_bf16_4(s, r, vb, nb, acc, c0, ahead)
        else:
            _acc_bf16_1(s, r, vb, nb, acc, c0, ahead)

    return rows16
