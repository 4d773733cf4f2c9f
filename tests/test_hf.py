"""nbkv.interop.hf.NbkvCache: a transformers Cache over nbkv buffers.

A tiny, randomly initialised Llama (grouped-query attention), built from a config in code:
nothing is downloaded. Every result is compared with transformers' own DynamicCache.
"""

from __future__ import annotations

import copy
import inspect
import types
import warnings

import numpy as np
import pytest

from conftest import cpu_only

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import nbkv  # noqa: E402
from nbkv.interop.hf import NbkvCache  # noqa: E402

pytestmark = cpu_only

DynamicCache = transformers.DynamicCache
LlamaConfig = transformers.LlamaConfig
LlamaForCausalLM = transformers.LlamaForCausalLM

# transformers 5 renamed generate's and forward's `past_key_values` to `cache`
CACHE_KW = (
    "cache"
    if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters
    else "past_key_values"
)
CACHE_KWS = sorted({CACHE_KW, "past_key_values"})

F32 = {"rtol": 1e-5, "atol": 1e-5}
PROMPT_LEN, NEW_TOKENS, CAPACITY = 7, 12, 32


def make_config(**kw) -> LlamaConfig:
    sizes = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query: two query heads per KV head
        head_dim=16,
        vocab_size=128,
        initializer_range=0.3,  # wide enough that greedy decoding does not just repeat
        bos_token_id=None,
        eos_token_id=None,  # never stop early: every run generates NEW_TOKENS
        pad_token_id=0,
    )
    return LlamaConfig(**(sizes | kw))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(make_config()).eval()


@pytest.fixture(scope="module")
def bf16_model():
    torch.manual_seed(0)
    pytest.importorskip("ml_dtypes")
    config = make_config(dtype="bfloat16")
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def prompt(batch: int, length: int = PROMPT_LEN, seed: int = 1):
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate(model, ids, cache, keyword=CACHE_KW, **kw):
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True) | kw
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values= under transformers 5
        return model.generate(ids, attention_mask=torch.ones_like(ids), **{keyword: cache}, **kw)


def forward(model, ids, cache):
    with torch.no_grad():
        return model(ids, **{CACHE_KW: cache}, use_cache=True).logits


def buffer_of(view: np.ndarray) -> np.ndarray:
    """The whole nbkv buffer a get_kv view looks into."""
    return view if view.base is None else view.base


def assert_inside(tensor, view: np.ndarray) -> None:
    buf = buffer_of(view)
    start = buf.__array_interface__["data"][0]
    assert start <= tensor.data_ptr() < start + buf.nbytes


def held(cache: NbkvCache, i: int):
    """Layer i's positions, as torch copies in the cache's dtype."""
    k, v = cache.nbkv[i].get_kv()
    if cache.dtype == torch.bfloat16:
        return (torch.from_numpy(np.array(x).view(np.int16)).view(torch.bfloat16) for x in (k, v))
    return torch.from_numpy(np.array(k)), torch.from_numpy(np.array(v))


# -- generate --------------------------------------------------------------------------


@pytest.mark.parametrize("keyword", CACHE_KWS)
@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_generate_gives_dynamic_cache_tokens_and_logits(model, batch, keyword):
    ids = prompt(batch)
    ours = generate(
        model, ids, NbkvCache(model.config, CAPACITY, batch_size=batch), keyword, output_logits=True
    )
    theirs = generate(model, ids, DynamicCache(config=model.config), output_logits=True)
    assert ours.sequences.shape == (batch, PROMPT_LEN + NEW_TOKENS)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.logits) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits, strict=True)):
        torch.testing.assert_close(a, b, **F32, msg=lambda m, s=step: f"step {s}: {m}")


