"""nbkv.tutorial.heads: attention maps of a forward pass, and the patterns heads are scored on."""

from __future__ import annotations

import numpy as np
import pytest

import nbkv
from nbkv.models import DEFAULT_CONFIG, Llama, seeded_weights
from nbkv.tutorial.heads import (
    PATTERNS,
    AttentionMaps,
    attention_maps,
    head_patterns,
    sharpness,
)

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


def test_current_byte_and_line_above_pick_the_right_keys():
    text = b"ab(c\nxyz\n1\nuv"
    ids = np.frombuffer(text, np.uint8).astype(np.int64)
    n = len(ids)
    eye = np.eye(n)[None, None]  # one head, each query on itself
    above = np.zeros((1, 1, n, n))
    above[0, 0, np.arange(n), 0] = 1
    # x<-a, y<-b, z<-(, the newline after z <-c, 1<-x, its newline <-y, u<-1
    for i, j in {5: 0, 6: 1, 7: 2, 8: 3, 9: 5, 10: 6, 11: 9}.items():
        above[0, 0, i] = 0
        above[0, 0, i, j] = 1
    s_eye = head_patterns(AttentionMaps(eye, np.zeros((n, 256))), ids, skip=1)
    s_above = head_patterns(AttentionMaps(above, np.zeros((n, 256))), ids, skip=1)
    assert s_eye["current byte"][0, 0] == 1 and s_eye["previous byte"][0, 0] == 0
    # every query with a byte right above it scores 1; v is not one of them (above it is
    # the newline that ends "1"), nor are the bytes of the first line
    assert s_above["line above (same column)"][0, 0] == 1


def test_sharpness_is_one_hot_or_uniform_at_the_extremes():
    n = 6
    one_hot = np.eye(n)
    uniform = np.tril(np.ones((n, n)))
    uniform /= uniform.sum(-1, keepdims=True)
    s = sharpness(np.stack([one_hot, uniform]), skip=2)
    np.testing.assert_allclose(s.max_weight, [1, np.mean(1 / np.arange(3, n + 1))])
    np.testing.assert_allclose(s.entropy, [0, np.mean(np.log(np.arange(3, n + 1)))])
    assert s.uniform_entropy == pytest.approx(s.entropy[1])
    # one decode step: a single query that sees every key
    step = np.full((3, 1, 4), 0.25)
    assert sharpness(step).uniform_entropy == pytest.approx(np.log(4))
    with pytest.raises(nbkv.ShapeMismatchError):
        sharpness(np.ones((3, 2)))
    with pytest.raises(nbkv.InvalidArgumentError):
        sharpness(one_hot, skip=n)


def test_bad_ids_are_typed_errors():
    with pytest.raises(nbkv.ShapeMismatchError):
        attention_maps(seeded_weights(), DEFAULT_CONFIG, np.zeros((2, 3), np.int64))
