"""nbkv.attention and nbkv.append_and_attend against nbkv.reference, on this run's backend."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import nbkv
from nbkv import _config, reference
from nbkv.backends import get_backend
from nbkv.kernels import cpu_attention

from conftest import (
    DEVICE,
    LAYOUTS,
    assert_bits_equal,
    cpu_only,
    dtype_of,
    host,
    randn,
    shape_of,
)
from test_errors import assert_same, snapshot

# tolerance on |nbkv - float64 reference| for float32 queries and output: 16-bit storage
# is widened exactly and accumulated in float32, like float32 storage
TOL = 3e-5


def grid():
    """(layout, dtype, group, head_dim, seq_len, capacity, n_q, window) cases."""
    dtypes = ["float32", "float64", "float16", "bfloat16"]
    cases = itertools.product(
        LAYOUTS, dtypes, [1, 4, 8], [3, 16], [(1, 1), (7, 12), (12, 12)], [1, 3], [None, 2]
    )
    out = []
    for layout, dtype, group, head_dim, (seq_len, cap), n_q, window in cases:
        if n_q > seq_len:
            continue
        out.append((layout, dtype, group, head_dim, seq_len, cap, n_q, window))
    if DEVICE == "cuda":  # the simulator runs each thread in Python: a spread, not all
        out = out[::17]
    return out


def make_cache(rng, layout, dtype, kv_heads, head_dim, seq_len, cap, batch=2):
    cache = nbkv.LayerKVCache(
        cap,
        batch=batch,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=DEVICE,
        layout=layout,
    )
    K = randn(rng, shape_of(layout, batch, kv_heads, seq_len, head_dim), dtype)
    V = randn(rng, shape_of(layout, batch, kv_heads, seq_len, head_dim), dtype)
    cache.append(K, V)
    return cache, K, V


@pytest.mark.parametrize("layout,dtype,group,head_dim,seq_len,cap,n_q,window", grid())
def test_attention_matches_the_reference(
    rng, layout, dtype, group, head_dim, seq_len, cap, n_q, window
):
    kv_heads = 2
    cache, K, V = make_cache(rng, layout, dtype, kv_heads, head_dim, seq_len, cap)
    q = randn(rng, (2, kv_heads * group, n_q, head_dim), "float32")
    got = host(nbkv.attention(q, cache, window=window))
    want = reference.attention(q, K, V, window=window, layout=layout)
    assert got.dtype == np.float32 and got.shape == q.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


@cpu_only
@pytest.mark.parametrize("parallel_min", [0, 1 << 62])  # always / never on the thread pool
@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_and_serial_cpu_kernels_match_the_reference(
    rng, monkeypatch, parallel_min, layout
):
    monkeypatch.setattr(_config, "ATTENTION_PARALLEL_MIN", parallel_min)
    cache, K, V = make_cache(rng, layout, "bfloat16", 4, 16, 70, 80, batch=3)
    q = randn(rng, (3, 16, 3, 16), "float32")
    for window in (None, 20):
        got = nbkv.attention(q, cache, window=window)
        want = reference.attention(q, K, V, window=window, layout=layout)
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


@cpu_only
def test_a_few_rows_take_long_blocks():
    block = cpu_attention._block_size.py_func
    assert block(8, 128 * 4) == 512  # a decode step at group 8, float32, head_dim 128
    assert block(32, 128 * 4) == 512  # at group 32, or 8 queries at group 4
    assert block(4, 128 * 2) == 512  # float16 or bfloat16 (their V pass goes in pieces)
    assert block(4, 128 * 8) == 256  # float64: 256 KiB of rows at the most
    assert block(4, 256 * 4) == 256  # float32 at head_dim 256
    assert block(4, 24 * 4) == 512  # small rows: 512 at the most
    assert block(4, 4096 * 4) == 64  # rows too large for two blocks of 64: 64
    assert cpu_attention._FEW_ROWS == 32
    assert block(33, 128 * 4) == 64  # more rows (a prefill chunk)


@cpu_only
@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(["float32", "float64", "float16", "bfloat16"]),
    group=st.sampled_from([1, 2, 4, 8, 12, 16, 32]),
    n_q=st.integers(1, 32),
    head_dim=st.sampled_from([16, 24, 128]),  # vector IR (1 and 4 passes), plain loops
    seq_len=st.integers(1, 1600),  # up to three blocks of 512 and part of a fourth
    window=st.one_of(st.none(), st.integers(1, 1200)),
    causal=st.booleans(),
)
@example(0, "float32", 2, 4, 128, 1025, 600, True)  # masks at a block's edge, both ends
@example(1, "float32", 1, 8, 16, 1100, 513, False)  # non-causal window past a boundary
@example(2, "float64", 4, 2, 128, 700, None, True)  # float64 rows: blocks of 256
@example(3, "float16", 4, 1, 128, 1100, None, True)  # 16-bit: V in pieces, a short last one
@example(4, "bfloat16", 2, 3, 128, 1537, 700, True)  # 16-bit with a window
@example(5, "float16", 8, 1, 128, 2000, 1300, False)  # non-causal window, V pieces in both
@example(6, "bfloat16", 16, 2, 128, 1100, None, True)  # 32 rows, the most in long blocks
@example(8, "float32", 16, 1, 128, 1100, None, True)  # a decode step at group 16
@example(7, "float32", 12, 1, 128, 600, 300, True)  # 12 rows: 3 tiles of four
def test_long_blocks_match_the_reference_and_the_64_position_blocks(
    seed, dtype, group, n_q, head_dim, seq_len, window, causal
):
    """A chunk of at most 32 query rows per KV head (a decode step at a group up to 32,
    or a few queries) walks blocks of up to 512 positions (cpu_attention._block_size;
    over 16-bit K/V, the V pass of a block in pieces of 32 or 64), every other chunk
    blocks of 64 (where cpu_prefill applies, as matrix products). The short chunk against the
    float64 reference, and against the same queries as the last of a chunk of more than
    32 rows (earlier queries before them): each query's output depends on its position
    alone."""
    few = cpu_attention._FEW_ROWS
    n_q = min(1 + (n_q - 1) % (few // group), seq_len)  # a decode step often at any group
    rng = np.random.default_rng(seed)
    tol = 1e-12 if dtype == "float64" else TOL
    cache, K, V = make_cache(rng, "bhsd", dtype, 2, head_dim, seq_len, seq_len, batch=1)
    q_dtype = "float64" if dtype == "float64" else "float32"
    q = randn(rng, (1, 2 * group, n_q, head_dim), q_dtype)
    got = nbkv.attention(q, cache, causal=causal, window=window)
    want = reference.attention(q, K, V, causal=causal, window=window)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    extra = few // group + 1 - n_q  # queries before them: more than `few` rows in all
    if extra + n_q <= seq_len:
        earlier = randn(rng, (1, 2 * group, extra, head_dim), q_dtype)
        longer = np.concatenate([earlier, q], axis=2)
        plain = nbkv.attention(longer, cache, causal=causal, window=window)
        np.testing.assert_allclose(got, plain[:, :, extra:], rtol=0, atol=tol)


@cpu_only
def test_float64_queries_over_a_float64_cache_stay_float64(rng):
    cache, K, V = make_cache(rng, "bshd", "float64", 2, 8, 9, 12)
    q = randn(rng, (2, 4, 3, 8), "float64")
    got = nbkv.attention(q, cache)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, reference.attention(q, K, V, layout="bshd"), atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_chunk_is_causal_and_non_causal_sees_everything(rng, causal):
    cache, K, V = make_cache(rng, "bhsd", "float32", 2, 8, 9, 16)
    q = randn(rng, (2, 4, 5, 8), "float32")
    got = host(nbkv.attention(q, cache, causal=causal))
    want = reference.attention(q, K, V, causal=causal)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


def test_attention_reads_only_the_positions_held(rng):
    cache = nbkv.LayerKVCache(
        12, batch=1, num_kv_heads=1, head_dim=4, dtype="float32", device=DEVICE
    )
    nan = np.full((1, 1, 12, 4), np.nan, np.float32)
    cache.append(nan, nan)  # unused capacity full of NaN, then forgotten
    cache.clear()
    k, v = randn(rng, (1, 1, 5, 4), "float32"), randn(rng, (1, 1, 5, 4), "float32")
    cache.append(k, v)
    q = randn(rng, (1, 2, 2, 4), "float32")
    got = host(nbkv.attention(q, cache))
    np.testing.assert_allclose(got, reference.attention(q, k, v), rtol=0, atol=3e-5)


def test_softmax_is_stable_for_large_logits_and_long_contexts(rng):
    seq_len = 3000 if DEVICE == "cpu" else 300
    cache, K, V = make_cache(rng, "bhsd", "float32", 1, 8, seq_len, seq_len, batch=1)
    q = 1000.0 * randn(rng, (1, 2, 1, 8), "float32")  # scores in the thousands
    got = host(nbkv.attention(q, cache))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, reference.attention(q, K, V), rtol=0, atol=1e-4)


def test_kv_pair_in_either_layout(rng):
    for layout in LAYOUTS:
        _, K, V = make_cache(rng, layout, "float32", 2, 8, 6, 6)
        q = randn(rng, (2, 4, 1, 8), "float32")
        pair = (K, V)
        if DEVICE == "cuda":
            from numba import cuda

            pair = (cuda.to_device(K), cuda.to_device(V))
        got = host(nbkv.attention(q, pair, layout=layout, scale=0.3))
        want = reference.attention(q, K, V, layout=layout, scale=0.3)
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-5)


@pytest.mark.parametrize("q_dtype", ["float16", "float64"])
def test_output_has_the_dtype_of_q(rng, q_dtype):
    cache, K, V = make_cache(rng, "bhsd", "float16", 2, 8, 6, 8)
    q = randn(rng, (2, 2, 1, 8), q_dtype)
    got = host(nbkv.attention(q, cache))
    assert got.dtype == dtype_of(q_dtype)
    # a float16 output is rounded to 11 bits: half an ulp is 2**-11 of the value
    rtol, atol = (2**-10, 1e-3) if q_dtype == "float16" else (0, TOL)
    np.testing.assert_allclose(got, reference.attention(q, K, V), rtol=rtol, atol=atol)


def test_out_is_written_in_place(rng):
    cache, K, V = make_cache(rng, "bhsd", "float32", 2, 8, 6, 8)
    q = randn(rng, (2, 4, 1, 8), "float32")
    if DEVICE == "cpu":
        out = np.empty_like(q)
    else:
        from numba import cuda

        out = cuda.device_array(q.shape, q.dtype)
    assert nbkv.attention(q, cache, out=out) is out
    np.testing.assert_allclose(host(out), reference.attention(q, K, V), rtol=0, atol=3e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_append_and_attend_equals_append_then_attention(rng, layout, dtype):
    cache, K, V = make_cache(rng, layout, dtype, 2, 8, 5, 12)
    twin = cache.copy()
    k = randn(rng, shape_of(layout, 2, 2, 3, 8), dtype)
    v = randn(rng, shape_of(layout, 2, 2, 3, 8), dtype)
    q = randn(rng, (2, 8, 2, 8), "float32")
    got = host(nbkv.append_and_attend(q, k, v, cache, window=4))
    twin.append(k, v)
    want = host(nbkv.attention(q, twin, window=4))
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)
    K2, V2 = reference.append(K, V, k, v, layout)
    np.testing.assert_allclose(
        got, reference.attention(q, K2, V2, window=4, layout=layout), rtol=0, atol=3e-5
    )
    assert cache.seq_len == 8
    np.testing.assert_array_equal(
        host(cache.get_kv()[0], K2.dtype).view(np.uint8), np.ascontiguousarray(K2).view(np.uint8)
    )


def test_append_and_attend_allocates_a_lazy_cache(rng):
    cache = nbkv.LayerKVCache(8, device=DEVICE)
    k = randn(rng, (1, 1, 2, 4), "float32")
    q = randn(rng, (1, 2, 2, 4), "float32")
    got = host(nbkv.append_and_attend(q, k, k, cache))
    np.testing.assert_allclose(got, reference.attention(q, k, k), rtol=0, atol=3e-5)
    assert cache.is_allocated and cache.seq_len == 2


def _bad_q(rng, cache):
    return randn(rng, (1, 4, 1, 3), "float32")  # head_dim 3 against the cache's 4


def _read_only_out(rng, cache):
    if DEVICE == "cuda":
        return None  # a device array cannot be read-only
    out = np.empty((1, 4, 1, 4), np.float32)
    out.flags.writeable = False
    return out


@pytest.mark.parametrize("state", ["lazy", "allocated", "primed", "grows"])
@pytest.mark.parametrize("failure", ["bad q", "read-only out", "attend fails"])
def test_append_and_attend_that_fails_leaves_the_cache_as_it_was(rng, monkeypatch, state, failure):
    """Whatever failed (a check of q or out, or the kernel), before or after the append
    (the CPU appends first: the cache's decode fast path, primed or not), the cache holds
    what it held, with its capacity and buffers; and the next call works."""
    grow = {"on_overflow": "grow", "grow_step": 4} if state == "grows" else {}
    if state == "lazy":
        cache = nbkv.LayerKVCache(8, device=DEVICE, **grow)
    else:
        cache = nbkv.LayerKVCache(
            4, batch=1, num_kv_heads=2, head_dim=4, dtype="float32", device=DEVICE, **grow
        )
        kv = randn(rng, (1, 2, 4 if state == "grows" else 2, 4), "float32")
        cache.append(kv, kv)  # of 2 or 4 positions: an append of 1 checks everything
    if state == "primed":  # an append of 1 position: the next one takes the fast path
        one = randn(rng, (1, 2, 1, 4), "float32")
        cache.append(one, one)
        cache.crop(2)
    full_checks = []
    prepare = cache.prepare_append

    def counted(*args):
        full_checks.append(1)
        return prepare(*args)

    monkeypatch.setattr(cache, "prepare_append", counted)
    before = snapshot(cache), cache.max_seq_len, cache.is_allocated
    views = cache.get_kv()
    k = randn(rng, (1, 2, 1, 4), "float32")
    q, out = randn(rng, (1, 4, 1, 4), "float32"), None
    if failure == "bad q":
        q, error = _bad_q(rng, cache), nbkv.ShapeMismatchError
    elif failure == "read-only out":
        out, error = _read_only_out(rng, cache), nbkv.InvalidArgumentError
        if out is None:
            pytest.skip("a device array cannot be read-only")
    else:
        be = get_backend(DEVICE, "bhsd")
        name = "attend" if not be.fused_append_attend else "append_attend"

        def fail(*args, **kwargs):
            raise RuntimeError("injected: the kernel failed")

        monkeypatch.setattr(be, name, fail)
        error = RuntimeError
    with pytest.raises(error):
        nbkv.append_and_attend(q, k, k, cache, out=out)
    monkeypatch.undo()
    # every path was taken: the CPU's fast path when primed, the full checks otherwise
    assert len(full_checks) == (0 if DEVICE == "cpu" and state == "primed" else 1)
    assert_same(before[0], snapshot(cache))
    assert (cache.max_seq_len, cache.is_allocated) == before[1:]
    if views is not None:  # the buffers the views see are still the cache's
        views[0][...] = 0
        assert not host(cache.get_kv()[0]).any()
    held = cache.seq_len
    got = host(nbkv.append_and_attend(randn(rng, (1, 4, 1, 4), "float32"), k, k, cache))
    assert cache.seq_len == held + 1 and np.isfinite(got).all()
    assert_bits_equal(cache.get_kv()[0][:, :, held : held + 1], k)


@pytest.mark.skipif(DEVICE != "cuda", reason="splits exist on the CUDA kernel only")
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_cuda_split_combine_for_any_number_of_splits(rng, monkeypatch, splits):
    monkeypatch.setattr(_config, "ATTENTION_SPLITS", splits)
    cache, K, V = make_cache(rng, "bhsd", "float32", 1, 4, 40, 40, batch=1)
    q = randn(rng, (1, 2, 3, 4), "float32")
    got = host(nbkv.attention(q, cache, window=30))
    want = reference.attention(q, K, V, window=30)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-5)


# -- bad input: typed errors, nothing changed ------------------------------------------


@pytest.fixture
def held(rng):
    cache, _, _ = make_cache(rng, "bhsd", "float32", 2, 8, 4, 8)
    return cache


@pytest.mark.parametrize(
    "q_shape,error,fragment",
    [
        ((2, 3, 1, 8), nbkv.ShapeMismatchError, "not a multiple"),
        ((2, 4, 1, 6), nbkv.ShapeMismatchError, "head_dim 6"),
        ((1, 4, 1, 8), nbkv.ShapeMismatchError, "batch 1"),
        ((2, 4, 6, 8), nbkv.ShapeMismatchError, "6 queries"),
        ((2, 4, 8), nbkv.ShapeMismatchError, "4-D"),
    ],
)
def test_bad_queries_raise_and_change_nothing(held, rng, q_shape, error, fragment):
    before = snapshot(held)
    q = randn(rng, q_shape, "float32")
    with pytest.raises(error, match=fragment):
        nbkv.attention(q, held)
    k = randn(rng, (2, 2, 1, 8), "float32")
    with pytest.raises(error):
        nbkv.append_and_attend(q, k, k, held)
    assert_same(before, snapshot(held))


@pytest.mark.parametrize(
    "kwargs,error,fragment",
    [
        ({"window": 0}, nbkv.InvalidArgumentError, "window"),
        ({"window": 2.5}, nbkv.ArgumentTypeError, "window"),
        ({"scale": float("nan")}, nbkv.InvalidArgumentError, "scale"),
        ({"scale": "1"}, nbkv.ArgumentTypeError, "scale"),
        ({"causal": 1}, nbkv.ArgumentTypeError, "causal"),
        ({"layout": "bshd"}, nbkv.InvalidArgumentError, "layout"),
    ],
)
def test_bad_options_raise(held, rng, kwargs, error, fragment):
    before = snapshot(held)
    with pytest.raises(error, match=fragment):
        nbkv.attention(randn(rng, (2, 4, 1, 8), "float32"), held, **kwargs)
    assert_same(before, snapshot(held))


def test_empty_caches_raise(rng):
    q = randn(rng, (1, 2, 1, 4), "float32")
    lazy = nbkv.LayerKVCache(8, device=DEVICE)
    with pytest.raises(nbkv.InvalidArgumentError, match="no position"):
        nbkv.attention(q, lazy)
    cleared, _, _ = make_cache(rng, "bhsd", "float32", 1, 4, 3, 8, batch=1)
    cleared.clear()
    with pytest.raises(nbkv.InvalidArgumentError, match="no position"):
        nbkv.attention(q, cleared)


def test_bad_out_and_kv_raise(held, rng):
    q = randn(rng, (2, 4, 1, 8), "float32")
    before = snapshot(held)
    with pytest.raises(nbkv.ShapeMismatchError, match="out has shape"):
        nbkv.attention(q, held, out=np.empty((2, 4, 2, 8), np.float32))
    with pytest.raises(nbkv.DTypeMismatchError, match="out has dtype"):
        nbkv.attention(q, held, out=np.empty((2, 4, 1, 8), np.float64))
    with pytest.raises(nbkv.ArgumentTypeError, match="kv must be"):
        nbkv.attention(q, [1, 2, 3])
    with pytest.raises(nbkv.ArgumentTypeError, match="cache must be"):
        nbkv.append_and_attend(q, q, q, (q, q))
    assert_same(before, snapshot(held))


def test_append_and_attend_overflow_changes_nothing(held, rng):
    before = snapshot(held)
    k = randn(rng, (2, 2, 5, 8), "float32")
    with pytest.raises(nbkv.CacheOverflowError, match="5 positions"):
        nbkv.append_and_attend(randn(rng, (2, 4, 1, 8), "float32"), k, k, held)
    assert_same(before, snapshot(held))


@cpu_only
def test_cpu_cache_refuses_cuda_queries(held):
    class CudaLike:
        __cuda_array_interface__ = {
            "shape": (2, 4, 1, 8),
            "typestr": "<f4",
            "data": (0, False),
            "version": 3,
        }

    with pytest.raises(nbkv.DeviceMismatchError, match="q"):
        nbkv.attention(CudaLike(), held)


# -- the CPU kernels, from user code, and the reference against one nobody here wrote --


@cpu_only
def test_attend_kernel_runs_inside_user_njit_code(rng):
    from numba import njit

    from nbkv.dtypes import widen_table
    from nbkv.kernels import attend, write_kv

    @njit
    def step(q, k, v, pos, k_cache, v_cache, table, out):
        write_kv(k, v, pos, k_cache, v_cache)
        attend(q, k_cache, v_cache, pos + k.shape[2], 0.5, True, 0, table, out)

    k_cache = randn(rng, (1, 2, 16, 8), "float32")
    v_cache = randn(rng, (1, 2, 16, 8), "float32")
    k, v = randn(rng, (1, 2, 1, 8), "float32"), randn(rng, (1, 2, 1, 8), "float32")
    q = randn(rng, (1, 4, 1, 8), "float32")
    out = np.empty_like(q)
    step(q, k, v, 6, k_cache, v_cache, widen_table(np.dtype(np.float32)), out)
    want = reference.attention(q, k_cache[:, :, :7], v_cache[:, :, :7], scale=0.5)
    np.testing.assert_allclose(out, want, rtol=0, atol=3e-5)


@cpu_only
@pytest.mark.parametrize("window", [None, 3])
def test_reference_agrees_with_torch_sdpa(rng, window):
    torch = pytest.importorskip("torch")
    q = rng.standard_normal((2, 8, 3, 16))
    K, V = rng.standard_normal((2, 2, 10, 16)), rng.standard_normal((2, 2, 10, 16))
    # queries are the last 3 of 10 positions: query i sees j <= 7 + i (and j > 7 + i - window)
    pos = np.arange(7, 10)[:, None]
    j = np.arange(10)[None, :]
    mask = j <= pos
    if window is not None:
        mask &= j > pos - window
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q),
        torch.from_numpy(K),
        torch.from_numpy(V),
        attn_mask=torch.from_numpy(mask),
        enable_gqa=True,
    ).numpy()
    np.testing.assert_allclose(reference.attention(q, K, V, window=window), want, atol=1e-12)
