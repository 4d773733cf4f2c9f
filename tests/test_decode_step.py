"""nbkv.DecodeStep: append_and_attend bound to one cache, its unchanging checks made once.

Every call is compared bit for bit with ``append_and_attend`` on a twin cache (outputs,
the positions held, errors), over random sequences of steps and of everything that can
change a cache between two steps (crop, clear, deallocate, a growth, a reorder, a copy,
a plain append, another shape); then which calls took the bound path, the errors and
faults that must leave the cache as it was, and the cache's write slots themselves.
"""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import weakref

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nbkv
from nbkv import decode_step
from nbkv.backends import get_backend
from nbkv.cuda_plan import KernelPlan

from conftest import DEVICE, LAYOUTS, assert_bits_equal, host, randn, shape_of

HEADS, DIM = 2, 8


def _dev(x):
    """``x`` as the cache device's own array (a Numba device array on CUDA), so that a
    DecodeStep may take its bound path; bfloat16 as its ``uint16`` bits there (Numba
    has no bfloat16), as a CUDA cache takes and gives it."""
    if DEVICE == "cuda":
        from numba import cuda

        return cuda.to_device(x if x.dtype.kind == "f" else x.view(np.uint16))
    return x


def _snapshot(cache) -> tuple:
    kv = cache.get_kv()
    held = None if kv is None else tuple(host(x, cache.dtype).copy() for x in kv)
    return cache.seq_len, cache.max_seq_len, cache.is_allocated, held


def _assert_same(a: tuple, b: tuple) -> None:
    assert a[:3] == b[:3]
    if a[3] is None or b[3] is None:
        assert a[3] is b[3] is None
    else:
        for x, y in zip(a[3], b[3], strict=True):
            assert_bits_equal(x, y)


class Twins:
    """A cache driven by a DecodeStep and its twin driven by append_and_attend."""

    def __init__(
        self, rng, *, dtype, layout, q_dtype, window, capacity, grow, batch=1, scale=None,
        causal=True, out=False,
    ):  # fmt: skip
        kw = dict(batch=batch, num_kv_heads=HEADS, head_dim=DIM, dtype=dtype, device=DEVICE)
        kw.update(layout=layout, on_overflow="grow" if grow else "error")
        if grow:
            kw["grow_step"] = 4
        self.a, self.b = nbkv.LayerKVCache(capacity, **kw), nbkv.LayerKVCache(capacity, **kw)
        self.rng, self.dtype, self.layout, self.batch = rng, dtype, layout, batch
        self.q_dtype = q_dtype
        self.options = dict(window=window, scale=scale, causal=causal)
        # with out=True, both write one array each, given once
        self.outs = [None, None]
        if out:
            shape = (batch, HEADS * 2, 1, DIM)
            self.outs = [_dev(np.zeros(shape, q_dtype)), _dev(np.zeros(shape, q_dtype))]
        self.step = nbkv.DecodeStep(self.a, out=self.outs[0], **self.options)

    def inputs(self, n: int, n_q: int, group: int = 2):
        q = randn(self.rng, (self.batch, HEADS * group, n_q, DIM), self.q_dtype)
        shape = shape_of(self.layout, self.batch, HEADS, n, DIM)
        k, v = randn(self.rng, shape, self.dtype), randn(self.rng, shape, self.dtype)
        return q, k, v

    def run(self, n: int, n_q: int) -> None:
        """One step on both; the same output, or the same error and nothing changed."""
        q, k, v = self.inputs(n, n_q)
        before = _snapshot(self.a)
        try:
            want = nbkv.append_and_attend(q, k, v, self.b, out=self.outs[1], **self.options)
            want = host(want).copy()
        except nbkv.KVCacheError as e:
            with pytest.raises(type(e)):
                self.step(_dev(q), _dev(k), _dev(v))
            _assert_same(before, _snapshot(self.a))
        else:
            assert_bits_equal(self.step(_dev(q), _dev(k), _dev(v)), want)
        self.check()

    def check(self) -> None:
        _assert_same(_snapshot(self.a), _snapshot(self.b))
        assert self.step.bind_error is None

    def both(self, method: str, *args) -> None:
        getattr(self.a, method)(*args)
        getattr(self.b, method)(*args)


