"""nbkv.tutorial.shapes: KV-cache sizes, grouped-query head mapping, attention weights."""

from __future__ import annotations

import numpy as np
import pytest

import nbkv
from nbkv.errors import InvalidArgumentError, ShapeMismatchError
from nbkv.models import Llama
from nbkv.tutorial.shapes import (
    MODEL_SHAPES,
    ModelShape,
    attention_weights,
    default_weights,
    kv_bytes_per_token,
    kv_head_of,
)

from conftest import cpu_only

pytestmark = cpu_only


def test_bytes_per_token_published_shapes():
    by_name = {s.name: s for s in MODEL_SHAPES}
    assert by_name["Llama-2-7B"].kv_bytes_per_token() == 512 * 1024
    assert by_name["Llama-3-8B"].kv_bytes_per_token() == 128 * 1024
    assert by_name["Mistral-7B"].kv_bytes_per_token() == 128 * 1024
    assert by_name["Falcon-7B"].kv_bytes_per_token() == 8 * 1024
    assert [s.kind for s in MODEL_SHAPES] == [
        "multi-head",
        "grouped-query",
        "grouped-query",
        "multi-query",
    ]
    assert by_name["Llama-2-7B"].kv_cache_bytes(4096) == 2 * 2**30
    assert by_name["Llama-3-8B"].kv_cache_bytes(32768, batch=2) == 8 * 2**30


def test_bytes_per_token_dtype_and_group():
    assert kv_bytes_per_token(1, 1, 1, "float32") == 8
    assert kv_bytes_per_token(2, 4, 8, np.float64) == 2 * 2 * 4 * 8 * 8
    mha = ModelShape("m", 4, 16, 16, 64)
    gqa = ModelShape("g", 4, 16, 4, 64)
    assert mha.kv_bytes_per_token() == gqa.group * gqa.kv_bytes_per_token()


def test_bytes_match_an_nbkv_cache():
    model = Llama.default()
    shape = ModelShape.from_config(model.config, "default")
    cache = model.new_cache(batch=3, max_seq_len=40)
    assert cache.nbytes == shape.kv_cache_bytes(40, batch=3, dtype="float32")


def test_bad_shapes():
    with pytest.raises(InvalidArgumentError):
        ModelShape("x", 2, 8, 3, 64)
    with pytest.raises(InvalidArgumentError):
        kv_bytes_per_token(0, 1, 1)
    with pytest.raises(nbkv.DTypeMismatchError):
        kv_bytes_per_token(1, 1, 1, "int8")
    with pytest.raises(InvalidArgumentError):
        kv_head_of(8, 8, 2)
    with pytest.raises(InvalidArgumentError):
        kv_head_of(0, 8, 3)


def test_kv_head_of():
    assert [kv_head_of(h, 8, 8) for h in range(8)] == list(range(8))
    assert [kv_head_of(h, 6, 1) for h in range(6)] == [0] * 6
    assert [kv_head_of(h, 6, 3) for h in range(6)] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("n_q", [1, 3])
def test_attention_weights_times_v_is_reference(rng, group, n_q):
    q = rng.standard_normal((2, 2 * group, n_q, 8))
    K = rng.standard_normal((2, 2, 7, 8))
    V = rng.standard_normal((2, 2, 7, 8))
    w = attention_weights(q, K)
    assert w.shape == (2, 2 * group, n_q, 7)
    np.testing.assert_allclose(w.sum(-1), 1.0)
    # causal: query i (position 7 - n_q + i) sees nothing after itself
    for i in range(n_q):
        assert np.all(w[:, :, i, 7 - n_q + i + 1 :] == 0)
    Vh = np.repeat(V, group, axis=1)  # query head h reads KV head h // group
    np.testing.assert_allclose(w @ Vh, nbkv.reference.attention(q, K, V), atol=1e-12)


def test_attention_weights_bad_shapes():
    with pytest.raises(ShapeMismatchError):
        attention_weights(np.zeros((1, 3, 1, 4)), np.zeros((1, 2, 5, 4)))
    with pytest.raises(ShapeMismatchError):
        attention_weights(np.zeros((1, 2, 6, 4)), np.zeros((1, 2, 5, 4)))
    with pytest.raises(ShapeMismatchError):
        attention_weights(np.zeros((2, 4)), np.zeros((1, 2, 5, 4)))


def test_default_weights_are_the_default_models():
    config = Llama.default().config
    ids = np.array([[2, 72, 105, 33]])
    np.testing.assert_array_equal(
        Llama(config, default_weights()).forward_nocache(ids),
        Llama.default().forward_nocache(ids),
    )
