"""The prefill chunk's score and V passes as matrix products (``nbkv.kernels.cpu_prefill``),
which the CPU attention takes for chunks of more than 32 query rows where vectors are
narrower than AVX-512's: each piece against float64 and against the pass it replaces, and
the whole attention against the reference and against the decode path. The functions
run on any target (their vectors follow it); ``tests/test_cpu_targets.py`` runs the
attention compiled for AVX2 and SSE2 too, where the kernel takes them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import nbkv
from nbkv import reference
from nbkv.kernels import cpu_attention
from nbkv.kernels.cpu_prefill import (
    OUTER_ROWS,
    TAKEN,
    accumulate_outer,
    applies,
    outer_columns,
    scores_outer,
    transpose_rows,
)
from nbkv.kernels.cpu_simd import tile_lanes

from conftest import cpu_only, randn

pytestmark = cpu_only

LANES = tile_lanes()
WIDTH = outer_columns(LANES)
KINDS = {"float32": -1, "float16": 0, "bfloat16": 1}


def _stored(x32, dtype):
    """(what the kernels read: float32, or uint16 bits; its float32 values)."""
    if dtype == "float32":
        return x32, x32
    x = x32.astype(np.float16 if dtype == "float16" else ml_dtypes.bfloat16)
    return x.view(np.uint16), x.astype(np.float32)


def test_a_chunk_takes_the_matrix_products_only_where_they_apply():
    here = cpu_attention._LINE_PASSES  # AVX2 and narrower: test_cpu_targets.py runs them
    assert TAKEN == here
    qs, acc = np.zeros((9, 128), np.float32), np.zeros((9, 128), np.float32)
    k32, k16 = np.zeros((64, 128), np.float32), np.zeros((64, 128), np.uint16)
    apart = np.zeros((64, 3, 128), np.float32)[:, 1]  # rows a head apart ("bshd"): fine
    assert applies(qs, k32, k32, acc, 64) == here
    assert applies(qs, k16, k16, acc, 64) == here
    assert applies(qs, apart, apart, acc, 64) == here
    assert not applies(qs, k32, k32, acc, 60)  # blocks not of whole tiles
    codes = np.zeros((64, 128), np.uint8)  # 8-bit codes: the transpose widens 16 or 32
    assert not applies(qs, codes, k32, acc, 64) and not applies(qs, k32, codes, acc, 64)
    strided = np.zeros((64, 256), np.float32)[:, ::2]  # elements 8 bytes apart
    assert not applies(qs, strided, k32, acc, 64) and not applies(qs, k32, strided, acc, 64)
    q64, k64 = np.zeros((9, 128)), np.zeros((64, 128))
    assert not applies(q64, k64, k64, q64, 64)  # float64: the plain loops
    narrow = np.zeros((64, 40), np.float32)  # head_dim not a multiple of 16
    assert not applies(qs[:, :40], narrow, narrow, acc[:, :40], 64)
    assert WIDTH == 2 * LANES and cpu_attention._BLOCK % WIDTH == 0


@pytest.mark.parametrize("v_step", [1, 2])
def test_a_prefill_chunk_over_v_rows_of_any_strides_matches_the_reference(rng, v_step):
    # attend takes K and V of any strides: V whose elements are not adjacent must leave
    # the matrix products for the plain V pass (it once read them as adjacent)
    seq, dim = 150, 64
    k = randn(rng, (1, 2, seq, dim), "float32")
    v_store = randn(rng, (1, 2, seq, dim * v_step), "float32")
    v = v_store[..., ::v_step]
    q = randn(rng, (1, 8, 12, dim), "float32")
    out = np.full(q.shape, np.nan, np.float32)
    table = np.zeros(0, np.float32)
    cpu_attention.attend(q, k, v, seq, np.float32(dim**-0.5), True, 0, table, out)
    want = reference.attention(q, k.astype(np.float64), v.astype(np.float64), causal=True)
    np.testing.assert_allclose(out, want, rtol=0, atol=3e-5)


@pytest.mark.parametrize("dtype", list(KINDS))
@pytest.mark.parametrize("nb", [1, LANES - 1, LANES, LANES + 1, 3 * LANES + 5, 64])
@pytest.mark.parametrize("dim", [16, 48, 128])
def test_transpose_rows_copies_each_row_into_a_column_widened_and_nothing_else(rng, dtype, nb, dim):
    x = randn(rng, (nb, dim), "float32")
    x[rng.random(x.shape) < 0.05] = np.inf
    x[rng.random(x.shape) < 0.05] = np.nan
    stored, values = _stored(x, dtype)
    pool = np.zeros((nb, 3, dim), stored.dtype)  # rows two heads apart, as "bshd" holds them
    pool[:, 1] = stored
    kt = np.full((dim, 64 + 3), -7.0, np.float32)
    transpose_rows(pool[:, 1], KINDS[dtype], kt)
    # bit for bit, NaN payloads included: a copy, widened exactly
    assert np.array_equal(kt[:, :nb].view(np.uint32), values.T.view(np.uint32))
    assert (kt[:, nb:] == -7.0).all()  # the columns past the rows are left alone


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, OUTER_ROWS, 7, 9, 10, 11, 13, 128])
@pytest.mark.parametrize("nb", [1, WIDTH - 1, WIDTH, WIDTH + 3, 64])
@pytest.mark.parametrize("dim", [16, 48, 80, 128])  # spans of 32: short, 32 + 16, 2 x 32 + 16
def test_scores_outer_matches_float64_and_the_score_tile_it_replaces(rng, rows, nb, dim):
    kb = randn(rng, (nb, dim), "float32")
    qs = (randn(rng, (rows, dim), "float32") / np.sqrt(dim)).astype(np.float32)
    kt = np.full((dim, 64), 0.25, np.float32)  # finite past nb: finite scores there
    transpose_rows(kb, -1, kt)
    c0 = 3
    s = np.full((rows, c0 + 64 + 5), np.nan, np.float32)
    scores_outer(qs, kt, s, c0, nb)
    want = qs.astype(np.float64) @ kb.T.astype(np.float64)
    tiled = np.zeros((rows, nb), np.float32)
    cpu_attention._scores(qs, kb, tiled, 0)
    got = s[:, c0 : c0 + nb]
    # within the bound of any order of float32 sums (head_dim roundings of at most the
    # sum of the products' sizes), which a wrong or missing product would break
    bound = dim * 2.0**-24 * (np.abs(qs).astype(np.float64) @ np.abs(kb).T.astype(np.float64))
    assert (np.abs(got - want) <= bound).all()
    assert (np.abs(got - tiled) <= 2 * bound).all()
    end = c0 + -(-nb // WIDTH) * WIDTH  # whole tiles: finite scores up to their end
    assert np.isfinite(s[:, c0:end]).all()
    assert np.isnan(s[:, :c0]).all() and np.isnan(s[:, end:]).all()  # nothing else


def test_scores_outer_is_as_close_to_float64_as_the_score_tile():
    # one chain over all of head_dim left the scores 4x further off than the tile's (16
    # elements per lane, then the lanes pairwise), and the attention tests' 3e-5 failed:
    # spans of 32, then the spans' sums, keep them about as close (8,192 scores; mean
    # error 1.27x the tile's here, 1.06x with spans of 16)
    rng = np.random.default_rng(7)
    qs = (randn(rng, (128, 128), "float32") / np.sqrt(128)).astype(np.float32)
    kb = randn(rng, (64, 128), "float32")
    kt = np.empty((128, 64), np.float32)
    transpose_rows(kb, -1, kt)
    got, tiled = np.empty((128, 64), np.float32), np.empty((128, 64), np.float32)
    scores_outer(qs, kt, got, 0, 64)
    cpu_attention._scores(qs, kb, tiled, 0)
    want = qs.astype(np.float64) @ kb.T.astype(np.float64)
    assert np.abs(got - want).mean() <= 1.5 * np.abs(tiled - want).mean()
    assert np.abs(got - want).max() <= 2.0 * np.abs(tiled - want).max()


@pytest.mark.parametrize("dtype", list(KINDS))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, OUTER_ROWS, 8, 9, 10, 11, 12, 13, 128])
@pytest.mark.parametrize(("nb", "dim"), [(1, 128), (17, 48), (64, 128), (64, 16), (40, 64)])
def test_accumulate_outer_adds_the_same_products_in_the_same_order_as_the_pass_it_replaces(
    rng, dtype, rows, nb, dim
):
    kind = KINDS[dtype]
    stored, values = _stored(randn(rng, (nb, dim), "float32"), dtype)
    pool = np.zeros((nb, 2, dim), stored.dtype)  # rows a head apart, as a paged "nhd" page
    pool[:, 1] = stored
    vb = pool[:, 1]
    c0 = 2
    s = rng.random((rows, c0 + nb), dtype=np.float32)
    acc0 = randn(rng, (rows, dim), "float32")
    got, base = acc0.copy(), acc0.copy()
    accumulate_outer(s, vb, got, c0, kind)
    cpu_attention._accumulate(s, vb, base, c0, kind, 0)
    full = rows - rows % 4  # the rows the old pass took four at a time, in vector IR
    assert np.array_equal(got[:full].view(np.uint32), base[:full].view(np.uint32))
    want = acc0.astype(np.float64) + s[:, c0:].astype(np.float64) @ values.astype(np.float64)
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())
    assert np.array_equal(pool[:, 1], stored)  # read, never written


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(list(KINDS)),
    group=st.sampled_from([1, 2, 4, 8, 16]),  # 16: past 32 rows from 3 queries
    n_q=st.integers(2, 40),
    head_dim=st.sampled_from([16, 48, 128, 40]),  # 40: no vector IR, the plain loops
    seq_len=st.integers(1, 400),
    window=st.one_of(st.none(), st.integers(1, 300)),
    causal=st.booleans(),
)
@example(0, "float32", 4, 33, 128, 300, None, True)  # chunks of 128 rows (21 tiles of six
# and 2 rows) and of 4 (a last chunk of a decode step's size: the tile, in blocks of 64)
@example(1, "float16", 8, 5, 128, 130, 70, True)  # 40 rows, blocks at the window's edges
@example(2, "bfloat16", 1, 33, 48, 65, None, False)  # 33 rows: 5 x 6 + 2 + 1, a 1-position
# block
def test_a_prefill_chunk_matches_the_reference_and_its_last_query_the_decode_path(
    seed, dtype, group, n_q, head_dim, seq_len, window, causal
):
    rng = np.random.default_rng(seed)
    n_q = min(n_q, seq_len)
    cache = nbkv.LayerKVCache(seq_len, batch=1, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    K = randn(rng, (1, 2, seq_len, head_dim), dtype)
    V = randn(rng, (1, 2, seq_len, head_dim), dtype)
    cache.append(K, V)
    q = randn(rng, (1, 2 * group, n_q, head_dim), "float32")
    got = nbkv.attention(q, cache, causal=causal, window=window)
    want = reference.attention(q, K, V, causal=causal, window=window)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-5)
    # the last query sees what a decode step of it alone sees: at most 32 rows (here
    # 8 at the most) walk the tile path of blocks of up to 512
    alone = nbkv.attention(q[:, :, -1:], cache, causal=causal, window=window)
    np.testing.assert_allclose(got[:, :, -1:], alone, rtol=0, atol=3e-5)