@given(data=st.data())
def test_a_decode_step_is_append_and_attend_bit_for_bit_whatever_happens_between(data):
    draw = data.draw
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    grow, out = draw(st.booleans()), draw(st.booleans())
    t = Twins(
        rng,
        dtype=draw(st.sampled_from(["float32", "float16", "bfloat16", "float64"])),
        layout=draw(st.sampled_from(LAYOUTS)),
        q_dtype=draw(st.sampled_from(["float32", "float16", "float64"])),
        window=draw(st.sampled_from([None, 1, 2, 5, 100])),
        capacity=draw(st.integers(3, 9)),
        grow=grow,
        batch=draw(st.integers(1, 2)),
        scale=draw(st.sampled_from([None, 0.3, -1.5])),
        causal=draw(st.booleans()),
        out=out,  # one out array given to both, for one query a call
    )
    for _ in range(draw(st.integers(1, 14))):
        op = draw(
            st.sampled_from(
                ["step"] * 8
                + ["crop", "trim", "clear", "deallocate", "reorder", "copy", "append", "load"]
            )
        )
        if op == "step":
            n = draw(st.sampled_from([1] * 6 + [2, 3]))  # mostly like the last step
            n_q = draw(st.sampled_from([1] * 6 + [n, n + 1]))  # n + 1: too many when empty
            t.run(n, 1 if out else n_q)
        elif op == "crop":
            t.both("crop", draw(st.integers(0, t.a.seq_len)))
        elif op == "trim":
            t.both("trim", draw(st.integers(0, 3)))
        elif op in ("clear", "deallocate"):
            t.both(op)
        elif op == "load":  # the twin's positions, saved and loaded into both
            with tempfile.TemporaryDirectory() as folder:
                path = os.path.join(folder, "layer.nbkv")
                nbkv.save(path, t.b)
                t.both("load_state", path)
        elif op == "reorder":
            t.both("reorder", [int(i) for i in rng.integers(0, t.batch, t.batch)])
        elif op == "copy":  # a copy takes nothing from the original, its slots included
            if t.a.seq_len < t.a.max_seq_len or grow:
                t.a.copy().append(*t.inputs(1, 1)[1:])
        elif t.a.max_seq_len - t.a.seq_len >= 2 or grow:
            _, k, v = t.inputs(2, 1)
            t.both("append", k, v)
        t.check()
    # and always, at the end: two steps alike, the second on the bound path
    t.both("clear")
    fast = t.step.fast_calls
    t.run(1, 1)
    t.run(1, 1)
    assert t.step.fast_calls >= fast + 1


def test_calls_like_the_last_checked_one_take_the_bound_path(rng):
    t = Twins(rng, dtype="float16", layout="bhsd", q_dtype="float32", window=None,
              capacity=10, grow=True)  # fmt: skip
    for _ in range(4):
        t.run(1, 1)
    assert (t.step.checked_calls, t.step.fast_calls) == (1, 3)
    t.both("crop", 2)  # the cursor moved back: the buffers are the same
    t.run(1, 1)
    assert t.step.fast_calls == 4
    t.run(2, 1)  # another shape: checked, and bound to it
    t.run(2, 2)  # another q: checked
    t.run(2, 2)
    assert (t.step.checked_calls, t.step.fast_calls) == (3, 5)
    t.run(2, 2)  # 9 + 2 > 10: the growth is checked
    assert t.a.max_seq_len == 12 and (t.step.checked_calls, t.step.fast_calls) == (4, 5)
    t.both("crop", 2)
    t.run(2, 2)  # bound to the new buffers
    t.both("deallocate")
    t.run(2, 2)
    t.run(2, 2)
    assert (t.step.checked_calls, t.step.fast_calls) == (5, 7)


def test_host_arrays_on_cuda_and_ring_caches_are_checked_every_call(rng):
    ring = nbkv.RotatingKVCache(4, batch=1, num_kv_heads=HEADS, head_dim=DIM,
                                dtype="float32", device=DEVICE)  # fmt: skip
    twin = ring.copy()
    step = nbkv.DecodeStep(ring)
    for _ in range(6):  # past the window: the ring wraps
        q = randn(rng, (1, 4, 1, DIM), "float32")
        k, v = randn(rng, (1, HEADS, 1, DIM), "float32"), randn(rng, (1, HEADS, 1, DIM), "float32")
        assert_bits_equal(
            step(_dev(q), _dev(k), _dev(v)), host(nbkv.append_and_attend(q, k, v, twin))
        )
    assert ring.write_slots() is None and (step.checked_calls, step.fast_calls) == (6, 0)
    if DEVICE == "cuda":  # host arrays are copied to the device: every call checked
        t = Twins(rng, dtype="float32", layout="bhsd", q_dtype="float32", window=None,
                  capacity=8, grow=False)  # fmt: skip
        for _ in range(3):
            q, k, v = t.inputs(1, 1)
            assert_bits_equal(t.step(q, k, v), host(nbkv.append_and_attend(q, k, v, t.b)))
        assert (t.step.checked_calls, t.step.fast_calls) == (3, 0)


