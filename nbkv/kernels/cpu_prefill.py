"""A prefill chunk's score and V passes as matrix products, for CPUs whose vectors are
narrower than AVX-512's: a block of K rows copied transposed, then tiles of query rows by
positions whose sums never leave their lanes; and the V pass six rows at a time.

A decode step scores a few query rows against each K row, and
:func:`nbkv.kernels.cpu_simd.score_tile` does that as dot products along head_dim: each sum
ends as a vector of partial sums, reduced across its lanes. Where vectors have 8 lanes
(AVX2's 16 registers) that tile holds 4 x 2 sums, eight chains of multiply-adds: a
multiply-add takes 5 cycles on the Zen 2 and two can start per cycle, so eight chains keep
the units four fifths busy at best, and the reductions come on top. Measured on the Zen 2
guest of 2026-12-06 (one thread, K in cache, 128 query rows over 4,096 positions in
blocks of 64): 2.37-2.38 ms, 55-57 GFLOP/s of the core's 108.

A prefill chunk has 128 query rows per block of 64 positions, enough to pay for a copy
of the block: :func:`transpose_rows` writes K's block as ``kt[d, j]`` (float32; 16-bit K
widened on the way, ``lanes x lanes`` at a time with shuffles: 0.08-0.09 ms of those
2.4, against 0.33 for a plain loop), and then :func:`scores_outer` computes ``s[r, j]``
for 6 rows by ``2 x lanes`` positions at a time (AVX2: 16; SSE or NEON: 8) as sums of
outer products: for each ``d``, one query element per row broadcast, times the two
vectors ``kt[d, j:j + 2 lanes]``. Twelve independent sums stay in registers (with two
vectors and a broadcast: 15 of 16), every sum lands in its own lane, and nothing is
reduced: 1.53-1.57 ms, with the copy 1.62-1.68.

Each score is summed over head_dim in spans of 32 elements (a chain of FMAs in registers
each), the first span's sums stored, the later ones' added in memory in turn
(:data:`_SPAN`): a different order from the tile's (16 elements per lane, then the lanes
pairwise), so the same scores to float32 rounding, not bit for bit, and nearly as close to
float64 (one chain over all of head_dim, 1.38 ms, was 4x further off). The V pass
(:func:`accumulate_outer`) is
:func:`~nbkv.kernels.cpu_simd.accumulate_rows`' loop for 6 rows instead of 4 (12
accumulators instead of 8): the same sums in the same order, bit for bit, 1.41 ms against
1.70-1.73. :func:`applies` says when the attention takes these (a chunk of more than 32
query rows, ``cpu_attention._FEW_ROWS``: ``nbkv.kernels.cpu_attention``, and
``nbkv.kernels.cpu_paged`` over each head's positions gathered from their pages); the
functions themselves check nothing
(kernels' rule): their docstrings say what they need. AVX-512 targets keep the tile,
which has 16 sums in flight (these were not measured there).
"""

from __future__ import annotations

from types import SimpleNamespace

from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from .. import _config
from .cpu_loops import value_of
from .cpu_simd import tile_ok
from .cpu_simd_ir import accumulate_codegen
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

__all__ = [
    "OUTER_ROWS",
    "TAKEN",
    "accumulate_outer",
    "applies",
    "outer_columns",
    "scores_outer",
    "transpose_rows",
]

# query rows per outer-product tile: 6 rows x 2 vectors = 12 accumulators, the most that
# fit 16 registers beside the two K vectors and the broadcast (10 chains keep a Zen 2's
# two FMA units busy: 5 cycles' latency, two a cycle)
OUTER_ROWS = 6
_VECTORS = 2  # vectors of positions per tile row
# elements of head_dim summed in registers before they are added to the scores in memory
# (the last span of a head_dim not a multiple of it shorter; the first span's sums are
# stored, not added to zeros): one chain over all 128 left scores 4x further from the
# float64 reference than the dot-product tile's (which sums 16 per lane, then its lanes
# pairwise), and the attention tests' tolerance, 3e-5 on the output, failed. Spans of 16
# were as close as the tile (mean error 1.06x its, on tests/test_cpu_prefill.py's data);
# spans of 32, 1.23-1.27x (seeds 7, 1, 2, 3), and the 512-query prefill chunk over 4,096
# positions 4% faster on the Zen 3 guest of 2026-12-07 (benchmarks/README.md, "The Zen 3
# guest again: the prefill's score spans")
_SPAN = 32


def outer_columns(lanes):
    """Positions per outer-product tile for vectors of ``lanes`` float32 lanes."""
    return _VECTORS * lanes


