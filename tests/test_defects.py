"""One regression test per defect that issues 8 (the cache protocol) and 9 (hardening)
found, each written to fail on the code before its fix, on both backends where it can.

- a CUDA append_and_attend whose window hides new positions left them unwritten;
- a growth whose allocation failed raised the capacity first;
- forward_nocache with the config's sliding_window gave a ring of window, not window - sinks;
- a failed CUDA attention launch left its split counters part-way, poisoning later calls;
- NaN or infinity in attention raised ZeroDivisionError on the CPU;
- append_and_attend wrote the cache, then raised (window 2**63, read-only out, NaN);
- a reader racing an atomic writer saw a "corrupted" file (it opened the file twice);
- multi-layer operations checked layer 0 only;
- raw exceptions at the API boundary (paths, array-valued options, from_layers(5), sizes
  of 2**62, a query with 0 heads);
- a killed save left its temporary file behind; a wrapped ring's get_kv returned a view.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nbkv
from nbkv import reference
from nbkv.backends import get_backend

from conftest import DEVICE, LAYOUTS, SIMULATOR, assert_bits_equal, cpu_only, host, randn, shape_of
from test_errors import assert_same, snapshot

SEQ = {"bhsd": 2, "bshd": 1}


def filled(rng, held, cap, layout="bhsd", dtype="float32", batch=1, heads=2, dim=4, **kw):
    cache = nbkv.LayerKVCache(
        cap, batch=batch, num_kv_heads=heads, head_dim=dim, dtype=dtype, device=DEVICE,
        layout=layout, **kw,
    )  # fmt: skip
    K = randn(rng, shape_of(layout, batch, heads, held, dim), dtype)
    V = randn(rng, shape_of(layout, batch, heads, held, dim), dtype)
    if held:
        cache.append(K, V)
    return cache, K, V


# -- issue 8 ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_and_attend_under_a_window_writes_every_new_position(rng, layout):
    # the case the issue names: 4 held, 10 new, 1 query, window 2 (8 new rows unseen)
    cache, K, V = filled(rng, 4, 16, layout)
    k = randn(rng, shape_of(layout, 1, 2, 10, 4), "float32")
    v = randn(rng, shape_of(layout, 1, 2, 10, 4), "float32")
    q = randn(rng, (1, 4, 1, 4), "float32")
    out = host(nbkv.append_and_attend(q, k, v, cache, window=2))
    K2, V2 = reference.append(K, V, k, v, layout)
    np.testing.assert_allclose(
        out, reference.attention(q, K2, V2, window=2, layout=layout), atol=3e-5
    )
    assert cache.seq_len == 14
    got_k, got_v = cache.get_kv()
    assert_bits_equal(got_k, K2)  # every row, also those no query of this step saw
    assert_bits_equal(got_v, V2)
    q = randn(rng, (1, 4, 1, 4), "float32")  # and a later step over all 14 is right
    np.testing.assert_allclose(
        host(nbkv.attention(q, cache)), reference.attention(q, K2, V2, layout=layout), atol=3e-5
    )


@given(
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    held=st.integers(0, 9),
    n=st.integers(1, 12),
    data=st.data(),
    seed=st.integers(0, 2**31),
)
def test_the_fused_path_equals_append_then_attention(layout, dtype, held, n, data, seed):
    """append_and_attend against the two calls it replaces, on random sizes reaching the
    edges: windows narrower than the new positions, a step that fills the cache, n_q 1..n."""
    rng = np.random.default_rng(seed)
    n_q = data.draw(st.integers(1, n))
    # windows narrower than the new positions are the edge a fused kernel got wrong
    window = data.draw(st.sampled_from([None, 1, 2]) | st.integers(1, held + n + 2))
    group = data.draw(st.sampled_from([1, 3]))
    cap = held + n + data.draw(st.integers(0, 2))
    fused, K, V = filled(rng, held, cap, layout, dtype)
    plain = fused.copy()
    k = randn(rng, shape_of(layout, 1, 2, n, 4), dtype)
    v = randn(rng, shape_of(layout, 1, 2, n, 4), dtype)
    q = randn(rng, (1, 2 * group, n_q, 4), "float32")
    got = host(nbkv.append_and_attend(q, k, v, fused, window=window))
    plain.append(k, v)
    want = host(nbkv.attention(q, plain, window=window))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert fused.seq_len == plain.seq_len == held + n
    for a, b in zip(fused.get_kv(), plain.get_kv(), strict=True):
        assert_bits_equal(a, host(b, plain.dtype))


class _Refuse:
    """A backend's allocation that fails, as an exhausted device would."""

    def __init__(self, backend, what="empty", error=MemoryError):
        self.backend, self.what, self.error = backend, what, error

    def __enter__(self):
        self.saved = self.backend.__dict__.get(self.what)  # an instance attribute, or None

        def refuse(*args, **kwargs):
            raise self.error(f"injected: {self.what} failed")

        setattr(self.backend, self.what, refuse)
        return self

    def __exit__(self, *exc):
        if self.saved is None:
            delattr(self.backend, self.what)  # the class's method again
        else:
            setattr(self.backend, self.what, self.saved)