def test_generate_with_left_padding_gives_dynamic_cache_tokens(model):
    ids = prompt(2)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0  # row 0 is a shorter, left-padded prompt
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    ours = model.generate(ids, **kw, **{CACHE_KW: NbkvCache(model.config, CAPACITY, batch_size=2)})
    theirs = model.generate(ids, **kw, **{CACHE_KW: DynamicCache(config=model.config)})
    assert torch.equal(ours, theirs)


def test_buffers_hold_what_dynamic_cache_holds_after_generate(model):
    ids = prompt(2)
    ours = NbkvCache(model.config, CAPACITY, batch_size=2)
    theirs = DynamicCache(config=model.config)
    generate(model, ids, ours)
    generate(model, ids, theirs)
    # the last generated token is never fed back, so it has no K/V
    expected_len = PROMPT_LEN + NEW_TOKENS - 1
    assert ours.get_seq_length() == ours.nbkv.seq_len == theirs.get_seq_length() == expected_len
    for i in range(model.config.num_hidden_layers):
        k, v = held(ours, i)
        assert k.shape == (2, 2, expected_len, 16)
        torch.testing.assert_close(k, theirs.layers[i].keys, **F32)
        torch.testing.assert_close(v, theirs.layers[i].values, **F32)


def test_beam_search_reorders_like_dynamic_cache(model, monkeypatch):
    calls = []
    reorder = NbkvCache.reorder_cache
    monkeypatch.setattr(
        NbkvCache, "reorder_cache", lambda self, idx: calls.append(idx) or reorder(self, idx)
    )
    ids = prompt(1)
    kw = dict(num_beams=2, max_new_tokens=8, do_sample=False)
    ours = model.generate(ids, **kw, **{CACHE_KW: NbkvCache(model.config, CAPACITY, batch_size=2)})
    theirs = model.generate(ids, **kw, **{CACHE_KW: DynamicCache(config=model.config)})
    assert calls, "beam search never reordered the cache"
    assert torch.equal(ours, theirs)


# -- forward, step by step -------------------------------------------------------------


def test_stepwise_forward_logits_match_dynamic_cache(model):
    ids = prompt(2, length=PROMPT_LEN + 5)
    ours, theirs = (
        NbkvCache(model.config, CAPACITY, batch_size=2),
        DynamicCache(config=model.config),
    )
    # a prefill in two chunks (the second attends to the first), then one token a step
    chunks = [(0, 4), (4, PROMPT_LEN)] + [(t, t + 1) for t in range(PROMPT_LEN, PROMPT_LEN + 5)]
    for start, stop in chunks:
        a = forward(model, ids[:, start:stop], ours)
        b = forward(model, ids[:, start:stop], theirs)
        torch.testing.assert_close(a, b, **F32)
        assert ours.get_seq_length() == theirs.get_seq_length() == stop


def test_mask_sizes_are_dynamic_cache_sizes(model):
    ours, theirs = NbkvCache(model.config, CAPACITY), DynamicCache(config=model.config)
    for cache in (ours, theirs):
        forward(model, prompt(1), cache)
    for query_length in (1, 3):
        arg = query_length if CACHE_KW == "cache" else torch.arange(query_length)
        # the positions held plus those about to be written, never the capacity
        assert ours.get_mask_sizes(arg, 0) == theirs.get_mask_sizes(arg, 0)
        assert ours.get_mask_sizes(arg, 0) == (PROMPT_LEN + query_length, 0)
    assert ours.layers[0].get_max_length() == ours.layers[0].get_max_cache_shape() == CAPACITY
    assert ours.max_cache_len == CAPACITY and not ours.is_compileable


# -- no copies -------------------------------------------------------------------------


