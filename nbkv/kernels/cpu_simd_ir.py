"""The LLVM IR behind :mod:`nbkv.kernels.cpu_simd`'s intrinsics: the score tile's loops over
head_dim (with and without prefetches), its transposing reduction and stores, and the V
pass's loops. Code generators only (they run when Numba compiles a caller): the reasons for
each shape, and the measurements behind them, are in :mod:`nbkv.kernels.cpu_simd`.
"""

from __future__ import annotations

from types import SimpleNamespace

from llvmlite import ir
from numba.core import cgutils, types

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
)

__all__ = ["TILE", "accumulate_codegen", "reduce_across", "tile_codegen", "tile_shape"]

TILE = 4  # query rows, and K rows, per tile


def reduce_across(builder, vecs, lanes=LANES):
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


def tile_shape(fmt):
    """(lanes, K rows per group) of the score tile over K stored as ``fmt``: on AVX-512,
    groups of four K rows by 16 lanes, float16 by 8 (32 registers hold 16 accumulators
    of either; 8-lane conversions, ``vcvtph2ps`` from 128 bits, made the float16 32k
    decode step 5% faster with fast memory on the Zen 4 of 2026-12-05, where 512-bit
    operations run as two halves; bfloat16's shift and float32 were slower in 8);
    narrower targets (:func:`tile_lanes`) two by 8 lanes (AVX) or one by 4, so that the
    accumulators fit their 16 registers."""
    lanes = tile_lanes()
    if lanes == LANES and fmt == "f16":
        return 8, TILE
    return lanes, lanes // TILE


def tile_codegen(fmt, context, builder, signature, args):
    """The IR of :func:`~nbkv.kernels.cpu_simd.score_tile`: per group of K rows
    (:func:`tile_shape`), a loop over head_dim, transposing reductions (one per ``lanes``
    sums) and the group's stores. Two copies of each group's loop, with prefetches and
    without, chosen once by ``ahead``."""
    qty, rty, kty, jty, sty, cty, hty = signature.args
    qa = context.make_array(qty)(context, builder, args[0])
    intp = context.get_value_type(types.intp)
    r0 = context.cast(builder, args[1], rty, types.intp)
    lanes, cols = tile_shape(fmt)
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
            for i in range(TILE)
        ],
    )
    ka = context.make_array(kty)(context, builder, args[2])
    sa = context.make_array(sty)(context, builder, args[4])
    j0 = context.cast(builder, args[3], jty, types.intp)
    c0 = context.cast(builder, args[5], cty, types.intp)
    ahead = context.cast(builder, args[6], hty, types.intp)
    for k0 in range(0, TILE, cols):
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
            sums = tile_loops(g, krows, pf)
            ends.append((builder.basic_block, sums))
            builder.branch(done)
        builder.position_at_end(done)
        merged = [builder.phi(g.f32v) for _ in range(TILE * cols)]
        for bb, sums in ends:
            for phi, v in zip(merged, sums, strict=True):
                phi.add_incoming(v, bb)
        # sum n = i * cols + k (row i . K row k0 + k) is lane n % lanes of sums[n // lanes]
        sums = [
            reduce_across(builder, merged[n : n + lanes], lanes)
            for n in range(0, len(merged), lanes)
        ]
        # row i's `cols` scores are adjacent in s (its rows are unit-stride: the kernels'
        # own buffers) and in `sums`: one store of `cols` lanes each. Sixteen single
        # scores extracted and stored took 32 micro-ops a tile on the Zen 4, these 4
        part_ty = ir.VectorType(ir.FloatType(), cols) if cols > 1 else ir.FloatType()
        for i in range(TILE):
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


