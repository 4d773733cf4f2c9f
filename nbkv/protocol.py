"""The cache protocol: the one seam between a cache and everything that uses it.

``nbkv.attention``, ``nbkv.append_and_attend``, ``nbkv.save`` / ``load`` /
``load_state``, :class:`nbkv.KVCache`, :class:`nbkv.models.Llama` and the transformers
adapter talk to a layer cache through the methods below and nothing else: never through
its underscore members, never by switching on its type. A new cache type is one new
module that implements them (:class:`nbkv.LayerKVCache` and :class:`nbkv.RotatingKVCache`
are the two siblings that do, on the shared :class:`nbkv.BaseKVCache`). The whole of
it is :class:`LayerCache`; the groups:

What a layer cache is (read-only properties): ``seq_len`` (rows held), ``offset``
(tokens seen: the next token's position), ``max_seq_len`` (rows the buffers hold),
``batch``, ``num_kv_heads``, ``head_dim``, ``dtype`` (None while a lazy cache does not
know them), ``device``, ``layout``, ``shape``, ``nbytes``, ``is_empty``, ``is_allocated``;
``get_kv()`` (the positions held in order, or None) and ``to_host(x)``.

Rows and rollback: ``clear()``, ``deallocate()``, ``trim(n)`` (drop the newest ``n``
held; how many), ``offset_after_trim(n)`` (the ``offset`` that would leave, changing
nothing: what a KVCache checks before it trims layers of different types), ``crop(n)``,
``check_indices(indices, length=None)``, ``reorder(indices)``, ``select(indices)``,
``copy()``.

Appending, in three steps, so that a caller can check everything before anything changes
and fuse the write into another kernel:

``prepare_append(k, v) -> AppendPlan``
    Every check ``append(k, v)`` makes (types, shapes, dtype, device, room), changing
    nothing. The plan holds the adopted arrays and the sizes.
``stage_append(plan) -> StagedAppend``
    Allocates whatever the append needs (the first buffers of a lazy cache, the larger
    buffers of a growth, with the positions held copied in) without changing the cache:
    if it raises (out of memory), the cache is exactly as it was. ``staged.fused`` is
    ``(k_buffer, v_buffer, pos)``, the user-form buffers (as ``get_kv`` sees them) in
    which the ``n`` new positions belong at ``[pos, pos + n)``, for a kernel that writes
    them itself; or ``None`` where positions are not contiguous slots (a ring).
``commit_append(staged, *, written=False, undoable=False) -> undo``
    Makes the new positions held: writes them (unless ``written``: a fused kernel did),
    installs staged buffers, moves the cursor. Allocates nothing (but that an undoable
    commit of a ring copies the rows it will overwrite first, before any write), so it
    does not fail on memory after it has changed anything. With ``undoable=True`` it
    returns a function that puts the cache back as it was before the commit; else
    ``None``.

A plan and a staged append belong to the cache and the state they were made for: any
change in between (another append, a trim, a growth, another cache) makes
``stage_append`` / ``commit_append`` raise :class:`~nbkv.InvalidArgumentError` rather
than write where the plan no longer fits.

``write_slots() -> WriteSlots | None`` (optional: a cache without it is served by
:class:`nbkv.DecodeStep` through ``append_and_attend``; not a member :class:`LayerCache`
checks)
    For a caller whose own kernel writes new positions and reads them in one launch, call
    after call (:class:`nbkv.DecodeStep`): the cache's buffers as slots, valid until the
    cache replaces its buffers. ``k`` and ``v`` are the buffers in the form the attention
    kernels read (as ``attention_view`` gives them), ``capacity`` the positions they hold,
    ``held()`` the positions held (the next one is written there), ``commit(pos, n)``
    holds ``n`` positions a kernel wrote at ``[pos, pos + n)``, and ``valid`` turns False
    once the buffers are replaced or dropped (a growth, ``deallocate``, a state loaded),
    when the slots also let go of them (``k`` and ``v`` become None);
    ``commit`` then raises :class:`~nbkv.InvalidArgumentError`, as it does when the
    cache moved since ``pos`` or the positions do not fit. Nothing is checked but that:
    the caller has checked the arrays its kernel writes against ``k`` and ``v``. ``None``
    where positions are not contiguous slots of the buffers (a ring, a quantized cache)
    or there are no buffers yet.

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
    cache copies one layer at a time to the host). A layer that stores something else
    than K/V in its dtype (a quantized layer: codes, scales, a window) declares its own
    tensors in ``meta["tensors"]`` (name -> ``[safetensors dtype, shape]``) and ``held``
    returns a dict of them by name; it reads them back from ``LoadedLayer.tensors``.
``from_state(state, *, device, layout)`` (classmethod)
    A new cache of this type holding ``state`` (a :class:`LoadedState`: metas and host
    arrays); every check first, :class:`~nbkv.CacheFormatError` for a state this type
    cannot hold.
``import_state(state)``
    Replace what the cache holds with ``state``, keeping its own device, layout and
    capacity; everything checked first, all or nothing.
``from_layer_state(layer, where, *, device, layout)`` (classmethod),
``check_layer_state(layer, where)``, ``stage_layer_state(layer, where) -> commit``
    The same, one :class:`LoadedLayer` at a time, for a container (a KVCache checks and
    stages every layer before it commits any). ``stage_layer_state`` makes every buffer
    and device copy first; the function it returns only writes.

A state from anywhere (not only a file) is checked before it is used: the common meta
fields, and tensors of exactly the shape and dtype the meta describes.

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
    "WriteSlots",
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
    key: tuple  # the cache and its state it was made for: a stale plan is refused


class StagedAppend(NamedTuple):
    """An append whose storage is ready: ``commit_append`` cannot fail on memory."""

    plan: AppendPlan
    k: Any  # the new positions on the cache's device (user form; bfloat16 as uint16)
    v: Any
    fused: tuple[Any, Any, int] | None  # (k_buffer, v_buffer, pos) for a fused kernel
    storage: Any  # the cache's own: buffers to install on commit, or None
    key: tuple  # as AppendPlan.key: commit_append refuses a staged append gone stale


class WriteSlots(Protocol):
    """A cache's buffers as slots a caller's kernel writes (see ``write_slots``)."""

    k: Any  # the buffers in the attention kernels' form
    v: Any
    capacity: int
    valid: bool  # False once the cache replaced or dropped these buffers

    def held(self) -> int: ...

    def commit(self, pos: int, n: int) -> None: ...


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
    """One layer, read back: ``meta`` and host arrays (None where nothing is held).

    A layer whose meta declares its own ``tensors`` (a quantized layer's codes and
    scales) has them in ``tensors`` (name -> array) and ``k``, ``v`` None."""

    meta: dict
    k: np.ndarray | None
    v: np.ndarray | None
    tensors: dict | None = None


class LoadedState(NamedTuple):
    """A cache, read back (from a file): type name, layers, and where it came from."""

    type: str
    layers: list[LoadedLayer]
    where: str  # for messages: the file's path


@runtime_checkable
class LayerCache(Protocol):
    """Every member a layer cache has (grouped and explained in the module docstring)."""

    seq_len: int
    offset: int
    max_seq_len: int
    batch: int | None
    num_kv_heads: int | None
    head_dim: int | None
    dtype: np.dtype | None
    device: str
    layout: str
    shape: tuple | None
    nbytes: int
    is_empty: bool
    is_allocated: bool

    def get_kv(self) -> tuple[Any, Any] | None: ...

    def to_host(self, x: Any) -> np.ndarray: ...

    def clear(self) -> None: ...

    def deallocate(self) -> None: ...

    def trim(self, n: int) -> int: ...

    def offset_after_trim(self, n: int) -> int: ...

    def crop(self, new_len: int) -> None: ...

    def check_indices(self, indices: Any, length: int | None = None) -> list[int]: ...

    def reorder(self, indices: Any) -> None: ...

    def select(self, indices: Any) -> Any: ...

    def copy(self) -> Any: ...

    def prepare_append(self, k: Any, v: Any) -> AppendPlan: ...

    def stage_append(self, plan: AppendPlan) -> StagedAppend: ...

    def commit_append(
        self, staged: StagedAppend, *, written: bool = False, undoable: bool = False
    ) -> Callable[[], None] | None: ...

    def append(self, k: Any, v: Any, *, undoable: bool = False) -> Callable[[], None] | None: ...

    def check_room(self, n: int) -> None: ...

    def attention_view(self, n_q: int, window: int | None) -> AttentionView: ...

    def export_state(self) -> CacheState: ...

    @classmethod
    def from_state(cls, state: LoadedState, *, device: str = "cpu", layout: str | None = None): ...

    @classmethod
    def from_layer_state(
        cls, layer: LoadedLayer, where: str, *, device: str = "cpu", layout: str | None = None
    ): ...

    def check_state(self, state: LoadedState) -> None: ...

    def check_layer_state(self, layer: LoadedLayer, where: str) -> None: ...

    def stage_layer_state(self, layer: LoadedLayer, where: str) -> Callable[[], None]: ...

    def import_state(self, state: LoadedState) -> None: ...

    def load_state(self, path: Any) -> None: ...


def is_layer_cache(x: object) -> bool:
    """Whether ``x`` looks like a layer cache to attention: a cheap check for hot paths
    (``isinstance(x, LayerCache)`` checks every member, as ``KVCache.from_layers`` does)."""
    t = type(x)
    return all(
        hasattr(t, name) for name in ("attention_view", "prepare_append", "device", "layout")
    )


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