def test_update_returns_views_of_nbkv_buffers():
    cache = NbkvCache(make_config(), 8, batch_size=2)
    k = torch.randn(2, 2, 3, 16)
    v = torch.randn(2, 16, 3, 2).transpose(1, 3)  # any strides are taken as they are
    keys, values = cache.update(k, v, 1)
    K, V = cache.nbkv[1].get_kv()
    assert keys.data_ptr() == K.ctypes.data and values.data_ptr() == V.ctypes.data
    assert_inside(keys, K) and assert_inside(values, V)
    assert torch.equal(keys, k) and torch.equal(values, v)
    K[0, 0, 0, 0] = 1234.0  # one memory: a write through nbkv's view shows in the tensor
    assert keys[0, 0, 0, 0].item() == 1234.0
    k.add_(1.0)  # but the input was copied in, not kept
    assert not torch.equal(keys[1], k[1])
    # the next update returns longer views of the same memory
    keys2, _ = cache.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), 1)
    assert keys2.shape == (2, 2, 4, 16) and keys2.data_ptr() == keys.data_ptr()


def test_model_attends_over_nbkv_memory(model, monkeypatch):
    cache = NbkvCache(model.config, CAPACITY)
    returned = []
    update = type(cache.layers[0]).update

    def spy(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        returned.append((self, out))
        return out

    monkeypatch.setattr(type(cache.layers[0]), "update", spy)
    forward(model, prompt(1), cache)
    assert len(returned) == model.config.num_hidden_layers
    for layer, (keys, values) in returned:
        K, V = layer.nbkv.get_kv()
        assert_inside(keys, K) and assert_inside(values, V)


# -- capacity and errors ---------------------------------------------------------------


def test_forward_past_capacity_raises_and_changes_nothing(model):
    cache = NbkvCache(model.config, PROMPT_LEN + 1)
    ids = prompt(1, length=PROMPT_LEN + 3)
    forward(model, ids[:, :PROMPT_LEN], cache)
    before = [tuple(held(cache, i)) for i in range(len(cache))]
    with pytest.raises(nbkv.CacheOverflowError, match="1 are free"):
        forward(model, ids[:, PROMPT_LEN : PROMPT_LEN + 2], cache)
    assert cache.get_seq_length() == cache.nbkv.seq_len == PROMPT_LEN
    assert all(layer.seq_len == PROMPT_LEN for layer in cache.nbkv)
    for i, (k, v) in enumerate(before):
        k2, v2 = held(cache, i)
        assert torch.equal(k, k2) and torch.equal(v, v2)
    # still usable: the one position left takes the next token, as DynamicCache would
    theirs = DynamicCache(config=model.config)
    forward(model, ids[:, :PROMPT_LEN], theirs)
    step = ids[:, PROMPT_LEN : PROMPT_LEN + 1]
    torch.testing.assert_close(forward(model, step, cache), forward(model, step, theirs), **F32)


def test_generate_past_capacity_raises_cache_overflow(model):
    cache = NbkvCache(model.config, PROMPT_LEN + 4)
    with pytest.raises(nbkv.CacheOverflowError):
        generate(model, prompt(1), cache)
    assert cache.get_seq_length() == PROMPT_LEN + 4  # full, nothing past it written


BAD = [
    ("max_cache_len", dict(max_cache_len=0), nbkv.InvalidArgumentError, "max_cache_len.*0"),
    ("max_cache_len", dict(max_cache_len=-3), nbkv.InvalidArgumentError, "positive int, got -3"),
    ("max_cache_len", dict(max_cache_len="8"), nbkv.ArgumentTypeError, "max_cache_len.*'8'"),
    ("max_cache_len", dict(max_cache_len=8.0), nbkv.ArgumentTypeError, "max_cache_len.*float"),
    ("batch_size", dict(batch_size=0), nbkv.InvalidArgumentError, "batch_size.*0"),
    ("device", dict(device="mps"), nbkv.InvalidArgumentError, "device.*'mps'"),
    ("device", dict(device="gpu"), nbkv.InvalidArgumentError, "device.*'gpu'"),
    ("device", dict(device="cuda:1"), nbkv.InvalidArgumentError, "device.*'cuda:1'"),
    ("device", dict(device=0), nbkv.InvalidArgumentError, "device.*0"),
    ("dtype", dict(dtype=torch.int8), nbkv.DTypeMismatchError, "dtype.*torch.int8"),
    ("dtype", dict(dtype="float8"), nbkv.DTypeMismatchError, "dtype.*'float8'"),
    ("dtype", dict(dtype=np.int32), nbkv.DTypeMismatchError, "dtype.*int32"),
]


@pytest.mark.parametrize("kwargs, error, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments_raise_typed_errors_naming_them(kwargs, error, message):
    kwargs = dict(config=make_config(), max_cache_len=8) | kwargs
    with pytest.raises(error, match=message):
        NbkvCache(**kwargs)


BAD_CONFIGS = [
    (
        "no layers",
        types.SimpleNamespace(num_attention_heads=4, hidden_size=64),
        nbkv.InvalidArgumentError,
        "config must have num_hidden_layers.*SimpleNamespace",
    ),
    (
        "no heads",
        types.SimpleNamespace(num_hidden_layers=2, hidden_size=64),
        nbkv.InvalidArgumentError,
        "config must have num_attention_heads",
    ),
    (
        "no head size",
        types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4),
        nbkv.InvalidArgumentError,
        "config must have hidden_size",
    ),
    (
        "uneven heads",
        types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=3, hidden_size=64),
        nbkv.InvalidArgumentError,
        "hidden_size 64 is not a multiple of.*num_attention_heads 3",
    ),
    (
        "zero layers",
        types.SimpleNamespace(num_hidden_layers=0, num_attention_heads=4, hidden_size=64),
        nbkv.InvalidArgumentError,
        "config.num_hidden_layers.*got 0",
    ),
    (
        "string heads",
        types.SimpleNamespace(num_hidden_layers=2, num_attention_heads="4", hidden_size=64),
        nbkv.ArgumentTypeError,
        "config.num_attention_heads.*'4'",
    ),
    (
        "sliding window",
        make_config(layer_types=["sliding_attention"] * 4, sliding_window=8),
        nbkv.InvalidArgumentError,
        "sliding_attention.*full-attention layers only",
    ),
    ("not a config", None, nbkv.InvalidArgumentError, "config must have num_hidden_layers"),
]


