"""Bad input gets a typed nbkv error naming argument, expectation and value, and changes
nothing: contents, seq_len and whether the buffers are allocated."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import nbkv

from conftest import DEVICE, SIMULATOR, host, randn


def snapshot(cache: nbkv.LayerKVCache):
    kv = cache.get_kv()
    held = None if kv is None else tuple(host(x, cache.dtype).copy() for x in kv)
    return cache.seq_len, cache.is_allocated, cache.shape, cache.dtype, cache.nbytes, held


def assert_same(before, after):
    assert before[:5] == after[:5]
    if before[5] is None:
        assert after[5] is None
    else:
        for b, a in zip(before[5], after[5], strict=True):
            np.testing.assert_array_equal(b.view(np.uint8), a.view(np.uint8))


@pytest.fixture(params=["allocated", "lazy"])
def cache(request, rng):
    """A cache holding 3 positions of [1, 2, _, 4] float32 (allocated up front, or lazily)."""
    if request.param == "allocated":
        c = nbkv.LayerKVCache(
            8, batch=1, num_kv_heads=2, head_dim=4, dtype="float32", device=DEVICE
        )
    else:
        c = nbkv.LayerKVCache(8, device=DEVICE)
    c.append(randn(rng, (1, 2, 3, 4), "float32"), randn(rng, (1, 2, 3, 4), "float32"))
    return c


def good(rng, n=1, shape=(1, 2, None, 4), dtype="float32"):
    return randn(rng, tuple(n if s is None else s for s in shape), dtype)


def check(cache, call, error, *fragments):
    before = snapshot(cache)
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, nbkv.KVCacheError)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert_same(before, snapshot(cache))


@pytest.mark.parametrize("bad", [[[1.0]], None, 3.0, "k"])
@pytest.mark.parametrize("which", ["k", "v"])
def test_append_of_a_non_array_raises_argument_type_error(cache, rng, bad, which):
    args = {"k": good(rng), "v": good(rng)} | {which: bad}
    check(cache, lambda: cache.append(**args), nbkv.ArgumentTypeError, which, type(bad).__name__)
    assert issubclass(nbkv.ArgumentTypeError, TypeError)


@pytest.mark.parametrize("which", ["k", "v"])
def test_append_of_wrong_ndim_raises_shape_mismatch(cache, rng, which):
    args = {"k": good(rng), "v": good(rng)} | {which: randn(rng, (2, 1, 4), "float32")}
    check(
        cache,
        lambda: cache.append(**args),
        nbkv.ShapeMismatchError,
        which,
        "4-D",
        "3-D",
        "(2, 1, 4)",
    )


@pytest.mark.parametrize(
    "field,v_shape",
    [
        ("batch", (2, 2, 1, 4)),
        ("num_kv_heads", (1, 3, 1, 4)),
        ("seq", (1, 2, 2, 4)),
        ("head_dim", (1, 2, 1, 5)),
    ],
)
def test_k_and_v_disagreeing_raise_shape_mismatch_naming_the_axis(cache, rng, field, v_shape):
    k, v = good(rng), randn(rng, v_shape, "float32")
    check(cache, lambda: cache.append(k, v), nbkv.ShapeMismatchError, field, str(v_shape))


def test_k_and_v_disagreeing_in_dtype_raise_dtype_mismatch(cache, rng):
    k, v = good(rng), good(rng, dtype="float64")
    check(cache, lambda: cache.append(k, v), nbkv.DTypeMismatchError, "float32", "float64")
    assert issubclass(nbkv.DTypeMismatchError, TypeError)


@pytest.mark.parametrize(
    "field,shape",
    [("batch", (2, 2, 1, 4)), ("num_kv_heads", (1, 4, 1, 4)), ("head_dim", (1, 2, 1, 8))],
)
def test_shape_other_than_the_buffers_raises_shape_mismatch(cache, rng, field, shape):
    k, v = randn(rng, shape, "float32"), randn(rng, shape, "float32")
    check(cache, lambda: cache.append(k, v), nbkv.ShapeMismatchError, field, str(shape))
    assert issubclass(nbkv.ShapeMismatchError, ValueError)


def test_dtype_other_than_the_buffers_raises_and_never_casts(cache, rng):
    k, v = good(rng, dtype="float16"), good(rng, dtype="float16")
    check(cache, lambda: cache.append(k, v), nbkv.DTypeMismatchError, "float16", "float32")


def test_unsupported_dtype_raises_on_a_lazy_cache(rng):
    cache = nbkv.LayerKVCache(4, device=DEVICE)
    k = np.arange(8, dtype=np.int32).reshape(1, 1, 2, 4) + 1
    check(cache, lambda: cache.append(k, k), nbkv.DTypeMismatchError, "int32")


def test_overflow_raises_saying_how_many_positions_are_free(cache, rng):
    k, v = good(rng, n=6), good(rng, n=6)
    check(cache, lambda: cache.append(k, v), nbkv.CacheOverflowError, "6 positions", "5 are free")


def test_too_large_first_append_leaves_a_lazy_cache_unallocated(rng):
    # the reference allocated the buffers, then failed
    cache = nbkv.LayerKVCache.with_capacity(4, device=DEVICE)
    k = good(rng, n=5)
    check(cache, lambda: cache.append(k, k), nbkv.CacheOverflowError, "0 of 4", "4 are free")
    assert not cache.is_allocated


def test_zero_sized_axis_raises_shape_mismatch(rng):
    cache = nbkv.LayerKVCache(4, device=DEVICE)
    k = np.ones((1, 0, 2, 4), np.float32)
    check(cache, lambda: cache.append(k, k), nbkv.ShapeMismatchError, "num_kv_heads", "at least 1")


def test_cpu_cache_refuses_a_cuda_array(cache, rng):
    class CudaLike:  # what a torch CUDA tensor or CuPy array looks like to nbkv
        __cuda_array_interface__ = {
            "shape": (1, 2, 1, 4),
            "typestr": "<f4",
            "data": (0, False),
            "version": 3,
        }

    if DEVICE != "cpu":
        pytest.skip("a CUDA cache takes CUDA arrays")
    check(cache, lambda: cache.append(CudaLike(), good(rng)), nbkv.DeviceMismatchError, "k", "cuda")


@pytest.mark.parametrize(
    "value,error",
    [
        (0, nbkv.InvalidArgumentError),
        (-3, nbkv.InvalidArgumentError),
        (2.5, nbkv.ArgumentTypeError),
        ("8", nbkv.ArgumentTypeError),
        (True, nbkv.ArgumentTypeError),
    ],
)
def test_bad_max_seq_len_raises(value, error):
    with pytest.raises(error, match="max_seq_len") as info:
        nbkv.LayerKVCache(value, device=DEVICE)
    assert repr(value) in str(info.value) or str(value) in str(info.value)
    with pytest.raises(error, match="max_seq_len"):
        nbkv.KVCache(2, value, device=DEVICE)
    with pytest.raises(error, match="max_seq_len"):
        nbkv.LayerKVCache.with_capacity(value, device=DEVICE)


@pytest.mark.parametrize("name", ["batch", "num_kv_heads", "head_dim"])
def test_bad_sizes_raise(name):
    with pytest.raises(nbkv.InvalidArgumentError, match=f"{name} must be a positive int, got 0"):
        nbkv.LayerKVCache(4, **{name: 0}, device=DEVICE)


def test_unknown_layout_device_or_dtype_raise():
    with pytest.raises(nbkv.InvalidArgumentError, match="layout must be one of .* got 'sbhd'"):
        nbkv.LayerKVCache(4, layout="sbhd")
    with pytest.raises(nbkv.InvalidArgumentError, match="device must be one of .* got 'tpu'"):
        nbkv.LayerKVCache(4, device="tpu")
    with pytest.raises(nbkv.DTypeMismatchError, match="int8"):
        nbkv.LayerKVCache(4, dtype="int8")
    with pytest.raises(nbkv.DTypeMismatchError, match="'floaty'"):
        nbkv.LayerKVCache(4, dtype="floaty")


@pytest.mark.skipif(SIMULATOR, reason="the simulator is a CUDA device")
def test_cuda_without_gpu_or_simulator_raises_backend_unavailable():
    from numba import cuda

    if cuda.is_available():
        pytest.skip("a real GPU is present")
    with pytest.raises(nbkv.BackendUnavailableError, match="NUMBA_ENABLE_CUDASIM=1"):
        nbkv.LayerKVCache(4, device="cuda")
    assert issubclass(nbkv.BackendUnavailableError, RuntimeError)


def test_set_k_errors_change_nothing(cache, rng):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        check(
            cache,
            lambda: cache.set_k(good(rng, n=9)),
            nbkv.CacheOverflowError,
            "set_k",
            "9 positions",
        )
        check(
            cache,
            lambda: cache.set_k(good(rng, dtype="float64")),
            nbkv.DTypeMismatchError,
            "float64",
        )
        check(
            cache,
            lambda: cache.set_k(randn(rng, (1, 2, 2, 5), "float32")),
            nbkv.ShapeMismatchError,
            "head_dim",
        )
        check(cache, lambda: cache.set_k([1.0]), nbkv.ArgumentTypeError, "k")


def test_set_v_needs_exactly_seq_len_positions(cache, rng):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        check(
            cache,
            lambda: cache.set_v(good(rng, n=2)),
            nbkv.ShapeMismatchError,
            "seq_len = 3",
            "got 2",
        )
        check(
            cache,
            lambda: cache.set_v(good(rng, dtype="float16", n=3)),
            nbkv.DTypeMismatchError,
            "v",
        )


def test_kvcache_bad_num_layers_and_index():
    with pytest.raises(nbkv.InvalidArgumentError, match="num_layers"):
        nbkv.KVCache(0)
    with pytest.raises(nbkv.ArgumentTypeError, match="num_layers"):
        nbkv.KVCache(2.0)
    cache = nbkv.KVCache(3, 8, device=DEVICE)
    with pytest.raises(nbkv.LayerIndexError, match=r"\[-3, 3\), got 3"):
        cache[3]
    with pytest.raises(nbkv.LayerIndexError, match="str"):
        cache["0"]
    assert issubclass(nbkv.LayerIndexError, IndexError)
