"""nbkv.tutorial.heads: attention maps of a forward pass, and the patterns heads are scored on."""

from __future__ import annotations

import numpy as np
import pytest

import nbkv
from nbkv.models import DEFAULT_CONFIG, Llama, seeded_weights
from nbkv.tutorial.heads import PATTERNS, AttentionMaps, attention_maps, head_patterns

from conftest import cpu_only

pytestmark = cpu_only

CODE = np.frombuffer(b"def f(a, b):\n    return (a + b) * [a]\n", np.uint8).astype(np.int64)


def test_the_maps_come_from_the_models_own_forward_pass():
    maps = attention_maps(seeded_weights(), DEFAULT_CONFIG, CODE)
    n = len(CODE)
    assert maps.weights.shape == (4, 8, n, n)
    np.testing.assert_allclose(maps.weights.sum(-1), 1)
    assert np.allclose(np.triu(maps.weights, 1), 0)  # causal: nothing after the query
    np.testing.assert_allclose(
        maps.logits, Llama.seeded().forward_nocache(CODE[None])[0], atol=1e-3
    )


def test_each_pattern_scores_a_head_that_does_exactly_it_at_one():
    n = len(CODE)
    text = bytes(CODE.tolist())
    w = np.zeros((1, len(PATTERNS), n, n))
    for i in range(n):
        w[0, 0, i, max(i - 1, 0)] = 1  # previous byte
        w[0, 1, i, max(i - 2, 0)] = 1  # two back
        w[0, 2, i, 0] = 1  # the first byte
    close = text.index(b")")  # the ")" of "f(a, b)" closes the "(" at 5
    w[0, 3, close] = 0
    w[0, 3, close, 5] = 1
    scores = head_patterns(AttentionMaps(w, np.zeros((n, 256))), CODE, skip=8)
    assert scores["previous byte"][0, 0] == 1 and scores["two bytes back"][0, 1] == 1
    assert scores["first byte (sink)"][0, 2] == 1 and scores["previous byte"][0, 2] == 0
    assert scores["matching bracket"][0, 3] == pytest.approx(1 / 3)  # 1 of its 3 ")]" queries
    assert set(scores) == set(PATTERNS)


def test_bad_ids_are_typed_errors():
    with pytest.raises(nbkv.ShapeMismatchError):
        attention_maps(seeded_weights(), DEFAULT_CONFIG, np.zeros((2, 3), np.int64))