@pytest.mark.parametrize(
    "config, error, message", [b[1:] for b in BAD_CONFIGS], ids=[b[0] for b in BAD_CONFIGS]
)
def test_configs_without_the_needed_fields_raise_typed_errors(config, error, message):
    with pytest.raises(error, match=message):
        NbkvCache(config, 8)


def test_defaults_come_from_the_config():
    config = types.SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, hidden_size=32)
    cache = NbkvCache(config, 8)
    # no num_key_value_heads: one per attention head; no head_dim: hidden // heads
    assert len(cache) == cache.nbkv.num_layers == 3
    assert cache.nbkv[0].shape == (1, 4, 8, 8)
    assert cache.dtype == torch.float32 and cache.nbkv.dtype == np.float32
    assert cache.device == torch.device("cpu") and cache.nbkv.device == "cpu"


@pytest.mark.parametrize(
    "dtype, expected",
    [
        (None, torch.float32),
        (torch.float16, torch.float16),
        ("float16", torch.float16),
        (np.float64, torch.float64),
        (torch.float32, torch.float32),
    ],
)
def test_dtype_accepts_torch_and_numpy_names(dtype, expected):
    cache = NbkvCache(make_config(), 8, dtype=dtype)
    assert cache.dtype == expected
    assert cache.nbkv.dtype == np.dtype(str(expected).removeprefix("torch."))


def test_dtype_none_takes_the_configs():
    assert NbkvCache(make_config(dtype=torch.float16), 8).dtype == torch.float16
    assert NbkvCache(make_config(dtype="float64"), 8).dtype == torch.float64


