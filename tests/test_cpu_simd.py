"""The CPU attention's vector-IR paths (nbkv.kernels.cpu_simd, cpu_vector): the 4 x 4 score
tile, the four-row V accumulation and the row maximum, against float64 NumPy and against
the plain loops they replace, on random shapes that reach the edges (head_dim 16 to 256,
one pass or four vectors a pass, blocks of 1 to 70 positions, 16-bit rows; rows of 0 to
200 scores with NaN and infinities), and checked to write every element they own and
nothing else.
Last, the online softmax step built on the row maximum against its float64 arithmetic."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from numba import njit
from numba.core import config

from nbkv.dtypes import kernel_dtype, resolve_dtype, widen_table
from nbkv.kernels import cpu_attention
from nbkv.kernels.cpu_math import kind16
from nbkv.kernels.cpu_paged_pages import accumulate_page, score_page
from nbkv.kernels.cpu_simd import (
    LANES,
    accumulate_lines,
    accumulate_pieces,
    accumulate_rows,
    accumulate_sweep,
    packed,
    score_tile,
    tile_lanes,
    tile_ok,
)
from nbkv.kernels.cpu_vector import row_max

from conftest import cpu_only

pytestmark = cpu_only

FORMATS = ("float32", "float16", "bfloat16", "uint8")
# 48 and 80: a tile over 16-bit K reads whole lines (32 elements), then a pass of 16; 80
# over 8-bit codes (lines of 64) the same
DIMS = (16, 32, 48, 64, 80, 128, 192, 256)


def _stored(x, name):
    """``x`` (float32) as a kernel stores it, its exact float64 value, and its kind."""
    if name == "float32":
        return x, x.astype(np.float64), -1
    if name == "uint8":  # 8-bit codes, read as their integer values
        codes = np.clip(np.round(x * 40 + 128), 0, 255).astype(np.uint8)
        return codes, codes.astype(np.float64), -1
    dtype = resolve_dtype(name)
    narrow = x.astype(dtype)
    return narrow.view(kernel_dtype(dtype)), narrow.astype(np.float64), kind16(widen_table(dtype))


@njit
def _tile(qs, r, kb, j, s, col, kind, ahead=0):
    score_tile(qs, r, kb, j, s, col, kind, ahead)


@njit
def _rows(s, r, vb, nb, acc, c0, kind, ahead):
    accumulate_rows(s, r, vb, nb, acc, c0, kind, ahead)


@njit
def _sweep(s, r, vb, nb, acc, c0, kind, ahead):
    accumulate_sweep(s, r, vb, nb, acc, c0, kind, ahead)


@njit
def _fours(s, vb, acc, c0, kind):
    """accumulate_rows over the whole of ``vb`` for every four rows of ``acc``."""
    for r in range(0, acc.shape[0] - 3, 4):
        accumulate_rows(s, r, vb, vb.shape[0], acc, c0, kind, 0)


@njit
def _ok(qs, kb):
    return tile_ok(qs, kb)


@njit
def _max(s, r, nb):
    return row_max(s, r, nb)


def _scalar_max(row):
    """The plain loop's maximum: ``best = x if x > best else best`` from ``-inf``."""
    best = -np.inf
    for x in row:
        best = x if x > best else best
    return best


