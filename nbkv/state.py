"""The state half of the cache protocol: export a layer cache, build one from a saved
state, or load a state into one, all or nothing (see :mod:`nbkv.protocol`).

:class:`StateMixin` is part of :class:`nbkv.BaseKVCache`: it works on the base's buffers
and counters, and each cache type adapts it through a few hooks (``_meta``,
``_read_meta``, ``_check_counts``, ``_check_import``, ``_capacity_for``, ``_write_rows``,
``_set_counters``). The file format itself is :mod:`nbkv._format`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import _format
from . import layout as _layout
from .errors import CacheFormatError, CacheOverflowError, DTypeMismatchError, ShapeMismatchError
from .protocol import CacheState, LayerState, LoadedLayer, LoadedState, cache_type_of

__all__ = ["StateMixin"]


class StateMixin:
    """Export and import of one layer cache's state; mixed into BaseKVCache."""

    def _meta(self) -> dict:
        """The layer's JSON-able description; subclasses add their own fields."""
        return {
            "type": self.state_type,
            "layout": self._layout,
            "dtype": "" if self._dtype is None else str(self._dtype),
            "batch": self._batch,
            "num_kv_heads": self._num_kv_heads,
            "head_dim": self._head_dim,
            "seq_len": self._seq_len,
            "allocated": self._k is not None,
        }

    def _held_on_host(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Host arrays (CPU: views) of the positions held, in position order."""
        if self._k is None:
            return None
        kv = self.get_kv()
        if kv is None:  # allocated, nothing held: zero-length arrays of the right shape
            shape = _layout.buffer_shape(
                self._layout, self._batch, self._num_kv_heads, 0, self._head_dim
            )
            return np.empty(shape, self._dtype), np.empty(shape, self._dtype)
        return self.to_host(kv[0]), self.to_host(kv[1])

    def export_state(self) -> CacheState:
        """This cache as a :class:`~nbkv.protocol.CacheState` (see nbkv.protocol)."""
        return CacheState(self.state_type, [LayerState(self._meta(), self._held_on_host)])

    @classmethod
    def _read_meta(cls, m: _format.MetaReader) -> dict:
        """Hook: check the type's own meta fields (CacheFormatError naming the field) and
        return the constructor arguments they give (capacity, ring, policy)."""
        raise NotImplementedError

    @classmethod
    def _check_counts(cls, m: _format.MetaReader, args: dict, held: int) -> None:
        """Hook: check the type's counters against ``held`` rows (CacheFormatError)."""

    def _check_import(self, args: dict, held: int, where: str) -> None:
        """Hook: raise unless this cache can take a state of ``args`` holding ``held``."""
        if held > self._max_seq_len:
            raise CacheOverflowError(
                f"{where} holds {held} positions, more than this cache's capacity "
                f"max_seq_len = {self._max_seq_len}; build it with max_seq_len >= {held}"
            )

    def _capacity_for(self, held: int) -> int:
        """Hook: the capacity a cache holding ``held`` rows from empty needs."""
        return self._max_seq_len

    # whether _write_rows puts rows in position order at slot 0 (a file reads straight in)
    _rows_in_order = True

    def _write_rows(self, meta: dict, kk: Any, vk: Any) -> None:
        """Hook: write rows ``kk``, ``vk`` (kernel form, position order) where they live."""
        self._backend.write_kv(kk, vk, 0, self._kk, self._vk)

    def _set_counters(self, meta: dict, held: int) -> None:
        """Hook: the counters of a state holding ``held`` rows."""
        self._seq_len = held

    @classmethod
    def _one_layer(cls, state: LoadedState) -> LoadedLayer:
        _format.check_loaded(state)
        if len(state.layers) != 1 or state.type != cls.state_type:
            raise CacheFormatError(
                f"{state.where} holds a {state.type} of {len(state.layers)} layer(s), but "
                f"this cache is a {cls.state_type}"
            )
        layer = state.layers[0]
        if layer.meta["type"] != cls.state_type:
            raise CacheFormatError(
                f"{state.where}: its layer is a {layer.meta['type']}, not a {cls.state_type}"
            )
        return layer

    @classmethod
    def _checked_args(cls, layer: LoadedLayer, where: str) -> dict:
        m = _format.MetaReader(layer.meta, where)
        args = cls._read_meta(m)
        cls._check_counts(m, args, layer.meta["seq_len"])
        return args

    @classmethod
    def from_state(cls, state: LoadedState, *, device: str = "cpu", layout: str | None = None):
        """A new cache of this type holding ``state`` (see :mod:`nbkv.protocol`)."""
        layer = cls._one_layer(state)
        return cls.from_layer_state(layer, state.where, device=device, layout=layout)

    @classmethod
    def from_layer_state(
        cls, layer: LoadedLayer, where: str, *, device: str = "cpu", layout: str | None = None
    ):
        """A new cache of this type holding one layer of a state (what KVCache loads)."""
        _format.check_loaded_layer(layer, None, where)
        args = cls._checked_args(layer, where)
        meta = layer.meta
        layout = meta["layout"] if layout is None else _layout.check_layout(layout)
        sizes = {f: meta[f] for f in _layout.SIZES}
        # built without its dtype, so that nothing is allocated yet; _fill then configures
        # and allocates it as saved (a lazy layer stays lazy)
        cache = cls(**args, **sizes, dtype=None, device=device, layout=layout)
        cache._fill(layer, where)
        return cache

    def _fill(self, layer: LoadedLayer, where: str) -> None:
        """Make this new, empty cache hold ``layer`` as it was saved."""
        meta = layer.meta
        self._configured = (*self._configured[:3], _format.meta_dtype(meta))
        self._release()
        if meta["allocated"]:
            self._install(self._new_storage(self._configured, self._max_seq_len))
        held = meta["seq_len"] if layer.k is not None else 0
        readable = hasattr(layer.k, "read_into")  # tensors still in an open file
        if (
            held
            and readable
            and self._rows_in_order
            and isinstance(self._k, np.ndarray)
            and self._layout == meta["layout"]
        ):
            # straight from the file into the new buffers, CRC-checked on the way: the
            # cache is no one's until it is returned, so a bad tensor leaves nothing behind
            index = _layout.seq_index(self._layout, 0, held)
            layer.k.read_into(self._k[index])
            layer.v.read_into(self._v[index])
            self._set_counters(meta, held)
            return
        if readable:
            layer = LoadedLayer(
                meta, *(None if t is None else t.read() for t in (layer.k, layer.v))
            )
        self.stage_layer_state(layer, where)()

    def check_state(self, state: LoadedState) -> None:
        """Raise unless :meth:`import_state` of ``state`` would succeed; change nothing."""
        cache_type_of(self)
        self.check_layer_state(self._one_layer(state), state.where)

    def check_layer_state(self, layer: LoadedLayer, where: str) -> None:
        """:meth:`check_state` for one layer of a state (what KVCache checks)."""
        _format.check_loaded_layer(layer, None, where)
        args = self._checked_args(layer, where)
        meta = layer.meta
        for field in _layout.SIZES:
            want, got = getattr(self, field), meta[field]
            if want is not None and got is not None and want != got:
                raise ShapeMismatchError(
                    f"{where} holds {field} {got}, but this cache holds {want}"
                )
        dtype = _format.meta_dtype(meta)
        if self._dtype is not None and dtype is not None and self._dtype != dtype:
            raise DTypeMismatchError(
                f"{where} holds dtype {dtype}, but this cache holds {self._dtype}; nbkv never casts"
            )
        self._check_import(args, meta["seq_len"], where)

    def stage_layer_state(self, layer: LoadedLayer, where: str) -> Callable[[], None]:
        """Check one layer of a state and make everything holding it needs (buffers,
        copies to the device), changing nothing; return the function that then holds
        it, which allocates nothing. KVCache stages every layer before it commits any."""
        self.check_layer_state(layer, where)
        meta = layer.meta
        held = meta["seq_len"] if layer.k is not None else 0
        storage = rows = None
        if held:
            be = self._backend
            k, v = (_format.in_layout(x, meta["layout"], self._layout) for x in (layer.k, layer.v))
            k, v, d, dtype = self._check_pair(k, v)
            capacity = self._capacity_for(held)
            if self._k is None or capacity != self._max_seq_len:
                storage = self._new_storage((d.batch, d.num_kv_heads, d.head_dim, dtype), capacity)
            rows = be.kernel_view(be.to_device(k)), be.kernel_view(be.to_device(v))

        def commit() -> None:
            if storage is not None:
                self._install(storage)
            if rows is not None:
                self._write_rows(meta, *rows)
            self._reset_counters()
            self._set_counters(meta, held)

        return commit

    def import_state(self, state: LoadedState) -> None:
        """Replace the positions held with ``state``'s, or change nothing.

        Keeps the cache's device, layout and capacity (a growing cache grows to fit); a
        state in the other layout is transposed on the way in; a state of a layer never
        allocated clears it (buffers kept).
        """
        cache_type_of(self)
        self.stage_layer_state(self._one_layer(state), state.where)()

    def load_state(self, path: Any) -> None:
        """Replace the positions held with those saved at ``path`` (see :func:`nbkv.save`).

        The file is read and checked in full (structure, checksums, sizes, dtype,
        capacity) before anything is written, so on any error the cache is unchanged.

        Raises
        ------
        FileNotFoundError, CacheFormatError, ShapeMismatchError, DTypeMismatchError,
        CacheOverflowError
        """
        self.import_state(_format.read_file(path))