def test_without_out_the_bound_calls_write_one_array_and_with_out_they_write_it(rng):
    cache = nbkv.LayerKVCache(8, batch=1, num_kv_heads=HEADS, head_dim=DIM,
                              dtype="float32", device=DEVICE)  # fmt: skip
    step = nbkv.DecodeStep(cache)
    q, k, v = (_dev(randn(rng, s, "float32")) for s in [(1, 4, 1, DIM)] + [(1, HEADS, 1, DIM)] * 2)
    first = step(q, k, v)
    assert step(q, k, v) is first and step(q, k, v) is first
    out = _dev(np.zeros((1, 4, 1, DIM), np.float32))
    step = nbkv.DecodeStep(cache, out=out)
    assert step(q, k, v) is out and step(q, k, v) is out and step.fast_calls == 1


def _bound(rng, **kw):
    cache = nbkv.LayerKVCache(4, batch=1, num_kv_heads=HEADS, head_dim=DIM,
                              dtype="float32", device=DEVICE, **kw)  # fmt: skip
    step = nbkv.DecodeStep(cache)
    q = _dev(randn(rng, (1, 4, 1, DIM), "float32"))
    k = _dev(randn(rng, (1, HEADS, 1, DIM), "float32"))
    step(q, k, k)
    step(q, k, k)
    assert step.fast_calls == 1
    return cache, step, q, k


@pytest.mark.parametrize(
    "bad",
    ["k head_dim", "k dtype", "v shape", "q heads", "q batch", "k not an array",
     "too many queries", "too many queries after a crop", "full"],
)  # fmt: skip
def test_bad_input_after_binding_raises_what_append_and_attend_raises_and_changes_nothing(rng, bad):
    cache, step, q, k = _bound(rng)
    twin = cache.copy()
    good_k = k
    if bad == "k head_dim":
        k = _dev(randn(rng, (1, HEADS, 1, DIM + 1), "float32"))
    elif bad == "k dtype":
        k = _dev(randn(rng, (1, HEADS, 1, DIM), "float64"))
    elif bad == "q heads":
        q = _dev(randn(rng, (1, 3, 1, DIM), "float32"))
    elif bad == "q batch":
        q = _dev(randn(rng, (2, 4, 1, DIM), "float32"))
    elif bad == "k not an array":
        k = [[0.0] * DIM]
    elif bad == "too many queries":
        q = _dev(randn(rng, (1, 4, 3, DIM), "float32"))
        cache.crop(0)
        twin.crop(0)
    elif bad == "too many queries after a crop":  # q like the bound one: n_q 2 > 1
        q = _dev(randn(rng, (1, 4, 2, DIM), "float32"))
        step(q, k, k)  # checked and bound: 3 held, 2 queries
        step(q, k, k)  # bound: 4 held
        for c in (cache, twin):
            c.crop(0)
    elif bad == "full":
        step(q, k, k)
        step(q, k, k)
        twin.append(k, k)
        twin.append(k, k)
    v = _dev(randn(rng, (1, HEADS, 2, DIM), "float32")) if bad == "v shape" else k
    with pytest.raises(nbkv.KVCacheError) as want:
        nbkv.append_and_attend(q, k, v, twin)
    before = _snapshot(cache)
    with pytest.raises(type(want.value)):
        step(q, k, v)
    _assert_same(before, _snapshot(cache))
    q_next = _dev(randn(rng, (1, 4, 1, DIM), "float32"))
    if bad == "too many queries after a crop":
        cache.append(good_k, good_k)  # 1 held: the 2 queries fit with 1 more
        q_next = q
    held = min(1, cache.seq_len)
    cache.crop(held)
    fast = step.fast_calls
    step(q_next, good_k, good_k)  # still bound
    assert step.fast_calls == fast + 1 and cache.seq_len == held + 1


def test_construction_checks_the_cache_and_the_options():
    cache = nbkv.LayerKVCache(4, device=DEVICE)
    with pytest.raises(nbkv.ArgumentTypeError, match="cache must be a layer cache"):
        nbkv.DecodeStep([cache])
    with pytest.raises(nbkv.InvalidArgumentError, match="window"):
        nbkv.DecodeStep(cache, window=0)
    with pytest.raises(nbkv.ArgumentTypeError, match="causal"):
        nbkv.DecodeStep(cache, causal=1)
    with pytest.raises(nbkv.InvalidArgumentError, match="scale"):
        nbkv.DecodeStep(cache, scale=float("nan"))
    assert "not bound" in repr(nbkv.DecodeStep(cache))