def _scores_with_edges(rng, rows, width):
    """float32 scores with NaN, infinities and signed zeros sprinkled in, some rows all
    -inf or all NaN (a masked or poisoned block)."""
    s = (rng.standard_normal((rows, width)) * 4).astype(np.float32)
    for value in (np.nan, np.inf, -np.inf, 0.0, -0.0):
        hit = rng.random((rows, width)) < rng.choice([0.0, 0.01, 0.2])
        s[hit] = value
    s[0] = -np.inf
    s[1] = np.nan
    return s


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("seed", range(3))
def test_score_tile_matches_float64_and_writes_its_16_scores_only(name, seed):
    rng = np.random.default_rng(seed)
    for dim in DIMS:
        qs = rng.standard_normal((9, dim)).astype(np.float32)
        kb, kb64, kind = _stored(rng.standard_normal((11, dim)).astype(np.float32), name)
        r, j, col = int(rng.integers(0, 6)), int(rng.integers(0, 8)), int(rng.integers(0, 5))
        want = qs[r : r + 4].astype(np.float64) @ kb64[j : j + 4].T
        scale = np.abs(qs[r : r + 4]).astype(np.float64) @ np.abs(kb64[j : j + 4]).T
        results = []
        # the loop that prefetches ``ahead`` rows (either side) reads a line of each K row
        # a body (on AVX-512: one pass of 16 lanes of float32, two of bfloat16, four of 8
        # lanes of float16, four of 16 of uint8), then head_dim's rest a pass at a time,
        # and must not change a bit
        for ahead in (0, 1, 64, -64):
            s = np.full((9, 12), np.nan, np.float32)  # NaN where nothing may be written
            _tile(qs, r, kb, j, s, col, kind, ahead)
            got = s[r : r + 4, col : col + 4]
            assert np.all(np.abs(got - want) <= 4e-7 * scale + 1e-30), (dim, name, ahead)
            untouched = np.ones(s.shape, bool)
            untouched[r : r + 4, col : col + 4] = False
            assert np.all(np.isnan(s[untouched])), "the tile wrote outside its 16 scores"
            results.append(s)
        for other in results[1:]:
            np.testing.assert_array_equal(other, results[0])


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("seed", range(3))
def test_accumulate_rows_matches_float64_and_leaves_other_rows(name, seed):
    rng = np.random.default_rng(seed)
    for dim in DIMS:
        nb = int(rng.integers(1, 71))
        c0 = int(rng.integers(0, 4))
        r = int(rng.integers(0, 5))
        w = rng.random((10, c0 + nb + 2)).astype(np.float32)
        vb, vb64, kind = _stored(rng.standard_normal((nb + 3, dim)).astype(np.float32), name)
        acc0 = rng.standard_normal((10, dim)).astype(np.float32)
        want = acc0.astype(np.float64)
        want[r : r + 4] += w[r : r + 4, c0 : c0 + nb].astype(np.float64) @ vb64[:nb]
        scale = np.abs(acc0[r : r + 4]).astype(np.float64) + (
            w[r : r + 4, c0 : c0 + nb].astype(np.float64) @ np.abs(vb64[:nb])
        )
        results = []
        # prefetching (either side, row by row or swept) must not change a bit
        for ahead, fn in itertools.product((0, 1, 64, -64), (_rows, _sweep)):
            acc = acc0.copy()
            fn(w, r, vb, nb, acc, c0, kind, ahead)
            results.append(acc)
            assert np.all(np.abs(acc[r : r + 4] - want[r : r + 4]) <= 1e-6 * scale), (dim, nb)
            others = np.ones(10, bool)
            others[r : r + 4] = False
            np.testing.assert_array_equal(acc[others], acc0[others])
        for other in results[1:]:
            np.testing.assert_array_equal(other, results[0])


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("seed", range(4))
def test_v_passes_in_short_pieces_are_the_whole_pass_bit_for_bit(name, seed):
    # accumulate_lines (pieces of 8 positions, a pass of a line at a time over column
    # slices) and accumulate_pieces (pieces of 32, each sweeping the next in) against one
    # accumulate_rows over the whole block for every four rows: the same multiply-adds in
    # the same order, so the same bits, on every row of every four, and the rows left
    # over (rows % 4) untouched. Every head_dim the tiles take (one pass to sixteen; 48
    # and 80 not a multiple of 64), blocks shorter and longer than a piece, offset columns
    rng = np.random.default_rng(500 + seed)
    for dim in DIMS:
        nb = int(rng.choice([1, 7, 8, 9, 31, 32, 33, int(rng.integers(1, 200))]))
        rows = int(rng.integers(4, 11))
        c0 = int(rng.integers(0, 5))
        ahead = int(rng.choice([0, 8, 16, 40, -24]))
        w = rng.random((rows, c0 + nb + 3)).astype(np.float32)
        vb, vb64, kind = _stored(rng.standard_normal((nb, dim)).astype(np.float32), name)
        acc0 = rng.standard_normal((rows, dim)).astype(np.float32)
        want = acc0.copy()
        _fours(w, vb, want, c0, kind)
        full = rows - rows % 4
        exact = acc0[:full].astype(np.float64) + w[:full, c0 : c0 + nb].astype(np.float64) @ vb64
        assert np.abs(want[:full] - exact).max() <= 1e-5 * max(1.0, np.abs(exact).max())
        lines, pieces = acc0.copy(), acc0.copy()
        accumulate_lines(w, vb, lines, c0, kind, ahead)
        assert packed(vb)
        accumulate_pieces(w, vb, pieces, c0, kind)
        for got in (lines, pieces):
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
            np.testing.assert_array_equal(got[full:], acc0[full:])


