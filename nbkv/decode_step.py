"""DecodeStep: one layer cache's decode step, its checks made once, not every call.

``append_and_attend`` checks everything on every call: the arrays' types, shapes and
dtypes, the cache's state, the options, ``out``; then it plans the kernels' arguments.
In a decode loop all of that is the same from one step to the next but the cursor, and
on a GPU, where a step's kernels take a few microseconds, that Python is much of the
step. A :class:`DecodeStep` is bound to one cache and its options: it makes the first
call through ``append_and_attend`` and keeps what that call checked; a later call with
arrays like the last checked one (class, shape, strides, dtype) checks only that they
are, that the cache's buffers are the same (its write slots, :mod:`nbkv.protocol`) and
that the new positions fit,
then calls the same backend method with the same arguments (the fused kernel on CUDA,
the append and attention kernels on the CPU) and holds the new positions.

>>> import numpy as np, nbkv
>>> cache = nbkv.LayerKVCache(16, batch=1, num_kv_heads=1, head_dim=4, dtype="float32")
>>> step = nbkv.DecodeStep(cache)
>>> q, k = np.ones((1, 2, 1, 4), np.float32), np.ones((1, 1, 1, 4), np.float32)
>>> o = step(q, k, 3 * k)  # checked as append_and_attend checks it; bound
>>> o = step(q, k, 5 * k)  # like the last: the kernels, and the cursor moved
>>> cache.seq_len, o[0, 1, 0].tolist(), step.fast_calls
(2, [4.0, 4.0, 4.0, 4.0], 1)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .attention import (
    accumulator,
    append_and_attend,
    check_options,
    kernel_scale,
    kernel_window,
)
from .backends import get_backend
from .errors import ArgumentTypeError
from .protocol import is_layer_cache

__all__ = ["DecodeStep"]


class _Bound(NamedTuple):
    """What a checked call found, for the calls like it."""

    backend: Any  # the cache's backend
    kind: type  # the backend's array class: q, k and v are of it
    q_shape: tuple
    kv_shape: tuple
    q_strides: tuple
    k_strides: tuple
    v_strides: tuple
    q_dtype: np.dtype
    kv_dtype: np.dtype
    n: int  # new positions per call
    n_q: int  # queries per call
    slots: Any  # the cache's write slots (nbkv.protocol.WriteSlots)
    bits: np.dtype | None  # the view k and v take to match the slots (16-bit on the CPU)
    acc: np.dtype  # the accumulator dtype
    cast: bool  # q is cast for the kernel, or the kernel writes a scratch (16-bit q, CPU)
    scale: float
    table: Any
    result: Any  # what the kernel writes, when not cast
    out: Any  # what the call returns
    out_strides: tuple
    host_out: bool  # out is a host array: its flag, shape, strides are checked every call
    launch: Any  # the backend's append_attend, bound to these arrays' signature


def _same_host_out(b: _Bound) -> bool:
    """A host ``out`` is still as bound: writeable, its shape and strides (NumPy lets
    both change in place)."""
    out = b.out
    return out.flags.writeable and out.shape == b.q_shape and out.strides == b.out_strides


class DecodeStep:
    """``append_and_attend(q, k, v, cache, ...)`` for one cache, call after call, with
    what stays the same between calls checked once.

    Parameters
    ----------
    cache : a layer cache
        A cache with write slots (:class:`~nbkv.LayerKVCache`) takes the bound path; one
        without (a ring, a quantized cache) gets ``append_and_attend`` every call.
    scale, causal, window : as :func:`nbkv.append_and_attend`, fixed for the step
    out : array, optional
        Written in place by every call. Without it, the first checked call allocates the
        output and later calls like it write that same array again: each call's result
        is valid until the next call (and is not to be passed back in as q, k or v).

    Calling ``step(q, k, v)`` returns what ``append_and_attend(q, k, v, cache, ...)``
    returns, bit for bit, and leaves the cache as it would. The first call, and any call
    whose q, k or v differs in class, shape, strides or dtype from the last checked one,
    or that finds the cache's buffers replaced (a growth, a load, ``deallocate``), its new
    positions not fitting, or the queries more than the positions held, goes through
    ``append_and_attend`` with every check (and raises what it raises, changing
    nothing). Otherwise the step reads the cursor, calls the backend's ``append_attend``
    with the arrays as they are (on CUDA one launch, its plan looked up once, its
    parameter list prepared and kept per step, so that only q, k, v and the scalars are
    filled in: :mod:`nbkv.cuda_launch`), and then holds the positions; if
    the kernel raises, nothing is held. What it does not check again cannot change
    without changing what it checks: the arrays' devices (their class), the heads and
    sizes against the cache's (the buffers are the same), the options and ``out`` (whose
    writeable flag, shape and strides it reads again on the CPU). Tunables the checks
    read (``ATTENTION_MAX_HEAD_DIM``) are read when the step binds.

    Attributes
    ----------
    cache : the cache it is bound to (read-only)
    checked_calls, fast_calls : int
        Calls that went through ``append_and_attend`` and returned, and calls that took
        the bound path.
    bind_error : Exception or None
        Why the last checked call could not bind, should binding itself fail (the call
        had succeeded, so it is not raised); None otherwise.

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError
        At construction: not a layer cache, bad options (as ``append_and_attend``).
    """

    def __init__(
        self,
        cache: Any,
        *,
        scale: float | None = None,
        causal: bool = True,
        window: int | None = None,
        out: Any = None,
    ) -> None:
        if not is_layer_cache(cache):
            raise ArgumentTypeError(f"cache must be a layer cache, got {type(cache).__name__}")
        self._scale, self._causal, self._window = check_options(scale, causal, window)
        self._cache = cache
        self._out = out
        self._bound: _Bound | None = None
        self.checked_calls = 0
        self.fast_calls = 0
        self.bind_error: Exception | None = None

    @property
    def cache(self) -> Any:
        """The cache this step appends to and attends over."""
        return self._cache

    def __repr__(self) -> str:
        state = "bound" if self._bound is not None else "not bound"
        return (
            f"DecodeStep({type(self._cache).__name__}, {state}, checked_calls="
            f"{self.checked_calls}, fast_calls={self.fast_calls})"
        )

    def __call__(self, q: Any, k: Any, v: Any) -> Any:
        """Append ``k``, ``v`` to the cache and attend ``q`` over it.

        Parameters
        ----------
        q, k, v : as :func:`nbkv.append_and_attend`

        Returns
        -------
        ``out`` (the given one, or the step's own), as ``append_and_attend`` returns it.

        Raises
        ------
        What ``append_and_attend`` raises, the cache unchanged.
        """
        b = self._bound
        if (
            b is not None
            and type(q) is b.kind
            and type(k) is b.kind
            and type(v) is b.kind
            and q.shape == b.q_shape
            and k.shape == b.kv_shape
            and v.shape == b.kv_shape
            and q.dtype is b.q_dtype
            and k.dtype is b.kv_dtype
            and v.dtype is b.kv_dtype
            and q.strides == b.q_strides
            and k.strides == b.k_strides
            and v.strides == b.v_strides
            and b.slots.valid
            and (not b.host_out or _same_host_out(b))
        ):
            slots = b.slots
            pos = slots.held()
            end = pos + b.n
            if end <= slots.capacity and b.n_q <= end:
                return self._bound_call(b, q, k, v, pos, end)
        return self._checked_call(q, k, v)

    def _bound_call(self, b: _Bound, q, k, v, pos: int, end: int):
        if b.bits is not None:
            k, v = k.view(b.bits), v.view(b.bits)
        be = b.backend
        if b.cast:
            q, result, _ = be.attention_arrays(q, b.acc, b.out)
        else:
            result = b.result
        slots = b.slots
        window = kernel_window(self._window, end)
        b.launch(q, k, v, pos, slots.k, slots.v, b.scale, self._causal, window, b.table, result)
        out = be.finish_attention(result, b.out)
        slots.commit(pos, b.n)  # last: if anything above raised, nothing is held
        self.fast_calls += 1
        return out

    def _checked_call(self, q, k, v):
        out = append_and_attend(
            q, k, v, self._cache, scale=self._scale, causal=self._causal,
            window=self._window, out=self._out,
        )  # fmt: skip
        self.checked_calls += 1
        self._bound = None
        try:
            self._bound = self._bind(q, k, v, out)
            self.bind_error = None
        except Exception as e:  # the call itself succeeded: not to fail for a speed-up
            self.bind_error = e
        return out

    def _bind(self, q, k, v, out) -> _Bound | None:
        """What the call that just succeeded checked, or None where the bound path
        does not serve (no write slots, arrays not of the backend's class)."""
        cache = self._cache
        be = get_backend(cache.device, cache.layout)
        write_slots = getattr(cache, "write_slots", None)  # optional in the protocol
        slots = None if write_slots is None else write_slots()
        kind = be.array_type
        if slots is None or not type(q) is type(k) is type(v) is kind or k.dtype is not v.dtype:
            return None
        n = k.shape[be.seq_axis]
        if n == 0:
            return None
        q_dtype, dtype = q.dtype, cache.dtype
        acc = accumulator(q_dtype, dtype)
        q_kernel, result, _ = be.attention_arrays(q, acc, out)
        cast = q_kernel is not q or result is not out
        bits = None if k.dtype == slots.k.dtype else slots.k.dtype
        kk, vv = (k, v) if bits is None else (k.view(bits), v.view(bits))
        launch = be.bind_append_attend(q_kernel, kk, vv, slots.k, slots.v, result)
        return _Bound(
            be, kind, q.shape, k.shape, q.strides, k.strides, v.strides, q_dtype, k.dtype,
            n, q.shape[2], slots, bits, acc, cast, kernel_scale(self._scale, q.shape[3]),
            be.attention_table(dtype), result, out, out.strides, isinstance(out, np.ndarray),
            launch,
        )  # fmt: skip
