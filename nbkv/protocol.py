"""The cache protocol: the one seam between a cache and everything that uses it.

``nbkv.attention``, ``nbkv.append_and_attend``, ``nbkv.save`` / ``load`` /
``load_state``, :class:`nbkv.KVCache`, :class:`nbkv.models.Llama` and the transformers
adapter talk to a layer cache through the methods below and nothing else: never through
its underscore members, never by switching on its type. A new cache type is one new
module that implements them (:class:`nbkv.LayerKVCache` and :class:`nbkv.RotatingKVCache`
are the two siblings that do, on the shared :class:`nbkv.BaseKVCache`).

Appending, in three steps, so that a caller can check everything before anything changes
and fuse the write into another kernel:

``prepare_append(k, v) -> AppendPlan``
    Every check ``append(k, v)`` makes (types, shapes, dtype, device, room), changing
    nothing. The plan holds the adopted arrays and the sizes.
``stage_append(plan) -> StagedAppend``
    Allocates whatever the append needs (the first buffers of a lazy cache, the larger
    buffers of a growth, with the positions held copied in) without changing the cache:
    if it raises (out of memory), the cache is exactly as it was. ``staged.fused`` is
    ``(k_buffer, v_buffer, pos)``, kernel-form buffers in which the ``n`` new positions
    belong at ``[pos, pos + n)``, for a kernel that writes them itself; or ``None`` where
    positions are not contiguous slots (a ring).
``commit_append(staged, *, written=False, undoable=False) -> undo``
    Makes the new positions held: writes them (unless ``written``: a fused kernel did),
    installs staged buffers, moves the cursor. Allocates nothing, so it does not fail on
    memory. With ``undoable=True`` it returns a function that puts the cache back as it
    was before the commit (a ring saves the rows it overwrites first); else ``None``.

``append(k, v, *, undoable=False)`` is the three in a row (a LayerKVCache adds a fast
path for the decode loop), returning the undo function when asked. ``check_room(n)`` raises
:class:`~nbkv.CacheOverflowError` unless ``n`` more positions would fit (a ring always
fits), for callers that know ``n`` before they have the arrays (a model's forward pass).

Attention:

``attention_view(n_q, window) -> AttentionView``
    What attention must read for the last ``n_q`` positions as queries under ``window``
    (``None`` or an int): the backend (bound to the cache's layout), K and V in the form
    the attention kernels read, the number of positions to read, the logical sizes and
    the dtype. A ring answers with its buffers in place for a decode step (a softmax does
    not care about order) and an ordered copy otherwise. Raises
    :class:`~nbkv.InvalidArgumentError` when nothing is held.

State, for persistence (``nbkv.save``/``load``/``load_state``) and any other transport:

``export_state() -> CacheState``
    ``CacheState(type, layers)``: the cache's registered type name and, per layer, a
    :class:`LayerState` (a JSON-able ``meta`` dict, and a function that returns the
    positions held as host arrays ``(k, v)`` in position order and in ``meta["layout"]``,
    or ``None`` when the layer was never allocated; called once per layer, so a CUDA
    cache copies one layer at a time to the host).
``from_state(state, *, device, layout)`` (classmethod)
    A new cache of this type holding ``state`` (a :class:`LoadedState`: metas and host
    arrays); every check first, :class:`~nbkv.CacheFormatError` for a state this type
    cannot hold.
``import_state(state)``
    Replace what the cache holds with ``state``, keeping its own device, layout and
    capacity; everything checked first, all or nothing.

Every layer meta holds at least ``type``, ``layout``, ``dtype`` (``""`` while unknown),
``batch``, ``num_kv_heads``, ``head_dim`` (``None`` while unknown), ``seq_len`` (rows held)
and ``allocated``: what the file format needs to check the tensors. The rest is the type's
own (a capacity, a ring's ``window``, ``sinks``, ``offset``, ...).

A cache type joins the format under a name with :func:`register_cache_type`; ``nbkv.load``
finds the class by the name a file holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from .errors import ArgumentTypeError, CacheFormatError

__all__ = [
    "AppendPlan",
    "StagedAppend",
    "AttentionView",
    "LayerState",
    "CacheState",
    "LoadedLayer",
    "LoadedState",
    "LayerCache",
    "register_cache_type",
    "cache_class",
    "cache_type_of",
    "is_layer_cache",
    "COMMON_META",
]

# fields every layer meta carries (what the file format checks the tensors against)
COMMON_META = (
    "type",
    "layout",
    "dtype",
    "batch",
    "num_kv_heads",
    "head_dim",
    "seq_len",
    "allocated",
)


class AppendPlan(NamedTuple):
    """A checked append: what ``prepare_append`` found. Valid until the cache changes."""

    k: Any  # the adopted arrays (user form, on the cache's device or the host)
    v: Any
    dims: Any  # nbkv.layout.Dims of k (seq = n, the new positions)
    dtype: np.dtype  # the cache's logical dtype for them
    pos: int  # tokens seen before the append: the first new position
    held_after: int  # positions held once it is committed


class StagedAppend(NamedTuple):
    """An append whose storage is ready: ``commit_append`` cannot fail on memory."""

    plan: AppendPlan
    k: Any  # the new positions on the cache's device (user form; bfloat16 as uint16)
    v: Any
    fused: tuple[Any, Any, int] | None  # (k_buffer, v_buffer, pos) for a fused kernel
    storage: Any  # the cache's own: buffers to install on commit, or None


class AttentionView(NamedTuple):
    """What attention reads: K/V (attention form) holding ``seq_len`` positions."""

    backend: Any  # the cache's backend, bound to its layout
    k: Any
    v: Any
    seq_len: int
    dims: Any  # nbkv.layout.Dims (seq = seq_len)
    dtype: np.dtype


class LayerState(NamedTuple):
    """One layer, exported: JSON-able ``meta`` and ``held()`` -> ``(k, v)`` host arrays or None."""

    meta: dict
    held: Callable[[], tuple[np.ndarray, np.ndarray] | None]


class CacheState(NamedTuple):
    """A cache, exported: its registered type name and its layers."""

    type: str
    layers: list[LayerState]


class LoadedLayer(NamedTuple):
    """One layer, read back: ``meta`` and host arrays (None where nothing is held)."""

    meta: dict
    k: np.ndarray | None
    v: np.ndarray | None


class LoadedState(NamedTuple):
    """A cache, read back (from a file): type name, layers, and where it came from."""

    type: str
    layers: list[LoadedLayer]
    where: str  # for messages: the file's path


@runtime_checkable
class LayerCache(Protocol):
    """The methods every layer cache implements (see the module docstring)."""

    @property
    def seq_len(self) -> int: ...

    @property
    def offset(self) -> int: ...

    def prepare_append(self, k: Any, v: Any) -> AppendPlan: ...

    def stage_append(self, plan: AppendPlan) -> StagedAppend: ...

    def commit_append(
        self, staged: StagedAppend, *, written: bool = False, undoable: bool = False
    ) -> Callable[[], None] | None: ...

    def append(self, k: Any, v: Any, *, undoable: bool = False) -> Callable[[], None] | None: ...

    def check_room(self, n: int) -> None: ...

    def attention_view(self, n_q: int, window: int | None) -> AttentionView: ...

    def export_state(self) -> CacheState: ...

    def import_state(self, state: LoadedState) -> None: ...


def is_layer_cache(x: object) -> bool:
    """Whether ``x`` speaks the layer-cache protocol (duck-typed: cheap on hot paths)."""
    return hasattr(type(x), "attention_view") and hasattr(type(x), "prepare_append")


# -- the registry of cache types the file format knows -------------------------------

_TYPES: dict[str, type] = {}


def register_cache_type(name: str) -> Callable[[type], type]:
    """Class decorator: make a cache class savable and loadable under ``name``.

    The class implements ``export_state``, ``from_state`` and ``import_state``. Its
    subclasses are not registered by inheritance: each type a file names is exact.
    """

    def register(cls: type) -> type:
        if name in _TYPES and _TYPES[name] is not cls:
            raise ArgumentTypeError(f"cache type {name!r} is already registered by {_TYPES[name]}")
        _TYPES[name] = cls
        cls.state_type = name
        return cls

    return register


def cache_type_of(cache: object, what: str = "cache") -> str:
    """The registered name of ``cache``'s exact type, or ArgumentTypeError."""
    name = getattr(type(cache), "state_type", None)
    if name is None or _TYPES.get(name) is not type(cache):
        known = ", ".join(sorted(_TYPES))
        raise ArgumentTypeError(
            f"{what} must be a cache of a registered type ({known}, or a KVCache of "
            f"layer caches), got {type(cache).__name__}; a subclass saves only once "
            f"registered with nbkv.protocol.register_cache_type"
        )
    return name


def cache_class(name: object, where: str) -> type:
    """The class registered as ``name``, or CacheFormatError naming the file."""
    if not isinstance(name, str) or name not in _TYPES:
        raise CacheFormatError(
            f"{where}: cache type {name!r} is not one this nbkv knows ({', '.join(sorted(_TYPES))})"
        )
    return _TYPES[name]
