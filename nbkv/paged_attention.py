"""paged_attention() and paged_append_and_attend(): attention of a packed ragged batch of
sequences over a :class:`nbkv.PagedKVCache`, read through its page tables in place.

Each sequence's queries are its new positions in the step (the last ``n`` it holds),
causal over everything it holds, grouped-query by index (query head ``h`` reads KV head
``h // group``); ``window`` as in :func:`nbkv.attention`. The result equals
:func:`nbkv.reference.attention` over that sequence's gathered K/V. NaN and infinities
follow IEEE arithmetic as in :func:`nbkv.attention`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .attention import check_options
from .dtypes import check_supported
from .errors import ArgumentTypeError, ShapeMismatchError

__all__ = ["paged_attention", "paged_append_and_attend"]


def _query(q: Any, view, out: Any):
    """Check q [total_new, num_heads, head_dim] (and out) against the view's step."""
    be, step = view.backend, view.step
    q = be.adopt(q, "q")
    if q.ndim != 3:
        raise ShapeMismatchError(
            f"q must be 3-D [total_new, num_heads, head_dim], got shape {tuple(q.shape)}"
        )
    total, num_heads, head_dim = (int(x) for x in q.shape)
    if total != step.num_tokens:
        raise ShapeMismatchError(
            f"q has {total} rows but the step holds {step.num_tokens} new positions"
        )
    if head_dim != view.head_dim or num_heads < 1:
        raise ShapeMismatchError(
            f"q has shape {tuple(q.shape)}: head_dim must be the cache's {view.head_dim}"
        )
    if num_heads % view.num_kv_heads:
        raise ShapeMismatchError(
            f"q has {num_heads} heads, not a multiple of the cache's {view.num_kv_heads} KV heads"
        )
    q_dtype = check_supported(np.dtype(q.dtype), "q")
    if out is not None:
        out = be.adopt(out, "out")
        if tuple(out.shape) != tuple(q.shape) or np.dtype(out.dtype) != q_dtype:
            raise ShapeMismatchError(
                f"out must have q's shape {tuple(q.shape)} and dtype {q_dtype}, got "
                f"{tuple(out.shape)} {out.dtype}"
            )
        if isinstance(out, np.ndarray) and not out.flags.writeable:
            raise ArgumentTypeError("out is read-only; pass a writeable array (or none)")
    acc = np.dtype(np.float64) if np.float64 in (q_dtype, view.dtype) else np.dtype(np.float32)
    return q, out, acc


def _prepare(q, view, scale, window, out):
    """Every check and allocation of an attention call, before anything is written."""
    be = view.backend
    q, out, acc = _query(q, view, out)
    scale, _, window = check_options(scale, True, window)
    be.check_attention(view)  # sizes the kernels cannot take (head_dim on CUDA)
    scale = 1.0 / math.sqrt(view.head_dim) if scale is None else scale
    q_kernel, result, out = be.attention_arrays(q, acc, out)
    return q_kernel, result, out, scale, 0 if window is None else window


def _tables(view, scale, window, table):
    s = view.step
    return (s.q_indptr, s.kv_indptr, s.kv_indices, s.seq_lens, scale, window, table)


def _hint(step, window: int) -> tuple[tuple[int, int, int], int]:
    """(sequences, longest new run, longest span any query sees), from the host arrays;
    and the window clamped to the longest sequence (a window past every sequence is
    none, and the kernels' int32 arithmetic stays in range)."""
    new = np.diff(step.host("q_indptr")).astype(np.int64)
    lens = step.host("seq_lens").astype(np.int64)
    window = min(window, int(lens.max()))
    span = np.minimum(lens, new + window - 1) if window else lens
    return (len(new), int(new.max()), int(span.max())), window


def paged_attention(
    q: Any,
    cache: Any,
    layer: int,
    step: Any,
    *,
    scale: float | None = None,
    window: int | None = None,
    out: Any = None,
):
    """Attention of every sequence's new positions in ``step`` over what it holds.

    Parameters
    ----------
    q : array [total_new, num_heads, head_dim]
        The step's new positions, in its order (sequence ``i``'s at
        ``step.q_indptr[i] .. step.q_indptr[i + 1] - 1``), on the cache's device.
    cache : PagedKVCache
    layer : int
    step : PagedStep
        From ``cache.reserve``, still valid, its K/V written in ``layer``.
    scale, window, out
        As for :func:`nbkv.attention` (causal always).

    Returns
    -------
    array [total_new, num_heads, head_dim], ``q``'s dtype.

    Raises
    ------
    StaleStepError, LayerIndexError, ShapeMismatchError, DTypeMismatchError,
    ArgumentTypeError, InvalidArgumentError, DeviceMismatchError
    """
    if not hasattr(type(cache), "view"):
        raise ArgumentTypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    view = cache.view(layer, step)
    q_kernel, result, out, scale, window = _prepare(q, view, scale, window, out)
    be = view.backend
    table = be.attention_table(view.dtype)
    hint, window = _hint(step, window)
    tables = _tables(view, scale, window, table)
    be.paged_attend(q_kernel, view.k_pool, view.v_pool, *tables, result, hint)
    return be.finish_attention(result, out)


def paged_append_and_attend(
    q: Any,
    k: Any,
    v: Any,
    cache: Any,
    layer: int,
    step: Any,
    *,
    scale: float | None = None,
    window: int | None = None,
    out: Any = None,
):
    """``cache.write(layer, step, k, v)`` then :func:`paged_attention`, in one call (one
    launch on CUDA). Everything is checked first: on an error nothing is written."""
    if not hasattr(type(cache), "view"):
        raise ArgumentTypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    view = cache.view(layer, step)
    k, v = cache.check_rows(k, "k", step), cache.check_rows(v, "v", step)
    q_kernel, result, out, scale, window = _prepare(q, view, scale, window, out)
    be = view.backend
    table = be.attention_table(view.dtype)
    hint, window = _hint(step, window)
    be.paged_append_attend(
        q_kernel, be.attention_form(k), be.attention_form(v), step.slot_mapping,
        view.k_pool, view.v_pool, *_tables(view, scale, window, table), result, hint,
    )  # fmt: skip
    cache.written(layer, step)
    return be.finish_attention(result, out)