@pytest.mark.parametrize("how", ["append", "append_and_attend", "load_state"])
def test_a_growth_whose_allocation_fails_changes_nothing(tmp_path, rng, how):
    cache, K, V = filled(rng, 6, 8, on_overflow="grow", grow_step=8)
    views = cache.get_kv()
    before = snapshot(cache), cache.max_seq_len, cache.shape
    k = randn(rng, (1, 2, 5, 4), "float32")
    if how == "load_state":
        big, _, _ = filled(rng, 11, 16)
        nbkv.save(tmp_path / "big.safetensors", big)
    calls = {
        "append": lambda: cache.append(k, k),
        "append_and_attend": lambda: nbkv.append_and_attend(
            randn(rng, (1, 2, 1, 4), "float32"), k, k, cache
        ),
        "load_state": lambda: cache.load_state(tmp_path / "big.safetensors"),
    }
    with _Refuse(get_backend(DEVICE, "bhsd")), pytest.raises(MemoryError, match="injected"):
        calls[how]()
    assert (snapshot(cache), cache.max_seq_len, cache.shape)[1:] == before[1:]
    assert_same(before[0], snapshot(cache))
    assert_bits_equal(views[0], K)  # the old buffers were not written either
    cache.append(k, k)  # the allocation works again: the growth happens, nothing lost
    assert cache.max_seq_len == 16
    assert_bits_equal(cache.get_kv()[0], reference.append(K, V, k, k)[0])


@pytest.mark.parametrize("how", ["to_device", "empty"])
def test_a_first_append_whose_allocation_or_copy_fails_leaves_the_cache_lazy(rng, how):
    cache = nbkv.LayerKVCache(8, device=DEVICE)
    k = randn(rng, (1, 2, 3, 4), "float32")
    with _Refuse(get_backend(DEVICE, "bhsd"), how), pytest.raises(MemoryError):
        cache.append(k, k)
    assert not cache.is_allocated and cache.seq_len == 0 and cache.batch is None
    cache.append(k, k)
    assert_bits_equal(cache.get_kv()[0], k)


@cpu_only
def test_forward_nocache_with_the_configs_window_and_sinks_gives_the_ring_window_minus_sinks():
    from test_models import tiny_config, tiny_weights

    from nbkv.models import Llama

    config = tiny_config(sliding_window=6)
    model = Llama(config, tiny_weights(config))
    ids = np.random.default_rng(3).integers(3, config.vocab_size, (1, 14))
    # the config's window with sinks must be what an explicit window gives
    np.testing.assert_allclose(
        model.forward_nocache(ids, sinks=2), model.forward_nocache(ids, window=6, sinks=2)
    )
    # and what a decode with a ring of that window and those sinks computes
    cache = model.new_cache(window=6, sinks=2)
    steps = [model.forward(ids[:, t : t + 1], cache) for t in range(ids.shape[1])]
    np.testing.assert_allclose(
        np.concatenate(steps, axis=1), model.forward_nocache(ids, sinks=2), rtol=1e-4, atol=1e-5
    )


