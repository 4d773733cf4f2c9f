"""nbkv.tutorial.long_contexts: the helpers of notebook 04 agree with the caches they model."""

from __future__ import annotations

import numpy as np
import pytest

import nbkv
from nbkv.tutorial.long_contexts import (
    held_matrix,
    held_positions,
    speculate,
    trace_decode,
    window_reference,
)

from conftest import cpu_only

pytestmark = cpu_only


def _kv(rng, n, batch=2, heads=2, dim=4):
    k = rng.standard_normal((batch, heads, n, dim)).astype(np.float32)
    return k, rng.standard_normal(k.shape).astype(np.float32)


def test_held_positions_small_cases():
    assert held_positions(0, 4, 1).tolist() == []
    assert held_positions(3, 4, 1).tolist() == [0, 1, 2]
    assert held_positions(4, 4, 1).tolist() == [0, 1, 2, 3]
    assert held_positions(9, 4, 1).tolist() == [0, 6, 7, 8]
    assert held_positions(9, 4, 0).tolist() == [5, 6, 7, 8]
    with pytest.raises(ValueError):
        held_positions(3, 4, 4)


@pytest.mark.parametrize("window,sinks", [(5, 0), (5, 2), (8, 3), (3, 2)])
def test_held_positions_and_window_reference_match_a_rotating_cache(window, sinks):
    rng = np.random.default_rng(1)
    cache = nbkv.RotatingKVCache(
        window, sinks=sinks, batch=2, num_kv_heads=2, head_dim=4, dtype="float32"
    )
    K = V = None
    for step in range(20):
        k, v = _kv(rng, 1 + step % 3)
        cache.append(k, v)
        K = k if K is None else np.concatenate([K, k], axis=2)
        V = v if V is None else np.concatenate([V, v], axis=2)
        assert len(held_positions(cache.offset, window, sinks)) == cache.seq_len
        want_k, want_v = window_reference(K, V, window, sinks)
        got_k, got_v = cache.get_kv()
        np.testing.assert_array_equal(got_k, want_k)
        np.testing.assert_array_equal(got_v, want_v)


def test_held_matrix_columns_are_held_positions():
    m = held_matrix(6, 2, 15)
    assert m.shape == (15, 15)
    assert m.sum(axis=0).tolist() == [min(t + 1, 6) for t in range(15)]
    assert m[:2, 1:].all()  # the sinks, once seen, stay
    assert not m[2, -1]
    for t in range(15):
        assert np.flatnonzero(m[:, t]).tolist() == held_positions(t + 1, 6, 2).tolist()


def test_speculate_equals_never_seeing_the_rejected_tokens():
    rng = np.random.default_rng(2)
    kw = dict(batch=2, num_kv_heads=2, head_dim=4, dtype="float32")
    spec, plain = nbkv.LayerKVCache(64, **kw), nbkv.LayerKVCache(64, **kw)
    prompt = _kv(rng, 5)
    spec.append(*prompt)
    plain.append(*prompt)
    for accepted in (0, 2, 4, 1):
        dk, dv = _kv(rng, 4)
        assert speculate(spec, dk, dv, accepted) == 4 - accepted
        plain.append(dk[:, :, :accepted], dv[:, :, :accepted])
        assert spec.seq_len == plain.seq_len
        for a, b in zip(spec.get_kv(), plain.get_kv(), strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError):
        speculate(spec, dk, dv, 5)


def test_trace_decode_records_growth_and_rotation():
    grow = nbkv.LayerKVCache(
        16, batch=1, num_kv_heads=2, head_dim=4, dtype="float32", on_overflow="grow", grow_step=16
    )
    rows = trace_decode(grow, 10, chunk=5)
    assert rows["tokens"].tolist() == list(range(5, 55, 5))
    assert rows["seq_len"].tolist() == rows["tokens"].tolist()
    assert rows["capacity"].tolist() == [16, 16, 16, 32, 32, 32, 48, 48, 48, 64]
    assert rows["nbytes"].tolist() == (rows["capacity"] * 2 * 2 * 4 * 4).tolist()

    ring = nbkv.RotatingKVCache(8, sinks=2, batch=1, num_kv_heads=2, head_dim=4, dtype="float32")
    rows = trace_decode(ring, 20)
    assert rows["offset"].tolist() == list(range(1, 21))
    assert rows["seq_len"].tolist() == [min(t, 8) for t in range(1, 21)]
    assert set(rows["nbytes"].tolist()) == {8 * 2 * 2 * 4 * 4}


def test_trace_decode_needs_fixed_sizes():
    with pytest.raises(ValueError):
        trace_decode(nbkv.LayerKVCache(8), 2)
