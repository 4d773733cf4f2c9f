"""KVCache: a model's layers, with seq_len derived from them."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import nbkv

from conftest import assert_bits_equal, randn


def make(device, num_layers=3, **kw):
    kw = dict(batch=1, num_kv_heads=2, head_dim=4, dtype="float32", device=device) | kw
    return nbkv.KVCache(num_layers, 10, **kw)


def test_layers_are_layer_caches_built_alike(device):
    cache = make(device, layout="bshd")
    assert len(cache) == cache.num_layers == 3
    layers = list(cache)
    assert all(type(layer) is nbkv.LayerKVCache for layer in layers)
    assert cache[0] is layers[0] and cache[-1] is layers[2]
    assert len({id(layer) for layer in layers}) == 3
    assert all(layer.shape == (1, 10, 2, 4) for layer in layers)
    assert (cache.max_seq_len, cache.device, cache.layout) == (10, device, "bshd")
    assert cache.dtype == np.float32
    assert cache.nbytes == 3 * 2 * 10 * 2 * 4 * 4 and cache.is_allocated


def test_default_capacity_is_default_max_seq_len(device):
    assert nbkv.KVCache(2, device=device).max_seq_len == nbkv.DEFAULT_MAX_SEQ_LEN


def test_seq_len_is_what_every_layer_holds(device, rng):
    cache = make(device)
    assert cache.seq_len == 0 and cache.is_empty
    for i, layer in enumerate(cache):  # a forward pass part-way: layer 0 ahead of the rest
        n = 3 if i == 0 else 2
        layer.append(randn(rng, (1, 2, n, 4), "float32"), randn(rng, (1, 2, n, 4), "float32"))
    assert cache.seq_len == 2 and not cache.is_empty
    cache[1].append(randn(rng, (1, 2, 1, 4), "float32"), randn(rng, (1, 2, 1, 4), "float32"))
    cache[2].append(randn(rng, (1, 2, 1, 4), "float32"), randn(rng, (1, 2, 1, 4), "float32"))
    assert cache.seq_len == 3


def test_clear_and_deallocate_act_on_every_layer(device, rng):
    cache = make(device)
    for layer in cache:
        layer.append(randn(rng, (1, 2, 2, 4), "float32"), randn(rng, (1, 2, 2, 4), "float32"))
    nbytes = cache.nbytes
    cache.clear()
    assert cache.is_empty and cache.nbytes == nbytes
    cache.deallocate()
    assert cache.nbytes == 0 and not cache.is_allocated and cache.max_seq_len == 10


@pytest.mark.parametrize("how", [lambda c: c.copy(), copy.copy, copy.deepcopy])
def test_copies_are_independent(device, rng, how):
    cache = make(device, num_layers=2)
    k = randn(rng, (1, 2, 2, 4), "float32")
    for layer in cache:
        layer.append(k, k)
    twin = how(cache)
    assert type(twin) is nbkv.KVCache and twin.seq_len == 2
    twin[1].append(randn(rng, (1, 2, 1, 4), "float32"), randn(rng, (1, 2, 1, 4), "float32"))
    assert cache[1].seq_len == 2 and twin[1].seq_len == 3
    assert_bits_equal(cache[1].get_kv()[0], k)


def test_repr_names_layers_shape_and_length(device):
    text = repr(make(device))
    for part in ("num_layers=3", "(1, 2, 10, 4)", "float32", repr(device), "seq_len=0/10"):
        assert part in text