# -- issue 9 ---------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE != "cuda", reason="split counters exist on the CUDA kernel only")
def test_a_failed_cuda_launch_does_not_poison_the_next(rng, monkeypatch):
    from nbkv.kernels import cuda_attention

    cache, K, V = filled(rng, 40, 40)
    q = randn(rng, (1, 4, 1, 4), "float32")
    real = cuda_attention.attend_kernel

    class HalfDone:
        """A launch that dies after some blocks counted themselves done."""

        def __getitem__(self, config):
            def launch(*args):
                counters = args[-2]
                counters[0, 0] = 1  # as if one split had finished before the failure
                raise RuntimeError("injected: the launch failed")

            return launch

    nbkv_attention = nbkv.attention
    with nbkv.override_tunables(ATTENTION_SPLITS=3):
        monkeypatch.setattr(cuda_attention, "attend_kernel", HalfDone())
        with pytest.raises(RuntimeError, match="injected"):
            nbkv_attention(q, cache)
        monkeypatch.setattr(cuda_attention, "attend_kernel", real)
        for _ in range(3):  # every later call starts from zeroed counters
            got = host(nbkv_attention(q, cache))
            np.testing.assert_allclose(got, reference.attention(q, K, V), atol=3e-5)


def _attend(q, K, V, **kw):
    cache = nbkv.LayerKVCache(
        K.shape[2], batch=K.shape[0], num_kv_heads=K.shape[1], head_dim=K.shape[3],
        dtype=K.dtype, device=DEVICE,
    )  # fmt: skip
    cache.append(K, V)
    return host(nbkv.attention(q, cache, **kw))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the simulator
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_nan_and_infinity_flow_through_attention_as_ieee_says(rng, dtype):
    # past one CPU block: 512 positions (float32), 64 (float16); the simulator, 70
    b, kvh, n, d = 1, 2, 530 if DEVICE == "cpu" else 70, 4
    K = np.abs(randn(rng, (b, kvh, n, d), dtype))
    V = randn(rng, (b, kvh, n, d), dtype)
    q = np.abs(randn(rng, (b, 4, 1, d), "float32"))  # positive: a -inf key scores -inf
    K[0, 0, 5] = -np.inf  # a float16 overflow: weight 0, the rest as without it
    want = reference.attention(
        q[:, :2], np.delete(K, 5, axis=2)[:, :1], np.delete(V, 5, axis=2)[:, :1]
    )
    got = _attend(q, K, V)
    np.testing.assert_allclose(got[:, :2], want, rtol=0, atol=3e-5)
    np.testing.assert_allclose(got, reference.attention(q, K, V), rtol=0, atol=3e-5)
    q_nan = q.copy()
    q_nan[0, 1, 0, 2] = np.nan  # a NaN query: its row is NaN, the others are not
    got = _attend(q_nan, K, V)
    assert np.isnan(got[0, 1]).all() and np.isfinite(np.delete(got, 1, axis=1)).all()
    K_nan = K.copy()
    K_nan[0, 1, n - 4] = np.nan  # a NaN key, in a later block: its heads' rows are NaN
    got = _attend(q, K_nan, V)
    assert np.isnan(got[0, 2:]).all() and np.isfinite(got[0, :2]).all()
    np.testing.assert_allclose(got, reference.attention(q, K_nan, V), atol=3e-5)
    K_inf = np.full_like(K, -np.inf)  # nothing finite to attend to: NaN, no exception
    assert np.isnan(_attend(q, K_inf, V)).all()
    K_pos = K.copy()
    K_pos[0, 0, 3] = np.inf  # a +inf score: softmax of inf is NaN, as torch gives
    got = _attend(q, K_pos, V)
    assert np.isnan(got[0, :2]).all() and np.isfinite(got[0, 2:]).all()
    # a NaN outside the window is never seen
    K_far = K.copy()
    K_far[0, :, 2] = np.nan
    got = _attend(q, K_far, V, window=8)
    np.testing.assert_allclose(got, reference.attention(q, K_far, V, window=8), atol=3e-5)
    assert np.isfinite(got).all()


