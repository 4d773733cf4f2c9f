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
``<8 x float>``, 4 x 4 of them reduced in two halves:
:func:`nbkv.kernels.cpu_simd_ir.tile_shape`). Narrower targets have 16 registers, and the
same shapes spilled (compiled for AVX2, the tile took 1.9x the plain loop's time), so the
shapes follow the target (:func:`tile_lanes`): with AVX, groups of 4 x 2 dot products in
``<8 x float>`` and V passes of 16 elements; otherwise (SSE, NEON) 4 x 1 in
``<4 x float>`` and passes of 8. ``tests/test_cpu_targets.py`` runs the kernels compiled for AVX2
and for x86-64's SSE2 baseline. Multiplies and adds carry LLVM's ``contract`` flag, so
they fuse into FMAs where the CPU has them. 16-bit K rows are widened as they are loaded:
float16 by ``fpext`` (``vcvtph2ps``; integer arithmetic where the target has no F16C, see
:func:`nbkv.kernels.cpu_math.half_to_float_ir`), bfloat16 by a 16-bit shift. Asked to, the
tile prefetches the K rows a distance ahead inside its loop over head_dim, a line of each
per line read (16-bit K: two passes of 16 lanes a line, float16's four of 8);
``nbkv.kernels.cpu_attention._scores`` asks it for 16-bit K, whose 32k decode step took
10% less time with fast memory this way than with the rows' lines prefetched before each
tile (float32 K, bound by memory, lost 10% and keeps the latter).

The summation order differs from the scalar loop's (lanes first, then the vectors), so
scores agree with it to float32 rounding, not bit for bit; the attention tests hold both
to the float64 reference. The building blocks (vector loads that widen, row pointers, the
lanes per target) are :mod:`nbkv.kernels.cpu_vector`'s; the IR of the loops is
:mod:`nbkv.kernels.cpu_simd_ir`'s.
"""

from __future__ import annotations

from numba import njit
from numba.core import types
from numba.extending import intrinsic, overload

from .. import _config
from .cpu_math import prefetch
from .cpu_simd_ir import accumulate_codegen, tile_codegen
from .cpu_vector import LANES, stored_type, tile_lanes, typed_2d

# LANES and tile_lanes are cpu_vector's, named here too (where they were first)
__all__ = [
    "LANES",
    "accumulate_lines",
    "accumulate_pieces",
    "accumulate_rows",
    "accumulate_sweep",
    "packed",
    "score_tile",
    "tile_lanes",
    "tile_ok",
]

# positions per piece of accumulate_lines: 4 KiB of float32 rows at head_dim 128, which
# its eight passes of a line together read before the next piece starts. Both pieces are
# compiled into cpu_attention's cached functions: Numba's disk cache does not see them
# change here, so touch cpu_attention.py with them (or delete the __pycache__ caches)
LINE_PIECE = 8
# positions per piece of accumulate_pieces: 8 KiB of 16-bit rows at head_dim 128
SWEEP_PIECE = 32


def _make_tile(fmt):
    """The tile intrinsic for K rows stored as ``fmt`` (see :func:`load_lanes`)."""

    @intrinsic
    def tile(typingctx, qs, r, kb, j, s, col, ahead):
        if not typed_2d((qs, types.float32), (kb, stored_type(fmt)), (s, types.float32)):
            return None
        if not isinstance(ahead, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            tile_codegen(fmt, context, builder, signature, args)
            return context.get_dummy_value()

        return types.none(qs, r, kb, j, s, col, ahead), codegen

    return tile


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


def _make_accumulate(fmt, chunks, sweep=False):
    """The accumulate intrinsic for V rows stored as ``fmt``, ``chunks`` x 16 elements of
    head_dim per pass (4: head_dim a multiple of 64; 1: of 16). Narrower targets
    (:func:`tile_lanes` below 16) take passes of two of their vectors, 16 or 8 elements,
    whichever ``chunks``: 4 x 2 accumulators and what feeds them fit 16 registers."""

    @intrinsic
    def accumulate(typingctx, s, r, vb, nb, acc, c0, ahead):
        if not typed_2d((s, types.float32), (vb, stored_type(fmt)), (acc, types.float32)):
            return None

        def codegen(context, builder, signature, args):
            accumulate_codegen(fmt, chunks, context, builder, signature, args, sweep=sweep)
            return context.get_dummy_value()

        return types.none(s, r, vb, nb, acc, c0, ahead), codegen

    return accumulate


_ACCUMULATE = {
    (fmt, chunks, sweep): _make_accumulate(fmt, chunks, sweep)
    for fmt in ("f32", "f16", "bf16", "u8")
    for chunks in (1, 4)
    for sweep in (False, True)
}


def accumulate_rows(s, r, vb, nb, acc, c0, kind, ahead):
    """``acc[r + i] += sum over j < nb of s[r + i, c0 + j] * vb[j]`` for i in 0..3, as vector
    IR: the 4 x 64 accumulators of a pass over head_dim stay in registers while every
    position of the block is added. ``vb``: float32 rows, uint16 bits of float16
    (``kind`` 0) or bfloat16 (1), or uint8 codes (their integer values); ``ahead`` not 0
    prefetches row ``j + ahead`` (either side of ``vb``) as row ``j`` is added. Only
    where :func:`tile_ok` holds for ``(acc, vb)`` and ``nb`` > 0. Mutates ``acc``. By the
    overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


def accumulate_sweep(s, r, vb, nb, acc, c0, kind, ahead):
    """:func:`accumulate_rows`, the same sums in the same order, but ``ahead`` not 0
    prefetches the ``nb`` rows from row ``ahead`` on in memory order, a share at each
    position of each pass (one pass's width of bytes): the passes over head_dim sweep
    them once in all, so that a caller going through a long run of contiguous rows in
    pieces has the next piece on its way while it computes this one. Only for rows
    stored one after another (``vb``'s row stride its row's bytes). By the overload."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


def _accumulate_impl(sweep):
    """The overload of :func:`accumulate_rows` (``sweep`` False) or
    :func:`accumulate_sweep`: the intrinsic for ``vb``'s format, and passes of 64
    elements where head_dim is a multiple of 64, of 16 otherwise."""

    def impl(s, r, vb, nb, acc, c0, kind, ahead):
        if not _types_ok(acc, vb):
            return lambda s, r, vb, nb, acc, c0, kind, ahead: None  # tile_ok is False
        if vb.dtype in (types.float32, types.uint8):
            fmt = "f32" if vb.dtype == types.float32 else "u8"
            four_, one_ = _ACCUMULATE[fmt, 4, sweep], _ACCUMULATE[fmt, 1, sweep]

            def rows32(s, r, vb, nb, acc, c0, kind, ahead):
                if acc.shape[1] % (4 * LANES) == 0:
                    four_(s, r, vb, nb, acc, c0, ahead)
                else:
                    one_(s, r, vb, nb, acc, c0, ahead)

            return rows32
        f16_4, f16_1 = _ACCUMULATE["f16", 4, sweep], _ACCUMULATE["f16", 1, sweep]
        bf16_4, bf16_1 = _ACCUMULATE["bf16", 4, sweep], _ACCUMULATE["bf16", 1, sweep]

        def rows16(s, r, vb, nb, acc, c0, kind, ahead):
            four = acc.shape[1] % (4 * LANES) == 0
            if kind == 0:
                if four:
                    f16_4(s, r, vb, nb, acc, c0, ahead)
                else:
                    f16_1(s, r, vb, nb, acc, c0, ahead)
            elif four:
                bf16_4(s, r, vb, nb, acc, c0, ahead)
            else:
                bf16_1(s, r, vb, nb, acc, c0, ahead)

        return rows16

    return impl


# inline="always" too: the paged kernels call it for every page and head; runs of 16 rows
# in L2 took 44 ns a position and head with the call, 40 without (Zen 2; cpu_paged_pages)
overload(accumulate_rows, inline="always", jit_options={"cache": True})(_accumulate_impl(False))
overload(accumulate_sweep, inline="always", jit_options={"cache": True})(_accumulate_impl(True))


@njit(cache=True, inline="always", fastmath=_config.FASTMATH)
def accumulate_lines(s, vb, acc, c0, kind, ahead):
    """:func:`accumulate_rows` for every four of ``acc``'s rows (``rows - rows % 4`` of
    them), where the vectors are narrower than AVX-512's: there a pass of the IR holds
    one 64-byte line of float32 (16 elements of head_dim) of four rows' accumulators, and
    a pass over a whole block would read one line of every row, 512 bytes apart at
    head_dim 128, a stride the memory serves at half the speed of rows read in order
    (the Zen 2 guest of 2026-12-06: 7.4 GB/s a thread against 18).

    So the rows go in pieces of :data:`LINE_PIECE` positions (4 KiB of float32 at head_dim
    128), pass after pass of a line over each piece, and each pass prefetches its share
    of the piece's rows ``ahead`` positions on, every line of them (at ``vb``'s row
    stride; a prefetch never faults past its ends): the reads of the rows ahead are asked
    for a few at a time while the arithmetic runs. The same multiply-adds in the same
    order as one call over the whole block, bit for bit (the accumulators go to memory
    between pieces; ``tests/test_cpu_targets.py``). ``vb``: float32 rows (16-bit ones too,
    though their passes are slower this way than a whole block's: the kernels do not send
    them); :func:`tile_ok` must hold for ``(acc, vb)`` (head_dim a multiple of 16: the
    passes cover ``dim // 16`` lines). Unlike :func:`accumulate_rows`, ``ahead`` 0 is no
    exception: it asks for the piece's own rows. Mutates ``acc``.

    On the Zen 3 guest of 2026-12-07 the 32k float32 decode step's share of a plain read
    of K and V rose this way in eight paired runs of nine (0.71-0.80 to 0.79-0.89), against
    each piece of 64 rows first read in memory order and then passed over from L1 (its
    reads and arithmetic took turns); pieces of 8 with rows 8-16 ahead did better than
    pieces of 4 or 16 and rows 24-32 ahead (benchmarks/README.md, "The Zen 3 guest again:
    the V pass's reads and arithmetic overlap")."""
    rows, dim = acc.shape
    nb = vb.shape[0]
    passes = dim // LANES  # passes of a line of float32 (tile_ok: dim a multiple of 16)
    step = max(1, 64 // vb.itemsize)  # elements per 64-byte line of vb
    for c in range(0, nb, LINE_PIECE):
        n = min(LINE_PIECE, nb - c)
        piece = vb[c : c + n]
        for p in range(passes):
            first = c + ahead + p * LINE_PIECE // passes  # this pass's rows ahead
            for t in range(first, c + ahead + (p + 1) * LINE_PIECE // passes):
                for d in range(0, dim, step):
                    prefetch(vb, t, d)
            d = p * LANES
            for r in range(0, rows - 3, 4):
                accumulate_rows(s, r, piece[:, d : d + LANES], n, acc[:, d : d + LANES],
                                c0 + c, kind, 0)  # fmt: skip


@njit(cache=True)
def packed(x):
    """Whether the rows of ``x`` ([rows, n]) lie one after another, with no gap (the
    rows :func:`accumulate_sweep` sweeps in)."""
    return x.strides[1] == x.itemsize and x.strides[0] == x.shape[1] * x.itemsize


@njit(cache=True, fastmath=_config.FASTMATH)
def accumulate_pieces(s, vb, acc, c0, kind):
    """:func:`accumulate_sweep` for every four of ``acc``'s rows (``rows - rows % 4`` of
    them) over ``vb`` in pieces of :data:`SWEEP_PIECE` positions, each piece's first four
    rows sweeping the next piece into the caches as they go: 16-bit rows stored one after
    another (:func:`packed`), where the vectors are narrower than AVX-512's; as for
    :func:`accumulate_rows`, :func:`tile_ok` must hold for ``(acc, vb)``. The same sums
    in the same order as one :func:`accumulate_rows` over the whole block, bit for bit
    (``tests/test_cpu_simd.py``, ``tests/test_cpu_targets.py``). Mutates ``acc``.

    On the Zen 3 guest of 2026-12-07 a float16 V pass alone over 8 heads x 32k took 3.4-4.8
    ms this way (pieces of 16 to 64, the next one or two swept) against 5.1-6.1 in pieces
    of 64 whose passes each prefetched their own line of the row 64 on, the way it went
    before (the read of the same bytes: 2.7-3.0 ms). For float32 rows
    :func:`accumulate_lines` did better (6.7 ms against 7.2-7.9)."""
    rows = acc.shape[0]
    nb = vb.shape[0]
    for c in range(0, nb, SWEEP_PIECE):
        piece = vb[c : min(c + SWEEP_PIECE, nb)]
        n = piece.shape[0]
        for r in range(0, rows - 3, 4):
            accumulate_sweep(s, r, piece, n, acc, c0 + c, kind, n if r == 0 else 0)