def _transpose_lanes(builder, rows):
    """The ``n x n`` transpose of ``rows`` (``n`` vectors of ``n`` lanes, ``n`` a power of
    two): log2(n) stages of shuffles, each pairing row ``i`` with row ``i + b`` and
    swapping the off-diagonal blocks of ``b`` lanes in every group of ``2 b``."""
    n = len(rows)
    rows = list(rows)
    b = n // 2
    while b >= 1:
        out = list(rows)
        for i in range(n):
            if i & b:
                continue
            low, high = [], []
            for g in range(0, n, 2 * b):  # lanes of rows[i + b] are numbered n..2n-1
                low.extend(list(range(g, g + b)) + list(range(n + g, n + g + b)))
                high.extend(list(range(g + b, g + 2 * b)) + list(range(n + g + b, n + g + 2 * b)))
            out[i] = builder.shuffle_vector(rows[i], rows[i + b], shuffle_mask(low))
            out[i + b] = builder.shuffle_vector(rows[i], rows[i + b], shuffle_mask(high))
        rows = out
        b //= 2
    return rows


def _make_transpose(fmt, lanes):
    """The intrinsic ``(kb, j, d, kt)``: ``kt[d + i, j + t] = kb[j + t, d + i]`` for i, t
    below ``lanes``, ``kb`` stored as ``fmt`` (widened to float32)."""

    @intrinsic
    def tile(typingctx, kb, j, d, kt):
        if not typed_2d((kb, stored_type(fmt)), (kt, types.float32)):
            return None

        def codegen(context, builder, signature, args):
            kty, jty, dty, tty = signature.args
            ka = context.make_array(kty)(context, builder, args[0])
            ta = context.make_array(tty)(context, builder, args[3])
            intp = context.get_value_type(types.intp)
            j0 = context.cast(builder, args[1], jty, types.intp)
            d0 = context.cast(builder, args[2], dty, types.intp)
            rows = [
                load_lanes(
                    builder,
                    row_pointer(context, builder, kty, ka, builder.add(j0, intp(t)), d0),
                    fmt,
                    lanes,
                )
                for t in range(lanes)
            ]
            f32v = ir.VectorType(ir.FloatType(), lanes)
            for i, vec in enumerate(_transpose_lanes(builder, rows)):
                ptr = row_pointer(context, builder, tty, ta, builder.add(d0, intp(i)), j0)
                builder.store(vec, builder.bitcast(ptr, f32v.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.none(kb, j, d, kt), codegen

    return tile


def _make_outer(rows, lanes):
    """The intrinsic ``(qs, r, kt, c, s, col)``: ``s[r + i, col + c + t] = sum over d of
    qs[r + i, d] * kt[d, c + t]`` for i below ``rows``, t below ``2 x lanes``."""

    @intrinsic
    def tile(typingctx, qs, r, kt, c, s, col):
        if not typed_2d((qs, types.float32), (kt, types.float32), (s, types.float32)):
            return None

        def codegen(context, builder, signature, args):
            _outer_codegen(rows, lanes, context, builder, signature, args)
            return context.get_dummy_value()

        return types.none(qs, r, kt, c, s, col), codegen

    return tile


def _outer_codegen(rows, lanes, context, builder, signature, args):
    """The IR of :func:`_make_outer`'s tile: the pointers it reads and writes, then
    :func:`_outer_loops`."""
    qty, rty, tty, cty, sty, oty = signature.args
    qa, ta, sa = (
        context.make_array(t)(context, builder, a)
        for t, a in zip((qty, tty, sty), (args[0], args[2], args[4]), strict=True)
    )
    intp = context.get_value_type(types.intp)
    r0 = context.cast(builder, args[1], rty, types.intp)
    c = context.cast(builder, args[3], cty, types.intp)  # the tile's first column of kt
    col = builder.add(context.cast(builder, args[5], oty, types.intp), c)  # and of s
    f32v = ir.VectorType(ir.FloatType(), lanes)
    g = SimpleNamespace(
        builder=builder,
        intp=intp,
        lanes=lanes,
        f32v=f32v,
        dim=cgutils.unpack_tuple(builder, qa.shape)[1],
        kstride=cgutils.unpack_tuple(builder, ta.strides)[0],
        kbase=row_pointer(context, builder, tty, ta, intp(0), c),  # kt[0, c]
        qrows=[  # qs[r + i, 0]
            row_pointer(context, builder, qty, qa, builder.add(r0, intp(i)), intp(0))
            for i in range(rows)
        ],
        targets=[  # s[r + i, col + c + lanes v], as vectors: targets[i * _VECTORS + v]
            builder.bitcast(
                row_pointer(
                    context,
                    builder,
                    sty,
                    sa,
                    builder.add(r0, intp(i)),
                    builder.add(col, intp(lanes * v)),
                ),
                f32v.as_pointer(),
            )
            for i in range(rows)
            for v in range(_VECTORS)
        ],
        zero=ir.Constant(f32v, [0.0] * lanes),
    )
    _outer_loops(g)


def _outer_loops(g):
    """Spans of ``_SPAN`` elements of head_dim (the last, up to head_dim's end); in each,
    per ``d``, the tile's query elements broadcast times the two vectors of ``kt[d]``, into
    sums held in registers, stored as the scores at the first span's end and added to them
    at every later one's."""
    builder, intp, lanes = g.builder, g.intp, g.lanes
    entry = builder.basic_block
    spans = builder.append_basic_block("outer.spans")
    loop = builder.append_basic_block("outer.d")
    tail = builder.append_basic_block("outer.span_end")
    done = builder.append_basic_block("outer.done")
    builder.branch(spans)  # head_dim > 0 (tile_ok: a multiple of 16)
    builder.position_at_end(spans)
    d0 = builder.phi(intp)
    builder.branch(loop)
    builder.position_at_end(loop)
    d = builder.phi(intp)
    sums = [builder.phi(g.f32v) for _ in g.targets]
    krow = builder.gep(g.kbase, [builder.mul(d, g.kstride)])  # kt[d, c:]
    kv = [
        load_lanes(builder, builder.gep(krow, [intp(4 * lanes * v)]), "f32", lanes)
        for v in range(_VECTORS)
    ]
    new = []
    for i, qrow in enumerate(g.qrows):  # query element (r + i, d), broadcast
        qptr = builder.gep(qrow, [builder.mul(d, intp(4))])
        qptr = builder.bitcast(qptr, ir.FloatType().as_pointer())
        w = splat(builder, builder.load(qptr, align=4), lanes)
        new.extend(fma(builder, w, kv[v], sums[i * _VECTORS + v]) for v in range(_VECTORS))
    d_next = builder.add(d, intp(1))
    full = builder.add(d0, intp(_SPAN))  # the span's end, or head_dim's (a multiple of 16)
    span_end = builder.select(builder.icmp_signed("<", full, g.dim), full, g.dim)
    builder.cbranch(builder.icmp_signed("<", d_next, span_end), loop, tail)
    d.add_incoming(d0, spans)
    d.add_incoming(d_next, loop)
    for phi, v in zip(sums, new, strict=True):
        phi.add_incoming(g.zero, spans)
        phi.add_incoming(v, loop)
    builder.position_at_end(tail)  # the span's sums into s: the first stored as they are
    first = builder.append_basic_block("outer.first_span")
    later = builder.append_basic_block("outer.later_span")
    stored = builder.append_basic_block("outer.stored")
    builder.cbranch(builder.icmp_signed("==", d0, intp(0)), first, later)
    builder.position_at_end(first)
    for ptr, v in zip(g.targets, new, strict=True):
        builder.store(v, ptr, align=4)
    builder.branch(stored)
    builder.position_at_end(later)  # the later ones added to what is there
    for ptr, v in zip(g.targets, new, strict=True):
        builder.store(builder.fadd(builder.load(ptr, align=4), v), ptr, align=4)
    builder.branch(stored)
    builder.position_at_end(stored)
    builder.cbranch(builder.icmp_signed("<", span_end, g.dim), spans, done)
    d0.add_incoming(intp(0), entry)
    d0.add_incoming(span_end, stored)
    builder.position_at_end(done)


def _make_accumulate(fmt, rows):
    """The intrinsic ``(s, r, vb, nb, acc, c0, ahead)`` of
    :func:`nbkv.kernels.cpu_simd.accumulate_rows` for ``rows`` query rows from ``r``."""

    @intrinsic
    def accumulate(typingctx, s, r, vb, nb, acc, c0, ahead):
        if not typed_2d((s, types.float32), (vb, stored_type(fmt)), (acc, types.float32)):
            return None

        def codegen(context, builder, signature, args):
            accumulate_codegen(fmt, 1, context, builder, signature, args, rows)
            return context.get_dummy_value()

        return types.none(s, r, vb, nb, acc, c0, ahead), codegen

    return accumulate


_LANES = tile_lanes()  # the CPU Numba compiles for decides, once per process
# whether the attention takes these here: vectors narrower than AVX-512's
TAKEN = _LANES < LANES
_WIDTH = outer_columns(_LANES)  # positions per tile
_TRANSPOSE = {fmt: _make_transpose(fmt, _LANES) for fmt in ("f32", "f16", "bf16")}
_OUTER_TILES = [None] + [_make_outer(n, _LANES) for n in range(1, OUTER_ROWS + 1)]
_tr_f32, _tr_f16, _tr_bf16 = _TRANSPOSE["f32"], _TRANSPOSE["f16"], _TRANSPOSE["bf16"]
_outer1, _outer2, _outer3, _outer4, _outer5, _outer6 = _OUTER_TILES[1:]


def _transpose_tile(kb, j, d, kt, kind):
    """``kt[d + i, j + t] = kb[j + t, d + i]`` (widened) for i, t below the lanes. By the
    overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


@overload(_transpose_tile, inline="always", jit_options={"cache": True})
def _transpose_tile_impl(kb, j, d, kt, kind):
    if kb.dtype == types.float32:
        return lambda kb, j, d, kt, kind: _tr_f32(kb, j, d, kt)
    if kb.dtype != types.uint16:
        return lambda kb, j, d, kt, kind: None  # float64 or 8-bit K: applies is False

    def widened(kb, j, d, kt, kind):
        if kind == 0:
            _tr_f16(kb, j, d, kt)
        else:
            _tr_bf16(kb, j, d, kt)

    return widened


@njit(cache=True, fastmath=_config.FASTMATH)
def transpose_rows(kb, kind, kt):
    """``kt[d, j] = kb[j, d]`` for every row ``j`` of ``kb`` ([nb, head_dim]: float32, or
    the uint16 bits of float16 (``kind`` 0) or bfloat16 (1), widened). Only where
    :func:`nbkv.kernels.cpu_simd.tile_ok` holds for (the queries, ``kb``): head_dim a
    multiple of 16, unit-stride rows (any row stride); ``kt``: float32 [head_dim, at
    least nb], unit-stride rows. Whole
    ``lanes x lanes`` squares by shuffles, the rows past the last whole one by one.
    Mutates ``kt`` (its columns past ``nb`` are left as they were)."""
    nb, dim = kb.shape
    j = 0
    while j + _LANES <= nb:
        for d in range(0, dim, _LANES):
            _transpose_tile(kb, j, d, kt, kind)
        j += _LANES
    for t in range(j, nb):  # the rows past the last whole square
        for d in range(dim):
            kt[d, t] = value_of(kb[t, d], kind)


@njit(cache=True)
def scores_outer(qs, kt, s, c0, nb):
    """``s[r, c0 + j] = qs[r] . kt[:, j]`` for every query row ``r`` and ``j < nb``, in tiles
    of :data:`OUTER_ROWS` rows by :func:`outer_columns` positions (the rows left over in
    one smaller tile). qs: float32 [rows, head_dim]; kt: float32 [head_dim, at least nb
    rounded up to whole tiles] (:func:`transpose_rows`); s: float32, rows of unit stride,
    at least ``c0`` + that many columns: the columns between ``nb`` and the tiles' end get
    the scores of whatever ``kt`` holds there (stale or unset: anything, NaN included,
    which nothing reads). head_dim a multiple of 16. Mutates ``s``."""
    rows = qs.shape[0]
    width = _WIDTH
    cols = (nb + width - 1) // width * width
    r = 0
    while r + OUTER_ROWS <= rows:
        for c in range(0, cols, width):
            _outer_tile(qs, r, kt, c, s, c0, OUTER_ROWS)
        r += OUTER_ROWS
    if r < rows:  # the rows left over, in one smaller tile
        for c in range(0, cols, width):
            _outer_tile(qs, r, kt, c, s, c0, rows - r)


def _outer_tile(qs, r, kt, c, s, col, n):
    """``s[r + i, col + c + t] = qs[r + i] . kt[:, c + t]`` for i below ``n`` (1 to
    :data:`OUTER_ROWS`) and t below :func:`outer_columns`. By the overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


@overload(_outer_tile, inline="always", jit_options={"cache": True})
def _outer_tile_impl(qs, r, kt, c, s, col, n):
    if qs.dtype != types.float32:
        return lambda qs, r, kt, c, s, col, n: None  # float64 queries: applies is False

    def by_rows(qs, r, kt, c, s, col, n):
        if n == OUTER_ROWS:
            _outer6(qs, r, kt, c, s, col)
        elif n == 5:
            _outer5(qs, r, kt, c, s, col)
        elif n == 4:
            _outer4(qs, r, kt, c, s, col)
        elif n == 3:
            _outer3(qs, r, kt, c, s, col)
        elif n == 2:
            _outer2(qs, r, kt, c, s, col)
        else:
            _outer1(qs, r, kt, c, s, col)

    return by_rows


_ACC_ROWS = (OUTER_ROWS, 4, 2, 1)  # rows per V-pass tile: six, then what is left
_ACC = {(fmt, n): _make_accumulate(fmt, n) for fmt in ("f32", "f16", "bf16") for n in _ACC_ROWS}


def _acc_tile(s, r, vb, nb, acc, c0, kind, n):
    """``acc[r + i] += sum over j < nb of s[r + i, c0 + j] * vb[j]`` for i below ``n`` (6,
    4, 2 or 1). By the overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


def _acc_by_rows(fmt):
    """A function ``(s, r, vb, nb, acc, c0, n)`` calling ``fmt``'s V-pass intrinsic for
    ``n`` rows (one of :data:`_ACC_ROWS`)."""
    six, four, two, one = (_ACC[fmt, n] for n in _ACC_ROWS)

    def by_rows(s, r, vb, nb, acc, c0, n):
        if n == OUTER_ROWS:
            six(s, r, vb, nb, acc, c0, 0)
        elif n == 4:
            four(s, r, vb, nb, acc, c0, 0)
        elif n == 2:
            two(s, r, vb, nb, acc, c0, 0)
        else:
            one(s, r, vb, nb, acc, c0, 0)

    return njit(by_rows)


_ACC_BY_ROWS = {fmt: _acc_by_rows(fmt) for fmt in ("f32", "f16", "bf16")}


@overload(_acc_tile, inline="always", jit_options={"cache": True})
def _acc_tile_impl(s, r, vb, nb, acc, c0, kind, n):
    if acc.dtype != types.float32 or vb.dtype not in (types.float32, types.uint16):
        return lambda s, r, vb, nb, acc, c0, kind, n: None  # float64, 8-bit: applies is False
    if vb.dtype == types.float32:
        f32 = _ACC_BY_ROWS["f32"]
        return lambda s, r, vb, nb, acc, c0, kind, n: f32(s, r, vb, nb, acc, c0, n)
    f16, bf16 = _ACC_BY_ROWS["f16"], _ACC_BY_ROWS["bf16"]

    def widened(s, r, vb, nb, acc, c0, kind, n):
        if kind == 0:
            f16(s, r, vb, nb, acc, c0, n)
        else:
            bf16(s, r, vb, nb, acc, c0, n)

    return widened


@njit(cache=True)
def accumulate_outer(s, vb, acc, c0, kind):
    """``acc[r] += sum over j of s[r, c0 + j] * vb[j]`` for every row ``r`` of ``acc``: the
    V pass of a prefill chunk, :data:`OUTER_ROWS` rows at a time (each V vector loaded
    feeds six rows; 6 x 2 accumulators), the rows left over by 4, 2 and 1. ``vb``: float32
    rows, or the uint16 bits of float16 (``kind`` 0) or bfloat16 (1); only where
    :func:`nbkv.kernels.cpu_simd.tile_ok` holds for (``acc``, ``vb``); none when ``vb``
    has no rows. Mutates ``acc``."""
    rows = acc.shape[0]
    nb = vb.shape[0]
    if nb == 0:  # the intrinsics' loop adds one position before it tests
        return
    r = 0
    while r + OUTER_ROWS <= rows:
        _acc_tile(s, r, vb, nb, acc, c0, kind, OUTER_ROWS)
        r += OUTER_ROWS
    for n in (4, 2, 1):
        if r + n <= rows:
            _acc_tile(s, r, vb, nb, acc, c0, kind, n)
            r += n


@njit(cache=True)
def applies(qs, k_rows, v_rows, acc, block):
    """Whether these passes can take a chunk with query rows ``qs`` and accumulators
    ``acc`` over blocks of ``block`` positions of ``k_rows`` and ``v_rows``: on targets
    narrower than AVX-512 (:data:`TAKEN`), float32 or 16-bit K and V that
    :func:`~nbkv.kernels.cpu_simd.tile_ok` takes (float32 queries, head_dim a multiple of
    16, unit-stride rows), and blocks of whole tiles (the score buffer and ``kt``, each
    ``block`` wide, get whole tiles written)."""
    return (
        TAKEN
        and k_rows.itemsize >= 2  # not 8-bit codes: the transpose widens 16 and 32 bits
        and v_rows.itemsize >= 2
        and tile_ok(qs, k_rows)
        and tile_ok(acc, v_rows)
        and block % _WIDTH == 0
    )
