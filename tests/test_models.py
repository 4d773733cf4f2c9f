"""nbkv.models.Llama: cached decoding, checkpoints, generation, and transformers as referee."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import nbkv
from nbkv._safetensors import SafetensorsError, load_file, save_file
from nbkv.models import Llama, LlamaConfig
from nbkv.models.config import _inv_freq

from conftest import cpu_only

pytestmark = cpu_only

# float32 all the way, but cached and uncached attention sum in different orders
RTOL, ATOL = 1e-4, 1e-5

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # wavelengths of head_dim 10 at theta 5000 span 6 to 580: every branch of llama3 runs
    "original_max_position_embeddings": 64,
}


def tiny_config(**overrides) -> LlamaConfig:
    """GQA (6 query heads, 2 KV heads: group 3), head_dim 10, 2 layers."""
    kwargs = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=10,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_weights(config: LlamaConfig, seed: int = 1) -> dict[str, np.ndarray]:
    """Hugging Face-named float32 weights, scaled so that logits are well apart."""
    rng = np.random.default_rng(seed)
    c = config
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (c.hidden_size,),
                p + "self_attn.q_proj.weight": (q_dim, c.hidden_size),
                p + "self_attn.k_proj.weight": (kv_dim, c.hidden_size),
                p + "self_attn.v_proj.weight": (kv_dim, c.hidden_size),
                p + "self_attn.o_proj.weight": (c.hidden_size, q_dim),
                p + "post_attention_layernorm.weight": (c.hidden_size,),
                p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            }
        )
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            w = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            w = 1.5 * rng.standard_normal(shape) / math.sqrt(shape[1])
        out[name] = w.astype(np.float32)
    return out


def tokens(rng, config, shape) -> np.ndarray:
    # avoid the end token so that generation tests control where it appears
    ids = rng.integers(3, config.vocab_size, shape)
    return ids.astype(np.int64)


def assert_logits_close(got, want):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


# -- cached decoding against recomputation ------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize(
    "chunks",
    [
        [13] + [1] * 8,  # one prefill, then decode
        [5, 3, 1, 4] + [1] * 8,  # prefill in chunks
        [1] * 21,  # token by token from the start
    ],
    ids=["prefill", "chunked-prefill", "token-by-token"],
)
def test_cached_decoding_matches_recompute_without_cache(rng, layout, chunks):
    config = tiny_config(rope_scaling=LLAMA3)
    model = Llama(config, tiny_weights(config))
    ids = tokens(rng, config, (2, sum(chunks)))
    want = model.forward_nocache(ids)
    cache = model.new_cache(batch=2, max_seq_len=32, layout=layout)
    got, start = [], 0
    for n in chunks:
        got.append(model.forward(ids[:, start : start + n], cache))
        start += n
        assert cache.seq_len == start
    got = np.concatenate(got, axis=1)
    assert got.dtype == np.float32 and got.shape == (2, sum(chunks), config.vocab_size)
    assert_logits_close(got, want)


def test_sliding_window_cached_matches_recompute(rng):
    config = tiny_config(sliding_window=4)
    model = Llama(config, tiny_weights(config))
    ids = tokens(rng, config, (1, 15))
    cache = model.new_cache(max_seq_len=15)
    got = np.concatenate(
        [model.forward(ids[:, :6], cache)]
        + [model.forward(ids[:, t : t + 1], cache) for t in range(6, 15)],
        axis=1,
    )
    want = model.forward_nocache(ids)
    assert_logits_close(got, want)
    # and the window matters: without it the logits of late positions differ
    unwindowed = Llama(tiny_config(), tiny_weights(config)).forward_nocache(ids)
    assert not np.allclose(unwindowed[:, 5:], want[:, 5:], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(unwindowed[:, :4], want[:, :4], rtol=RTOL, atol=ATOL)


def test_default_model_is_the_shipped_one_and_cache_consistent():
    # (what it learned is in tests/test_default_model.py; the random model is Llama.seeded)
    model = Llama.default()
    assert model.config.vocab_size == 256 and model.config.num_key_value_heads == 2
    prompt = np.frombuffer(b"def main():\n    ", np.uint8).astype(np.int64)
    out = model.generate(prompt, 48, eos_token_id=None)
    assert out.shape == (1, 64) and out.dtype == np.int64
    np.testing.assert_array_equal(out, Llama.default().generate(prompt, 48, eos_token_id=None))
    # greedy from the cache is greedy from recomputation
    full = model.forward_nocache(out[:, :-1])
    np.testing.assert_array_equal(full[0, 15:].argmax(-1), out[0, 16:])


# -- checkpoints ---------------------------------------------------------------------


def write_checkpoint(path, config_dict, weights, dtype, shards=1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_dict))
    cast = {name: w.astype(dtype) for name, w in weights.items()}
    if shards == 1:
        save_file(cast, path / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(cast)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: cast[n] for n in part}, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def hf_config_dict(config: LlamaConfig, style: str) -> dict:
    """config.json as transformers 4 (top-level rope_theta, rope_scaling) or 5 writes it."""
    d = config.to_dict()
    scaling = d.pop("rope_scaling")
    theta = d.pop("rope_theta")
    if style == "rope_parameters":
        d["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    else:
        d["rope_theta"] = theta
        if scaling is not None:
            scaling = dict(scaling)
            scaling["type"] = scaling.pop("rope_type")  # the oldest spelling
        d["rope_scaling"] = scaling
    return d


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_from_pretrained_gives_the_model_of_the_same_weights(tmp_path, rng, dtype, tied, style):
    np_dtype = np.dtype(pytest.importorskip("ml_dtypes").bfloat16) if dtype == "bfloat16" else dtype
    config = tiny_config(rope_scaling=LLAMA3, tie_word_embeddings=tied, rope_theta=7000.0)
    weights = tiny_weights(config)
    write_checkpoint(tmp_path, hf_config_dict(config, style), weights, np_dtype)
    loaded = Llama.from_pretrained(tmp_path)
    assert loaded.config == config
    direct = Llama(config, {n: w.astype(np_dtype).astype(np.float32) for n, w in weights.items()})
    ids = tokens(rng, config, (2, 9))
    np.testing.assert_allclose(loaded.forward_nocache(ids), direct.forward_nocache(ids), rtol=1e-6)


def test_from_pretrained_reads_sharded_checkpoints(tmp_path, rng):
    config = tiny_config()
    weights = tiny_weights(config)
    write_checkpoint(tmp_path, hf_config_dict(config, "rope_parameters"), weights, np.float32, 3)
    assert (
        sorted(p.name for p in tmp_path.glob("*.safetensors"))[0]
        == "model-00001-of-00003.safetensors"
    )
    ids = tokens(rng, config, (1, 6))
    np.testing.assert_allclose(
        Llama.from_pretrained(tmp_path).forward_nocache(ids),
        Llama(config, weights).forward_nocache(ids),
        rtol=1e-6,
    )


def test_from_dict_finds_rope_theta_wherever_the_config_keeps_it():
    base = tiny_config().to_dict()
    base.pop("rope_theta")
    base.pop("rope_scaling")
    assert LlamaConfig.from_dict(base).rope_theta == 10000.0
    assert LlamaConfig.from_dict({**base, "rope_theta": 123.0}).rope_theta == 123.0
    new = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 456.0}}
    c = LlamaConfig.from_dict(new)
    assert (c.rope_theta, c.rope_scaling) == (456.0, None)
    # inside rope_parameters wins over the top level, as in transformers
    assert LlamaConfig.from_dict({**new, "rope_theta": 1.0}).rope_theta == 456.0
    mid = {**base, "rope_scaling": {**LLAMA3, "rope_theta": 789.0}}
    c = LlamaConfig.from_dict(mid)
    assert c.rope_theta == 789.0 and c.rope_scaling["factor"] == 4.0
    # original_max_position_embeddings falls back to max_position_embeddings
    short = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    c = LlamaConfig.from_dict({**base, "rope_scaling": short})
    assert c.rope_scaling["original_max_position_embeddings"] == base["max_position_embeddings"]
    # end tokens: a list, or none at all
    assert LlamaConfig.from_dict({**base, "eos_token_id": [2, 5]}).eos_token_ids == (2, 5)
    assert LlamaConfig.from_dict({**base, "eos_token_id": None}).eos_token_ids == ()
    assert LlamaConfig.from_dict({**base, "head_dim": None}).head_dim == 48 // 6


def test_llama3_inverse_frequencies_follow_the_published_formula():
    config = tiny_config(rope_scaling=LLAMA3)
    factor, low, high, old = 4.0, 1.0, 4.0, 64
    want = []
    for i in range(0, 10, 2):
        f = 1.0 / 5000.0 ** (i / 10)
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            want.append(f)
        elif wavelen > old / low:
            want.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            want.append((1 - smooth) * f / factor + smooth * f)
    got = _inv_freq(config)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[0] == want[0] and got[-1] < 1.0 / 5000.0**0.8  # kept, and divided


# -- transformers as referee ---------------------------------------------------------


def test_logits_and_greedy_tokens_match_transformers(tmp_path, rng):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=10,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={**LLAMA3, "rope_theta": 5000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # training-scale 0.02 weights give near-uniform logits
        for p in hf.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.5 / math.sqrt(p.shape[1]))
    hf.save_pretrained(tmp_path, safe_serialization=True)

    model = Llama.from_pretrained(tmp_path)
    assert model.config.rope_scaling["rope_type"] == "llama3"
    assert "lm_head.weight" in load_file(tmp_path / "model.safetensors")  # untied
    ids = tokens(rng, model.config, (2, 11))
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(model.forward_nocache(ids), want, atol=1e-4, rtol=1e-4)
    cache = model.new_cache(batch=2, max_seq_len=11)
    cached = np.concatenate([model.forward(ids[:, :7], cache), model.forward(ids[:, 7:], cache)], 1)
    np.testing.assert_allclose(cached, want, atol=1e-4, rtol=1e-4)

    with torch.no_grad():
        hf_tokens = hf.generate(
            torch.from_numpy(ids[:, :5]),
            attention_mask=torch.ones((2, 5), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
        ).numpy()
    np.testing.assert_array_equal(model.generate(ids[:, :5], 12), hf_tokens)


# -- generation ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    config = tiny_config()
    return Llama(config, tiny_weights(config))


def greedy_by_recompute(model, prompt, n):
    ids = prompt
    for _ in range(n):
        nxt = model.forward_nocache(ids)[:, -1].argmax(-1)
        ids = np.concatenate([ids, nxt[:, None]], axis=1)
    return ids


def test_greedy_generation_is_deterministic_and_equals_recompute(tiny, rng):
    prompt = tokens(rng, tiny.config, (2, 6))
    out = tiny.generate(prompt, 10, eos_token_id=None)
    assert out.shape == (2, 16) and out.dtype == np.int64
    np.testing.assert_array_equal(out, tiny.generate(prompt, 10, eos_token_id=None))
    np.testing.assert_array_equal(out, greedy_by_recompute(tiny, prompt, 10))


def test_one_dimensional_prompt_is_batch_one(tiny, rng):
    prompt = tokens(rng, tiny.config, (7,))
    out = tiny.generate(prompt.tolist(), 3, eos_token_id=None)
    np.testing.assert_array_equal(out, tiny.generate(prompt[None], 3, eos_token_id=None))
    assert out.shape == (1, 10)
    assert tiny.generate(prompt, 0).shape == (1, 7)


def test_generation_stops_at_the_end_token(tiny, rng):
    prompt = tokens(rng, tiny.config, (1, 6))
    free = tiny.generate(prompt, 12, eos_token_id=None)[0, 6:]
    # the first token that did not appear before it: greedy must stop right there
    step = next(i for i in range(2, 12) if free[i] not in free[:i])
    eos = int(free[step])
    stopped = tiny.generate(prompt, 12, eos_token_id=eos)
    np.testing.assert_array_equal(stopped[0, 6:], free[: step + 1])
    assert stopped[0, -1] == eos
    # a list of end tokens, and the config's end token by default
    np.testing.assert_array_equal(tiny.generate(prompt, 12, eos_token_id=[96, eos]), stopped)
    as_config = Llama(tiny_config(eos_token_id=eos), tiny_weights(tiny.config))
    np.testing.assert_array_equal(as_config.generate(prompt, 12), stopped)
    np.testing.assert_array_equal(as_config.generate(prompt, 12, eos_token_id=None)[0, 6:], free)


def test_batch_rows_finish_apart_and_are_padded_with_the_end_token(tiny, rng):
    prompts = tokens(rng, tiny.config, (2, 5))
    free = tiny.generate(prompts, 10, eos_token_id=None)[:, 5:]
    # an end token that row 0 reaches first, at step s, and row 1 never, or later
    for s, eos in ((s, int(free[0, s])) for s in range(10)):
        if eos not in free[0, :s] and eos not in free[1, : s + 1]:
            break
    else:
        pytest.skip("no token separates the rows")
    out = tiny.generate(prompts, 10, eos_token_id=eos)
    np.testing.assert_array_equal(out[0, 5 : 5 + s + 1], free[0, : s + 1])
    assert (out[0, 5 + s :] == eos).all()
    row1 = tiny.generate(prompts[1:], 10, eos_token_id=eos)[0]
    np.testing.assert_array_equal(out[1, : len(row1)], row1)
    assert (out[1, len(row1) :] == eos).all()


def test_generation_continues_a_cache_it_is_given(tiny, rng):
    first, second = tokens(rng, tiny.config, (1, 5)), tokens(rng, tiny.config, (1, 4))
    cache = tiny.new_cache(max_seq_len=20)
    tiny.forward(first, cache)
    out = tiny.generate(second, 6, eos_token_id=None, cache=cache)
    assert cache.seq_len == 5 + 4 + 5  # the last new token is never fed back
    whole = tiny.generate(np.concatenate([first, second], 1), 6, eos_token_id=None)
    np.testing.assert_array_equal(out, whole[:, 5:])


def test_sampling_is_seeded_and_callback_sees_every_step(tiny, rng):
    prompt = tokens(rng, tiny.config, (2, 4))
    seen = []
    a = tiny.generate(
        prompt,
        8,
        temperature=1.5,
        seed=7,
        eos_token_id=None,
        callback=lambda s, t: seen.append((s, t)),
    )
    b = tiny.generate(prompt, 8, temperature=1.5, seed=7, eos_token_id=None)
    c = tiny.generate(prompt, 8, temperature=1.5, seed=8, eos_token_id=None)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert [s for s, _ in seen] == list(range(8))
    np.testing.assert_array_equal(np.stack([t for _, t in seen], 1), a[:, 4:])
    assert a.min() >= 0 and a.max() < tiny.config.vocab_size


# -- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (
            [[5, 97]],
            nbkv.InvalidArgumentError,
            r"prompt_ids must be in \[0, vocab_size=97\), got 97",
        ),
        ([[-1, 5]], nbkv.InvalidArgumentError, "got -1 at index"),
        ([[1.0, 2.0]], nbkv.ArgumentTypeError, "integer token ids, got dtype float64"),
        (np.ones((1, 2, 3), np.int64), nbkv.ShapeMismatchError, r"1-D \[n\] or 2-D"),
        (np.ones((1, 0), np.int64), nbkv.InvalidArgumentError, "at least one token"),
        ([[1, 2], [3]], nbkv.ArgumentTypeError, "integer array"),
        (None, nbkv.ArgumentTypeError, "integer token ids"),
    ],
)
def test_bad_token_ids_raise(tiny, ids, error, match):
    with pytest.raises(error, match=match):
        tiny.generate(ids, 2)
    with pytest.raises(error, match=match.replace("prompt_ids", "token_ids")):
        tiny.forward(ids, tiny.new_cache(max_seq_len=8))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_new_tokens": -1}, nbkv.InvalidArgumentError, "max_new_tokens must be >= 0, got -1"),
        ({"max_new_tokens": 2.0}, nbkv.ArgumentTypeError, "max_new_tokens must be an int"),
        ({"temperature": -0.5}, nbkv.InvalidArgumentError, "temperature must be >= 0"),
        ({"temperature": float("nan")}, nbkv.InvalidArgumentError, "temperature"),
        ({"eos_token_id": -3}, nbkv.InvalidArgumentError, "eos_token_id"),
        ({"callback": 3}, nbkv.ArgumentTypeError, "callback must be callable"),
    ],
)
def test_bad_generate_arguments_raise(tiny, kwargs, error, match):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(error, match=match):
        tiny.generate([[5, 6]], **kwargs)


def test_prompt_longer_than_the_cache_raises_and_writes_nothing(tiny, rng):
    cache = tiny.new_cache(max_seq_len=8)
    with pytest.raises(nbkv.CacheOverflowError, match="build it with max_seq_len >= 13"):
        tiny.generate(tokens(rng, tiny.config, (1, 6)), 8, cache=cache)
    with pytest.raises(nbkv.CacheOverflowError, match="need 9 positions"):
        tiny.forward(tokens(rng, tiny.config, (1, 9)), cache)
    assert cache.seq_len == 0 and cache.is_empty


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda m: nbkv.KVCache(3, 8, batch=1, num_kv_heads=2, head_dim=10),
            nbkv.InvalidArgumentError,
            "3 layers",
        ),
        (lambda m: m.new_cache(batch=2, max_seq_len=8), nbkv.ShapeMismatchError, "batch 2"),
        (lambda m: nbkv.KVCache(2, 8, num_kv_heads=3), nbkv.ShapeMismatchError, "num_kv_heads 3"),
        (lambda m: nbkv.KVCache(2, 8, head_dim=8), nbkv.ShapeMismatchError, "head_dim 8"),
        (lambda m: nbkv.KVCache(2, 8, dtype="float64"), nbkv.DTypeMismatchError, "float32"),
        (lambda m: {"not": "a cache"}, nbkv.ArgumentTypeError, "nbkv.KVCache"),
    ],
)
def test_caches_that_do_not_fit_the_model_raise(tiny, make, error, match):
    with pytest.raises(error, match=match):
        tiny.forward([[4, 5]], make(tiny))


def test_lazy_cache_of_the_right_shape_works(tiny, rng):
    ids = tokens(rng, tiny.config, (1, 5))
    lazy = nbkv.KVCache(2, 16)
    assert_logits_close(tiny.forward(ids, lazy), tiny.forward_nocache(ids))
    assert lazy.dtype == np.float32 and lazy[0].num_kv_heads == 2


def test_bad_weights_and_configs_raise():
    config = tiny_config()
    weights = tiny_weights(config)
    with pytest.raises(nbkv.InvalidArgumentError, match="lack 1 .*lm_head.weight.*unties"):
        Llama(config, {k: v for k, v in weights.items() if k != "lm_head.weight"})
    with pytest.raises(nbkv.InvalidArgumentError, match="q_proj.bias"):
        Llama(config, {**weights, "model.layers.0.self_attn.q_proj.bias": np.ones(60, np.float32)})
    bad = {**weights, "model.norm.weight": np.ones(47, np.float32)}
    with pytest.raises(nbkv.ShapeMismatchError, match=r"model.norm.weight.*\(47,\).*\(48,\)"):
        Llama(config, bad)
    with pytest.raises(nbkv.DTypeMismatchError, match="floating point"):
        Llama(config, {**weights, "model.norm.weight": np.ones(48, np.int32)})
    with pytest.raises(nbkv.InvalidArgumentError, match="device"):
        Llama(config, weights, device="tpu")
    with pytest.raises(nbkv.ArgumentTypeError, match="LlamaConfig"):
        Llama(config.to_dict(), weights)
    with pytest.raises(nbkv.InvalidArgumentError, match="must divide num_attention_heads = 6"):
        tiny_config(num_key_value_heads=4)
    with pytest.raises(nbkv.InvalidArgumentError, match="head_dim must be even"):
        tiny_config(head_dim=9)
    with pytest.raises(nbkv.InvalidArgumentError, match="rope_scaling type"):
        tiny_config(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(nbkv.InvalidArgumentError, match="high_freq_factor > low_freq_factor"):
        tiny_config(rope_scaling={**LLAMA3, "high_freq_factor": 0.5})
    d = config.to_dict()
    for change, match in (
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_size": None}, "lacks hidden_size"),
    ):
        with pytest.raises(nbkv.InvalidArgumentError, match=match):
            LlamaConfig.from_dict({**d, **change})


def test_from_pretrained_errors_name_the_problem(tmp_path):
    with pytest.raises(nbkv.InvalidArgumentError, match="checkpoint directory"):
        Llama.from_pretrained(tmp_path / "missing")
    with pytest.raises(nbkv.InvalidArgumentError, match="no config.json"):
        Llama.from_pretrained(tmp_path)
    config = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(nbkv.InvalidArgumentError, match="never read"):
        Llama.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00")
    with pytest.raises(SafetensorsError, match="truncated"):
        Llama.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}})
    )
    with pytest.raises(SafetensorsError, match="must be a file name"):
        Llama.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(nbkv.InvalidArgumentError, match="not valid JSON"):
        Llama.from_pretrained(tmp_path)
