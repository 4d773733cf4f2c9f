"""Steady-state appends allocate no new buffers."""

from __future__ import annotations

import tracemalloc

import numpy as np

import nbkv

from conftest import cpu_only, randn

pytestmark = cpu_only


def test_steady_state_appends_allocate_nothing(rng):
    cache = nbkv.LayerKVCache(4096, batch=1, num_kv_heads=8, head_dim=128, dtype="float32")
    k, v = randn(rng, (1, 8, 1, 128), "float32"), randn(rng, (1, 8, 1, 128), "float32")
    cache.append(k, v)  # warm up: compile, take the fast path
    k_buf, v_buf = cache._k, cache._v
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for _ in range(2000):
            cache.append(k, v)
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 2000 appends write 16 MB; a copy of one 4 KiB input, even freed at once, shows in the peak
    assert peak - before < 2048, (before, after, peak)
    assert cache._k is k_buf and cache._v is v_buf
    assert np.shares_memory(cache.get_kv()[0], k_buf)
    assert cache.seq_len == 2001


def test_steady_state_strided_and_16bit_appends_allocate_nothing(rng):
    # the validated path (no fast path): bshd views of bhsd data, 16-bit bit patterns
    cache = nbkv.LayerKVCache(
        512, batch=2, num_kv_heads=4, head_dim=64, dtype="float16", layout="bshd"
    )
    k = randn(rng, (2, 4, 1, 64), "float16").transpose(0, 2, 1, 3)
    cache.append(k, k)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for _ in range(400):
            cache.append(k, k)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # an input here is 1 KiB: a copy of one, even freed at once, would lift the peak past it
    assert peak - before < 1024