@pytest.mark.parametrize(
    "kwargs, q_fill",
    [
        ({"window": 2**63}, None),  # as good as no window
        ({"window": 2**31}, None),
        ({}, np.nan),  # NaN queries: NaN out, the append stands
    ],
)
def test_append_and_attend_succeeds_where_it_used_to_write_then_raise(rng, kwargs, q_fill):
    cache, K, V = filled(rng, 3, 8)
    k = randn(rng, (1, 2, 1, 4), "float32")
    q = randn(rng, (1, 4, 1, 4), "float32")
    if q_fill is not None:
        q[:] = q_fill
    out = host(nbkv.append_and_attend(q, k, k, cache, **kwargs))
    K2, V2 = reference.append(K, V, k, k)
    np.testing.assert_allclose(out, reference.attention(q, K2, V2), atol=3e-5)
    assert cache.seq_len == 4


@cpu_only
def test_append_and_attend_into_read_only_out_raises_and_leaves_the_cache_as_it_was(rng):
    cache, _, _ = filled(rng, 3, 8)
    before = snapshot(cache)
    out = np.empty((1, 4, 1, 4), np.float32)
    out.flags.writeable = False
    k = randn(rng, (1, 2, 1, 4), "float32")
    with pytest.raises(nbkv.InvalidArgumentError, match="read-only"):
        nbkv.append_and_attend(randn(rng, (1, 4, 1, 4), "float32"), k, k, cache, out=out)
    assert_same(before, snapshot(cache))


def test_a_ring_append_and_attend_that_fails_after_writing_is_undone(rng, monkeypatch):
    ring = nbkv.RotatingKVCache(4, sinks=1, batch=1, num_kv_heads=2, head_dim=4, device=DEVICE)
    k = randn(rng, (1, 2, 6, 4), "float32")
    ring.append(k, k)  # wrapped: the next append overwrites held rows
    before = snapshot(ring), ring.offset
    backend = get_backend(DEVICE, "bhsd")

    def fail(*args, **kwargs):
        raise RuntimeError("injected: the attention launch failed")

    monkeypatch.setattr(backend, "attend", fail)
    new = randn(rng, (1, 2, 2, 4), "float32")
    with pytest.raises(RuntimeError, match="injected"):
        nbkv.append_and_attend(randn(rng, (1, 4, 1, 4), "float32"), new, new, ring)
    assert_same(before[0], snapshot(ring))
    assert ring.offset == before[1]


def test_a_reader_racing_an_atomic_writer_never_sees_a_broken_file(tmp_path, rng):
    path = tmp_path / "shared.safetensors"
    caches = [filled(rng, n, 64, heads=4, dim=16)[0] for n in (8, 40)]
    nbkv.save(path, caches[0])
    stop, errors, loads = threading.Event(), [], [0]

    def write():
        i = 0
        while not stop.is_set():
            nbkv.save(path, caches[i % 2])
            i += 1

    def read():
        for _ in range(150):
            try:
                assert nbkv.load(path).seq_len in (8, 40)
                loads[0] += 1
            except Exception as err:  # noqa: BLE001 - any failure is the finding
                errors.append(repr(err))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        read()
    finally:
        stop.set()
        writer.join()
    assert errors == [] and loads[0] == 150


def test_multi_layer_operations_check_every_layer_before_changing_any(rng):
    layers = [filled(rng, 3, 8, batch=b)[0] for b in (2, 2, 1)]  # the last has one row
    cache = nbkv.KVCache.from_layers(layers)
    before = [snapshot(x) for x in layers]
    with pytest.raises(nbkv.ShapeMismatchError, match="indices"):
        cache.reorder([1, 0])  # fine for layers 0 and 1, not for layer 2
    with pytest.raises(nbkv.InvalidArgumentError):
        cache.select([1])
    for layer, b in zip(layers, before, strict=True):
        assert_same(b, snapshot(layer))


