"""KVCache: a model's cache, one layer cache per decoder layer.

It holds layer caches (:class:`nbkv.LayerKVCache`, :class:`nbkv.RotatingKVCache` or any
type that speaks :mod:`nbkv.protocol`) and talks to them through their public methods
and the protocol only. Every operation over the layers checks all of them before it
changes any.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from . import _format
from ._units import human_bytes
from ._validate import nonnegative_int, positive_int
from .cache import DEFAULT_MAX_SEQ_LEN, LayerKVCache
from .errors import ArgumentTypeError, CacheFormatError, InvalidArgumentError, LayerIndexError
from .protocol import (
    CacheState,
    LayerCache,
    LoadedState,
    cache_class,
    cache_type_of,
    register_cache_type,
)

__all__ = ["KVCache"]


@register_cache_type("KVCache")
class KVCache:
    """A model's cache: one layer cache per layer.

    Parameters
    ----------
    num_layers : int
    max_seq_len : int, default DEFAULT_MAX_SEQ_LEN
    **kwargs
        The keyword arguments of :class:`LayerKVCache` (``batch``, ``num_kv_heads``,
        ``head_dim``, ``dtype``, ``device``, ``layout``, ``on_overflow``, ``grow_step``),
        applied to every layer. :meth:`from_layers` takes layers built by the caller
        (rotating ones, say).

    ``seq_len`` is derived, never stored: the positions every layer holds (the minimum
    over layers), which during a forward pass is what the model has finished.

    Examples
    --------
    >>> import nbkv
    >>> cache = nbkv.KVCache(2, 64, batch=1, num_kv_heads=2, head_dim=8, dtype="float16")
    >>> len(cache), cache[0].max_seq_len, cache.nbytes
    (2, 64, 8192)
    """

    def __init__(self, num_layers: int, max_seq_len: int = DEFAULT_MAX_SEQ_LEN, **kwargs: Any):
        num_layers = positive_int(num_layers, "num_layers")
        self._layers = [LayerKVCache(max_seq_len, **kwargs) for _ in range(num_layers)]

    @classmethod
    def from_layers(cls, layers: Iterable[Any]) -> KVCache:
        """A model's cache of layer caches built by the caller (e.g. RotatingKVCache).

        Raises
        ------
        ArgumentTypeError
            ``layers`` is not an iterable of one or more layer caches.
        """
        not_iterable = ArgumentTypeError(
            f"layers must be an iterable of layer caches (LayerKVCache, RotatingKVCache), "
            f"got {type(layers).__name__}"
        )
        if isinstance(layers, (str, bytes)):
            raise not_iterable
        try:
            layers = list(layers)
        except TypeError:
            raise not_iterable from None
        bad = next((x for x in layers if not isinstance(x, LayerCache)), None)
        if not layers or bad is not None:
            got = "none" if not layers else type(bad).__name__
            raise ArgumentTypeError(
                "layers must be one or more layer caches (LayerKVCache, RotatingKVCache, "
                f"or another nbkv.protocol cache), got {got}"
            )
        new = object.__new__(cls)
        new._layers = layers
        return new

    # -- what every layer holds ------------------------------------------------------

    @property
    def offset(self) -> int:
        """Tokens every layer has seen (the minimum over layers)."""
        return min(layer.offset for layer in self._layers)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, i: int):
        if type(i) is int:  # the decode loop's path: no more than a list lookup
            try:
                return self._layers[i]
            except IndexError:
                pass
        n = len(self._layers)
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise LayerIndexError(f"layer index must be an int, got {type(i).__name__} {i!r}")
        if not -n <= i < n:
            raise LayerIndexError(f"layer index must be in [-{n}, {n}), got {i}")
        return self._layers[i]

    def __iter__(self) -> Iterator:
        return iter(self._layers)

    @property
    def seq_len(self) -> int:
        """Rows every layer holds (the minimum over layers; a ring holds fewer rows than
        the tokens it has seen: see :attr:`offset`)."""
        return min(layer.seq_len for layer in self._layers)

    @property
    def max_seq_len(self) -> int:
        """Capacity every layer offers (the minimum over layers)."""
        return min(layer.max_seq_len for layer in self._layers)

    @property
    def is_empty(self) -> bool:
        """True when no layer holds any position."""
        return all(layer.is_empty for layer in self._layers)

    @property
    def is_allocated(self) -> bool:
        """True when every layer's buffers are allocated."""
        return all(layer.is_allocated for layer in self._layers)

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers of all layers."""
        return sum(layer.nbytes for layer in self._layers)

    @property
    def dtype(self) -> np.dtype | None:
        return self._layers[0].dtype

    @property
    def device(self) -> str:
        return self._layers[0].device

    @property
    def layout(self) -> str:
        return self._layers[0].layout

    def check_room(self, n: int) -> None:
        """Raise :class:`~nbkv.CacheOverflowError` unless every layer has room for ``n``."""
        for layer in self._layers:
            layer.check_room(n)

    # -- every layer at once, checked first ------------------------------------------

    def clear(self) -> None:
        """Clear every layer, keeping the buffers."""
        for layer in self._layers:
            layer.clear()

    def deallocate(self) -> None:
        """Free every layer's buffers, keeping the capacity."""
        for layer in self._layers:
            layer.deallocate()

    def crop(self, new_len: int) -> None:
        """Roll every layer back to ``new_len`` tokens seen (``offset``), dropping the
        newest positions (for layers that hold every token, keep the first ``new_len``).

        Raises
        ------
        InvalidArgumentError
            ``new_len`` above what every layer has seen, or a layer that cannot go back
            there (a ring keeps only its window: what it forgot cannot come back).
        """
        new_len = nonnegative_int(new_len, "new_len")
        if new_len > self.offset:
            raise InvalidArgumentError(
                f"new_len must be at most offset = {self.offset} (crop only shortens), "
                f"got {new_len}"
            )
        drops = [layer.offset - new_len for layer in self._layers]
        self._check_ends(drops, [new_len] * len(self._layers), f"crop({new_len})")
        for layer, n in zip(self._layers, drops, strict=True):
            layer.trim(n)

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions of every layer; return how many ``seq_len`` lost.

        Raises
        ------
        InvalidArgumentError
            Layers that have seen the same tokens would end at different ones (a ring
            trimmed into its sinks falls back to them; the other layers would not).
        """
        n = nonnegative_int(n, "n")
        before = self.seq_len
        if len({layer.offset for layer in self._layers}) == 1:
            ends = [layer.offset_after_trim(n) for layer in self._layers]
            self._check_ends([n] * len(self._layers), [ends[0]] * len(ends), f"trim({n})")
        for layer in self._layers:
            layer.trim(n)
        return before - self.seq_len

    def _check_ends(self, drops: list[int], wanted: list[int], what: str) -> None:
        """Raise unless ``trim(drops[i])`` leaves layer ``i`` at ``wanted[i]`` tokens seen."""
        for i, (layer, n, want) in enumerate(zip(self._layers, drops, wanted, strict=True)):
            got = layer.offset_after_trim(n)
            if got != want:
                raise InvalidArgumentError(
                    f"{what} would leave layer {i} at offset {got}, not {want}: a ring "
                    "cannot go back past what it has forgotten, and the layers must agree"
                )

    def reorder(self, indices: Any) -> None:
        """``reorder`` of every layer; the indices are checked against every layer first."""
        for layer in self._layers:
            layer.check_indices(indices, layer.batch)
        for layer in self._layers:
            layer.reorder(indices)

    def select(self, indices: Any) -> KVCache:
        """A new KVCache of ``select`` of every layer (indices checked on every layer first)."""
        for layer in self._layers:
            layer.check_indices(indices)
        new = object.__new__(type(self))
        new._layers = [layer.select(indices) for layer in self._layers]
        return new

    def copy(self) -> KVCache:
        """An independent copy of every layer."""
        new = object.__new__(type(self))
        new._layers = [layer.copy() for layer in self._layers]
        return new

    def __copy__(self) -> KVCache:
        return self.copy()

    def __deepcopy__(self, memo: dict) -> KVCache:
        return self.copy()

    def __repr__(self) -> str:
        first = self._layers[0]
        shape = "unallocated" if first.shape is None else str(first.shape)
        return (
            f"KVCache(num_layers={self.num_layers}, layer_shape={shape}, dtype={self.dtype}, "
            f"device={self.device!r}, layout={self.layout!r}, "
            f"seq_len={self.seq_len}/{self.max_seq_len}, "
            f"nbytes={self.nbytes} ({human_bytes(self.nbytes)}))"
        )

    # -- state (nbkv.protocol) -------------------------------------------------------

    def export_state(self) -> CacheState:
        """Every layer's state, each of its own registered type (see nbkv.protocol)."""
        layers = []
        for i, layer in enumerate(self._layers):
            cache_type_of(layer, f"layer {i} of the KVCache")
            layers += layer.export_state().layers
        return CacheState(self.state_type, layers)

    @classmethod
    def from_state(cls, state: LoadedState, *, device: str = "cpu", layout: str | None = None):
        """A new KVCache holding ``state``: each layer built by the class its type names."""
        _format.check_loaded(state)
        if state.type != cls.state_type:
            raise CacheFormatError(f"{state.where} holds a {state.type}, not a {cls.state_type}")
        layers = []
        for i, layer in enumerate(state.layers):
            where = f"{state.where} (layer {i})"
            layer_cls = cache_class(layer.meta["type"], where)
            if layer_cls is cls:
                raise CacheFormatError(f"{where}: a KVCache cannot be a layer of a KVCache")
            layers.append(layer_cls.from_layer_state(layer, where, device=device, layout=layout))
        return cls.from_layers(layers)

    def check_state(self, state: LoadedState) -> None:
        """Raise unless :meth:`import_state` would succeed; change nothing."""
        self._stage(state, commit=False)

    def _stage(self, state: LoadedState, commit: bool) -> None:
        _format.check_loaded(state)
        if state.type != self.state_type:
            raise CacheFormatError(
                f"{state.where} holds a {state.type}, but this cache is a {self.state_type}"
            )
        if len(state.layers) != len(self._layers):
            raise CacheFormatError(
                f"{state.where} holds {len(state.layers)} layers, but this cache has "
                f"{len(self._layers)}"
            )
        stages = []
        for i, (own, layer) in enumerate(zip(self._layers, state.layers, strict=True)):
            where = f"{state.where} (layer {i})"
            kind = cache_type_of(own, f"layer {i} of this KVCache")
            if layer.meta["type"] != kind:
                raise CacheFormatError(
                    f"{where} is a {layer.meta['type']}, but this layer is a {kind}"
                )
            if commit:
                stages.append(own.stage_layer_state(layer, where))
            else:
                own.check_layer_state(layer, where)
        for hold in stages:  # every layer checked and staged: from here on only writes
            hold()

    def import_state(self, state: LoadedState) -> None:
        """Replace every layer's positions with ``state``'s, or change nothing: every
        layer is checked, and its buffers made, before any is written."""
        self._stage(state, commit=True)

    def load_state(self, path: Any) -> None:
        """Replace every layer's positions with those saved at ``path`` (see nbkv.save).

        All layers are read and checked before any is written.
        """
        self.import_state(_format.read_file(path))
