"""nbkv.tutorial.shapes: KV-cache sizes, grouped-query head mapping, attention weights."""

from __future__ import annotations

import dataclasses

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
    forward_cost,
    held_positions,
    kv_bytes_per_token,
    kv_head_of,
    model_shape,
)

from conftest import cpu_only

pytestmark = cpu_only


def test_bytes_per_token_published_shapes():
    by_name = {s.name: s for s in MODEL_SHAPES}
    kib = {name: s.kv_bytes_per_token() // 1024 for name, s in by_name.items()}
    assert kib == {
        "Llama-2-7B": 512,
        "Llama-3.1-8B": 128,
        "Llama-3.1-70B": 320,
        "Mistral-7B-v0.1": 128,
        "Qwen2.5-7B": 56,
        "Gemma-2-9B": 336,
        "Falcon-7B": 8,
    }
    assert [s.kind for s in MODEL_SHAPES] == ["multi-head"] + ["grouped-query"] * 5 + [
        "multi-query"
    ]
    assert by_name["Llama-2-7B"].kv_cache_bytes(4096) == 2 * 2**30
    assert by_name["Llama-3.1-8B"].kv_cache_bytes(32768, batch=2) == 8 * 2**30
    assert by_name["Llama-3.1-8B"].kv_cache_bytes(131072) == 16 * 2**30


def test_published_parameter_counts_are_reproduced():
    # the counts the model cards give: 6.74B, 8.03B, 70.6B
    assert model_shape("Llama-2-7B").num_parameters() == 6_738_415_616
    assert model_shape("Llama-3.1-8B").num_parameters() == 8_030_261_248
    assert model_shape("Llama-3.1-70B").num_parameters() == 70_553_706_496
    with pytest.raises(InvalidArgumentError, match="hidden_size"):
        model_shape("Qwen2.5-7B").num_parameters()
    with pytest.raises(InvalidArgumentError, match="no model shape"):
        model_shape("GPT-5")


def test_parameters_match_the_default_model():
    model = Llama.default()
    shape = ModelShape.from_config(model.config)
    assert shape.num_parameters() == model.num_parameters
    kw = dict(hidden_size=8, intermediate_size=8, vocab_size=16)
    tied = ModelShape("t", 1, 2, 1, 4, tie_word_embeddings=True, **kw)
    untied = ModelShape("u", 1, 2, 1, 4, **kw)
    assert untied.num_parameters() - tied.num_parameters() == 16 * 8


def test_a_windowed_layer_stops_growing_at_its_window():
    mistral, gemma = model_shape("Mistral-7B-v0.1"), model_shape("Gemma-2-9B")
    per_token = mistral.kv_bytes_per_token()
    assert mistral.kv_cache_bytes(4096) == 4096 * per_token
    assert mistral.kv_cache_bytes(8192) == mistral.kv_cache_bytes(4096)  # the rolling buffer
    assert mistral.kv_cache_bytes(100, batch=3) == 3 * 100 * per_token
    # Gemma-2: 21 local layers stop at 4,096, the 21 global ones grow to 8,192
    per_layer = gemma.kv_bytes_per_token() // 42
    assert gemma.kv_cache_bytes(8192) == (21 * 4096 + 21 * 8192) * per_layer
    assert gemma.kv_cache_bytes(4096) == 42 * 4096 * per_layer
    assert gemma.kv_positions(6000) == 21 * 4096 + 21 * 6000
    assert held_positions(5, None) == 5 and held_positions(5, 3) == 3 and held_positions(0, 3) == 0


def test_sizing_past_the_context_limit_raises():
    llama2 = model_shape("Llama-2-7B")
    with pytest.raises(InvalidArgumentError, match="context of 4,096"):
        llama2.kv_cache_bytes(32768)
    with pytest.raises(InvalidArgumentError, match="context"):
        forward_cost(llama2, 1, past=4096)
    assert ModelShape("no limit", 1, 1, 1, 1).kv_cache_bytes(10**6) == 4 * 10**6


def test_window_bytes_match_an_nbkv_rotating_cache():
    model = Llama.default()
    shape = ModelShape.from_config(model.config)
    windowed = dataclasses.replace(shape, sliding_window=16, max_context=None)
    cache = model.new_cache(batch=3, window=16)
    assert cache.nbytes == windowed.kv_cache_bytes(40, batch=3, dtype="float32")


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
    with pytest.raises(InvalidArgumentError, match="sliding_window"):
        ModelShape("x", 2, 8, 2, 64, window_layers=1)
    with pytest.raises(InvalidArgumentError, match="at most"):
        ModelShape("x", 2, 8, 2, 64, sliding_window=16, window_layers=3)
    with pytest.raises(InvalidArgumentError):
        ModelShape("x", 2, 8, 2, 64, sliding_window=0)
    with pytest.raises(InvalidArgumentError):
        kv_bytes_per_token(0, 1, 1)
    with pytest.raises(nbkv.DTypeMismatchError):
        kv_bytes_per_token(1, 1, 1, "int8")
    with pytest.raises(InvalidArgumentError):
        kv_head_of(8, 8, 2)
    with pytest.raises(InvalidArgumentError):
        kv_head_of(0, 8, 3)


def _brute_force_cost(shape, tokens, past, batch, itemsize):
    """forward_cost by loops over layers, queries and keys."""
    flops = attn = read = 0
    for layer in range(shape.num_layers):
        window = shape.sliding_window if layer < shape.num_window_layers else None
        seen = set()
        for p in range(past, past + tokens):
            keys = [j for j in range(p + 1) if window is None or p - j < window]
            attn += 4 * shape.num_attention_heads * shape.head_dim * len(keys)
            seen.update(keys)
        read += len(seen) * 2 * shape.num_kv_heads * shape.head_dim * itemsize
    flops = 2 * shape.matmul_parameters() * tokens
    write = shape.num_layers * tokens * 2 * shape.num_kv_heads * shape.head_dim * itemsize
    return batch * flops, batch * attn, batch * read, batch * write


@pytest.mark.parametrize("window, window_layers", [(None, None), (5, None), (5, 2), (1, 1)])
@pytest.mark.parametrize("tokens, past", [(1, 0), (1, 9), (7, 0), (12, 0), (3, 3), (4, 8)])
def test_forward_cost_counts_what_loops_count(window, window_layers, tokens, past):
    shape = ModelShape(
        "toy", 3, 4, 2, 8, sliding_window=window, window_layers=window_layers,
        hidden_size=16, intermediate_size=24, vocab_size=32,
    )  # fmt: skip
    c = forward_cost(shape, tokens, past, batch=2, dtype="float32")
    want = _brute_force_cost(shape, tokens, past, 2, 4)
    assert (c.weight_flops, c.attention_flops, c.kv_read_bytes, c.kv_write_bytes) == want
    assert c.weight_bytes == shape.matmul_parameters() * 4  # once, whatever the batch
    assert c.flops == c.weight_flops + c.attention_flops
    assert c.flops_per_byte == c.flops / c.bytes


def test_prefill_is_compute_bound_and_decode_memory_bound():
    llama = model_shape("Llama-3.1-8B")
    prefill, decode = forward_cost(llama, 2048), forward_cost(llama, 1, past=2048)
    assert prefill.flops_per_byte > 1000 and decode.flops_per_byte < 2
    # attention at the same context: 4 * n_q * S * heads * head_dim per layer, S = 2,049
    assert decode.attention_flops == 32 * 4 * 1 * 2049 * 32 * 128
    assert decode.kv_read_bytes == 32 * 2 * 2049 * 8 * 128 * 2
    # causal prefill attends to half the square (plus the diagonal)
    assert prefill.attention_flops == 32 * 4 * (2048 * 2049 // 2) * 32 * 128
    # batching decode shares the weight reads: more FLOPs per byte
    assert forward_cost(llama, 1, past=2048, batch=64).flops_per_byte > 20 * decode.flops_per_byte
    with pytest.raises(InvalidArgumentError):
        forward_cost(llama, 0)


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