@cpu_only
def test_a_forward_pass_checks_every_layer_before_writing_any():
    from test_models import tiny_config, tiny_weights

    from nbkv.models import Llama

    config = tiny_config()
    model = Llama(config, tiny_weights(config))
    good = model.new_cache(max_seq_len=8)
    odd = nbkv.KVCache.from_layers([good[0], nbkv.LayerKVCache(8, head_dim=12, num_kv_heads=2)])
    with pytest.raises(nbkv.ShapeMismatchError, match="layer 1 holds head_dim 12"):
        model.forward([[4, 5, 6]], odd)
    assert good[0].seq_len == 0
    bshd = nbkv.KVCache.from_layers([good[0], model.new_cache(layout="bshd", max_seq_len=8)[1]])
    with pytest.raises(nbkv.InvalidArgumentError, match="layout"):
        model.forward([[4, 5, 6]], bshd)
    assert good[0].seq_len == 0


def _failing_on_the_second_call(attention):
    calls = []

    def second_layer_fails(q, layer, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("injected: out of memory in layer 1")
        return attention(q, layer, **kw)

    return second_layer_fails


@cpu_only
def test_a_forward_pass_that_fails_part_way_puts_every_layer_back(monkeypatch):
    from test_models import tiny_config, tiny_weights

    from nbkv.models import Llama, llama

    config = tiny_config()
    model = Llama(config, tiny_weights(config))
    for cache in (model.new_cache(max_seq_len=16), model.new_cache(window=4, sinks=1)):
        for ids in ([[4, 5, 6]], [[7]], [[8]]):  # 5 tokens: the ring of 4 has wrapped
            model.forward(ids, cache)
        before = [snapshot(x) for x in cache], cache.offset
        real = llama.attention
        monkeypatch.setattr(llama, "attention", _failing_on_the_second_call(real))
        with pytest.raises(MemoryError, match="injected"):
            model.forward([[9]], cache)  # a full ring takes one token a step
        monkeypatch.setattr(llama, "attention", real)
        assert cache.offset == before[1]
        for layer, b in zip(cache, before[0], strict=True):
            assert_same(b, snapshot(layer))


HUGE = 2**31 - 1
E_ARG, E_TYPE, E_DTYPE = nbkv.InvalidArgumentError, nbkv.ArgumentTypeError, nbkv.DTypeMismatchError


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda: nbkv.LayerKVCache(8, layout=np.array(["bhsd", "bshd"])), E_ARG, "layout"),
        (lambda: nbkv.LayerKVCache(8, device=np.array(["cpu"])), E_ARG, "device"),
        (lambda: nbkv.LayerKVCache(8, on_overflow=np.array(["grow"])), E_ARG, "on_overflow"),
        (lambda: nbkv.LayerKVCache(8, dtype=np.array([1.0])), E_DTYPE, "dtype"),
        (lambda: nbkv.KVCache.from_layers(5), E_TYPE, "layers"),
        (lambda: nbkv.KVCache.from_layers([]), E_TYPE, "layers"),
        (lambda: nbkv.KVCache.from_layers("ab"), E_TYPE, "layers"),
        (lambda: nbkv.LayerKVCache(2**62), E_ARG, "max_seq_len"),
        (lambda: nbkv.LayerKVCache(8, batch=2**62), E_ARG, "batch"),
        (lambda: nbkv.LayerKVCache(HUGE, batch=HUGE, num_kv_heads=HUGE, dtype="float32",
                                   head_dim=2), E_ARG, "address"),
        (lambda: nbkv.RotatingKVCache(2**62), E_ARG, "window"),
        (lambda: nbkv.KVCache(2**62), E_ARG, "num_layers"),
    ],
)  # fmt: skip
def test_bad_arguments_at_the_boundary_get_typed_errors(call, error, fragment):
    with pytest.raises(error, match=fragment):
        call()


