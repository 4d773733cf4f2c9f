"""What :class:`nbkv.models.Llama` checks before a forward pass writes anything: token
ids, and that a cache (a :class:`~nbkv.KVCache`, or a paged cache and its step) fits the
model and has room. Each raises the typed error the model's methods document.

>>> import numpy as np
>>> from nbkv.models.checks import check_token_ids
>>> check_token_ids([72, 105], 256)
array([[ 72, 105]])
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ..dtypes import supported_dtypes
from ..errors import (
    ArgumentTypeError,
    CacheOverflowError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
)
from ..kvcache import KVCache
from .config import _F32, LlamaConfig

__all__ = ["CACHE_DTYPES", "check_token_ids", "check_cache", "check_paged"]

# the dtypes a model's cache may store (the model computes in float32)
CACHE_DTYPES = tuple(d for d in supported_dtypes() if d.itemsize <= 4)


def check_token_ids(x: ArrayLike, vocab_size: int, name: str = "token_ids") -> NDArray[np.int64]:
    """``x`` as int64 [batch, n] (1-D: batch 1), every id in [0, vocab_size), or a
    typed error naming ``name``."""
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as err:
        raise ArgumentTypeError(
            f"{name} must be an integer array of token ids, got {type(x).__name__} ({err})"
        ) from None
    if arr.dtype.kind in "OSUV":
        raise ArgumentTypeError(
            f"{name} must hold integer token ids, got {type(x).__name__} of dtype {arr.dtype}"
        )
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ShapeMismatchError(f"{name} must be 1-D [n] or 2-D [batch, n], got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidArgumentError(
            f"{name} must hold at least one token in each of at least one row, got "
            f"shape {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InvalidArgumentError(
            f"{name} must be in [0, vocab_size={vocab_size}), got {int(arr[where])} at "
            f"index {where}"
        )
    return arr.astype(np.int64, copy=False)


def check_cache(c: LlamaConfig, cache: object, batch: int, n: int, what: str) -> None:
    """Raise unless ``cache`` fits a model of config ``c`` and has room for ``n`` more
    positions."""
    if not isinstance(cache, KVCache):
        raise ArgumentTypeError(
            f"cache must be an nbkv.KVCache (see Llama.new_cache), got {type(cache).__name__}"
        )
    if cache.num_layers != c.num_hidden_layers:
        raise InvalidArgumentError(
            f"cache has {cache.num_layers} layers but the model has "
            f"{c.num_hidden_layers}; build it with model.new_cache(...)"
        )
    seen = sorted({layer.offset for layer in cache})
    if len(seen) > 1:
        raise InvalidArgumentError(
            f"cache layers have seen different numbers of tokens ({seen}), as after an "
            "interrupted forward pass; clear() the cache"
        )
    want = (batch, c.num_key_value_heads, c.head_dim, _F32, cache.layout)
    for i, layer in enumerate(cache):  # every layer, before anything is written
        dtype = _F32 if layer.dtype in CACHE_DTYPES else layer.dtype
        got = (layer.batch, layer.num_kv_heads, layer.head_dim, dtype, layer.layout)
        if got != want:  # only then find out which, if any, is wrong (None: lazy)
            _check_layer(i, got, want)
    if cache.seq_len + n <= cache.max_seq_len:
        return  # room in every layer
    try:
        cache.check_room(n)
    except CacheOverflowError as err:
        held, capacity = cache.seq_len, cache.max_seq_len
        raise CacheOverflowError(
            f"{what} need {n} positions but the cache holds {held} of {capacity} and "
            f"{capacity - held} are free; build it with max_seq_len >= {held + n} ({err})"
        ) from None


def _check_layer(i: int, got: tuple, want: tuple) -> None:
    """Raise the typed error for the first size, dtype or layout of cache layer ``i``
    that does not fit the model (sizes and dtype may be None: a lazy layer)."""
    for field, g, w in zip(("batch", "num_kv_heads", "head_dim"), got, want, strict=False):
        if g is not None and g != w:
            source = "token_ids" if field == "batch" else "the model"
            raise ShapeMismatchError(f"cache layer {i} holds {field} {g} but {source} has {w}")
    if got[3] is not None and got[3] != want[3]:
        raise DTypeMismatchError(
            f"cache layer {i} must hold float32, float16 or bfloat16, got {got[3]}"
        )
    if got[4] != want[4]:
        raise InvalidArgumentError(
            f"cache layer {i} has layout {got[4]!r} but layer 0 has {want[4]!r}; a "
            "model's cache holds one layout"
        )


def check_paged(c: LlamaConfig, cache: Any, step: Any, ids: np.ndarray, token_ids: Any) -> None:
    """Raise unless ``cache`` is a paged cache that fits a model of config ``c``,
    ``step`` is its and still valid, and ``ids`` (checked from ``token_ids``) are the
    step's new tokens."""
    if not hasattr(type(cache), "check_step"):
        raise ArgumentTypeError(f"cache must be an nbkv.PagedKVCache, got {type(cache).__name__}")
    got = (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype)
    want = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim, _F32)
    if got != want:
        raise ShapeMismatchError(
            f"cache holds (layers, kv_heads, head_dim, dtype) {got} but the model needs {want}"
        )
    cache.check_step(step)
    if ids.shape != (1, step.num_tokens):
        raise ShapeMismatchError(
            f"token_ids must be 1-D with the step's {step.num_tokens} new tokens, got shape "
            f"{np.shape(token_ids)}"
        )