def test_packed_names_rows_that_lie_one_after_another():
    x = np.zeros((6, 32), np.float32)
    assert packed(x) and packed(x[1:4]) and packed(np.zeros((3, 16), np.uint16))
    assert not packed(x[::2]) and not packed(x[:, :16]) and not packed(x[:, ::2])


def test_tile_ok_names_where_the_vector_paths_apply():
    f32 = np.zeros((4, 64), np.float32)
    assert _ok(f32, np.zeros((8, 64), np.float32))
    assert _ok(f32, np.zeros((8, 64), np.uint16))
    assert _ok(np.zeros((4, LANES), np.float32), np.zeros((8, LANES), np.float32))
    assert not _ok(np.zeros((4, 40), np.float32), np.zeros((8, 40), np.float32))  # 40 % 16
    assert not _ok(np.zeros((4, 8), np.float32), np.zeros((8, 8), np.float32))
    assert not _ok(np.zeros((4, 64), np.float64), np.zeros((8, 64), np.float64))
    assert not _ok(f32, np.zeros((8, 128), np.float32)[:, ::2])  # not unit-stride
    assert not _ok(np.zeros((4, 128), np.float32)[:, ::2], np.zeros((8, 64), np.float32))
    assert not _ok(f32, np.zeros((8, 32), np.float32))  # head_dims differ


def test_tile_lanes_follow_the_features_numba_compiles_for(monkeypatch):
    for features, lanes in (
        ("+avx2,+fma,+avx512f", 16),
        ("+avx,+avx2,+fma,-avx512f", 8),
        ("+sse4.2", 4),
        ("", 4),  # NUMBA_CPU_NAME=generic
    ):
        monkeypatch.setattr(config, "CPU_FEATURES", features)
        assert tile_lanes() == lanes, features


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("seed", range(4))
def test_block_functions_agree_with_the_plain_loops_they_replace(name, seed):
    # _scores and _accumulate take the vector paths on unit-stride rows and the plain
    # loops on strided ones (the same values): for every row count (the 4-row passes
    # and the rows left over) and block length, the two agree to float32 rounding
    rng = np.random.default_rng(100 + seed)
    for _ in range(6):
        rows = int(rng.integers(1, 14))
        nb = int(rng.integers(1, 70))
        dim = int(rng.choice([16, 64, 128, 192]))
        qs = rng.standard_normal((rows, dim)).astype(np.float32)
        block, values, kind = _stored(rng.standard_normal((nb, dim)).astype(np.float32), name)
        mag = max(1.0, float(np.abs(values).max()))  # codes run to 255: errors scale so
        strided = np.zeros((nb, 2 * dim), block.dtype)
        strided[:, ::2] = block
        strided = strided[:, ::2]
        assert _ok(qs, block) and not _ok(qs, strided)
        fast, plain = np.zeros((rows, nb), np.float32), np.zeros((rows, nb), np.float32)
        cpu_attention._scores(qs, block, fast, 0, kind)
        cpu_attention._scores(qs, strided, plain, 0, kind)
        np.testing.assert_allclose(fast, plain, rtol=2e-5, atol=2e-5 * mag * np.sqrt(dim))
        w = rng.random((rows, nb)).astype(np.float32)
        acc0 = rng.standard_normal((rows, dim)).astype(np.float32)
        fast_acc, plain_acc = acc0.copy(), acc0.copy()
        cpu_attention._accumulate(w, block, fast_acc, 0, kind, 64)
        cpu_attention._accumulate(w, strided, plain_acc, 0, kind, 64)
        np.testing.assert_allclose(fast_acc, plain_acc, rtol=2e-5, atol=2e-5 * mag * np.sqrt(nb))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("nb", [1, 8, 63, 64, 65, 127, 200, 512])
