"""QuantizedKVCache (KIVI): exact codes against nbkv.reference's quantizer, the error
bound of each bit width, the window's size, crop/trim keeping values, attention over the
codes against the reference over get_kv, save/load, rows, typed errors that change
nothing, injected faults, and a stateful machine against a NumPy model."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import nbkv
from nbkv import reference as ref
from nbkv.dtypes import resolve_dtype, supported_dtypes

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def _dtypes() -> list[str]:
    names = ["float32", "float16"]
    if any(d.itemsize == 2 and d != np.float16 for d in supported_dtypes()):
        names.append("bfloat16")
    return names


DTYPES = _dtypes()
DEVICES = ["cuda"] if SIM else ["cpu"]


def _bshd(x, layout):
    return x.transpose(0, 2, 1, 3) if layout == "bshd" else x


def _host(cache, x):
    return np.asarray(cache.to_host(x))


def _kv(cache):
    """get_kv as host float32 arrays in [batch, heads, seq, head_dim]."""
    k, v = cache.get_kv()
    return tuple(_bshd(_host(cache, x), cache.layout).astype(np.float32) for x in (k, v))


class Model:
    """The quantized cache in NumPy: the values it would hold in the window (its dtype,
    as float32) and how many positions are codes."""

    def __init__(self, bits, group, residual, max_seq_len, dtype):
        self.bits, self.group, self.residual, self.max = bits, group, residual, max_seq_len
        self.dtype = resolve_dtype(dtype)
        self.kind = (
            "bfloat16" if self.dtype.itemsize == 2 and self.dtype != np.float16 else "float16"
        )
        self.k = self.v = None
        self.q = 0

    def append(self, k, v):
        k, v = k.astype(np.float32), v.astype(np.float32)
        self.k = k if self.k is None else np.concatenate([self.k, k], axis=2)
        self.v = v if self.v is None else np.concatenate([self.v, v], axis=2)
        g = self.group
        while self.k.shape[2] - self.q >= self.residual + g:
            self.q += g

    def get(self):
        K, V = ref.quantized_kv(
            self.k, self.v, self.q, bits=self.bits, group_size=self.group, kind=self.kind
        )
        return tuple(x.astype(self.dtype).astype(np.float32) for x in (K, V))

    def crop(self, n):
        K, V = self.get()
        self.k, self.v = self.k[:, :, :n].copy(), self.v[:, :, :n].copy()
        if n < self.q:
            q = (n // self.group) * self.group
            self.k[:, :, q:n], self.v[:, :, q:n] = K[:, :, q:n], V[:, :, q:n]
            self.q = q

    @property
    def seq_len(self):
        return 0 if self.k is None else self.k.shape[2]


def _data(rng, shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 0] *= 8  # an outlier channel, as real K has
    return x.astype(resolve_dtype(dtype))


def _cache(device="cpu", **kw):
    args = dict(batch=2, num_kv_heads=2, head_dim=8, dtype="float32", group_size=4, residual=5)
    args.update(kw)
    max_seq_len = args.pop("max_seq_len", 64)
    return nbkv.QuantizedKVCache(max_seq_len, device=device, **args)


# -- construction --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(bits=3), nbkv.InvalidArgumentError, "bits"),
        (dict(bits=(8, 1)), nbkv.InvalidArgumentError, "bits"),
        (dict(bits=(8, 4, 2)), nbkv.InvalidArgumentError, "bits"),
        (dict(bits=8.0), nbkv.ArgumentTypeError, "bits"),
        (dict(group_size=0), nbkv.InvalidArgumentError, "group_size"),
        (dict(group_size=2.5), nbkv.ArgumentTypeError, "group_size"),
        (dict(residual=-1), nbkv.InvalidArgumentError, "residual"),
        (dict(head_dim=12, group_size=8), nbkv.InvalidArgumentError, "multiple"),
        (dict(dtype="float64"), nbkv.InvalidArgumentError, "float32, float16 or bfloat16"),
        (dict(dtype=None), nbkv.ArgumentTypeError, "dtype"),
        (dict(batch=0), nbkv.InvalidArgumentError, "batch"),
        (dict(max_seq_len=0), nbkv.InvalidArgumentError, "max_seq_len"),
    ],
)
def test_bad_construction_raises_typed_errors(kw, error, match):
    with pytest.raises(error, match=match):
        _cache(**kw)


def test_required_sizes_have_no_default():
    with pytest.raises(TypeError):
        nbkv.QuantizedKVCache(16, num_kv_heads=1, head_dim=4, dtype="float32")


def test_it_is_a_base_cache_and_a_protocol_cache_but_not_a_layer_kv_cache():
    c = _cache()
    assert isinstance(c, nbkv.BaseKVCache)
    assert isinstance(c, nbkv.protocol.LayerCache)
    assert not isinstance(c, nbkv.LayerKVCache)


# -- exact codes, window, bounds -----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4, 2, (4, 2), (2, 8)])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_get_kv_is_exactly_the_reference_quantizer(device, dtype, bits, layout):
    rng = np.random.default_rng(hash((dtype, str(bits), layout)) % 2**32)
    group, residual, dim = int(rng.integers(1, 7)), int(rng.integers(0, 9)), 12
    while dim % min(group, dim):
        group += 1
    c = _cache(device, dtype=dtype, bits=bits, group_size=group, residual=residual,
               head_dim=dim, layout=layout, max_seq_len=61)  # fmt: skip
    m = Model(c.bits, group, residual, 61, dtype)
    n = 0
    for step in (int(rng.integers(1, 20)), 1, 1, int(rng.integers(1, 12)), 1):
        step = min(step, 61 - n)
        k, v = _data(rng, (2, 2, step, dim), dtype), _data(rng, (2, 2, step, dim), dtype)
        c.append(_bshd(k, layout), _bshd(v, layout))
        m.append(k, v)
        n += step
        assert (c.seq_len, c.q_len) == (m.seq_len, m.q)
        K, V = _kv(c)
        mk, mv = m.get()
        np.testing.assert_array_equal(K, mk)
        np.testing.assert_array_equal(V, mv)


@pytest.mark.parametrize("group, residual, max_seq_len", [(4, 5, 64), (8, 0, 30), (5, 20, 100)])
def test_the_window_holds_between_residual_and_residual_plus_group_minus_one(
    group, residual, max_seq_len
):
    c = _cache(group_size=group, residual=residual, max_seq_len=max_seq_len, head_dim=group)
    rng = np.random.default_rng(0)
    last_group_end = (max_seq_len // group) * group
    for n in range(1, max_seq_len + 1):
        x = _data(rng, (2, 2, 1, group), "float32")
        c.append(x, x)
        held = c.seq_len - c.q_len
        assert c.q_len % group == 0
        if n >= residual:
            assert residual <= held <= residual + group - 1 or c.q_len + group > last_group_end
        assert held <= c.window_capacity


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_element_is_within_half_a_step_of_its_group(bits, dtype):
    rng = np.random.default_rng(bits)
    c = _cache(dtype=dtype, bits=bits, group_size=8, residual=0, head_dim=16, max_seq_len=64)
    k = _data(rng, (2, 2, 64, 16), dtype)
    v = _data(rng, (2, 2, 64, 16), dtype)
    c.append(k, v)
    K, V = _kv(c)
    eps = float(np.finfo(np.float16).eps) if dtype != "float32" else float(np.finfo(np.float32).eps)
    if dtype == "bfloat16":
        eps = 2.0**-7
    for x, xh, axis, shape in (
        (k, K, 3, (2, 2, 8, 8, 16)),  # K: per channel over 8 positions
        (v, V, 4, (2, 2, 64, 2, 8)),  # V: per position over 8 channels
    ):
        g = x.astype(np.float32).reshape(shape)
        span = g.max(axis=axis, keepdims=True) - g.min(axis=axis, keepdims=True)
        top = np.abs(g).max(axis=axis, keepdims=True)
        bound = span / (2**bits - 1) / 2 + (2.0**-8 + 2 * eps) * top
        err = np.abs(xh.reshape(shape) - g)
        assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize("value", [0.0, 1.5, -3.25])
def test_a_constant_group_comes_back_as_its_value(value):
    c = _cache(bits=2, residual=0)
    x = np.full((2, 2, 8, 8), value, np.float32)
    c.append(x, x)
    K, V = _kv(c)
    assert c.q_len == 8
    assert (K == value).all() and (V == value).all()


def test_nbytes_counts_codes_scales_and_window():
    c = _cache(bits=(4, 2), group_size=4, residual=5, head_dim=8, max_seq_len=64)
    # K codes 64 x 4 bytes, V codes 64 x 2, K scales+zeros 16 groups x 8 x 2 x 2 bytes,
    # V scales+zeros 64 x 2 groups x 2 x 2, window 8 rows x 8 x 4 bytes x 2
    per_row = 64 * 4 + 64 * 2 + 16 * 8 * 4 + 64 * 2 * 4 + 8 * 8 * 4 * 2
    assert c.nbytes == 2 * 2 * per_row
    assert c.window_capacity == 8


@pytest.mark.parametrize("bits, limit", [(8, 0.56), (4, 0.30)])
def test_memory_at_32k_is_within_the_target_fraction_of_float16(bits, limit):
    sizes = dict(batch=1, num_kv_heads=8, head_dim=128, dtype="float16")
    fp16 = nbkv.LayerKVCache(32768, **sizes)
    q = nbkv.QuantizedKVCache(32768, bits=bits, **sizes)
    assert q.nbytes / fp16.nbytes <= limit


# -- crop and trim -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_crop_keeps_every_value_and_gives_the_cut_group_back_to_the_window(dtype):
    rng = np.random.default_rng(3)
    c = _cache(dtype=dtype, bits=4, group_size=4, residual=0, max_seq_len=64)
    k = _data(rng, (2, 2, 50, 8), dtype)
    c.append(k, k)
    K0, V0 = _kv(c)
    for n in (49, 48, 47, 45, 30, 3, 0):
        c.crop(n)
        assert c.q_len == min(48, (n // 4) * 4)
        if n:
            K, V = _kv(c)
            np.testing.assert_array_equal(K, K0[:, :, :n])
            np.testing.assert_array_equal(V, V0[:, :, :n])
    assert c.get_kv() is None


def test_trim_returns_how_many_and_offset_after_trim_changes_nothing():
    c = _cache()
    x = np.ones((2, 2, 10, 8), np.float32)
    c.append(x, x)
    assert c.offset_after_trim(3) == 7 and c.seq_len == 10
    assert c.trim(3) == 3 and c.trim(100) == 7 and c.seq_len == 0


# -- attention -----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "n_q, causal, window",
    [(1, True, None), (5, True, None), (3, False, None), (4, True, 6), (1, True, 3)],
)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_attention_over_codes_matches_the_reference_over_get_kv(
    device, dtype, n_q, causal, window, layout
):
    rng = np.random.default_rng(n_q * 7 + (window or 0))
    c = _cache(device, dtype=dtype, bits=(4, 8), group_size=4, residual=3, layout=layout,
               max_seq_len=80)  # fmt: skip
    for step in (33, 1, 2):
        x = _data(rng, (2, 2, step, 8), dtype)
        c.append(_bshd(x, layout), _bshd(-x, layout))
    K, V = _kv(c)
    q = rng.standard_normal((2, 8, n_q, 8)).astype(np.float32)
    out = nbkv.to_host(nbkv.attention(q, c, causal=causal, window=window))
    want = ref.attention(q, K, V, causal=causal, window=window)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(out, want, atol=tol, rtol=tol)
    if device == "cpu":  # out= is written in place
        given = np.full_like(q, np.nan)
        assert nbkv.attention(q, c, causal=causal, window=window, out=given) is given
        np.testing.assert_array_equal(given, out)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_reads_a_cache_of_window_only_and_of_codes_only(device):
    rng = np.random.default_rng(5)
    for residual, n in ((20, 12), (0, 16)):
        c = _cache(device, residual=residual, group_size=4, max_seq_len=40)
        x = _data(rng, (2, 2, n, 8), "float32")
        c.append(x, x)
        assert (c.q_len == 0) if residual else (c.q_len == c.seq_len)
        q = rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
        K, V = _kv(c)
        np.testing.assert_allclose(
            nbkv.to_host(nbkv.attention(q, c)), ref.attention(q, K, V), atol=1e-5
        )


@pytest.mark.parametrize("device", DEVICES)
def test_append_and_attend_equals_append_then_attention(device):
    rng = np.random.default_rng(9)
    a, b = _cache(device, max_seq_len=40), _cache(device, max_seq_len=40)
    x = _data(rng, (2, 2, 17, 8), "float32")
    a.append(x, x)
    b.append(x, x)
    for _ in range(6):
        k = _data(rng, (2, 2, 1, 8), "float32")
        q = rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
        fused = nbkv.to_host(nbkv.append_and_attend(q, k, -k, a))
        b.append(k, -k)
        np.testing.assert_array_equal(fused, nbkv.to_host(nbkv.attention(q, b)))
        np.testing.assert_array_equal(_kv(a)[1], _kv(b)[1])


def test_attention_allocates_a_small_fraction_of_the_cache_in_dtype():
    import tracemalloc

    c = nbkv.QuantizedKVCache(4096, batch=1, num_kv_heads=2, head_dim=64, dtype="float32",
                              bits=4)  # fmt: skip
    x = np.random.default_rng(0).standard_normal((1, 2, 4096, 64)).astype(np.float32)
    c.append(x, x)
    q = np.ones((1, 8, 1, 64), np.float32)
    nbkv.attention(q, c)  # compiled
    tracemalloc.start()
    nbkv.attention(q, c)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < x.nbytes * 2 / 4  # K and V in float32 would be 2 * x.nbytes


# -- save and load -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_save_load_round_trip_gives_bit_identical_results_after_the_same_appends(
    tmp_path, dtype, layout
):
    rng = np.random.default_rng(11)
    c = _cache(dtype=dtype, bits=(2, 4), group_size=4, residual=6, layout=layout)
    x = _data(rng, (2, 2, 23, 8), dtype)
    c.append(_bshd(x, layout), _bshd(x, layout))
    path = tmp_path / "q.nbkv"
    nbkv.save(path, c)
    d = nbkv.load(path)
    assert type(d) is nbkv.QuantizedKVCache
    assert (d.bits, d.group_size, d.residual, d.q_len, d.seq_len, d.layout) == (
        c.bits, c.group_size, c.residual, c.q_len, c.seq_len, c.layout,
    )  # fmt: skip
    more = _data(rng, (2, 2, 9, 8), dtype)
    for cache in (c, d):
        cache.append(_bshd(more, layout), _bshd(more, layout))
    for a, b in zip(_kv(c), _kv(d), strict=True):
        np.testing.assert_array_equal(a, b)


def test_saved_tensors_are_codes_not_floats(tmp_path):
    from nbkv import _safetensors

    c = _cache(bits=4, residual=0, max_seq_len=64)
    x = np.ones((2, 2, 32, 8), np.float32)
    c.append(x, x)
    nbkv.save(tmp_path / "q.nbkv", c)
    names = _safetensors.load_file(str(tmp_path / "q.nbkv"))
    assert names["layers.0.k_codes"].dtype == np.uint8
    assert names["layers.0.k_codes"].shape == (2, 2, 32, 4)


@pytest.mark.parametrize(
    "kw",
    [
        dict(bits=8),
        dict(group_size=8),
        dict(residual=4),
        dict(head_dim=16),
        dict(dtype="float16"),
        dict(max_seq_len=32),
    ],  # fmt: skip
)
def test_load_state_of_other_geometry_raises_and_changes_nothing(tmp_path, kw):
    rng = np.random.default_rng(2)
    c = _cache(bits=4)
    x = _data(rng, (2, 2, 20, 8), "float32")
    c.append(x, x)
    nbkv.save(tmp_path / "q.nbkv", c)
    other = _cache(**{"bits": 4, **kw})
    y = _data(rng, (2, 2, 7, other.head_dim), str(other.dtype))
    other.append(y, y)
    before = _kv(other)
    with pytest.raises(nbkv.CacheFormatError):
        other.load_state(tmp_path / "q.nbkv")
    for a, b in zip(before, _kv(other), strict=True):
        np.testing.assert_array_equal(a, b)


def test_load_state_of_another_cache_type_raises(tmp_path):
    plain = nbkv.LayerKVCache(64, batch=2, num_kv_heads=2, head_dim=8, dtype="float32")
    plain.append(np.ones((2, 2, 3, 8), np.float32), np.ones((2, 2, 3, 8), np.float32))
    nbkv.save(tmp_path / "p.nbkv", plain)
    c = _cache()
    with pytest.raises(nbkv.CacheFormatError):
        c.load_state(tmp_path / "p.nbkv")
    assert c.seq_len == 0


def test_a_corrupted_or_truncated_file_is_a_cache_format_error(tmp_path):
    c = _cache(bits=2, residual=0)
    x = np.random.default_rng(0).standard_normal((2, 2, 24, 8)).astype(np.float32)
    c.append(x, x)
    path = tmp_path / "q.nbkv"
    nbkv.save(path, c)
    raw = path.read_bytes()
    for bad in (raw[:-3], raw[:-40] + bytes(40), raw[: len(raw) // 2]):
        path.write_bytes(bad)
        with pytest.raises(nbkv.CacheFormatError):
            nbkv.load(path)


# -- rows ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_reorder_select_and_copy_move_whole_rows(device):
    rng = np.random.default_rng(4)
    c = _cache(device, batch=3, bits=4)
    x = _data(rng, (3, 2, 21, 8), "float32")
    c.append(x, -x)
    K, V = _kv(c)
    s = c.select([2, 0])
    np.testing.assert_array_equal(_kv(s)[0], K[[2, 0]])
    cp = c.copy()
    c.reorder([1, 1, 0])
    np.testing.assert_array_equal(_kv(c)[1], V[[1, 1, 0]])
    np.testing.assert_array_equal(_kv(cp)[1], V)  # the copy is independent
    with pytest.raises(nbkv.ShapeMismatchError):
        c.reorder([0, 1])
    np.testing.assert_array_equal(_kv(c)[1], V[[1, 1, 0]])


# -- errors change nothing, faults change nothing ------------------------------------


def _bad_appends():
    ok = np.ones((2, 2, 1, 8), np.float32)
    nan = ok.copy()
    nan[0, 0, 0, 0] = np.nan
    big = ok * 1e6
    return [
        ((nan, ok), nbkv.InvalidArgumentError, "NaN or infinity"),
        ((ok, big), nbkv.InvalidArgumentError, "within the 65504"),
        ((ok.astype(np.float16), ok.astype(np.float16)), nbkv.DTypeMismatchError, "float16"),
        ((np.ones((2, 2, 1, 4), np.float32),) * 2, nbkv.ShapeMismatchError, "head_dim"),
        ((np.ones((2, 2, 60, 8), np.float32),) * 2, nbkv.CacheOverflowError, "does not fit"),
    ]


@pytest.mark.parametrize("args, error, match", _bad_appends())
def test_a_bad_append_raises_a_typed_error_and_changes_nothing(args, error, match):
    c = _cache()
    x = _data(np.random.default_rng(0), (2, 2, 11, 8), "float32")
    c.append(x, x)
    before = (_kv(c), c.seq_len, c.q_len)
    with pytest.raises(error, match=match):
        c.append(*args)
    with pytest.raises(error):
        nbkv.append_and_attend(np.ones((2, 4, 1, 8), np.float32), *args, c)
    after = (_kv(c), c.seq_len, c.q_len)
    assert before[1:] == after[1:]
    for a, b in zip(before[0], after[0], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("held", [9, 10])  # 10: the append quantizes a group of the window
@pytest.mark.parametrize("failure", ["bad q", "attention raises"])
def test_an_append_and_attend_that_fails_after_its_append_changes_nothing(
    device, held, failure, monkeypatch
):
    """On the CPU the append comes first (codes and window written), then the attention;
    whatever fails after it, the codes, the window and the counters are put back."""
    c = _cache(device)
    rng = np.random.default_rng(held)
    x = _data(rng, (2, 2, held, 8), "float32")
    c.append(x, x)
    before = (_kv(c), c.seq_len, c.q_len, c.offset)
    k = _data(rng, (2, 2, 1, 8), "float32")
    q = np.ones((2, 4, 1, 8), np.float32)
    if failure == "bad q":
        q, error = np.ones((2, 3, 1, 8), np.float32), nbkv.ShapeMismatchError
    else:
        error = RuntimeError

        def fail(*args, **kwargs):
            raise RuntimeError("injected: the attention failed")

        # the module, which nbkv.attention (the function) hides
        monkeypatch.setattr(importlib.import_module("nbkv.attention"), "_run", fail)
    with pytest.raises(error):
        nbkv.append_and_attend(q, k, k, c)
    monkeypatch.undo()
    after = (_kv(c), c.seq_len, c.q_len, c.offset)
    assert before[1:] == after[1:]
    for a, b in zip(before[0], after[0], strict=True):
        np.testing.assert_array_equal(a, b)
    got = nbkv.to_host(nbkv.append_and_attend(np.ones((2, 4, 1, 8), np.float32), k, k, c))
    assert c.seq_len == held + 1 and np.isfinite(got).all()


def test_a_failing_forward_pass_of_a_model_puts_every_quantized_layer_back(monkeypatch):
    from nbkv.models import Llama
    from nbkv.quant_backends import CPUQuant

    model = Llama.default()
    cache = model.new_cache(1, 64, bits=4, group_size=8, residual=4)
    ids = np.arange(20, 40)[None]
    model.forward(ids, cache)
    before = [(_kv(layer), layer.q_len) for layer in cache]
    calls = {"n": 0}
    real = CPUQuant.attend

    def flaky(self, *args):
        calls["n"] += 1
        if calls["n"] == 3:  # the third layer's attention fails
            raise MemoryError("injected")
        return real(self, *args)

    monkeypatch.setattr(CPUQuant, "attend", flaky)
    with pytest.raises(MemoryError):
        model.forward(np.arange(40, 49)[None], cache)  # crosses a group: quantizes
    for layer, (kv, q) in zip(cache, before, strict=True):
        assert layer.q_len == q and layer.seq_len == 20
        for a, b in zip(kv, _kv(layer), strict=True):
            np.testing.assert_array_equal(a, b)


def test_an_allocation_that_fails_leaves_a_deallocated_cache_as_it_was(monkeypatch):
    c = _cache()
    c.deallocate()
    be = c._backend  # the fault goes where the cache allocates: its backend

    def no_memory(shape, dtype):
        raise MemoryError("injected")

    monkeypatch.setattr(be, "empty", no_memory)
    with pytest.raises(MemoryError):
        c.append(np.ones((2, 2, 3, 8), np.float32), np.ones((2, 2, 3, 8), np.float32))
    monkeypatch.undo()
    assert not c.is_allocated and c.seq_len == 0 and c.nbytes == 0


# -- containers and models -----------------------------------------------------------


def test_a_kv_cache_of_quantized_layers_and_the_model_decode_close_to_float32():
    from nbkv.models import Llama

    model = Llama.default()
    text = b"def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    ids = np.frombuffer(text * 2, np.uint8).astype(np.int64)[None]
    full = model.forward(ids, model.new_cache(1, 256))
    cache = model.new_cache(1, 256, bits=8, group_size=16, residual=16)
    assert all(type(layer) is nbkv.QuantizedKVCache for layer in cache)
    logits = [model.forward(ids[:, :64], cache)[0]]
    for t in range(64, ids.shape[1]):
        logits.append(model.forward(ids[:, t : t + 1], cache)[0])
    got = np.concatenate(logits)
    assert cache[0].q_len > 0
    assert (got.argmax(-1) == full[0].argmax(-1)).mean() > 0.95
    np.testing.assert_allclose(got, full[0], atol=0.25)
    same = nbkv.KVCache.from_layers([cache[i] for i in range(cache.num_layers)])
    assert same.seq_len == ids.shape[1]


# -- the stateful machine ------------------------------------------------------------


class QuantizedMachine(RuleBasedStateMachine):
    @initialize(
        dtype=st.sampled_from(DTYPES),
        bits=st.sampled_from([8, 4, 2, (8, 2), (2, 4)]),
        group=st.sampled_from([1, 2, 3, 4]),
        residual=st.integers(0, 6),
        layout=st.sampled_from(["bhsd", "bshd"]),
        seed=st.integers(0, 2**16),
    )
    def setup(self, dtype, bits, group, residual, layout, seed):
        self.rng = np.random.default_rng(seed)
        self.layout, self.dtype = layout, dtype
        self.cache = _cache(DEVICES[0], dtype=dtype, bits=bits, group_size=group,
                            residual=residual, head_dim=4 * group if group != 3 else 6,
                            layout=layout, max_seq_len=40, batch=2)  # fmt: skip
        self.model = Model(self.cache.bits, group, residual, 40, dtype)

    @rule(n=st.integers(1, 9))
    def append(self, n):
        n = min(n, 40 - self.cache.seq_len)
        if n == 0:
            return
        shape = (2, 2, n, self.cache.head_dim)
        k, v = _data(self.rng, shape, self.dtype), _data(self.rng, shape, self.dtype)
        self.cache.append(_bshd(k, self.layout), _bshd(v, self.layout))
        self.model.append(k, v)

    @rule(data=st.data())
    def crop(self, data):
        n = data.draw(st.integers(0, self.cache.seq_len))
        self.cache.crop(n)
        if self.model.k is not None:
            self.model.crop(n)

    @rule(rows=st.sampled_from([[1, 0], [0, 0], [1, 1]]))
    def reorder(self, rows):
        self.cache.reorder(rows)
        if self.model.k is not None:
            self.model.k, self.model.v = self.model.k[rows], self.model.v[rows]

    @rule()
    def clear(self):
        self.cache.clear()
        self.model.k = self.model.v = None
        self.model.q = 0

    @invariant()
    def holds_what_the_model_holds(self):
        assert self.cache.seq_len == self.model.seq_len
        if self.model.seq_len == 0:
            return
        assert self.cache.q_len == self.model.q
        K, V = _kv(self.cache)
        mk, mv = self.model.get()
        np.testing.assert_array_equal(K, mk)
        np.testing.assert_array_equal(V, mv)


TestQuantizedMachine = QuantizedMachine.TestCase
TestQuantizedMachine.settings = settings(
    max_examples=8 if SIM else 40,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_model_caches_of_other_dtypes_and_bad_combinations_raise():
    from nbkv.models import Llama

    model = Llama.default()
    with pytest.raises(nbkv.DTypeMismatchError, match="float32, float16 or bfloat16"):
        model.new_cache(1, 16, dtype="float64")
    with pytest.raises(nbkv.InvalidArgumentError, match="window and bits"):
        model.new_cache(1, window=16, bits=4)
    with pytest.raises(nbkv.InvalidArgumentError, match="bits"):
        model.new_cache(1, 16, bits=3)
    half = model.new_cache(1, 64, dtype="float16")
    ids = np.arange(30, 50)[None]
    full = model.forward(ids, model.new_cache(1, 64))
    np.testing.assert_allclose(model.forward(ids, half), full, atol=0.05)
    assert half[0].dtype == np.float16


@pytest.mark.parametrize(
    "tensors",
    [
        "not a dict",
        {},
        {"K-codes": ["U8", [1, 1, 1, 1]]},
        {"k": ["U8", [1]]},
        {"k_codes": ["X9", [1]]},
        {"k_codes": ["U8", [-1]]},
        {"k_codes": ["U8", "shape"]},
        {f"t{i}": ["U8", [1]] for i in range(17)},
    ],
)
def test_a_file_declaring_bad_tensors_is_a_cache_format_error(tmp_path, tensors):
    from nbkv import _format

    c = _cache(bits=4, residual=0)
    x = np.ones((2, 2, 8, 8), np.float32)
    c.append(x, x)
    state = c.export_state()
    meta = dict(state.layers[0].meta, tensors=tensors)
    bad = nbkv.protocol.LoadedState(
        state.type, [nbkv.protocol.LoadedLayer(meta, None, None, {})], "crafted"
    )
    with pytest.raises(nbkv.CacheFormatError):
        _format.check_loaded(bad)
    with pytest.raises(nbkv.CacheFormatError):
        c.import_state(bad)
    assert c.seq_len == 8


def test_a_kv_cache_of_quantized_layers_saves_and_loads(tmp_path):
    layers = [_cache(bits=b) for b in (8, 4, 2)]
    cache = nbkv.KVCache.from_layers(layers)
    x = np.random.default_rng(0).standard_normal((2, 2, 20, 8)).astype(np.float32)
    for layer in cache:
        layer.append(x, x)
    nbkv.save(tmp_path / "m.nbkv", cache)
    back = nbkv.load(tmp_path / "m.nbkv")
    assert [layer.bits for layer in back] == [(8, 8), (4, 4), (2, 2)]
    for a, b in zip(cache, back, strict=True):
        np.testing.assert_array_equal(_kv(a)[0], _kv(b)[0])


@pytest.mark.skipif(SIM, reason="the CPU kernels' serial and parallel forms")
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_the_parallel_and_the_serial_kernels_agree_exactly(bits):
    rng = np.random.default_rng(bits)
    c = _cache(batch=3, num_kv_heads=4, head_dim=16, bits=bits, group_size=8, residual=3,
               max_seq_len=200)  # fmt: skip
    x = _data(rng, (3, 4, 150, 16), "float32")
    c.append(x, -x)
    q = rng.standard_normal((3, 8, 4, 16)).astype(np.float32)
    with nbkv.override_tunables(ATTENTION_PARALLEL_MIN=2**31 - 1):
        serial = nbkv.attention(q, c, window=70)
    with nbkv.override_tunables(ATTENTION_PARALLEL_MIN=1):
        parallel = nbkv.attention(q, c, window=70)
    np.testing.assert_array_equal(serial, parallel)


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda c: c.crop(-1), nbkv.InvalidArgumentError),
        (lambda c: c.crop(99), nbkv.InvalidArgumentError),
        (lambda c: c.trim(1.5), nbkv.ArgumentTypeError),
        (lambda c: c.select([5]), nbkv.InvalidArgumentError),
        (lambda c: c.reorder([0, 7]), nbkv.InvalidArgumentError),
        (lambda c: c.check_room(60), nbkv.CacheOverflowError),
        (lambda c: nbkv.attention(np.ones((2, 3, 1, 8), np.float32), c), nbkv.ShapeMismatchError),
        (
            lambda c: nbkv.attention(np.ones((2, 4, 1, 8), np.float32), c, window=0),
            nbkv.InvalidArgumentError,
        ),  # fmt: skip
    ],
)
def test_every_other_bad_call_raises_a_typed_error_and_changes_nothing(call, error):
    c = _cache(device=DEVICES[0])
    x = _data(np.random.default_rng(0), (2, 2, 19, 8), "float32")
    c.append(x, x)
    before = (_kv(c), c.seq_len, c.q_len)
    with pytest.raises(error):
        call(c)
    assert (c.seq_len, c.q_len) == before[1:]
    for a, b in zip(before[0], _kv(c), strict=True):
        np.testing.assert_array_equal(a, b)