def test_cuda_without_a_gpu_raises_backend_unavailable():
    from numba import cuda

    if cuda.is_available():
        pytest.skip("a CUDA GPU is available here")
    with pytest.raises(nbkv.BackendUnavailableError):
        NbkvCache(make_config(), 8, device="cuda")


BAD_UPDATES = [
    (
        "dtype",
        dict(k=torch.randn(1, 2, 3, 16, dtype=torch.float64)),
        nbkv.DTypeMismatchError,
        "key_states has dtype torch.float64 but this NbkvCache holds torch.float32",
    ),
    (
        "batch",
        dict(k=torch.randn(2, 2, 3, 16), v=torch.randn(2, 2, 3, 16)),
        nbkv.ShapeMismatchError,
        "batch 2.*batch_size=1",
    ),
    (
        "head_dim",
        dict(k=torch.randn(1, 2, 3, 8), v=torch.randn(1, 2, 3, 8)),
        nbkv.ShapeMismatchError,
        "head_dim 16",
    ),
    ("k and v", dict(v=torch.randn(1, 2, 4, 16)), nbkv.ShapeMismatchError, "disagree"),
    (
        "not a tensor",
        dict(v=np.zeros((1, 2, 3, 16), np.float32)),
        nbkv.ArgumentTypeError,
        "value_states must be a torch.Tensor",
    ),
    (
        "overflow",
        dict(k=torch.randn(1, 2, 9, 16), v=torch.randn(1, 2, 9, 16)),
        nbkv.CacheOverflowError,
        "append of 9 positions does not fit",
    ),
    (
        "grad",
        dict(k=torch.randn(1, 2, 3, 16, requires_grad=True)),
        NotImplementedError,
        "requires grad.*no_grad",
    ),
]


@pytest.mark.parametrize(
    "tensors, error, message", [b[1:] for b in BAD_UPDATES], ids=[b[0] for b in BAD_UPDATES]
)
def test_bad_updates_raise_and_change_nothing(tensors, error, message):
    cache = NbkvCache(make_config(), 8)
    first = torch.randn(1, 2, 2, 16)
    cache.update(first, first, 0)
    tensors = dict(k=torch.randn(1, 2, 3, 16), v=torch.randn(1, 2, 3, 16)) | tensors
    with pytest.raises(error, match=message):
        cache.update(tensors["k"], tensors["v"], 0)
    assert cache.get_seq_length(0) == 2
    assert torch.equal(cache.layers[0].keys, first)


# -- sequence management -----------------------------------------------------------------


def test_crop_drops_positions_and_decoding_goes_on_as_with_dynamic_cache(model):
    ours, theirs = NbkvCache(model.config, CAPACITY), DynamicCache(config=model.config)
    ids = prompt(1, length=PROMPT_LEN + 1)
    for cache in (ours, theirs):
        forward(model, ids[:, :PROMPT_LEN], cache)
        cache.crop(-2)  # negative: remove two, in transformers 4 and 5 alike
    assert ours.get_seq_length() == theirs.get_seq_length() == PROMPT_LEN - 2
    keys = ours.layers[0].keys
    assert keys.shape[2] == PROMPT_LEN - 2
    torch.testing.assert_close(keys, theirs.layers[0].keys, **F32)
    assert_inside(keys, ours.nbkv[0].get_kv()[0])
    step = ids[:, PROMPT_LEN - 2 : PROMPT_LEN - 1]
    torch.testing.assert_close(forward(model, step, ours), forward(model, step, theirs), **F32)


