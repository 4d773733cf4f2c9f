"""The nbkv exception hierarchy.

Every error nbkv raises for bad input derives from :class:`KVCacheError` and is raised
before anything is allocated or written, so a failed call leaves a cache as it was.
Where Python has a matching built-in category, the nbkv error also derives from it, so
``except ValueError`` and ``except TypeError`` keep working.
"""

from __future__ import annotations

__all__ = [
    "KVCacheError",
    "CacheOverflowError",
    "ShapeMismatchError",
    "DTypeMismatchError",
    "BackendUnavailableError",
    "DeviceMismatchError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "LayerIndexError",
    "CacheFormatError",
    "OutOfBlocksError",
    "StaleStepError",
    "StoreError",
]


class KVCacheError(Exception):
    """Base class of every error nbkv raises for bad input or an impossible request."""


class CacheOverflowError(KVCacheError):
    """An append or ``set_k`` would need more positions than the cache's capacity."""


class ShapeMismatchError(KVCacheError, ValueError):
    """An array's rank or shape does not fit its partner or the cache's buffers."""


class DTypeMismatchError(KVCacheError, TypeError):
    """An array's dtype is unsupported or differs from the cache's (nbkv never casts)."""


class BackendUnavailableError(KVCacheError, RuntimeError):
    """The requested device cannot be used in this process."""


class DeviceMismatchError(KVCacheError, ValueError):
    """An array lives on a different device than the cache that was given it."""


class InvalidArgumentError(KVCacheError, ValueError):
    """An argument has the right type but an impossible value (``max_seq_len=0``)."""


class ArgumentTypeError(KVCacheError, TypeError):
    """An argument has the wrong type (a list where an array was expected)."""


class LayerIndexError(KVCacheError, IndexError):
    """A layer index is outside ``[-num_layers, num_layers)``."""


class CacheFormatError(KVCacheError, ValueError):
    """A saved cache file is truncated, corrupted, of another format or version, or
    does not describe the cache it is loaded into (see :mod:`nbkv.persist`)."""


class OutOfBlocksError(CacheOverflowError):
    """A paged cache's step needs more blocks than are free or evictable (the message
    names how many it needs and how many there are); nothing was changed."""


class StaleStepError(KVCacheError, ValueError):
    """A paged cache's step was used after the cache changed (or with another cache):
    its slot mapping could write into blocks now owned by another sequence."""


class StoreError(KVCacheError, RuntimeError):
    """A K/V store (:mod:`nbkv.store`) could not be reached or failed: the Redis server
    is down or timed out, a directory cannot be written. The message names the store and
    the cause. An :class:`nbkv.serving.Engine` counts it and recomputes; it never fails a
    request for it."""
