"""LayerKVCache behaviour, on whichever backend this run uses (see conftest)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import nbkv
from nbkv import reference

from conftest import DTYPES, LAYOUTS, assert_bits_equal, dtype_of, host, randn, shape_of


def make(device, layout="bhsd", dtype="float32", max_seq_len=16, b=2, h=3, d=5):
    return nbkv.LayerKVCache(
        max_seq_len,
        batch=b,
        num_kv_heads=h,
        head_dim=d,
        dtype=dtype,
        device=device,
        layout=layout,
    )


def test_default_max_seq_len_is_2048():
    assert nbkv.DEFAULT_MAX_SEQ_LEN == 2048
    assert nbkv.LayerKVCache().max_seq_len == 2048
    assert nbkv.LayerKVCache.new().max_seq_len == 2048


def test_new_and_with_capacity_allocate_nothing(device):
    for cache in (
        nbkv.LayerKVCache(device=device),
        nbkv.LayerKVCache.with_capacity(7, device=device),
    ):
        assert not cache.is_allocated and cache.is_empty and cache.nbytes == 0
        assert cache.seq_len == 0 == len(cache) and cache.get_kv() is None
        assert cache.dtype is None and cache.shape is None
    assert nbkv.LayerKVCache.with_capacity(7).max_seq_len == 7


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_constructor_allocates_at_once(device, layout, dtype):
    cache = make(device, layout, dtype, max_seq_len=9, b=2, h=3, d=5)
    assert cache.is_allocated and cache.is_empty
    assert cache.shape == shape_of(layout, 2, 3, 9, 5)
    assert cache.dtype == dtype_of(dtype)
    assert cache.nbytes == 2 * 2 * 3 * 9 * 5 * dtype_of(dtype).itemsize
    assert (cache.device, cache.layout) == (device, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [3, 8])
def test_appends_up_to_full_capacity_match_the_reference(device, rng, layout, dtype, head_dim):
    cache = make(device, layout, dtype, max_seq_len=13, d=head_dim)
    K, V = reference.empty_kv(2, 3, head_dim, dtype_of(dtype), layout)
    for n in (1, 7, 1, 4):  # 13 positions: seq_len 1, 8, 9 and full capacity
        k = randn(rng, shape_of(layout, 2, 3, n, head_dim), dtype)
        v = randn(rng, shape_of(layout, 2, 3, n, head_dim), dtype)
        cache.append(k, v)
        K, V = reference.append(K, V, k, v, layout)
        got_k, got_v = cache.get_kv()
        assert_bits_equal(got_k, K)
        assert_bits_equal(got_v, V)
        assert cache.seq_len == len(cache) == K.shape[2 if layout == "bhsd" else 1]
    assert cache.seq_len == cache.max_seq_len


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lazy_cache_takes_shape_and_dtype_from_first_append(device, rng, layout):
    cache = nbkv.LayerKVCache.with_capacity(10, device=device, layout=layout)
    k = randn(rng, shape_of(layout, 1, 2, 3, 4), "float16")
    cache.append(k, k)
    assert cache.shape == shape_of(layout, 1, 2, 10, 4)
    assert cache.dtype == np.float16
    assert (cache.batch, cache.num_kv_heads, cache.head_dim) == (1, 2, 4)


def test_partial_constructor_constrains_first_append(device, rng):
    cache = nbkv.LayerKVCache(8, head_dim=4, device=device)
    assert not cache.is_allocated
    with pytest.raises(nbkv.ShapeMismatchError, match="head_dim 4"):
        cache.append(randn(rng, (1, 2, 3, 5), "float32"), randn(rng, (1, 2, 3, 5), "float32"))
    assert not cache.is_allocated
    cache.append(randn(rng, (1, 2, 3, 4), "float32"), randn(rng, (1, 2, 3, 4), "float32"))
    assert cache.shape == (1, 2, 8, 4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_reads_strided_views_without_a_copy(device, rng, layout):
    # keys as a model computes them, [batch, seq, heads, dim], transposed to bhsd (and back)
    other = "bshd" if layout == "bhsd" else "bhsd"
    k_src = randn(rng, shape_of(other, 2, 3, 4, 6), "float32")
    v_src = randn(rng, shape_of(other, 2, 3, 4, 6), "float32")[..., ::-1]  # negative stride
    k, v = k_src.transpose(0, 2, 1, 3), v_src.transpose(0, 2, 1, 3)
    assert not k.flags.c_contiguous and not v.flags.c_contiguous
    cache = make(device, layout, max_seq_len=8, b=2, h=3, d=6)
    cache.append(k, v)
    got_k, got_v = cache.get_kv()
    assert_bits_equal(got_k, np.ascontiguousarray(k))
    assert_bits_equal(got_v, np.ascontiguousarray(v))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_copy_is_bit_exact_for_special_values(device, dtype):
    specials = np.array([0x7E01, 0xFE33, 0x8000, 0x0000, 0x7C00, 0x0001, 0x7F80, 0xFFFF], np.uint16)
    k = np.tile(specials, (1, 1, 3, 1)).view(dtype_of(dtype))  # NaN payloads, -0, inf, subnormal
    v = k[..., ::-1].copy()
    cache = make(device, dtype=dtype, max_seq_len=4, b=1, h=1, d=8)
    cache.append(k, v)
    got_k, got_v = cache.get_kv()
    assert_bits_equal(got_k, k)
    assert_bits_equal(got_v, v)


def test_get_kv_is_none_when_empty_and_after_clear(device, rng):
    cache = make(device)
    assert cache.get_kv() is None
    k = randn(rng, (2, 3, 2, 5), "float32")
    cache.append(k, k)
    assert cache.get_kv() is not None
    cache.clear()
    assert cache.get_kv() is None and cache.is_empty and cache.is_allocated


def test_clear_keeps_the_buffers_and_later_appends_overwrite(device, rng):
    cache = make(device)
    cache.append(randn(rng, (2, 3, 4, 5), "float32"), randn(rng, (2, 3, 4, 5), "float32"))
    buffers = (cache._k, cache._v)
    nbytes = cache.nbytes
    cache.clear()
    k, v = randn(rng, (2, 3, 2, 5), "float32"), randn(rng, (2, 3, 2, 5), "float32")
    cache.append(k, v)
    assert (cache._k, cache._v) == buffers and cache.nbytes == nbytes
    assert_bits_equal(cache.get_kv()[0], k)
    assert_bits_equal(cache.get_kv()[1], v)


def test_deallocate_frees_buffers_and_keeps_capacity(device, rng):
    cache = nbkv.LayerKVCache(12, device=device)
    cache.append(randn(rng, (1, 2, 3, 4), "float32"), randn(rng, (1, 2, 3, 4), "float32"))
    cache.deallocate()
    assert not cache.is_allocated and cache.nbytes == 0 and cache.seq_len == 0
    assert cache.max_seq_len == 12 and cache.get_kv() is None
    # a lazy cache takes a new shape and dtype after deallocate
    k = randn(rng, (2, 1, 5, 3), "float64")
    cache.append(k, k)
    assert cache.shape == (2, 1, 12, 3) and cache.dtype == np.float64


def test_deallocate_keeps_what_the_constructor_fixed(device, rng):
    cache = make(device, b=2, h=3, d=5)
    cache.deallocate()
    assert not cache.is_allocated
    with pytest.raises(nbkv.ShapeMismatchError):
        cache.append(randn(rng, (2, 3, 1, 4), "float32"), randn(rng, (2, 3, 1, 4), "float32"))
    cache.append(randn(rng, (2, 3, 1, 5), "float32"), randn(rng, (2, 3, 1, 5), "float32"))
    assert cache.shape == (2, 3, 16, 5)


def test_zero_length_append_changes_nothing(device, rng):
    cache = nbkv.LayerKVCache(4, device=device)
    empty = randn(rng, (1, 2, 0, 3), "float32")
    cache.append(empty, empty)
    assert cache.seq_len == 0 and not cache.is_allocated


@pytest.mark.parametrize("how", ["method", "copy.copy", "copy.deepcopy"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copies_are_independent(device, rng, how, layout):
    cache = make(device, layout, max_seq_len=10)
    k0, v0 = (
        randn(rng, shape_of(layout, 2, 3, 4, 5), "float32"),
        randn(rng, shape_of(layout, 2, 3, 4, 5), "float32"),
    )
    cache.append(k0, v0)
    twin = {"method": lambda c: c.copy(), "copy.copy": copy.copy, "copy.deepcopy": copy.deepcopy}[
        how
    ](cache)
    assert type(twin) is nbkv.LayerKVCache and twin.seq_len == 4
    k1, v1 = (
        randn(rng, shape_of(layout, 2, 3, 3, 5), "float32"),
        randn(rng, shape_of(layout, 2, 3, 3, 5), "float32"),
    )
    k2, v2 = (
        randn(rng, shape_of(layout, 2, 3, 3, 5), "float32"),
        randn(rng, shape_of(layout, 2, 3, 3, 5), "float32"),
    )
    twin.append(k1, v1)  # same positions in both: shared storage would show here
    cache.append(k2, v2)
    K, V = reference.append(k0, v0, k2, v2, layout)
    assert_bits_equal(cache.get_kv()[0], K)
    assert_bits_equal(cache.get_kv()[1], V)
    K, V = reference.append(k0, v0, k1, v1, layout)
    assert_bits_equal(twin.get_kv()[0], K)
    assert_bits_equal(twin.get_kv()[1], V)


def test_copy_of_lazy_cache_is_lazy(device):
    twin = nbkv.LayerKVCache(5, device=device).copy()
    assert not twin.is_allocated and twin.max_seq_len == 5


def test_repr_shows_shape_dtype_device_seq_len_and_nbytes(device, rng):
    cache = make(device, max_seq_len=16, b=2, h=3, d=5)
    cache.append(randn(rng, (2, 3, 4, 5), "float32"), randn(rng, (2, 3, 4, 5), "float32"))
    text = repr(cache)
    for part in (
        "(2, 3, 16, 5)",
        "float32",
        repr(device),
        "seq_len=4/16",
        f"nbytes={cache.nbytes}",
    ):
        assert part in text
    assert "unallocated" in repr(nbkv.LayerKVCache(device=device))


def test_legacy_k_and_v_warn_and_return_the_get_kv_views(device, rng):
    cache = make(device)
    with pytest.warns(DeprecationWarning):
        assert cache.k() is None
    k, v = randn(rng, (2, 3, 4, 5), "float32"), randn(rng, (2, 3, 4, 5), "float32")
    cache.append(k, v)
    with pytest.warns(DeprecationWarning, match="get_kv"):
        got_k = cache.k()
    with pytest.warns(DeprecationWarning):
        got_v = cache.v()
    assert_bits_equal(got_k, k)
    assert_bits_equal(got_v, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_set_k_then_set_v_replace_contents_and_later_appends_work(device, rng, dtype):
    cache = nbkv.LayerKVCache(9, device=device)  # lazy: set_k allocates, capacity kept
    K, V = randn(rng, (1, 2, 5, 3), dtype), randn(rng, (1, 2, 5, 3), dtype)
    with pytest.warns(DeprecationWarning):
        cache.set_k(K)
    assert cache.seq_len == 5 and cache.max_seq_len == 9
    with pytest.warns(DeprecationWarning):
        cache.set_v(V)
    assert_bits_equal(cache.get_kv()[0], K)
    assert_bits_equal(cache.get_kv()[1], V)
    k, v = randn(rng, (1, 2, 4, 3), dtype), randn(rng, (1, 2, 4, 3), dtype)
    cache.append(k, v)
    K, V = reference.append(K, V, k, v)
    assert_bits_equal(cache.get_kv()[0], K)
    assert_bits_equal(cache.get_kv()[1], V)
    # set_k shortens the cache too
    with pytest.warns(DeprecationWarning):
        cache.set_k(K[:, :, :2])
    assert cache.seq_len == 2


def test_get_kv_views_share_the_buffers(device, rng):
    cache = make(device)
    k = randn(rng, (2, 3, 4, 5), "float32")
    cache.append(k, k)
    got_k, got_v = cache.get_kv()
    if device == "cpu":
        assert np.shares_memory(got_k, cache._k) and np.shares_memory(got_v, cache._v)
    else:
        assert got_k.shape == (2, 3, 4, 5) and hasattr(got_k, "copy_to_host")


def test_cuda_cache_appends_device_arrays_without_the_host(device, rng):
    if device != "cuda":
        pytest.skip("device arrays exist only on the CUDA backend")
    from numba import cuda

    for dtype in DTYPES:
        cache = make(device, dtype=dtype, max_seq_len=12, b=1, h=2, d=4)
        k, v = randn(rng, (1, 2, 6, 4), dtype), randn(rng, (1, 2, 6, 4), dtype)
        as_device = (
            (lambda x: cuda.to_device(x.view(np.uint16))) if dtype == "bfloat16" else cuda.to_device
        )
        cache.append(as_device(k), as_device(v))
        # a strided device view: every other position
        cache.append(as_device(k)[:, :, ::2], as_device(v)[:, :, ::2])
        K, V = reference.append(k, v, k[:, :, ::2], v[:, :, ::2])
        assert_bits_equal(cache.get_kv()[0], K)
        assert_bits_equal(host(cache.get_kv()[1], V.dtype), V)
