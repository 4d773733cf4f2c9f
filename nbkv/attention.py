"""attention() and append_and_attend(): validate, then dispatch to the cache's backend.

Decode attention reads only the positions held, ``[0, seq_len)``, and maps query head
``h`` to KV head ``h // group`` by index: K/V are never repeated or copied, and no mask
is built over unused capacity. A cache is reached through the cache protocol
(:mod:`nbkv.protocol`): ``attention_view`` says what to read; ``prepare_append`` /
``stage_append`` / ``commit_append`` write ahead of a fused launch (CUDA), ``append(k, v,
undoable=True)`` where the backend runs the two kernels back to back anyway (the CPU); no
cache type is special-cased here.

NaN and infinities flow through as IEEE arithmetic says, never as an exception: a NaN
query (or key it sees) gives NaN out, a ``-inf`` score gets weight 0, and a row that sees
nothing finite gives NaN, as torch's ``scaled_dot_product_attention`` does. As in the
matrix products of torch and of :func:`nbkv.reference.attention`, a NaN or infinity in
V multiplies every weight of its position, 0 included (0 * NaN is NaN): V rows the
kernel reads for a query's block reach that query even where masked; rows of positions
no query of the call can see (before a window) are never read.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import numpy as np

from . import layout as _layout
from .backends import get_backend
from .dtypes import check_supported
from .errors import (
    ArgumentTypeError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
)
from .protocol import AttentionView, is_layer_cache

__all__ = ["attention", "append_and_attend"]


_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


class _Plan(NamedTuple):
    """Everything a kernel launch needs, all checked."""

    backend: Any
    q: Any  # kernel form: the accumulator dtype, on the backend's device
    out: Any  # what the caller gets back
    result: Any  # what the kernel writes (``out`` itself, or a scratch to cast from)
    scale: float
    causal: bool
    window: int  # 0: no window (also when the window covers every position)
    table: Any


def check_options(scale: Any, causal: Any, window: Any) -> tuple[Any, bool, int | None]:
    """``(scale, causal, window)`` checked as ``attention`` takes them, or a typed error."""
    if not isinstance(causal, (bool, np.bool_)):
        raise ArgumentTypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if window is not None:
        if isinstance(window, (bool, np.bool_)) or not isinstance(window, numbers.Integral):
            raise ArgumentTypeError(
                f"window must be None or a positive int, got {type(window).__name__} {window!r}"
            )
        if window <= 0:
            raise InvalidArgumentError(f"window must be None or a positive int, got {window}")
        window = int(window)
    if scale is not None:
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
            raise ArgumentTypeError(
                f"scale must be None or a real number, got {type(scale).__name__} {scale!r}"
            )
        try:
            scale = float(scale)
        except OverflowError:
            scale = math.inf
        if not math.isfinite(scale):
            raise InvalidArgumentError(f"scale must be a finite real number, got {scale}")
    return scale, bool(causal), window


def kernel_scale(scale: float | None, head_dim: int) -> float:
    """The scale the kernels take: ``scale``, or ``head_dim ** -0.5`` when None."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def kernel_window(window: int | None, seq_len: int) -> int:
    """The window the kernels take over ``seq_len`` positions: 0 for none, and for a
    window that reaches back past position 0 for every query (no window at all)."""
    return 0 if window is None or window >= seq_len else window


def accumulator(q_dtype: np.dtype, kv_dtype: np.dtype) -> np.dtype:
    """float32, or float64 where q or K/V is float64 (16-bit storage is accumulated in
    float32)."""
    return _F64 if _F64 in (q_dtype, kv_dtype) else _F32


def _adopt_q(q: Any, backend) -> Any:
    q = backend.adopt(q, "q")
    if q.ndim != 4:
        raise ShapeMismatchError(
            f"q must be 4-D [batch, num_heads, n_q, head_dim], got shape {tuple(q.shape)}"
        )
    if min(q.shape) < 1:
        raise ShapeMismatchError(
            f"q has shape {tuple(q.shape)}: batch, num_heads, n_q and head_dim must each be "
            f"at least 1"
        )
    check_supported(np.dtype(q.dtype), "q")
    return q