@pytest.mark.parametrize("layer", ["lazy", "allocated"])
def test_attending_over_an_empty_cache_says_so_whatever_the_call(rng, layer):
    """An empty append to an empty cache leaves nothing to attend to: the error attention
    gives, on every backend (the CUDA path used to say 1 query over 0 positions)."""
    if layer == "lazy":
        cache = nbkv.LayerKVCache(8, device=DEVICE)
    else:
        cache = nbkv.LayerKVCache(
            8, batch=1, num_kv_heads=2, head_dim=4, dtype="float32", device=DEVICE
        )
    before = snapshot(cache)
    q, k = randn(rng, (1, 4, 1, 4), "float32"), randn(rng, (1, 2, 0, 4), "float32")
    with pytest.raises(nbkv.InvalidArgumentError, match="holds no position"):
        nbkv.attention(q, cache)
    with pytest.raises(nbkv.InvalidArgumentError, match="holds no position"):
        nbkv.append_and_attend(q, k, k, cache)
    assert_same(before, snapshot(cache))


def test_a_query_with_a_zero_size_is_a_shape_error(rng):
    cache, _, _ = filled(rng, 3, 8)
    before = snapshot(cache)
    for shape in ((1, 0, 1, 4), (1, 4, 0, 4), (0, 4, 1, 4), (1, 4, 1, 0)):
        q = np.zeros(shape, np.float32)
        with pytest.raises(nbkv.ShapeMismatchError, match="at least 1"):
            nbkv.attention(q, cache)
        k = randn(rng, (1, 2, 1, 4), "float32")
        with pytest.raises(nbkv.ShapeMismatchError):
            nbkv.append_and_attend(q, k, k, cache)
    assert_same(before, snapshot(cache))


def test_a_save_removes_what_a_killed_save_left_and_load_ignores_it(tmp_path, rng):
    cache, _, _ = filled(rng, 3, 8)
    from nbkv._format import _TMP, _host_tag

    dead = tmp_path / f".c.safetensors.{_host_tag()}.{2**22 + 12345}.0123abcd{_TMP}"
    alive = tmp_path / f".c.safetensors.{_host_tag()}.{os.getpid()}.4567cdef{_TMP}"
    other = tmp_path / f".c.safetensors.another-host.{2**22 + 12345}.89ab{_TMP}"
    for stale in (dead, alive, other):
        stale.write_bytes(b"half a file")
    nbkv.save(tmp_path / "c.safetensors", cache)
    assert not dead.exists()  # its process is gone: removed
    assert alive.exists() and other.exists()  # a live writer's, another machine's: kept
    assert nbkv.load(tmp_path / "c.safetensors", device=DEVICE).seq_len == 3


def test_a_wrapped_ring_returns_a_copy_never_a_view(rng):
    ring = nbkv.RotatingKVCache(4, sinks=1, batch=1, num_kv_heads=1, head_dim=2, device=DEVICE)
    k = randn(rng, (1, 1, 7, 2), "float32")  # 7 = window + ring: slots in order again
    ring.append(k, k)
    K, _ = ring.get_kv()
    assert_bits_equal(K, k[:, :, [0, 4, 5, 6]])
    K_again, _ = ring.get_kv()
    if not SIMULATOR:
        assert not np.shares_memory(K, K_again)
    ring.append(k[:, :, :1], k[:, :, :1])  # writing the cache does not change the copy
    assert_bits_equal(K, k[:, :, [0, 4, 5, 6]])


# -- found by a review of the protocol change --------------------------------------------


