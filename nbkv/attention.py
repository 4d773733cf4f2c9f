"""attention() and append_and_attend(): validate, then dispatch to the cache's backend.

Decode attention reads only the positions held, ``[0, seq_len)``, and maps query head
``h`` to KV head ``h // group`` by index: K/V are never repeated or copied, and no mask
is built over unused capacity.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import numpy as np

from . import layout as _layout
from .backends import get_backend
from .cache import LayerKVCache
from .dtypes import check_supported
from .errors import (
    ArgumentTypeError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
)
from .rotating import RotatingKVCache

__all__ = ["attention", "append_and_attend"]


class _Plan(NamedTuple):
    """Everything a kernel launch needs, all checked."""

    backend: Any
    layout: str
    q: Any  # kernel form: the accumulator dtype, on the backend's device
    out: Any  # what the caller gets back
    result: Any  # what the kernel writes (``out`` itself, or a scratch to cast from)
    scale: float
    causal: bool
    window: int  # 0: no window
    table: Any


def _check_options(scale: Any, causal: Any, window: Any, head_dim: int):
    if not isinstance(causal, (bool, np.bool_)):
        raise ArgumentTypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise ArgumentTypeError(
                f"window must be None or a positive int, got {type(window).__name__} {window!r}"
            )
        if window <= 0:
            raise InvalidArgumentError(f"window must be None or a positive int, got {window}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ArgumentTypeError(
            f"scale must be None or a real number, got {type(scale).__name__} {scale!r}"
        )
    elif not math.isfinite(scale):
        raise InvalidArgumentError(f"scale must be finite, got {scale}")
    return float(scale), bool(causal), 0 if window is None else int(window)


def _pair(kv: Any, layout: str):
    """(K, V) given as a pair: check them and find their backend."""
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise ArgumentTypeError(
            f"kv must be a LayerKVCache or a (K, V) pair, got {type(kv).__name__}"
        )
    K, V = kv
    on_device = any(
        hasattr(x, "__cuda_array_interface__") or hasattr(x, "__cuda_ndarray__") for x in (K, V)
    )
    backend = get_backend("cuda" if on_device else "cpu")
    K, V = backend.adopt(K, "K"), backend.adopt(V, "V")
    for name, x in (("K", K), ("V", V)):
        if x.ndim != 4:
            raise ShapeMismatchError(
                f"{name} must be 4-D (layout {layout!r}), got shape {tuple(x.shape)}"
            )
    if tuple(K.shape) != tuple(V.shape):
        raise ShapeMismatchError(
            f"K and V must have one shape, got {tuple(K.shape)} and {tuple(V.shape)}"
        )
    if np.dtype(K.dtype) != np.dtype(V.dtype):
        raise DTypeMismatchError(f"K has dtype {K.dtype} but V has dtype {V.dtype}")
    dtype = check_supported(np.dtype(K.dtype), "K")
    d = _layout.dims(tuple(K.shape), layout)
    return backend, backend.attention_form(K), backend.attention_form(V), d, dtype


def _plan(q, backend, layout, kv_dims, seq_len, dtype, scale, causal, window, out) -> _Plan:
    """Check q and out against K/V of ``kv_dims`` holding ``seq_len`` positions."""
    q = backend.adopt(q, "q")
    if q.ndim != 4:
        raise ShapeMismatchError(
            f"q must be 4-D [batch, num_heads, n_q, head_dim], got shape {tuple(q.shape)}"
        )
    q_dtype = check_supported(np.dtype(q.dtype), "q")
    batch, num_heads, n_q, head_dim = (int(x) for x in q.shape)
    if batch != kv_dims.batch:
        raise ShapeMismatchError(
            f"q has shape {tuple(q.shape)}: batch {batch}, but the cache holds batch "
            f"{kv_dims.batch}"
        )
    if head_dim != kv_dims.head_dim:
        raise ShapeMismatchError(
            f"q has shape {tuple(q.shape)}: head_dim {head_dim}, but the cache holds "
            f"head_dim {kv_dims.head_dim}"
        )
    if num_heads % kv_dims.num_kv_heads:
        raise ShapeMismatchError(
            f"q has {num_heads} heads, which is not a multiple of the cache's "
            f"{kv_dims.num_kv_heads} KV heads (grouped-query attention needs num_heads = "
            f"group * num_kv_heads)"
        )
    if seq_len == 0:
        raise InvalidArgumentError("the cache holds no position: there is nothing to attend to")
    if n_q > seq_len:
        raise ShapeMismatchError(
            f"q has {n_q} queries but the cache holds {seq_len} positions; the queries are "
            f"the last n_q positions held, so append their K/V first"
        )
    scale, causal, window = _check_options(scale, causal, window, head_dim)
    # 16-bit storage is accumulated in float32; float64 anywhere means float64
    acc = np.dtype(np.float64) if np.float64 in (q_dtype, dtype) else np.dtype(np.float32)
    if out is not None:
        out = backend.adopt(out, "out")
        if tuple(out.shape) != tuple(q.shape):
            raise ShapeMismatchError(
                f"out has shape {tuple(out.shape)} but q has shape {tuple(q.shape)}"
            )
        if np.dtype(out.dtype) != q_dtype:
            raise DTypeMismatchError(f"out has dtype {out.dtype} but q has dtype {q_dtype}")
    backend.check_attention(kv_dims)
    q_kernel, result, out = backend.attention_arrays(q, acc, out)
    table = backend.attention_table(dtype)
    return _Plan(backend, layout, q_kernel, out, result, scale, causal, window, table)


def attention(
    q: Any,
    kv: LayerKVCache | tuple[Any, Any],
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
    out: Any = None,
    layout: str | None = None,
):
    """Attention of ``q`` over the keys and values a cache holds.

    Parameters
    ----------
    q : array, shape [batch, num_heads, n_q, head_dim]
        The queries of the last ``n_q`` positions held (decode: ``n_q == 1``; a prefill
        chunk: ``n_q > 1``). ``num_heads`` is a multiple of ``num_kv_heads``: query head
        ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    kv : LayerKVCache, or a (K, V) pair
        A pair is read in ``layout`` (default "bhsd"): shape [batch, num_kv_heads, seq_len,
        head_dim], every position held.
    scale : float, default ``head_dim ** -0.5``
    causal : bool, default True
        Each query sees the positions up to its own.
    window : int, optional
        Each query sees only the last ``window`` positions, its own included (sliding-window
        attention, as transformers defines it).
    out : array, optional
        Written in place: shape and dtype of ``q``, on the cache's device.
    layout : {"bhsd", "bshd"}, optional
        The layout of a (K, V) pair; a cache knows its own.

    Returns
    -------
    array of shape [batch, num_heads, n_q, head_dim], ``q``'s dtype, on the cache's device.
    Accumulation is float32 (float64 when ``q`` or the cache is float64), with a streaming
    softmax that is stable for long contexts and large logits.

    Raises
    ------
    ShapeMismatchError, DTypeMismatchError, DeviceMismatchError, InvalidArgumentError,
    ArgumentTypeError
        Heads that do not divide, another head_dim or batch, ``n_q > seq_len``, an empty
        cache, q on another device, bad options. Nothing is written.

    Examples
    --------
    >>> import numpy as np, nbkv
    >>> cache = nbkv.LayerKVCache(16, batch=1, num_kv_heads=2, head_dim=8, dtype="float32")
    >>> rng = np.random.default_rng(0)
    >>> k = rng.standard_normal((1, 2, 5, 8), dtype=np.float32)
    >>> cache.append(k, k)
    >>> q = rng.standard_normal((1, 8, 1, 8), dtype=np.float32)  # 8 query heads, group 4
    >>> o = nbkv.attention(q, cache)
    >>> o.shape, bool(np.allclose(o, nbkv.reference.attention(q, k, k), atol=1e-6))
    ((1, 8, 1, 8), True)
    """
    if isinstance(kv, LayerKVCache):
        if layout is not None and layout != kv.layout:
            raise InvalidArgumentError(
                f"layout={layout!r} but this cache holds layout {kv.layout!r}; leave it out"
            )
        backend, layout = kv._backend, kv.layout
        K, V = kv._buffers()
        seq_len, dtype = kv.seq_len, kv.dtype
        if isinstance(kv, RotatingKVCache) and K is not None:
            # a decode step reads the ring in place; anything else, the ordered positions
            n_q = q.shape[2] if getattr(q, "ndim", 0) == 4 else 1
            K, V, seq_len = kv._attention_view(n_q, window)
        dims = _layout.Dims(kv.batch, kv.num_kv_heads, seq_len, kv.head_dim)
        if K is None:
            raise InvalidArgumentError("the cache holds no position: there is nothing to attend to")
        K, V = backend.attention_form(K), backend.attention_form(V)
    else:
        layout = _layout.check_layout("bhsd" if layout is None else layout)
        backend, K, V, dims, dtype = _pair(kv, layout)
        seq_len = dims.seq
    plan = _plan(q, backend, layout, dims, seq_len, dtype, scale, causal, window, out)
    backend.attend(
        layout,
        plan.q,
        K,
        V,
        seq_len,
        plan.scale,
        plan.causal,
        plan.window,
        plan.table,
        plan.result,
    )
    return backend.finish_attention(plan.result, plan.out)


def append_and_attend(
    q: Any,
    k: Any,
    v: Any,
    cache: LayerKVCache,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
    out: Any = None,
):
    """``cache.append(k, v)`` then ``attention(q, cache, ...)``, in one kernel call.

    One launch on CUDA (per-launch overhead is a large part of a decode step on a GPU).
    Everything is checked first, as by the two calls: if anything is wrong, nothing is
    written and the cache is as it was.

    Examples
    --------
    >>> import numpy as np, nbkv
    >>> cache = nbkv.LayerKVCache(16, batch=1, num_kv_heads=1, head_dim=4, dtype="float32")
    >>> k = np.ones((1, 1, 1, 4), np.float32)
    >>> o = nbkv.append_and_attend(np.ones((1, 2, 1, 4), np.float32), k, 3 * k, cache)
    >>> cache.seq_len, o[0, 1, 0].tolist()
    (1, [3.0, 3.0, 3.0, 3.0])
    """
    if not isinstance(cache, LayerKVCache):
        raise ArgumentTypeError(f"cache must be a LayerKVCache, got {type(cache).__name__}")
    if isinstance(cache, RotatingKVCache):
        # everything checked first, then the append and the attention (two launches on
        # CUDA: the ring's slots are not the positions the fused kernel writes)
        k, v, d, dtype = cache._check_append(k, v)
        held = min(cache.seq_len + d.seq, cache.window)
        _plan(q, cache._backend, cache.layout, d, held, dtype, scale, causal, window, out)
        cache.append(k, v)
        return attention(q, cache, scale=scale, causal=causal, window=window, out=out)
    k, v, d, dtype = cache._check_append(k, v)
    pos = cache.seq_len
    plan = _plan(q, cache._backend, cache.layout, d, pos + d.seq, dtype, scale, causal, window, out)
    cache._make_room(pos + d.seq)
    cache._ensure_allocated(d, dtype)
    be = cache._backend
    K, V = (be.attention_form(x) for x in cache._buffers())
    be.append_attend(
        cache.layout,
        plan.q,
        be.attention_form(k),
        be.attention_form(v),
        pos,
        K,
        V,
        plan.scale,
        plan.causal,
        plan.window,
        plan.table,
        plan.result,
    )
    cache._advance(d.seq)
    return be.finish_attention(plan.result, plan.out)