def _pair(kv: Any, layout: str) -> AttentionView:
    """(K, V) given as a pair: check them and find their backend."""
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise ArgumentTypeError(
            f"kv must be a layer cache or a (K, V) pair, got {type(kv).__name__}"
        )
    K, V = kv
    on_device = any(
        hasattr(x, "__cuda_array_interface__") or hasattr(x, "__cuda_ndarray__") for x in (K, V)
    )
    backend = get_backend("cuda" if on_device else "cpu", layout)
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
    if min(d) < 1 and d.seq != 0:
        raise ShapeMismatchError(f"K has shape {tuple(K.shape)}: every size must be at least 1")
    if d.seq == 0:
        raise InvalidArgumentError("K holds no position: there is nothing to attend to")
    return AttentionView(
        backend, backend.attention_form(K), backend.attention_form(V), d.seq, d, dtype
    )


def _plan(q, backend, kv_dims, dtype, options, out) -> _Plan:
    """Check an adopted q and ``out`` against K/V of ``kv_dims`` (seq = positions held)."""
    batch, num_heads, n_q, head_dim = q.shape  # an adopted array's: ints
    seq_len = kv_dims.seq
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
    if seq_len == 0:  # an empty append to an empty cache: as attention over it says
        raise InvalidArgumentError("the cache holds no position: there is nothing to attend to")
    if n_q > seq_len:
        raise _too_many_queries(n_q, seq_len)
    scale, causal, window = options
    scale = kernel_scale(scale, head_dim)
    window = kernel_window(window, seq_len)
    q_dtype = np.dtype(q.dtype)
    acc = accumulator(q_dtype, dtype)
    if out is not None:
        out = backend.adopt(out, "out")
        if tuple(out.shape) != tuple(q.shape):
            raise ShapeMismatchError(
                f"out has shape {tuple(out.shape)} but q has shape {tuple(q.shape)}"
            )
        if np.dtype(out.dtype) != q_dtype:
            raise DTypeMismatchError(f"out has dtype {out.dtype} but q has dtype {q_dtype}")
        if isinstance(out, np.ndarray) and not out.flags.writeable:
            raise InvalidArgumentError("out is read-only; pass a writeable array (or none)")
    backend.check_attention(kv_dims)
    q_kernel, result, out = backend.attention_arrays(q, acc, out)
    table = backend.attention_table(dtype)
    return _Plan(backend, q_kernel, out, result, scale, causal, window, table)


def _too_many_queries(n_q: int, seq_len: int) -> ShapeMismatchError:
    return ShapeMismatchError(
        f"q has {n_q} queries but the cache holds {seq_len} positions; the queries are "
        f"the last n_q positions held, so append their K/V first"
    )


def _run(plan: _Plan, view: AttentionView):
    be = plan.backend
    be.attend(
        plan.q, view.k, view.v, view.seq_len, plan.scale, plan.causal, plan.window, plan.table,
        plan.result,
    )  # fmt: skip
    return be.finish_attention(plan.result, plan.out)


