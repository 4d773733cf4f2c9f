"""DecodeStep: one layer cache's decode step, its checks made once, not every call.

``append_and_attend`` checks everything on every call: the arrays' types, shapes and
dtypes, the cache's state, the options, ``out``; then it plans the kernels' arguments.
In a decode loop all of that is the same from one step to the next but the cursor, and
on a GPU, where a step's kernels take a few microseconds, that Python is much of the
step. A :class:`DecodeStep` is bound to one cache and its options: it makes the first
call through ``append_and_attend`` and keeps what that call checked; a later call with
arrays like the last checked one checks only that they are, that the cache's buffers
are the same (its write slots, :mod:`nbkv.protocol`) and that the new positions fit,
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

import math
from typing import Any, NamedTuple

import numpy as np

from .attention import _check_options, append_and_attend
from .backends import get_backend
from .errors import ArgumentTypeError
from .protocol import is_layer_cache

__all__ = ["DecodeStep"]

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


class _Bound(NamedTuple):
    """What a checked call found, for the calls like it."""

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
    launch: Any  # the backend's append_attend, bound to these arrays' signature


class DecodeStep:
    """``append_and_attend(q, k, v, cache, ...)`` for one cache, call after call, with
    what stays the same between calls checked once.

    Parameters
    ----------
    cache : a layer cache
        A :class:`~nbkv.LayerKVCache` takes the bound path. A cache without write
        slots (a ring, a quantized cache) gets ``append_and_attend`` every call.
    scale, causal, window : as :func:`nbkv.append_and_attend`, fixed for the step
    out : array, optional
        Written in place by every call. Without it, the first checked call allocates the
        output and later calls like it write that same array again: each call's result
        is valid until the next call.

    Calling ``step(q, k, v)`` returns what ``append_and_attend(q, k, v, cache, ...)``
    returns, bit for bit, and leaves the cache as it would. The first call, and any call
    whose q, k or v differs in class, shape or dtype from the last checked one, or that
    finds the cache's buffers replaced (a growth, a load, ``deallocate``), its new
    positions not fitting, or the queries more than the positions held, goes through
    ``append_and_attend`` with every check (and raises what it raises, changing
    nothing). Otherwise the step reads the cursor and calls the backend's fused
    ``append_attend`` with the arrays as they are (on CUDA: one launch, its parameter list
    prepared, :mod:`nbkv.cuda_launch`), then holds the positions; if the launch raises,
    nothing is held. What it does not check again is what cannot change without changing
    what it checks: the arrays' devices (their class), the heads and sizes against the
    cache's (the buffers are the same), the options and ``out``.

    Attributes
    ----------
    cache : the cache it is bound to
    checked_calls, fast_calls : int
        How many calls went through ``append_and_attend``, and how many took the bound
        path.

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
        self._scale, self._causal, self._window = _check_options(scale, causal, window)
        self.cache = cache
        self._out = out
        self._bound: _Bound | None = None
        self.checked_calls = 0
        self.fast_calls = 0

    def __repr__(self) -> str:
        state = "bound" if self._bound is not None else "not bound"
        return (
            f"DecodeStep({type(self.cache).__name__}, {state}, checked_calls="
            f"{self.checked_calls}, fast_calls={self.fast_calls})"
        )

    def __call__(self, q: Any, k: Any, v: Any) -> Any:
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
        ):
            slots = b.slots
            pos = slots.held()
            end = pos + b.n
            if end <= slots.capacity and b.n_q <= end:
                return self._bound_call(b, q, k, v, pos, end)
        return self._checked_call(q, k, v)

    def _bound_call(self, b: _Bound, q, k, v, pos: int, end: int):
        window = self._window
        if window is None or window >= end:  # as attention's plan: no window at all
            window = 0
        if b.bits is not None:
            k, v = k.view(b.bits), v.view(b.bits)
        be = self._backend
        if b.cast:
            q, result, _ = be.attention_arrays(q, b.acc, b.out)
        else:
            result = b.result
        slots = b.slots
        b.launch(q, k, v, pos, slots.k, slots.v, b.scale, self._causal, window, b.table, result)
        slots.commit(pos, b.n)
        self.fast_calls += 1
        return be.finish_attention(result, b.out)

    def _checked_call(self, q, k, v):
        cache = self.cache
        out = append_and_attend(
            q, k, v, cache, scale=self._scale, causal=self._causal, window=self._window,
            out=self._out,
        )  # fmt: skip
        self.checked_calls += 1
        try:
            self._bound = self._bind(q, k, v, out)
        except Exception:  # the call itself succeeded: it is not to fail for a speed-up
            self._bound = None
        return out

    def _bind(self, q, k, v, out) -> _Bound | None:
        """What the call that just succeeded checked, or None where the bound path
        does not serve (no write slots, arrays not of the backend's class)."""
        cache = self.cache
        self._backend = be = get_backend(cache.device, cache.layout)
        slots = cache.write_slots()
        kind = be.array_type
        if slots is None or not type(q) is type(k) is type(v) is kind or k.dtype is not v.dtype:
            return None
        n = k.shape[be.seq_axis]
        if n == 0:
            return None
        q_dtype, dtype = q.dtype, cache.dtype
        acc = _F64 if _F64 in (q_dtype, dtype) else _F32
        scale = 1.0 / math.sqrt(q.shape[3]) if self._scale is None else self._scale
        q_kernel, result, _ = be.attention_arrays(q, acc, out)
        cast = q_kernel is not q or result is not out
        bits = None if k.dtype == slots.k.dtype else slots.k.dtype
        kk, vv = (k, v) if bits is None else (k.view(bits), v.view(bits))
        launch = be.bind_append_attend(q_kernel, kk, vv, slots.k, slots.v, result)
        return _Bound(
            kind, q.shape, k.shape, q.strides, k.strides, v.strides, q_dtype, k.dtype, n,
            q.shape[2], slots, bits, acc, cast, scale, be.attention_table(dtype), result,
            out, launch,
        )  # fmt: skip