def test_a_blocks_v_pass_in_pieces_is_the_whole_pass_bit_for_bit(name, nb):
    # _accumulate_block takes 16-bit V in pieces (of 32 positions by accumulate_pieces for
    # unit-stride rows where vectors are narrower than AVX-512's, otherwise of _BLOCK; the
    # accumulators stored and loaded between pieces) and other rows in one call: the same
    # multiply-adds in the same order as one _accumulate over the block, so the same bits,
    # on the vector path (unit-stride rows) and on the plain loops (strided rows),
    # prefetching or not.
    # Five rows: the four-row passes and a row left over; scores wider than the block
    rng = np.random.default_rng(300 + nb)
    dim = 128
    block, _, kind = _stored(rng.standard_normal((nb, dim)).astype(np.float32), name)
    strided = np.zeros((nb, 2 * dim), block.dtype)
    strided[:, ::2] = block
    w = rng.random((5, nb + 3)).astype(np.float32)
    acc0 = rng.standard_normal((5, dim)).astype(np.float32)
    for rows in (block, strided[:, ::2]):
        for ahead in (0, 64):
            whole, pieces = acc0.copy(), acc0.copy()
            cpu_attention._accumulate(w, rows, whole, 0, kind, ahead)
            cpu_attention._accumulate_block(w, rows, pieces, kind, ahead)
            np.testing.assert_array_equal(pieces, whole)
    assert not np.array_equal(whole, acc0)  # every row of acc was added to


@pytest.mark.parametrize("seed", range(4))
def test_row_max_is_the_plain_loops_maximum_at_every_length(seed):
    # the vector path takes multiples of 4 x tile_lanes() scores and the loop the rest:
    # every length from 0 to 200 crosses both, with NaN (never taken) and infinities; a
    # zero maximum may differ in sign only (the loop keeps the first of +0.0 and -0.0)
    rng = np.random.default_rng(200 + seed)
    s = _scores_with_edges(rng, 8, 203)
    s[2, 100] = np.float32(1e30)  # one lane's maximum, past the first vectors
    for nb in range(-2, 201):
        for r in range(8):
            want = _scalar_max(s[r, :nb]) if nb > 0 else -np.inf
            assert _max(s, r, nb) == want, (nb, r, _max(s, r, nb), want)
    # the loop alone (strided columns, float64) gives the same; rows of another stride
    # (every other row, a view from column 3) take the vectors
    strided = np.zeros((8, 406), np.float32)
    strided[:, ::2] = s
    wide = np.zeros((16, 206), np.float32)
    wide[::2, 3:] = s
    for nb in (0, 1, 63, 64, 65, 200):
        for r in range(8):
            want = _scalar_max(s[r, :nb])
            assert _max(strided[:, ::2], r, nb) == want
            assert _max(s.astype(np.float64), r, nb) == want
            assert _max(wide[::2, 3:], r, nb) == want


def test_row_max_takes_the_vector_path_where_it_applies():
    # a row_max that always fell back to the loop would pass the test above. The one
    # result that tells the two apart is a zero maximum's sign: +0.0 in lane 1 of the
    # first vector and -0.0 in lane 0 of the second, every other score -1. The loop keeps
    # the first it meets (+0.0); the vectors fold lane by lane, then lane 1 into lane 0,
    # where +0.0 > -0.0 is false (-0.0). Pinned to that fold order on purpose. (The
    # compiled IR is no witness: loaded from Numba's cache, the overload is not in it.)
    lanes = tile_lanes()
    row = np.full((1, 8 * lanes), -1.0, np.float32)
    row[0, 1], row[0, lanes] = 0.0, -0.0
    strided = np.zeros((1, 16 * lanes), np.float32)
    strided[:, ::2] = row
    n = row.shape[1]
    assert _max(row, 0, n) == 0.0 and np.signbit(_max(row, 0, n))  # the vectors
    assert not np.signbit(_max(strided[:, ::2], 0, n))  # the loop
    assert not np.signbit(_max(row.astype(np.float64), 0, n))  # the loop