def attention(
    q: Any,
    kv: Any,
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
    kv : a layer cache (LayerKVCache, RotatingKVCache, ...), or a (K, V) pair
        A pair is read in ``layout`` (default "bhsd"): shape [batch, num_kv_heads, seq_len,
        head_dim], every position held.
    scale : float, default ``head_dim ** -0.5``
    causal : bool, default True
        Each query sees the positions up to its own.
    window : int, optional
        Each query sees only the last ``window`` positions, its own included (sliding-window
        attention, as transformers defines it). Any positive int; one at least
        ``seq_len`` is the same as none.
    out : array, optional
        Written in place: shape and dtype of ``q``, writeable, on the cache's device.
    layout : {"bhsd", "bshd"}, optional
        The layout of a (K, V) pair; a cache knows its own.

    Returns
    -------
    array of shape [batch, num_heads, n_q, head_dim], ``q``'s dtype, on the cache's device.
    Accumulation is float32 (float64 when ``q`` or the cache is float64), with a streaming
    softmax that is stable for long contexts and large logits. NaN and infinities follow
    IEEE arithmetic (see the module docstring); they never raise.

    Raises
    ------
    ShapeMismatchError, DTypeMismatchError, DeviceMismatchError, InvalidArgumentError,
    ArgumentTypeError
        Heads that do not divide, another head_dim or batch, ``n_q > seq_len``, an empty
        cache, q on another device, bad options, a read-only ``out``. Nothing is written.

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
    options = check_options(scale, causal, window)
    if is_layer_cache(kv):
        if layout is not None and layout != kv.layout:
            raise InvalidArgumentError(
                f"layout={layout!r} but this cache holds layout {kv.layout!r}; leave it out"
            )
        return _attend_cache(q, kv, options, out, get_backend(kv.device, kv.layout))
    view = _pair(kv, _layout.check_layout("bhsd" if layout is None else layout))
    q = _adopt_q(q, view.backend)
    plan = _plan(q, view.backend, view.dims, view.dtype, options, out)
    return _run(plan, view)


def _attend_cache(q: Any, cache: Any, options: tuple, out: Any, backend: Any):
    """``attention`` over a layer cache, its options checked; ``backend`` is the cache's."""
    q = _adopt_q(q, backend)
    n_q, held = q.shape[2], cache.seq_len
    if 0 < held < n_q:  # before the view: a ring would say it overwrote what q needs
        raise _too_many_queries(n_q, held)
    # a decode step of a ring reads its buffers in place; anything else in order; the
    # view's backend is the cache's reader (a quantized cache's reads the codes)
    view = cache.attention_view(n_q, options[2])
    plan = _plan(q, view.backend, view.dims, view.dtype, options, out)
    return _run(plan, view)


def append_and_attend(
    q: Any,
    k: Any,
    v: Any,
    cache: Any,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
    out: Any = None,
):
    """``cache.append(k, v)`` then ``attention(q, cache, ...)``, in one kernel call where
    the cache allows it.

    One launch on CUDA for a :class:`~nbkv.LayerKVCache` (per-launch overhead is a large
    part of a decode step on a GPU): everything is checked and allocated first, then the
    kernel runs. A ring's slots are not the positions a fused kernel writes, so a
    :class:`~nbkv.RotatingKVCache` gets the append and then the attention; so does every
    cache on the CPU, where the two kernels would run back to back anyway and the
    cache's own ``append`` takes its decode fast path. All or nothing: if anything fails
    (a bad ``q`` or ``out`` included), the cache is put back as it was.

    Examples
    --------
    >>> import numpy as np, nbkv
    >>> cache = nbkv.LayerKVCache(16, batch=1, num_kv_heads=1, head_dim=4, dtype="float32")
    >>> k = np.ones((1, 1, 1, 4), np.float32)
    >>> o = nbkv.append_and_attend(np.ones((1, 2, 1, 4), np.float32), k, 3 * k, cache)
    >>> cache.seq_len, o[0, 1, 0].tolist()
    (1, [3.0, 3.0, 3.0, 3.0])
    """
    if not is_layer_cache(cache):
        raise ArgumentTypeError(f"cache must be a layer cache, got {type(cache).__name__}")
    options = check_options(scale, causal, window)
    be = get_backend(cache.device, cache.layout)
    if not be.fused_append_attend:
        undo = cache.append(k, v, undoable=True)  # its own decode fast path
        try:
            return _attend_cache(q, cache, options, out, be)
        except BaseException:
            undo()
            raise
    append = cache.prepare_append(k, v)
    q = _adopt_q(q, be)
    d = append.dims
    dims = _layout.Dims(d.batch, d.num_kv_heads, append.held_after, d.head_dim)
    plan = _plan(q, be, dims, append.dtype, options, out)
    staged = cache.stage_append(append)
    if staged.fused is None:
        undo = cache.commit_append(staged, undoable=True)
        try:
            view = cache.attention_view(q.shape[2], options[2])
            # the plan made before the commit, on the view's own reader (a quantized
            # cache's reads the codes) and its table
            table = view.backend.attention_table(view.dtype)
            return _run(plan._replace(backend=view.backend, table=table), view)
        except BaseException:
            undo()
            raise
    k_buf, v_buf, pos = staged.fused
    form = be.attention_form
    be.append_attend(
        plan.q, form(staged.k), form(staged.v), pos, form(k_buf), form(v_buf),
        plan.scale, plan.causal, plan.window, plan.table, plan.result,
    )  # fmt: skip
    cache.commit_append(staged, written=True)
    return be.finish_attention(plan.result, plan.out)