@pytest.mark.skipif(CACHE_KW != "cache", reason="crop(0) removes nothing only in transformers 5")
def test_crop_zero_removes_nothing_and_positive_is_refused(model):
    cache = NbkvCache(model.config, CAPACITY)
    forward(model, prompt(1), cache)
    cache.crop(0)
    assert cache.get_seq_length() == PROMPT_LEN
    with pytest.raises(nbkv.InvalidArgumentError, match="negative"):
        cache.crop(3)
    assert cache.get_seq_length() == PROMPT_LEN


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c.batch_select_indices(torch.tensor([2, 0])),  # contrastive search's
        lambda c: c.batch_select_indices(torch.tensor([True, False, True])),
        lambda c: c.batch_repeat_interleave(2),  # num_return_sequences' expansion
        lambda c: c.batch_repeat_interleave(1),
    ],
)
def test_batch_changes_match_dynamic_cache_and_decoding_goes_on(model, change):
    nb = NbkvCache(model.config, CAPACITY, batch_size=3)
    dyn = DynamicCache(config=model.config)
    ids = prompt(3)
    forward(model, ids, nb)
    forward(model, ids, dyn)
    change(nb)
    change(dyn)
    batch = dyn.layers[0].keys.shape[0]
    assert nb.max_batch_size == batch and nb.nbkv[0].batch == batch
    for got, want in zip(nb.layers, dyn.layers, strict=True):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    step = prompt(batch, length=1, seed=5)
    np.testing.assert_allclose(forward(model, step, nb), forward(model, step, dyn), **F32)
    assert nb.get_seq_length() == PROMPT_LEN + 1


def test_bad_batch_changes_raise_and_change_nothing(model):
    cache = NbkvCache(model.config, CAPACITY, batch_size=2)
    forward(model, prompt(2), cache)
    before = [layer.keys.clone() for layer in cache.layers]
    for call, error in (
        (lambda: cache.batch_select_indices(torch.tensor([0, 2])), nbkv.InvalidArgumentError),
        (lambda: cache.batch_select_indices(torch.tensor([True])), nbkv.ShapeMismatchError),
        (lambda: cache.batch_select_indices(torch.tensor([[0]])), nbkv.ArgumentTypeError),
        (lambda: cache.batch_select_indices(torch.tensor([0.5])), nbkv.ArgumentTypeError),
        (lambda: cache.batch_repeat_interleave(0), nbkv.InvalidArgumentError),
        (lambda: cache.batch_repeat_interleave(1.5), nbkv.ArgumentTypeError),
        (lambda: cache.reorder_cache(torch.tensor([0, 1, 1])), nbkv.ShapeMismatchError),
    ):
        with pytest.raises(error):
            call()
        assert cache.max_batch_size == 2 and cache.get_seq_length() == PROMPT_LEN
        for layer, keys in zip(cache.layers, before, strict=True):
            assert torch.equal(layer.keys, keys)


def test_reorder_cache_swaps_rows_in_place():
    cache = NbkvCache(make_config(), 8, batch_size=2)
    k, v = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)
    cache.update(k, v, 0)
    ptr = cache.layers[0].keys.data_ptr()
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(cache.layers[0].keys, k[[1, 1]])
    assert torch.equal(cache.layers[0].values, v[[1, 1]])
    assert cache.layers[0].keys.data_ptr() == ptr and cache.get_seq_length(0) == 3


def test_reset_forgets_positions_and_keeps_buffers(model):
    cache = NbkvCache(model.config, CAPACITY)
    forward(model, prompt(1), cache)
    nbytes = cache.nbkv.nbytes
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbkv.is_empty
    assert cache.nbkv.nbytes == nbytes and cache.layers[0].keys.shape == (1, 2, 0, 16)
    # generate from scratch again, into the same buffers
    out = generate(model, prompt(1), cache)
    expected = generate(model, prompt(1), DynamicCache(config=model.config))
    assert torch.equal(out.sequences, expected.sequences)