def test_a_failed_launch_on_the_bound_path_holds_nothing(rng, monkeypatch):
    cache, step, q, k = _bound(rng)
    be = get_backend(DEVICE, "bhsd")

    def fail(*args, **kwargs):
        raise RuntimeError("injected: the kernel failed")

    # the attention after the rows are written (CPU), or the launch itself (CUDA)
    target = (be, "attend") if DEVICE == "cpu" else (KernelPlan, "run")
    monkeypatch.setattr(*target, fail)
    checked = []
    monkeypatch.setattr(decode_step, "append_and_attend", lambda *a, **kw: checked.append(1))
    before = _snapshot(cache)
    with pytest.raises(RuntimeError, match="injected"):
        step(q, k, k)
    monkeypatch.undo()
    _assert_same(before, _snapshot(cache))
    assert checked == [] and step.fast_calls == 1  # it was the bound path that failed
    step(q, k, k)
    assert cache.seq_len == 3 and step.fast_calls == 2


@pytest.mark.skipif(DEVICE != "cuda", reason="launch plans are per thread on CUDA only")
def test_a_call_from_another_thread_takes_the_plain_launch(rng, monkeypatch):
    cache, step, q, k = _bound(rng)
    be = get_backend(DEVICE, "bhsd")
    plain = []
    append_attend = be.append_attend

    def counted(*args):
        plain.append(threading.get_ident())
        return append_attend(*args)

    monkeypatch.setattr(be, "append_attend", counted)
    twin = cache.copy()
    want = host(nbkv.append_and_attend(q, k, k, twin)).copy()
    plain.clear()
    got = []
    worker = threading.Thread(target=lambda: got.append(host(step(q, k, k)).copy()))
    worker.start()
    worker.join()
    assert len(plain) == 1 and plain[0] != threading.get_ident() and step.fast_calls == 2
    assert_bits_equal(got[0], want)
    step(q, k, k)
    assert len(plain) == 1 and step.fast_calls == 3  # this thread: the bound launch


# -- the cache's write slots (nbkv.protocol) --------------------------------------------


def test_write_slots_are_the_buffers_until_they_change(rng):
    cache = nbkv.LayerKVCache(4, device=DEVICE, on_overflow="grow", grow_step=4)
    assert cache.write_slots() is None  # no buffers yet
    k = randn(rng, (1, HEADS, 3, DIM), "float16")
    cache.append(k, k)
    slots = cache.write_slots()
    assert cache.write_slots() is slots and slots.valid and slots.capacity == 4
    assert slots.held() == 3 and "valid" in repr(slots)
    copy = cache.copy()
    assert slots.valid and copy.write_slots() is not slots  # a copy has its own
    with pytest.raises(nbkv.InvalidArgumentError, match="next n positions go at pos = 3"):
        slots.commit(2, 1)
    with pytest.raises(nbkv.InvalidArgumentError, match="at most 1 fit"):
        slots.commit(3, 2)
    slots.commit(3, 1)  # as a kernel that wrote position 3 would
    assert cache.seq_len == 4
    cache.append(k, k)  # a growth: new buffers
    assert not slots.valid and "stale" in repr(slots)
    with pytest.raises(nbkv.InvalidArgumentError, match="replaced or dropped"):
        slots.commit(7, 0)
    new = cache.write_slots()
    assert new is not slots and new.capacity == 8
    cache.deallocate()
    assert not new.valid and cache.write_slots() is None
    ring = nbkv.RotatingKVCache(4, batch=1, num_kv_heads=1, head_dim=2, dtype="float32")
    quant = nbkv.QuantizedKVCache(
        8, batch=1, num_kv_heads=1, head_dim=64, dtype="float32", residual=4, device=DEVICE
    )
    assert ring.write_slots() is None and quant.write_slots() is None


def test_a_step_keeps_no_cycle_alive(rng):
    cache, step, q, k = _bound(rng)
    gone = weakref.ref(cache)
    gc.disable()
    try:
        del cache, step
        assert gone() is None  # freed by reference counting: buffers too, at once
    finally:
        gc.enable()