def _softmax_step_f64(s, nb, m, denom, acc):
    """The online softmax step in float64, as nbkv.kernels.cpu_attention._online_softmax
    documents it: a block that raises a row's maximum rescales ``acc`` and ``denom`` by
    ``exp(m - m_new)``; one that does not (a NaN maximum included) leaves them."""
    for r in range(s.shape[0]):
        x = s[r, :nb]
        block_max = _scalar_max(x)
        if block_max == -np.inf:
            poisoned = np.isnan(x).any()
            s[r, :nb] = 0.0
            if poisoned:
                m[r] = denom[r] = np.nan
            continue
        if block_max > m[r]:
            correction = np.exp(m[r] - block_max)
            acc[r] *= correction
            denom[r] *= correction
            m[r] = block_max
        with np.errstate(invalid="ignore"):  # inf - inf: a NaN weight, as in the kernel
            w = np.exp(x - m[r])
        s[r, :nb] = w
        denom[r] += w.sum()


@pytest.mark.parametrize("seed", range(4))
def test_online_softmax_step_matches_its_float64_arithmetic(seed):
    # a running state that the block raises (rescaled; from -inf: acc zeroed), leaves
    # (the rescaling skipped), or meets with nothing finite (masked) or with NaN
    # (poisoned); running maxima of NaN and +inf; +inf scores; over block lengths the
    # vector maximum and its tail both see
    rng = np.random.default_rng(300 + seed)
    for _ in range(12):
        rows, nb, dim = int(rng.integers(6, 12)), int(rng.integers(1, 140)), 32
        s = _scores_with_edges(rng, rows, nb + 3)  # rows 0, 1: all -inf, all NaN
        m = (rng.standard_normal(rows) * 6).astype(np.float32)
        m[2] = -np.inf  # a fresh row that the block raises: acc * exp(-inf) = 0
        s[2, :nb] = np.where(np.isinf(s[2, :nb]), 1.0, s[2, :nb])
        m[3] = np.nan  # a poisoned running state
        m[4] = np.inf  # a running maximum of +inf (after a +inf score)
        m[5] = 100.0  # above every score of the block: the rescaling skipped
        s[5, :nb] = np.where(s[5, :nb] == np.inf, 1.0, s[5, :nb])
        denom = rng.random(rows).astype(np.float32) * 5
        acc = rng.standard_normal((rows, dim)).astype(np.float32)
        want = [a.astype(np.float64) for a in (s, m, denom, acc)]
        _softmax_step_f64(want[0], nb, *want[1:])
        got = [a.copy() for a in (s, m, denom, acc)]
        cpu_attention._online_softmax(got[0], nb, *got[1:])
        for name, g, w in zip(("weights", "m", "denom", "acc"), got, want, strict=True):
            if name == "weights":
                g, w = g[:, :nb], w[:, :nb]
            np.testing.assert_allclose(g, w, rtol=3e-6, atol=1e-30, equal_nan=True, err_msg=name)
        np.testing.assert_array_equal(got[0][:, nb:], s[:, nb:])  # past the block: untouched
        assert np.all(got[3][2] == 0.0)  # the fresh row's old acc is gone
        np.testing.assert_array_equal(got[3][5], acc[5])  # not raised: acc as it was


@pytest.mark.parametrize("name", ("float32", "float16", "bfloat16"))
@pytest.mark.parametrize("seed", range(4))
def test_the_paged_runs_are_the_block_functions_bit_for_bit(name, seed):
    # cpu_paged_pages.run_scores and run_accumulate (inlined into the paged task, no call
    # per page) against _scores and _accumulate, the calls they replace: the same tiles
    # in the same order, so the same bits in every score and accumulator, and nothing else
    # written; rows and positions not multiples of four, empty runs, runs past a piece
    # of the V pass (64), offset columns, prefetches either side, rows a head apart (an
    # "nhd" page) and strided ones
    from nbkv.kernels.cpu_paged_pages import run_accumulate, run_scores

    rng = np.random.default_rng(500 + seed)
    for _ in range(8):
        rows, c0 = int(rng.integers(1, 14)), int(rng.integers(0, 6))
        nb = int(rng.choice([0, 1, 3, 4, 7, 16, 17, 63, 64, 65, 130]))  # _BLOCK: 64
        dim, heads = int(rng.choice([16, 48, 64, 128])), int(rng.integers(1, 4))
        ahead = int(rng.choice([0, 5, 32, -16]))
        pool, _, kind = _stored(rng.standard_normal((nb, heads, dim)).astype(np.float32), name)
        for kb in (pool[:, heads - 1], pool[:, heads - 1, ::2] if dim >= 32 else pool[:, 0]):
            qs = rng.standard_normal((rows, kb.shape[1])).astype(np.float32)
            got = np.full((rows, c0 + nb + 2), np.nan, np.float32)
            want = got.copy()
            run_scores(qs, kb, got, c0, kind, ahead, _ok(qs, kb))
            cpu_attention._scores(qs, kb, want, c0, kind, ahead)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
            assert np.isnan(got[:, :c0]).all() and np.isnan(got[:, c0 + nb :]).all()
            s = rng.random((rows, c0 + nb)).astype(np.float32)
            acc0 = rng.standard_normal((rows, kb.shape[1])).astype(np.float32)
            got_acc, want_acc = acc0.copy(), acc0.copy()
            run_accumulate(s, kb, got_acc, c0, kind, ahead, _ok(acc0, kb))
            cpu_attention._accumulate(s, kb, want_acc, c0, kind, ahead)
            np.testing.assert_array_equal(got_acc.view(np.uint32), want_acc.view(np.uint32))
            assert nb == 0 or not np.array_equal(got_acc, acc0)