def test_deepcopy_owns_new_buffers(model):
    cache = NbkvCache(model.config, CAPACITY)
    forward(model, prompt(1), cache)
    clone = copy.deepcopy(cache)
    assert type(clone) is NbkvCache and clone.nbkv is not cache.nbkv
    assert all(layer.nbkv is clone.nbkv[i] for i, layer in enumerate(clone.layers))
    assert torch.equal(clone.layers[2].keys, cache.layers[2].keys)
    assert clone.layers[2].keys.data_ptr() != cache.layers[2].keys.data_ptr()
    forward(model, prompt(1, length=1), clone)
    assert clone.get_seq_length() == PROMPT_LEN + 1 and cache.get_seq_length() == PROMPT_LEN


def test_nbkv_exposes_the_underlying_kvcache(model):
    cache = NbkvCache(model.config, CAPACITY, batch_size=2)
    assert isinstance(cache.nbkv, nbkv.KVCache) and cache.nbkv.layout == "bhsd"
    assert [layer.nbkv for layer in cache.layers] == list(cache.nbkv)
    assert cache.nbkv[0].shape == (2, 2, CAPACITY, 16)
    assert "seq_len=0/32" in repr(cache)


# -- bfloat16 ------------------------------------------------------------------------------


def test_bfloat16_matches_dynamic_cache_in_bfloat16(bf16_model):
    ids = prompt(2)
    ours = NbkvCache(bf16_model.config, CAPACITY, batch_size=2)  # dtype from the config
    assert ours.dtype == torch.bfloat16 and ours.nbkv.dtype.name == "bfloat16"
    theirs = DynamicCache(config=bf16_model.config)
    a = forward(bf16_model, ids, ours)
    b = forward(bf16_model, ids, theirs)
    assert a.dtype == torch.bfloat16
    torch.testing.assert_close(a, b)  # bfloat16 tolerances
    step = ids[:, -1:]
    torch.testing.assert_close(forward(bf16_model, step, ours), forward(bf16_model, step, theirs))
    for i in range(bf16_model.config.num_hidden_layers):
        k, v = held(ours, i)
        # bit patterns, copied as they are
        assert torch.equal(k.view(torch.int16), theirs.layers[i].keys.view(torch.int16))
        assert torch.equal(v.view(torch.int16), theirs.layers[i].values.view(torch.int16))
        keys = ours.layers[i].keys
        assert keys.dtype == torch.bfloat16
        assert_inside(keys, ours.nbkv[i].get_kv()[0])


def test_bfloat16_generate_gives_dynamic_cache_tokens(bf16_model):
    ids = prompt(1)
    ours = generate(bf16_model, ids, NbkvCache(bf16_model.config, CAPACITY), max_new_tokens=6)
    theirs = generate(bf16_model, ids, DynamicCache(config=bf16_model.config), max_new_tokens=6)
    assert torch.equal(ours.sequences, theirs.sequences)


def test_float32_tensors_into_a_bfloat16_cache_are_refused(bf16_model):
    cache = NbkvCache(bf16_model.config, 8)
    k = torch.randn(1, 2, 3, 16)
    with pytest.raises(nbkv.DTypeMismatchError, match="dtype=torch.float32"):
        cache.update(k, k, 0)
    assert cache.get_seq_length(0) == 0


# -- quantized layers -------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, (8, 4)])
def test_quantized_layers_hold_codes_and_generate_the_float_tokens(model, bits):
    ids = prompt(1, 40)
    cache = NbkvCache(model.config, 64, bits=bits, group_size=8, residual=8)
    ours = generate(model, ids, cache)
    theirs = generate(model, ids, DynamicCache(config=model.config))
    layer = cache.nbkv[0]
    assert type(layer) is nbkv.QuantizedKVCache and layer.q_len > 0
    assert (ours.sequences == theirs.sequences).float().mean() > 0.9
    # what the model attended over is what the quantized layer returns
    keys, _ = held(cache, 0)
    assert torch.equal(cache.layers[0].keys, keys)


def test_quantized_layers_refuse_float64():
    with pytest.raises(nbkv.InvalidArgumentError, match="float32, float16 or bfloat16"):
        NbkvCache(make_config(), 16, dtype="float64", bits=8)