def test_a_state_whose_tensors_disagree_with_its_meta_is_refused_and_changes_nothing(rng):
    from nbkv.protocol import LoadedLayer, LoadedState

    cache, K, V = filled(rng, 3, 4)
    meta = cache.export_state().layers[0].meta
    before = snapshot(cache)
    k40 = randn(rng, (1, 2, 40, 4), "float32")
    bad = [
        LoadedLayer(meta, k40, k40),  # 40 rows under a meta that says 3
        LoadedLayer(meta | {"seq_len": 5}, K, V),  # 5 rows said, 3 given
        LoadedLayer({k: v for k, v in meta.items() if k != "type"}, K, V),
        LoadedLayer({k: v for k, v in meta.items() if k != "layout"}, K, V),
        LoadedLayer(meta | {"dtype": "float8"}, K, V),
        LoadedLayer(meta, K.astype(np.float64), V),
        LoadedLayer(meta | {"allocated": False, "seq_len": 0}, K, V),
        LoadedLayer(meta, K.tolist(), V),
    ]
    for layer in bad:
        state = LoadedState("LayerKVCache", [layer], "a state")
        for call in (
            lambda s=state: cache.import_state(s),
            lambda s=state: nbkv.LayerKVCache.from_state(s, device=DEVICE),
            lambda s=state: nbkv.KVCache.from_state(
                nbkv.protocol.LoadedState("KVCache", s.layers, "x")
            ),
        ):
            with pytest.raises(nbkv.CacheFormatError):
                call()
        assert_same(before, snapshot(cache))
    with pytest.raises(nbkv.ArgumentTypeError):
        cache.import_state({"type": "LayerKVCache"})


def test_a_stale_plan_or_staged_append_is_refused(rng):
    cache, K, V = filled(rng, 2, 4)
    k = randn(rng, (1, 2, 2, 4), "float32")
    plan = cache.prepare_append(k, k)
    staged = cache.stage_append(cache.prepare_append(k, k))
    cache.append(k, k)  # the cache is full now: neither plan fits any more
    before = snapshot(cache)
    with pytest.raises(nbkv.InvalidArgumentError, match="another state"):
        cache.stage_append(plan)
    with pytest.raises(nbkv.InvalidArgumentError, match="another state"):
        cache.commit_append(staged)
    other, _, _ = filled(rng, 2, 4)
    with pytest.raises(nbkv.InvalidArgumentError, match="another"):
        other.commit_append(other.stage_append(plan))
    assert_same(before, snapshot(cache)) and cache.seq_len == 4
    ring = nbkv.RotatingKVCache(4, batch=1, num_kv_heads=2, head_dim=4, device=DEVICE)
    staged = ring.stage_append(ring.prepare_append(k, k))
    ring.append(k, k)
    with pytest.raises(nbkv.InvalidArgumentError, match="another state"):
        ring.commit_append(staged)


def test_a_chunk_of_queries_over_a_wrapped_ring_is_refused_not_answered_wrongly(rng):
    ring = nbkv.RotatingKVCache(4, batch=1, num_kv_heads=1, head_dim=2, device=DEVICE)
    K = randn(rng, (1, 1, 6, 2), "float32")
    ring.append(K, K)  # holds positions 2..5
    before = snapshot(ring), ring.offset
    q2 = randn(rng, (1, 1, 2, 2), "float32")
    with pytest.raises(nbkv.InvalidArgumentError, match="overwritten"):
        nbkv.attention(q2, ring)  # position 4 would need position 1, gone
    k = randn(rng, (1, 1, 2, 2), "float32")
    with pytest.raises(nbkv.InvalidArgumentError, match="overwritten"):
        nbkv.append_and_attend(q2, k, k, ring)
    assert_same(before[0], snapshot(ring))
    assert ring.offset == before[1]
    # more queries than the ring holds: a shape error, said before "overwritten"
    q5 = randn(rng, (1, 1, 5, 2), "float32")
    with pytest.raises(nbkv.ShapeMismatchError, match="5 queries but the cache holds 4"):
        nbkv.attention(q5, ring)
    with pytest.raises(nbkv.ShapeMismatchError, match="5 queries but the cache holds 4"):
        nbkv.append_and_attend(q5, k[:, :, :0], k[:, :, :0], ring)
    assert_same(before[0], snapshot(ring))
    assert ring.offset == before[1]
    # a decode step, and a chunk whose window the ring still holds, are exact
    q1 = randn(rng, (1, 1, 1, 2), "float32")
    np.testing.assert_allclose(
        host(nbkv.attention(q1, ring)), reference.attention(q1, K[:, :, 2:], K[:, :, 2:]), atol=3e-5
    )
    got = host(nbkv.attention(q2, ring, window=2))
    np.testing.assert_allclose(
        got, reference.attention(q2, K[:, :, 2:], K[:, :, 2:], window=2), atol=3e-5
    )


