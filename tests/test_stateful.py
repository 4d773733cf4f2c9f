"""Random sequences of cache operations against a plain-NumPy model of the cache.

The model is what a cache must be: the positions held (grown by concatenation, see
nbkv.reference), the capacity, and the sizes fixed by the constructor or the first write.
After every step the cache must hold exactly what the model holds; every step that the
model says must fail must raise the expected nbkv error and change nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import nbkv
from nbkv import reference
from nbkv.backends import get_backend

from conftest import DEVICE, LAYOUTS, assert_bits_equal, dtype_of, host, randn, shape_of

DTYPES = ["float32", "float64", "float16", "bfloat16"]
SEQ = {"bhsd": 2, "bshd": 1}


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        layout=st.sampled_from(LAYOUTS),
        dtype=st.sampled_from(DTYPES),
        dims=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 5)),
        max_seq_len=st.integers(1, 12),
        eager=st.booleans(),
        grow=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
    )
    def build(self, layout, dtype, dims, max_seq_len, eager, grow, seed):
        self.rng = np.random.default_rng(seed)
        self.layout, self.dtype, self.cap = layout, dtype_of(dtype), max_seq_len
        self.dims = dims  # (batch, num_kv_heads, head_dim) the machine writes
        self.grow = grow  # on_overflow="grow" with grow_step 4, else "error"
        kw = dict(
            device=DEVICE, layout=layout, on_overflow="grow" if grow else "error", grow_step=4
        )
        if eager:
            kw.update(batch=dims[0], num_kv_heads=dims[1], head_dim=dims[2], dtype=dtype)
        self.cache = nbkv.LayerKVCache(max_seq_len, **kw)
        self.fixed = (dims, self.dtype) if eager else None  # constructor's constraint
        self.sizes = self.fixed  # what the buffers hold, once allocated
        self.allocated = eager
        self.K = self.V = None  # the model's positions held (None: none)
        self.twin = None  # a copy and the model state it must keep
        self.folder = tempfile.mkdtemp(prefix="nbkv-stateful-")

    # -- helpers -------------------------------------------------------------------

    def arrays(self, n, dims=None, dtype=None):
        b, h, d = dims or self.dims
        shape = shape_of(self.layout, b, h, n, d)
        dtype = dtype or self.dtype
        return randn(self.rng, shape, dtype), randn(self.rng, shape, dtype)

    @property
    def seq_len(self):
        return 0 if self.K is None else self.K.shape[SEQ[self.layout]]

    def fits(self, needed):
        """Whether ``needed`` positions fit, growing the model's capacity as the cache would."""
        if needed <= self.cap:
            return True
        if self.grow:
            self.cap = -(-needed // 4) * 4
            return True
        return False

    def expect_error(self, error, call):
        try:
            call()
        except error:
            return
        raise AssertionError(f"expected {error.__name__}")

    # -- rules ---------------------------------------------------------------------

    @rule(n=st.integers(0, 14))
    def append(self, n):
        k, v = self.arrays(n)
        if n and not self.fits(self.seq_len + n):
            self.expect_error(nbkv.CacheOverflowError, lambda: self.cache.append(k, v))
            return
        self.cache.append(k, v)
        if n == 0:
            return
        if not self.allocated:
            self.allocated, self.sizes = True, (self.dims, self.dtype)
        if self.K is None:
            self.K, self.V = reference.empty_kv(
                *self.dims[:2], self.dims[2], self.dtype, self.layout
            )
        self.K, self.V = reference.append(self.K, self.V, k, v, self.layout)

    @rule(n=st.integers(1, 6), group=st.sampled_from([1, 2]), data=st.data())
    def append_and_attend(self, n, group, data):
        """The fused write and attention: the output against the float64 reference over
        what the model holds after the append, the cache against the model."""
        n_q = data.draw(st.integers(1, n), label="n_q")
        window = data.draw(st.sampled_from([None, 1, 2]) | st.integers(1, 16), label="window")
        k, v = self.arrays(n)
        b, h, d = self.dims
        q_dtype = np.float64 if self.dtype == np.float64 else np.float32
        q = randn(self.rng, (b, h * group, n_q, d), q_dtype)
        if not self.fits(self.seq_len + n):
            self.expect_error(
                nbkv.CacheOverflowError,
                lambda: nbkv.append_and_attend(q, k, v, self.cache, window=window),
            )
            return
        out = nbkv.append_and_attend(q, k, v, self.cache, window=window)
        if not self.allocated:
            self.allocated, self.sizes = True, (self.dims, self.dtype)
        if self.K is None:
            self.K, self.V = reference.empty_kv(b, h, d, self.dtype, self.layout)
        self.K, self.V = reference.append(self.K, self.V, k, v, self.layout)
        want = reference.attention(q, self.K, self.V, window=window, layout=self.layout)
        # float64 accumulates in float64 on the CPU; CUDA accumulates everything in float32
        tol = 1e-9 if q_dtype == np.float64 and DEVICE == "cpu" else 5e-5
        np.testing.assert_allclose(host(out), want, rtol=tol, atol=tol)

    @rule(
        fault=st.sampled_from(["empty", "to_device"]),
        op=st.sampled_from(["append", "append_and_attend", "select", "copy", "reorder"]),
        n=st.integers(1, 14),
        fail_at=st.integers(0, 2),
    )
    def a_fault_changes_nothing(self, fault, op, n, fail_at):
        """An allocation or a host->device copy that fails (the ``fail_at``-th), in the
        middle of an operation that needs it: MemoryError, and the cache exactly as it
        was (the invariant checks
        it against the model, which is left alone). Where the operation needs neither,
        it succeeds, and the model follows."""
        backend = get_backend(DEVICE, self.layout)
        saved = backend.__dict__.get(fault)
        real, calls = getattr(backend, fault), []

        def refuse(*args, **kwargs):  # the fail_at-th call fails
            calls.append(1)
            if len(calls) > fail_at:
                raise MemoryError(f"injected: {fault} failed")
            return real(*args, **kwargs)

        model = (self.cap, self.K, self.V, self.allocated, self.sizes)
        setattr(backend, fault, refuse)
        try:
            if op == "append":
                self.append(n)
            elif op == "append_and_attend":
                self.append_and_attend(n, 1, _Draws([min(n, 2), None]))
            elif op == "reorder" and self.sizes is not None:
                self.cache.reorder(list(range(self.dims[0]))[::-1])
                if self.K is not None:
                    self.K, self.V = self.K[::-1], self.V[::-1]
            elif op in ("select", "copy") and self.sizes is not None:
                picked = self.cache.select([0]) if op == "select" else self.cache.copy()
                rows = [0] if op == "select" else slice(None)
                self.check(
                    picked, *((None, None) if self.K is None else (self.K[rows], self.V[rows]))
                )
        except MemoryError as err:
            assert "injected" in str(err)
            self.cap, self.K, self.V, self.allocated, self.sizes = model  # nothing happened
        finally:
            if saved is None:
                delattr(backend, fault)
            else:
                setattr(backend, fault, saved)

    @rule(n=st.integers(1, 3), which=st.sampled_from(["head_dim", "dtype", "seq", "ndim", "list"]))
    def bad_append(self, n, which):
        k, v = self.arrays(n)
        if which == "head_dim":
            b, h, d = self.dims
            k, v = self.arrays(n, dims=(b, h, d + 1))
            if self.sizes is None:  # a lazy, unallocated cache takes any consistent shape
                return
            error = nbkv.ShapeMismatchError
        elif which == "dtype":
            other = np.float32 if self.dtype != np.float32 else np.float64
            k, v = self.arrays(n, dtype=other)
            if self.sizes is None:
                return
            error = nbkv.DTypeMismatchError
        elif which == "seq":
            v = self.arrays(n + 1)[1]
            error = nbkv.ShapeMismatchError
        elif which == "ndim":
            k = k[0]
            error = nbkv.ShapeMismatchError
        else:
            k = k.tolist()
            error = nbkv.ArgumentTypeError
        self.expect_error(error, lambda: self.cache.append(k, v))

    @rule()
    def clear(self):
        self.cache.clear()
        self.K = self.V = None

    @rule()
    def deallocate(self):
        self.cache.deallocate()
        self.K = self.V = None
        # buffers freed; what the constructor fixed still constrains the next write
        self.allocated, self.sizes = False, self.fixed

    @rule(n=st.integers(0, 4))
    def copy_then_diverge(self, n):
        twin = self.cache.copy()
        state = (self.K, self.V)
        if n and self.allocated and self.seq_len + n <= twin.max_seq_len:
            k, v = self.arrays(n)
            twin.append(k, v)  # must not show in the original
            state = reference.append(*state, k, v, self.layout) if self.K is not None else (k, v)
        self.twin = (twin, state)

    @precondition(lambda self: self.twin is not None)
    @rule()
    def check_twin(self):
        twin, (K, V) = self.twin
        self.check(twin, K, V)

    @rule(n=st.integers(0, 14))
    def set_k_then_set_v(self, n):
        K, V = self.arrays(n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            if not self.fits(n):
                self.expect_error(nbkv.CacheOverflowError, lambda: self.cache.set_k(K))
                return
            self.cache.set_k(K)
            if not self.allocated:
                self.allocated, self.sizes = True, (self.dims, self.dtype)
            bad = self.arrays(n + 1)[1]
            self.expect_error(nbkv.ShapeMismatchError, lambda: self.cache.set_v(bad))
            self.cache.set_v(V)
        self.K, self.V = (K, V) if n else (None, None)

    @rule(new_len=st.integers(-1, 14))
    def crop(self, new_len):
        if not 0 <= new_len <= self.seq_len:
            self.expect_error(nbkv.InvalidArgumentError, lambda: self.cache.crop(new_len))
            return
        self.cache.crop(new_len)
        self.keep(new_len)

    @rule(n=st.integers(-1, 14))
    def trim(self, n):
        if n < 0:
            self.expect_error(nbkv.InvalidArgumentError, lambda: self.cache.trim(n))
            return
        dropped = min(n, self.seq_len)
        assert self.cache.trim(n) == dropped
        self.keep(self.seq_len - dropped)

    def keep(self, n):
        if n == 0:
            self.K = self.V = None
        else:
            index = [slice(None)] * 4
            index[SEQ[self.layout]] = slice(0, n)
            self.K, self.V = self.K[tuple(index)], self.V[tuple(index)]

    @rule(data=st.data())
    def reorder(self, data):
        batch = self.dims[0]
        rows = data.draw(st.lists(st.integers(0, batch), min_size=batch, max_size=batch))
        if self.sizes is None or batch in rows:  # no batch yet, or an index out of range
            self.expect_error(nbkv.InvalidArgumentError, lambda: self.cache.reorder(rows))
            return
        self.cache.reorder(rows)
        if self.K is not None:
            self.K, self.V = self.K[rows], self.V[rows]

    @rule(data=st.data())
    def select(self, data):
        if self.sizes is None:
            return
        rows = data.draw(st.lists(st.integers(0, self.dims[0] - 1), min_size=1, max_size=4))
        picked = self.cache.select(rows)
        assert picked.batch == len(rows) and picked.max_seq_len == self.cap
        K, V = (None, None) if self.K is None else (self.K[rows], self.V[rows])
        self.check(picked, K, V)

    @rule(layout=st.sampled_from(LAYOUTS), clobber=st.booleans())
    def save_then_load(self, layout, clobber):
        """A file round trip (into a new cache, and back into this one) changes nothing."""
        path = os.path.join(self.folder, "cache.safetensors")
        nbkv.save(path, self.cache)
        back = nbkv.load(path, device=DEVICE, layout=layout)
        assert back.max_seq_len == self.cap and back.is_allocated == self.allocated
        if back.layout == self.layout:
            self.check(back, self.K, self.V)
        if clobber and self.allocated and self.seq_len < self.cap:
            self.cache.append(*self.arrays(1))  # changed, then restored from the file
            self.cache.load_state(path)

    def teardown(self):
        if hasattr(self, "folder"):
            shutil.rmtree(self.folder, ignore_errors=True)

    # -- the cache must be the model -----------------------------------------------

    def check(self, cache, K, V):
        n = 0 if K is None else K.shape[SEQ[self.layout]]
        assert cache.seq_len == n == len(cache)
        kv = cache.get_kv()
        if n == 0:
            assert kv is None and cache.is_empty
        else:
            assert_bits_equal(kv[0], K)
            assert_bits_equal(kv[1], V)

    @invariant()
    def matches_the_model(self):
        if not hasattr(self, "cache"):
            return
        self.check(self.cache, self.K, self.V)
        assert self.cache.is_allocated == self.allocated
        assert self.cache.max_seq_len == self.cap
        if self.allocated:
            b, h, d = self.dims
            assert self.cache.shape == shape_of(self.layout, b, h, self.cap, d)
            assert self.cache.nbytes == 2 * b * h * self.cap * d * self.dtype.itemsize


class _Draws:
    """Stands in for hypothesis's ``data`` where a rule calls another with fixed draws."""

    def __init__(self, values):
        self.values = list(values)

    def draw(self, strategy, label=None):
        return self.values.pop(0)


TestCacheMachine = CacheMachine.TestCase
