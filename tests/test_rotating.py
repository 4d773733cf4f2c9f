"""RotatingKVCache: a window of recent positions plus sinks, offset apart from seq_len."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import nbkv
from nbkv import reference
from nbkv.backends import get_backend

from conftest import DEVICE, LAYOUTS, assert_bits_equal, host, randn, shape_of
from test_errors import assert_same, snapshot

SEQ = {"bhsd": 2, "bshd": 1}


def take(x, layout, positions):
    return np.take(x, positions, axis=SEQ[layout])


def kept(offset, window, sinks):
    """The positions a rotating cache holds after seeing ``offset`` tokens, oldest first."""
    ring = window - sinks
    return list(range(min(offset, sinks))) + list(range(max(sinks, offset - ring), offset))


def make(layout="bhsd", window=6, sinks=2, dtype="float32"):
    return nbkv.RotatingKVCache(
        window,
        sinks=sinks,
        batch=2,
        num_kv_heads=2,
        head_dim=3,
        dtype=dtype,
        device=DEVICE,
        layout=layout,
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("chunks", [[1] * 15, [4, 1, 9, 2], [20], [3, 3, 3, 3, 3]])
def test_appends_keep_the_sinks_and_the_last_positions_in_order(rng, layout, sinks, chunks):
    cache = make(layout, 6, sinks, "bfloat16")
    K = np.empty(shape_of(layout, 2, 2, 0, 3), cache.dtype)
    V = K.copy()
    for n in chunks:
        k = randn(rng, shape_of(layout, 2, 2, n, 3), "bfloat16")
        v = randn(rng, shape_of(layout, 2, 2, n, 3), "bfloat16")
        cache.append(k, v)
        K, V = reference.append(K, V, k, v, layout)
        held = kept(cache.offset, 6, sinks)
        assert cache.offset == K.shape[SEQ[layout]] and cache.seq_len == len(held) == len(cache)
        got_k, got_v = cache.get_kv()
        assert_bits_equal(got_k, take(K, layout, held))
        assert_bits_equal(got_v, take(V, layout, held))


@pytest.mark.parametrize("sinks", [0, 1, 3])
def test_trim_after_wrapping_drops_newest_first_and_lowers_offset(rng, sinks):
    cache = make(window=5, sinks=sinks)
    K = randn(rng, (2, 2, 13, 3), "float32")
    cache.append(K, K)
    positions = kept(13, 5, sinks)
    for n in (2, 1, 10):
        dropped = cache.trim(n)
        expect = min(n, len(positions))
        assert dropped == expect
        positions = positions[: len(positions) - expect]
        assert cache.seq_len == len(positions)
        if positions:
            assert_bits_equal(cache.get_kv()[0], K[:, :, positions])
        else:
            assert cache.get_kv() is None
    # every held position dropped: offset fell by the ring's 5 - sinks, then (if the drops
    # reached the sinks) to the sinks still held, none
    assert cache.offset == (13 - 5 if sinks == 0 else 0)
    # appends continue from there
    base = cache.offset
    new = randn(rng, (2, 2, 2, 3), "float32")
    cache.append(new, new)
    assert cache.offset == base + 2 and cache.seq_len == 2
    assert_bits_equal(cache.get_kv()[0], new)


def test_trim_then_append_continues_the_ring(rng):
    cache = make(window=4, sinks=1)
    seq = randn(rng, (2, 2, 9, 3), "float32")
    cache.append(seq, seq)  # holds 0, 6, 7, 8
    cache.trim(2)  # holds 0, 6; offset 7
    tail = randn(rng, (2, 2, 3, 3), "float32")
    cache.append(tail, tail)  # positions 7, 8, 9 -> holds 0, 7, 8, 9
    full = np.concatenate([seq[:, :, :7], tail], axis=2)
    assert cache.offset == 10
    assert_bits_equal(cache.get_kv()[0], full[:, :, [0, 7, 8, 9]])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sinks", [0, 2])
def test_decoding_four_windows_matches_sliding_window_attention_from_scratch(rng, layout, sinks):
    """A decode loop over 4x the window: each step's attention equals attention over the
    sinks and the last window - sinks positions, computed from scratch on every token."""
    window, steps = 6, 24
    cache = nbkv.RotatingKVCache(
        window,
        sinks=sinks,
        batch=1,
        num_kv_heads=2,
        head_dim=4,
        dtype="float32",
        device=DEVICE,
        layout=layout,
    )
    K = np.empty(shape_of(layout, 1, 2, 0, 4), np.float32)
    V = K.copy()
    for step in range(steps):
        k = randn(rng, shape_of(layout, 1, 2, 1, 4), "float32")
        v = randn(rng, shape_of(layout, 1, 2, 1, 4), "float32")
        q = randn(rng, (1, 4, 1, 4), "float32")
        K, V = reference.append(K, V, k, v, layout)
        if step % 2:
            got = host(nbkv.append_and_attend(q, k, v, cache))
        else:
            cache.append(k, v)
            got = host(nbkv.attention(q, cache))
        held = kept(step + 1, window, sinks)
        want = reference.attention(q, take(K, layout, held), take(V, layout, held), layout=layout)
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-5)


def test_prefill_chunk_attends_over_the_ordered_positions(rng):
    cache = make(window=8, sinks=1)
    K = randn(rng, (2, 2, 11, 3), "float32")
    cache.append(K, K)
    q = randn(rng, (2, 4, 3, 3), "float32")
    held = kept(11, 8, 1)
    got = host(nbkv.attention(q, cache, window=4))
    want = reference.attention(q, K[:, :, held], K[:, :, held], window=4)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-5)


def test_copy_select_and_reorder_keep_the_ring(rng):
    cache = make(window=4, sinks=1)
    K = randn(rng, (2, 2, 7, 3), "float32")
    cache.append(K, K)
    held = kept(7, 4, 1)
    twin = cache.copy()
    picked = cache.select([1, 1, 0])
    cache.reorder([1, 0])
    assert_bits_equal(twin.get_kv()[0], K[:, :, held])
    assert_bits_equal(picked.get_kv()[0], K[[1, 1, 0]][:, :, held])
    assert picked.offset == 7 and picked.seq_len == 4
    assert_bits_equal(cache.get_kv()[0], K[[1, 0]][:, :, held])


@pytest.mark.parametrize(
    "kwargs,error,fragment",
    [
        ({"window": 0}, nbkv.InvalidArgumentError, "window"),
        ({"window": 4, "sinks": 4}, nbkv.InvalidArgumentError, "smaller than window"),
        ({"window": 4, "sinks": -1}, nbkv.InvalidArgumentError, "sinks"),
        ({"window": 4, "on_overflow": "grow"}, nbkv.InvalidArgumentError, "on_overflow"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        nbkv.RotatingKVCache(**kwargs, device=DEVICE)


def test_bad_input_changes_nothing(rng):
    cache = make(window=4, sinks=1)
    cache.append(randn(rng, (2, 2, 6, 3), "float32"), randn(rng, (2, 2, 6, 3), "float32"))
    before = snapshot(cache), cache.offset
    with pytest.raises(nbkv.ShapeMismatchError):
        cache.append(randn(rng, (2, 2, 1, 4), "float32"), randn(rng, (2, 2, 1, 4), "float32"))
    with pytest.raises(nbkv.DTypeMismatchError):
        cache.append(randn(rng, (2, 2, 1, 3), "float64"), randn(rng, (2, 2, 1, 3), "float64"))
    # a ring is no LayerKVCache: it has no set_k/set_v, on_overflow or grow_step at all
    assert not any(hasattr(cache, a) for a in ("set_k", "set_v", "on_overflow", "grow_step"))
    with pytest.raises(nbkv.ShapeMismatchError):
        q = randn(rng, (2, 3, 1, 3), "float32")  # 3 heads over 2 KV heads
        k = randn(rng, (2, 2, 1, 3), "float32")
        nbkv.append_and_attend(q, k, k, cache)
    assert_same(before[0], snapshot(cache))
    assert cache.offset == before[1]


# -- a stateful model of the ring --------------------------------------------------------


class RotatingMachine(RuleBasedStateMachine):
    """Random appends, trims, crops, clears, copies and reorders against a plain model:
    the list of positions held and their rows, retained as the ring must retain them."""

    @initialize(window=st.integers(1, 7), sinks=st.integers(0, 3), seed=st.integers(0, 2**31))
    def build(self, window, sinks, seed):
        sinks = min(sinks, window - 1)
        self.rng = np.random.default_rng(seed)
        self.window, self.sinks = window, sinks
        self.cache = nbkv.RotatingKVCache(
            window,
            sinks=sinks,
            batch=2,
            num_kv_heads=1,
            head_dim=2,
            dtype="float16",
            device=DEVICE,
        )
        self.positions: list[int] = []
        self.rows = np.empty((2, 1, 0, 2), np.float16)  # K of the positions held
        self.offset = 0

    def retain(self):
        ring = [i for i, p in enumerate(self.positions) if p >= self.sinks]
        keep = [i for i, p in enumerate(self.positions) if p < self.sinks]
        keep += ring[max(0, len(ring) - (self.window - self.sinks)) :]
        self.positions = [self.positions[i] for i in keep]
        self.rows = self.rows[:, :, keep]

    @rule(n=st.integers(0, 9))
    def append(self, n):
        k = randn(self.rng, (2, 1, n, 2), "float16")
        self.cache.append(k, k)
        self.positions += list(range(self.offset, self.offset + n))
        self.rows = np.concatenate([self.rows, k], axis=2)
        self.offset += n
        self.retain()

    @rule(n=st.integers(1, 9), group=st.sampled_from([1, 3]), data=st.data())
    def append_and_attend(self, n, group, data):
        """Append and attend in one call: the output against the reference over the rows
        the ring holds afterwards (in temporal order), or a typed error and no change."""
        n_q = data.draw(st.integers(1, n), label="n_q")
        window = data.draw(st.sampled_from([None, 1, 2]) | st.integers(1, 9), label="window")
        k = randn(self.rng, (2, 1, n, 2), "float16")
        q = randn(self.rng, (2, group, n_q, 2), "float32")
        held_after = min(len(self.positions) + n, self.window)
        if n_q > held_after:  # the queries must be positions the ring still holds
            with pytest.raises(nbkv.ShapeMismatchError, match="queries"):
                nbkv.append_and_attend(q, k, k, self.cache, window=window)
            return
        if n_q > 1 and self.misses(n, n_q, window):
            with pytest.raises(nbkv.InvalidArgumentError, match="overwritten"):
                nbkv.append_and_attend(q, k, k, self.cache, window=window)
            return  # and nothing changed: the invariant checks it
        out = host(nbkv.append_and_attend(q, k, k, self.cache, window=window))
        self.positions += list(range(self.offset, self.offset + n))
        self.rows = np.concatenate([self.rows, k], axis=2)
        self.offset += n
        self.retain()
        want = reference.attention(q, self.rows, self.rows, window=window)
        np.testing.assert_allclose(out, want, rtol=0, atol=5e-5)

    def misses(self, n, n_q, window):
        """Whether, after appending ``n``, the first of ``n_q`` queries would need a
        position the ring no longer holds (the span it sees: the ring, or the window)."""
        offset, ring = self.offset + n, self.window - self.sinks
        positions = self.positions + list(range(self.offset, offset))
        ring_held = sorted(p for p in positions if p >= self.sinks)[-ring:] if ring else []
        if not ring_held:
            return False
        span = ring if window is None else min(window, ring)
        return ring_held[0] > max(self.sinks, offset - n_q - span + 1)

    @rule(n=st.integers(1, 9), data=st.data())
    def a_fault_changes_nothing(self, n, data):
        """An allocation that fails (saving the rows an append overwrites, or the ordered
        copy attention reads after the rows were written): MemoryError and the ring
        exactly as it was."""
        backend = get_backend(DEVICE, "bhsd")
        real, fail_at, calls = backend.empty, data.draw(st.integers(0, 5), label="fail_at"), []

        def refuse(*args, **kwargs):  # the fail_at-th allocation fails
            calls.append(1)
            if len(calls) > fail_at:
                raise MemoryError("injected: empty failed")
            return real(*args, **kwargs)

        model = (list(self.positions), self.rows, self.offset)
        backend.empty = refuse
        try:
            self.append_and_attend(n, 1, data)
        except MemoryError as err:
            assert "injected" in str(err)
            self.positions, self.rows, self.offset = model
        finally:
            del backend.empty

    @rule(n=st.integers(0, 9))
    def trim(self, n):
        dropped = min(n, len(self.positions))
        assert self.cache.trim(n) == dropped
        keep = len(self.positions) - dropped
        from_ring = min(dropped, sum(p >= self.sinks for p in self.positions))
        self.positions, self.rows = self.positions[:keep], self.rows[:, :, :keep]
        self.offset -= from_ring
        if dropped > from_ring:  # into the sinks: what follows them is gone for good
            self.offset = len(self.positions)

    @rule()
    def clear(self):
        self.cache.clear()
        self.positions, self.rows, self.offset = [], self.rows[:, :, :0], 0

    @rule()
    def copy_and_reorder(self):
        twin = self.cache.copy()
        twin.reorder([1, 0])
        if self.positions:
            assert_bits_equal(twin.get_kv()[0], self.rows[[1, 0]])

    @rule()
    def save_then_load(self):
        """A file round trip keeps the ring, the sinks and the offset."""
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "ring.safetensors")
            nbkv.save(path, self.cache)
            back = nbkv.load(path, device=DEVICE)
            assert (back.offset, back.seq_len) == (self.offset, len(self.positions))
            if self.positions:
                assert_bits_equal(back.get_kv()[0], self.rows)
            self.cache.load_state(path)  # into itself: nothing changes

    @invariant()
    def matches_the_model(self):
        if not hasattr(self, "cache"):
            return
        assert self.cache.offset == self.offset
        assert self.cache.seq_len == len(self.positions)
        kv = self.cache.get_kv()
        if not self.positions:
            assert kv is None
        else:
            assert_bits_equal(kv[0], self.rows)


TestRotatingMachine = RotatingMachine.TestCase


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,trim", [(3, 0), (9, 0), (17, 2), (17, 7)])
def test_save_and_load_keep_the_ring_offset_and_sinks(tmp_path, rng, layout, n, trim):
    cache = make(layout, window=6, sinks=2, dtype="bfloat16")
    k = randn(rng, shape_of(layout, 2, 2, n, 3), "bfloat16")
    cache.append(k, k)
    cache.trim(trim)
    path = tmp_path / "ring.safetensors"
    nbkv.save(path, cache)
    for back in (nbkv.load(path, device=DEVICE), nbkv.load(path, device="cpu", layout="bshd")):
        assert (back.offset, back.seq_len, back.window, back.sinks) == (
            cache.offset,
            cache.seq_len,
            6,
            2,
        )
        if cache.seq_len == 0:
            assert back.get_kv() is None
            continue
        want = host(cache.get_kv()[0], cache.dtype)
        if back.layout != layout:
            want = want.transpose(0, 2, 1, 3)
        assert_bits_equal(back.get_kv()[0], np.ascontiguousarray(want))
    # and it goes on as the original does
    back = nbkv.load(path, device=DEVICE)
    more = randn(rng, shape_of(layout, 2, 2, 3, 3), "bfloat16")
    back.append(more, more)
    cache.append(more, more)
    assert_bits_equal(back.get_kv()[0], host(cache.get_kv()[0], cache.dtype))
    twin = make(layout, window=6, sinks=2, dtype="bfloat16")
    twin.load_state(path)
    assert twin.offset == cache.offset - 3


def test_load_state_refuses_another_window_and_changes_nothing(tmp_path, rng):
    cache = make(window=6, sinks=2)
    cache.append(randn(rng, (2, 2, 9, 3), "float32"), randn(rng, (2, 2, 9, 3), "float32"))
    path = tmp_path / "ring.safetensors"
    nbkv.save(path, cache)
    other = make(window=8, sinks=2)
    other.append(randn(rng, (2, 2, 3, 3), "float32"), randn(rng, (2, 2, 3, 3), "float32"))
    before = snapshot(other), other.offset
    with pytest.raises(nbkv.CacheFormatError, match="window 6"):
        other.load_state(path)
    assert_same(before[0], snapshot(other))
    assert other.offset == before[1]
    with pytest.raises(nbkv.CacheFormatError, match="holds a RotatingKVCache"):
        nbkv.LayerKVCache(8, device=DEVICE).load_state(path)