def test_crop_and_trim_keep_a_mixed_kvcache_at_one_offset(rng):
    def mixed():
        ring = nbkv.RotatingKVCache(8, sinks=1, batch=1, num_kv_heads=1, head_dim=2, device=DEVICE)
        plain = nbkv.LayerKVCache(32, batch=1, num_kv_heads=1, head_dim=2, device=DEVICE)
        cache = nbkv.KVCache.from_layers([plain, ring])
        k = randn(rng, (1, 1, 20, 2), "float32")
        for layer in cache:
            layer.append(k, k)
        return cache

    cache = mixed()
    cache.crop(16)  # the ring still holds 13..19: it can go back to 16
    assert [(x.seq_len, x.offset) for x in cache] == [(16, 16), (4, 16)]
    cache.trim(2)
    assert [x.offset for x in cache] == [14, 14]
    cache = mixed()
    before = [snapshot(x) for x in cache]
    with pytest.raises(nbkv.InvalidArgumentError, match="layer 1"):
        cache.crop(5)  # the ring forgot 1..12: it cannot be at token 5
    with pytest.raises(nbkv.InvalidArgumentError, match="layer 1"):
        cache.trim(10)  # the ring would fall back to its sink
    for x, b in zip(cache, before, strict=True):
        assert_same(b, snapshot(x))


@cpu_only
def test_a_model_decodes_over_a_mix_of_a_ring_and_a_full_cache():
    from test_models import tiny_config, tiny_weights

    from nbkv.models import Llama

    config = tiny_config()
    model = Llama(config, tiny_weights(config))
    ring = model.new_cache(window=4, sinks=1)[0]
    plain = model.new_cache(max_seq_len=16)[1]
    cache = nbkv.KVCache.from_layers([ring, plain])
    for t in range(9):  # the ring fills at 4 and keeps going
        model.forward([[5 + t]], cache)
    assert [x.offset for x in cache] == [9, 9] and [x.seq_len for x in cache] == [4, 9]


def test_undoing_the_first_append_of_a_lazy_growing_cache_restores_its_capacity(rng):
    cache = nbkv.LayerKVCache(2, on_overflow="grow", grow_step=8, device=DEVICE)
    k = randn(rng, (1, 1, 5, 2), "float32")
    undo = cache.append(k, k, undoable=True)
    assert cache.max_seq_len == 8
    undo()
    assert (cache.max_seq_len, cache.is_allocated, cache.seq_len) == (2, False, 0)


def test_an_object_with_only_some_of_the_protocol_is_not_a_layer_cache():
    class Minimal:
        def attention_view(self, n_q, window): ...

        def prepare_append(self, k, v): ...

    with pytest.raises(nbkv.ArgumentTypeError, match="layer caches"):
        nbkv.KVCache.from_layers([Minimal()])
    with pytest.raises(nbkv.ArgumentTypeError, match="kv must be"):
        nbkv.attention(np.ones((1, 1, 1, 2), np.float32), Minimal())


def test_huge_scales_and_ragged_indices_are_typed_errors(rng):
    cache, _, _ = filled(rng, 3, 8, batch=2)
    with pytest.raises(nbkv.InvalidArgumentError, match="scale"):
        nbkv.attention(randn(rng, (2, 2, 1, 4), "float32"), cache, scale=10**400)
    with pytest.raises(nbkv.ArgumentTypeError, match="indices"):
        cache.reorder([[0], [0, 1]])
