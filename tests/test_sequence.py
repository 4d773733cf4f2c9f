"""Sequence management on LayerKVCache and KVCache: crop, trim, reorder, select, growth."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import nbkv
from nbkv import reference

from conftest import DEVICE, LAYOUTS, assert_bits_equal, host, randn, shape_of
from test_errors import assert_same, snapshot

SEQ = {"bhsd": 2, "bshd": 1}


def filled(rng, layout="bhsd", dtype="float32", batch=4, n=5, cap=8, **kw):
    cache = nbkv.LayerKVCache(
        cap,
        batch=batch,
        num_kv_heads=2,
        head_dim=3,
        dtype=dtype,
        device=DEVICE,
        layout=layout,
        **kw,
    )
    k = randn(rng, shape_of(layout, batch, 2, n, 3), dtype)
    v = randn(rng, shape_of(layout, batch, 2, n, 3), dtype)
    cache.append(k, v)
    return cache, k, v


def held(cache, layout, K):
    index = [slice(None)] * 4
    index[SEQ[layout]] = slice(0, cache.seq_len)
    return K[tuple(index)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_crop_and_trim_move_no_data_and_later_appends_overwrite(rng, layout):
    cache, k, v = filled(rng, layout)
    buffers = cache._k
    cache.crop(3)
    assert cache.seq_len == 3 and cache._k is buffers
    assert_bits_equal(cache.get_kv()[0], held(cache, layout, k))
    assert cache.trim(1) == 1 and cache.seq_len == 2
    assert cache.trim(10) == 2 and cache.seq_len == 0 and cache.get_kv() is None
    assert cache.trim(0) == 0
    k2 = randn(rng, shape_of(layout, 4, 2, 2, 3), "float32")
    cache.append(k2, k2)
    assert_bits_equal(cache.get_kv()[0], k2)


@pytest.mark.parametrize(
    "call,error,fragment",
    [
        (lambda c: c.crop(6), nbkv.InvalidArgumentError, "at most seq_len = 5"),
        (lambda c: c.crop(-1), nbkv.InvalidArgumentError, "non-negative"),
        (lambda c: c.crop(2.0), nbkv.ArgumentTypeError, "new_len"),
        (lambda c: c.trim(-2), nbkv.InvalidArgumentError, "got -2"),
        (lambda c: c.reorder([0, 1, 2]), nbkv.ShapeMismatchError, "one index per batch row (4)"),
        (lambda c: c.reorder([0, 1, 2, 4]), nbkv.InvalidArgumentError, "[0, 4), got 4"),
        (lambda c: c.reorder([0, 1, 2, -1]), nbkv.InvalidArgumentError, "got -1"),
        (lambda c: c.reorder([0.0, 1, 2, 3]), nbkv.ArgumentTypeError, "ints"),
        (lambda c: c.reorder(3), nbkv.ArgumentTypeError, "sequence"),
        (lambda c: c.select([]), nbkv.InvalidArgumentError, "at least one"),
        (lambda c: c.select([[0, 1]]), nbkv.ArgumentTypeError, "1-D"),
    ],
)
def test_bad_sequence_arguments_raise_and_change_nothing(rng, call, error, fragment):
    cache, _, _ = filled(rng)
    before = snapshot(cache)
    with pytest.raises(error) as info:
        call(cache)
    assert fragment in str(info.value)
    assert_same(before, snapshot(cache))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "indices", [[1, 0, 3, 2], [0, 0, 1, 1], [3, 3, 3, 3], [1, 2, 3, 0], [0, 1, 2, 3], [2, 0, 0, 1]]
)
def test_reorder_matches_numpy_fancy_indexing(rng, layout, indices):
    cache, k, v = filled(rng, layout, dtype="bfloat16")
    cache.reorder(np.array(indices))
    assert_bits_equal(cache.get_kv()[0], k[indices])
    assert_bits_equal(cache.get_kv()[1], v[indices])


@pytest.mark.skipif(DEVICE != "cpu", reason="tracemalloc sees host allocations only")
def test_reorder_allocates_at_most_one_scratch_row(rng):
    cache, k, _ = filled(rng, batch=8, n=500, cap=512)
    filled(rng, batch=8, n=500, cap=512)[0].reorder([1, 0, 2, 3, 4, 5, 6, 7])  # compile first
    row_bytes = 2 * 2 * 500 * 3 * 4  # K and V of one batch row, positions held
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        cache.reorder([1, 0, 3, 2, 5, 4, 7, 6])  # four swaps: cycles that need the scratch
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < row_bytes + 16 * 1024, peak - base
    assert_bits_equal(cache.get_kv()[0], k[[1, 0, 3, 2, 5, 4, 7, 6]])


@pytest.mark.parametrize("indices", [[2], [3, 3, 0], [0, 1, 2, 3, 3, 2]])
def test_select_makes_an_independent_cache_of_those_rows(rng, indices):
    cache, k, v = filled(rng, layout="bshd")
    picked = cache.select(indices)
    assert picked.batch == len(indices) and picked.seq_len == 5
    assert picked.max_seq_len == cache.max_seq_len and picked.layout == "bshd"
    assert_bits_equal(picked.get_kv()[0], k[indices])
    more = randn(rng, shape_of("bshd", len(indices), 2, 1, 3), "float32")
    picked.append(more, more)
    assert cache.seq_len == 5
    assert_bits_equal(cache.get_kv()[0], k)


def test_growth_rounds_capacity_up_and_keeps_old_views(rng):
    cache, k, v = filled(rng, cap=8, on_overflow="grow", grow_step=16)
    old_k, _ = cache.get_kv()
    old_copy = host(old_k).copy()
    k2, v2 = randn(rng, (4, 2, 20, 3), "float32"), randn(rng, (4, 2, 20, 3), "float32")
    cache.append(k2, v2)  # 25 positions: capacity 8 -> 32
    assert cache.max_seq_len == 32 and cache.seq_len == 25
    K, V = reference.append(k, v, k2, v2)
    assert_bits_equal(cache.get_kv()[0], K)
    assert_bits_equal(cache.get_kv()[1], V)
    np.testing.assert_array_equal(host(old_k), old_copy)  # the old view: old buffer, old data
    cache.append(k2[:, :, :7], v2[:, :, :7])  # exactly full: no growth
    assert cache.max_seq_len == 32


def test_growth_of_a_lazy_cache_allocates_at_the_grown_capacity(rng):
    cache = nbkv.LayerKVCache(4, device=DEVICE, on_overflow="grow")
    k = randn(rng, (1, 1, 300, 2), "float16")
    cache.append(k, k)
    assert cache.max_seq_len == 512 and cache.shape == (1, 1, 512, 2)
    assert_bits_equal(cache.get_kv()[0], k)


def test_growth_in_append_and_attend(rng):
    cache, k, v = filled(rng, cap=6, on_overflow="grow", grow_step=4)
    k2, v2 = randn(rng, (4, 2, 3, 3), "float32"), randn(rng, (4, 2, 3, 3), "float32")
    q = randn(rng, (4, 4, 1, 3), "float32")
    out = host(nbkv.append_and_attend(q, k2, v2, cache))
    K, V = reference.append(k, v, k2, v2)
    np.testing.assert_allclose(out, reference.attention(q, K, V), atol=3e-5)
    assert cache.max_seq_len == 8


def test_bad_overflow_policy_or_step_raise():
    with pytest.raises(nbkv.InvalidArgumentError, match="on_overflow must be one of"):
        nbkv.LayerKVCache(4, on_overflow="wrap")
    with pytest.raises(nbkv.InvalidArgumentError, match="grow_step"):
        nbkv.LayerKVCache(4, on_overflow="grow", grow_step=0)


def test_kvcache_sequence_operations_act_on_every_layer(rng):
    cache = nbkv.KVCache(3, 8, batch=2, num_kv_heads=1, head_dim=2, dtype="float32", device=DEVICE)
    ks = [randn(rng, (2, 1, 5, 2), "float32") for _ in range(3)]
    for layer, k in zip(cache, ks, strict=True):
        layer.append(k, k)
    cache.reorder([1, 1])
    for layer, k in zip(cache, ks, strict=True):
        assert_bits_equal(layer.get_kv()[0], k[[1, 1]])
    assert cache.trim(2) == 2 and cache.seq_len == 3
    cache.crop(1)
    assert [layer.seq_len for layer in cache] == [1, 1, 1]
    picked = cache.select([0])
    assert isinstance(picked, nbkv.KVCache) and picked[2].batch == 1
    with pytest.raises(nbkv.InvalidArgumentError):
        cache.crop(2)
    with pytest.raises(nbkv.ShapeMismatchError):
        cache.reorder([0, 1, 1])
    assert [layer.seq_len for layer in cache] == [1, 1, 1]