def test_arrays_of_other_strides_are_checked_not_bound(rng):
    """Same class, shape and dtype but other strides: a launch typed for the bound
    strides would read the wrong elements, so the call is checked (and bound anew)."""
    cache, step, q, k = _bound(rng)
    twin = cache.copy()
    wide = randn(rng, (1, HEADS, 1, 2 * DIM), "float32")
    q_wide = randn(rng, (1, 4, 1, 2 * DIM), "float32")
    k2, q2 = _dev(wide)[..., ::2], _dev(q_wide)[..., ::2]
    assert k2.shape == k.shape and k2.strides != k.strides
    want = host(nbkv.append_and_attend(q_wide[..., ::2], wide[..., ::2], k, twin)).copy()
    assert_bits_equal(step(q2, k2, k), want)
    assert (step.checked_calls, step.fast_calls) == (2, 1)
    _assert_same(_snapshot(cache), _snapshot(twin))


def test_deallocate_frees_the_buffers_while_a_step_is_bound(rng):
    cache, step, q, k = _bound(rng)
    buffer = weakref.ref(cache.get_kv()[0].base if DEVICE == "cpu" else cache.write_slots().k)
    gc.disable()
    try:
        cache.deallocate()
        assert buffer() is None  # neither the stale slots nor the step keep it
    finally:
        gc.enable()
    step(q, k, k)  # checked: new buffers, bound to them
    step(q, k, k)
    assert (step.checked_calls, step.fast_calls, cache.seq_len) == (2, 2, 2)


@pytest.mark.skipif(DEVICE != "cpu", reason="a device array cannot be read-only")
def test_an_out_made_read_only_or_reshaped_after_binding_is_refused_as_append_and_attend_does(
    rng,
):
    cache = nbkv.LayerKVCache(8, batch=1, num_kv_heads=HEADS, head_dim=DIM, dtype="float16")
    for q_dtype in ("float32", "float16"):  # the kernel writes out; or a scratch cast into it
        out = np.zeros((1, 4, 1, DIM), q_dtype)
        step = nbkv.DecodeStep(cache, out=out)
        q, k = randn(rng, (1, 4, 1, DIM), q_dtype), randn(rng, (1, HEADS, 1, DIM), "float16")
        step(q, k, k)
        step(q, k, k)
        assert step.fast_calls == 1
        out.flags.writeable = False
        before = _snapshot(cache)
        with pytest.raises(nbkv.InvalidArgumentError, match="read-only"):
            step(q, k, k)
        _assert_same(before, _snapshot(cache))
        out.flags.writeable = True
        out.shape = (1, 2, 2, DIM)  # NumPy reshapes in place: no longer q's shape
        with pytest.raises(nbkv.ShapeMismatchError, match="out has shape"):
            step(q, k, k)
        _assert_same(before, _snapshot(cache))


def test_the_cache_is_read_only_and_a_cache_without_slots_is_served_checked(rng):
    cache, step, q, k = _bound(rng)
    with pytest.raises(AttributeError):
        step.cache = nbkv.LayerKVCache(4, device=DEVICE)

    class NoSlots(nbkv.LayerKVCache):  # a cache type that does not offer write_slots
        write_slots = None

    other = NoSlots(4, batch=1, num_kv_heads=HEADS, head_dim=DIM, dtype="float32", device=DEVICE)
    twin = nbkv.LayerKVCache(4, batch=1, num_kv_heads=HEADS, head_dim=DIM, dtype="float32",
                             device=DEVICE)  # fmt: skip
    step = nbkv.DecodeStep(other)
    for _ in range(2):
        assert_bits_equal(step(q, k, k), host(nbkv.append_and_attend(q, k, k, twin)))
    assert (step.checked_calls, step.fast_calls, step.bind_error) == (2, 0, None)


def test_a_bind_that_fails_leaves_the_call_done_and_says_why(rng, monkeypatch):
    cache = nbkv.LayerKVCache(8, batch=1, num_kv_heads=HEADS, head_dim=DIM, dtype="float32",
                              device=DEVICE)  # fmt: skip
    be = get_backend(DEVICE, "bhsd")

    def fail(*args):
        raise MemoryError("injected: binding failed")

    monkeypatch.setattr(be, "bind_append_attend", fail)
    step = nbkv.DecodeStep(cache)
    q = _dev(randn(rng, (1, 4, 1, DIM), "float32"))
    k = _dev(randn(rng, (1, HEADS, 1, DIM), "float32"))
    step(q, k, k)
    step(q, k, k)
    assert cache.seq_len == 2 and step.checked_calls == 2
    assert isinstance(step.bind_error, MemoryError) and "not bound" in repr(step)
    monkeypatch.undo()
    step(q, k, k)
    step(q, k, k)
    assert step.bind_error is None and (step.checked_calls, step.fast_calls) == (3, 1)