@njit
def _page_passes(qs, k_pool, v_pool, page, off, n, kind, table, s, acc, c0, ahead):
    buf = np.empty((0, 1, 1), np.float32)  # the tiles apply: no widening copy
    score_page(qs, k_pool, page, off, n, kind, table, buf, s, c0, ahead)
    accumulate_page(s, v_pool, page, off, n, kind, table, buf, acc, c0, ahead)


@njit
def _page_passes_per_head(qs, k_pool, v_pool, page, off, n, kind, s, acc, c0, ahead):
    # what the page passes did before cpu_paged_pages: a call of each per page and head
    heads = qs.shape[0]
    for h in range(heads):
        if k_pool.ndim == 3:  # "hnd", flattened to (block, head) pages
            kb = k_pool[page * heads + h, off : off + n]
        else:
            kb = k_pool[page, off : off + n, h]
        cpu_attention._scores(qs[h], kb, s[h], c0, kind, ahead)
    for h in range(heads):
        if k_pool.ndim == 3:
            vb = v_pool[page * heads + h, off : off + n]
        else:
            vb = v_pool[page, off : off + n, h]
        cpu_attention._accumulate(s[h], vb, acc[h], c0, kind, ahead)


@pytest.mark.parametrize("name", ("float32", "bfloat16"))
@pytest.mark.parametrize("layout", ("hnd", "nhd"))
def test_the_page_passes_are_the_per_head_calls_bit_for_bit(name, layout):
    # score_page / accumulate_page ask tile_ok once a page (head 0's rows) and run every
    # head through the inlined runs: the same bits as a call of _scores / _accumulate per
    # head, for group 4 and 5 (a row left over), runs of 16 and 7 positions, mid-page
    rng = np.random.default_rng(700)
    heads, bs, dim, blocks = 3, 16, 64, 4
    for rows, off, n, c0, ahead in ((4, 0, 16, 0, 32), (5, 9, 7, 3, 0), (8, 2, 14, 16, -5)):
        shape = (blocks * heads, bs, dim) if layout == "hnd" else (blocks, bs, heads, dim)
        k_pool, _, kind = _stored(rng.standard_normal(shape).astype(np.float32), name)
        v_pool, _, _ = _stored(rng.standard_normal(shape).astype(np.float32), name)
        qs = rng.standard_normal((heads, rows, dim)).astype(np.float32)
        s0 = np.full((heads, rows, c0 + n + 2), np.nan, np.float32)
        acc0 = rng.standard_normal((heads, rows, dim)).astype(np.float32)
        got_s, got_acc, want_s, want_acc = s0.copy(), acc0.copy(), s0.copy(), acc0.copy()
        table = None if name == "float32" else widen_table(resolve_dtype(name))
        _page_passes(qs, k_pool, v_pool, 2, off, n, kind, table, got_s, got_acc, c0, ahead)
        _page_passes_per_head(qs, k_pool, v_pool, 2, off, n, kind, want_s, want_acc, c0, ahead)
        np.testing.assert_array_equal(got_s.view(np.uint32), want_s.view(np.uint32))
        np.testing.assert_array_equal(got_acc.view(np.uint32), want_acc.view(np.uint32))
        assert not np.isnan(got_s[:, :, c0 : c0 + n]).any() and not np.array_equal(got_acc, acc0)
