"""nbkv.tutorial.long_contexts: the helpers of notebook 04 agree with the caches they model."""

from __future__ import annotations

import numpy as np
import pytest

import nbkv
from nbkv.models import Llama
from nbkv.tutorial.long_contexts import (
    held_matrix,
    held_positions,
    lookup_draft,
    speculative_greedy,
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


@pytest.fixture(scope="module")
def model():
    return Llama.default()


PROMPT = list(b"import os\nimport sys\nimport ")


def test_lookup_draft_copies_what_followed_the_last_match():
    assert bytes(lookup_draft(list(b"ab1 ab2 ab"), 2).tolist()) == b"2 "  # the latest "ab"
    assert bytes(lookup_draft(list(b"xyz-xy"), 4).tolist()) == b"z-xy"  # copies past the end
    assert bytes(lookup_draft(list(b"aaaa"), 3).tolist()) == b"aaa"
    assert lookup_draft(list(b"abcd"), 3).tolist() == []  # the last token never seen before
    assert lookup_draft(list(b"abab"), 0).tolist() == []
    assert lookup_draft(list(b"a"), 3).tolist() == []


@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_speculative_greedy_equals_greedy_and_its_cache_holds_what_was_accepted(model, k):
    new = 40
    want = model.generate(PROMPT, new, eos_token_id=None)[0]
    run = speculative_greedy(model, PROMPT, new, k=k)
    assert run.tokens.tolist() == want.tolist()
    assert run.forward_passes == 1 + len(run.accepted)
    assert (run.accepted <= run.drafted).all() and (run.drafted <= k).all()
    # each round keeps the token fed and the drafts accepted; the model's next token waits
    assert np.diff(np.r_[len(PROMPT), run.cache_len]).tolist() == (run.accepted + 1).tolist()
    assert run.cache_len[-1] == len(run.tokens) - 1
    if k:
        assert run.accepted.sum() > 0 and run.forward_passes < new  # the draft saved passes
    else:
        assert run.forward_passes == new  # plain greedy decoding, one token a pass


def test_speculative_greedy_is_exact_whatever_the_draft(model):
    new = 24
    want = model.generate(PROMPT, new, eos_token_id=None)[0].tolist()
    oracle = speculative_greedy(model, PROMPT, new, k=5, draft=lambda t, k: want[len(t) :][:k])
    assert oracle.tokens.tolist() == want and oracle.accepted.sum() == oracle.drafted.sum()
    assert oracle.forward_passes == 1 + -(-(new - 1) // 6)  # k + 1 tokens a pass

    def wrong(tokens, k):  # never the model's choice
        return [(want[len(tokens) + i] + 1) % 256 for i in range(min(k, len(want) - len(tokens)))]

    rejected = speculative_greedy(model, PROMPT, new, k=3, draft=wrong)
    assert rejected.tokens.tolist() == want and rejected.accepted.sum() == 0
    assert rejected.forward_passes == new


def test_speculative_greedy_rolls_back_a_cache_it_is_given(model):
    cache = model.new_cache(1, 128, dtype="float16")
    run = speculative_greedy(model, PROMPT, 30, k=4, cache=cache)
    assert cache.offset == cache.seq_len == run.cache_len[-1] == len(run.tokens) - 1
    with pytest.raises(ValueError, match="empty"):
        speculative_greedy(model, PROMPT, 5, cache=cache)
    with pytest.raises(ValueError):
        speculative_greedy(model, PROMPT, 0)


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