def tile_loops(g, krows, far):
    """The dot products of the tile's query rows with the K rows at ``krows`` along
    head_dim, as ``4 x len(krows)`` vectors of partial sums. ``far`` (row pointers, or
    None): rows to prefetch, one line of each per 64 bytes of a K row read, so that the
    body of the first loop reads one line of each K row (several passes of ``lanes``
    where K elements are narrower than float32) and the second takes what is left of
    head_dim a pass at a time."""
    builder, intp, lanes, f32v = g.builder, g.intp, g.lanes, g.f32v
    sub = max(1, 64 // (lanes * g.ksize)) if far is not None else 1  # passes per line
    step = lanes * sub
    zeros = [ir.Constant(f32v, [0.0] * lanes)] * (TILE * len(krows))

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
        if far is not None:  # and the last line of each row ahead, which they read
            with builder.if_then(builder.icmp_signed("<", d, g.dim)):
                for p in far:
                    prefetch_ir(builder, builder.gep(p, [builder.mul(d, intp(g.ksize))]))
        d, sums = loop("rest", d, sums, 1, False, lambda d: builder.icmp_signed("<", d, g.dim))
    return sums


def accumulate_codegen(fmt, chunks, context, builder, signature, args, rows=TILE, sweep=False):
    """The IR of :func:`~nbkv.kernels.cpu_simd.accumulate_rows` (``rows`` rows from
    ``r``: 4 there, 1 to 6 for :func:`nbkv.kernels.cpu_prefill.accumulate_outer`; with
    ``sweep``, of :func:`~nbkv.kernels.cpu_simd.accumulate_sweep`, whose prefetches sweep
    the ``nb`` rows from ``ahead`` on instead of each pass's line of row ``j + ahead``): two
    copies of its loops, with prefetches and without, chosen once by ``ahead`` (no test
    inside them)."""
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
        rows=[builder.add(r0, intp(i)) for i in range(rows)],
        n=context.cast(builder, args[3], nty, types.intp),
        c0=context.cast(builder, args[5], cty, types.intp),
        ahead=context.cast(builder, args[6], hty, types.intp),
        done=builder.append_basic_block("acc.done"),
        sweep=sweep,
    )
    with_pf = builder.append_basic_block("acc.prefetching")
    plain = builder.append_basic_block("acc.plain")
    builder.cbranch(builder.icmp_signed("!=", g.ahead, intp(0)), with_pf, plain)
    builder.position_at_end(with_pf)
    accumulate_loops(g, True)
    builder.position_at_end(plain)
    accumulate_loops(g, False)
    builder.position_at_end(g.done)


def accumulate_loops(g, with_prefetch):
    """The loops of :func:`~nbkv.kernels.cpu_simd.accumulate_rows`, over passes of head_dim
    and, inside, over the block's positions with the pass's accumulators in registers; ends
    in ``g.done``."""
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
    pass_bytes = lanes * chunks * vsize  # of a row, per pass
    if with_prefetch and g.sweep:
        # the n rows from row `ahead` on, in memory order (contiguous rows): pass p's
        # position j asks for bytes (p * n + j) * pass_bytes of them, so that the passes
        # sweep them once in all
        at = builder.mul(builder.mul(g.n, d), intp(vsize))  # pass p's share starts here
        at = builder.add(at, builder.mul(j, intp(pass_bytes)))
        far = builder.gep(row_pointer(context, builder, vty, va, g.ahead, intp(0)), [at])
    elif with_prefetch:  # this pass's lines of row j + ahead
        far = builder.gep(vrow, [builder.mul(g.ahead, vstride)])
    if with_prefetch:
        for line in range(0, pass_bytes, 64):
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
    for i in range(len(g.rows)):
        for c in range(chunks):
            sums[i][c].add_incoming(start[i][c], outer)
            sums[i][c].add_incoming(new[i][c], inner)
    builder.position_at_end(tail)
    for i in range(len(g.rows)):
        for c in range(chunks):
            builder.store(new[i][c], builder.bitcast(aptr[i][c], f32v.as_pointer()), align=4)
    d_next = builder.add(d, intp(lanes * chunks))
    builder.cbranch(builder.icmp_signed("<", d_next, dim), outer, g.done)
    d.add_incoming(intp(0), entry)
    d.add_incoming(d_next, tail)
