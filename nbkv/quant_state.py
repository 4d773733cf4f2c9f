"""The state half of :class:`nbkv.QuantizedKVCache`'s cache protocol: export what it
stores (codes, scales, the window), check a saved layer against the cache, and load it,
all or nothing (see :mod:`nbkv.protocol`).

A quantized layer declares its own tensors in its meta (``meta["tensors"]``, the file
format's extension for layers that are not K/V in their dtype), all ``[batch, heads,
...]`` whatever the layout: ``k_codes``, ``k_scale``, ``k_zero``, ``v_codes``, ``v_scale``,
``v_zero`` of the ``q_len`` coded positions (K's scales of its ``q_len / G`` groups), and
``k_window``, ``v_window`` holding the window's positions in order, in the cache's
dtype. The meta adds ``max_seq_len``, ``bits``, ``group_size``, ``residual`` and
``q_len``; a cache loads only a state of its own geometry, dtype, bits, group size and
residual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import _format
from . import layout as _layout
from .dtypes import kernel_dtype
from .errors import ArgumentTypeError, CacheFormatError, InvalidArgumentError, ShapeMismatchError
from .protocol import CacheState, LayerState, LoadedLayer
from .quant_backends import QStorage

__all__ = ["QuantStateMixin", "Store"]

BITS = (8, 4, 2)


class Store(NamedTuple):
    """A quantized layer's arrays and the sizes they were made for."""

    arrays: QStorage
    sizes: tuple  # (batch, num_kv_heads, head_dim, dtype)


class _Spec(NamedTuple):
    code: str  # safetensors dtype
    shape: tuple


def _code(dtype: Any, logical: np.dtype) -> str:
    """The safetensors dtype of a saved tensor: a window in the cache's dtype."""
    dtype = np.dtype(dtype)
    if dtype == logical:
        return _format.CODES[str(logical)]
    return {np.dtype(np.uint8): "U8", np.dtype(np.uint16): "U16"}[dtype]


def _other_type(where: str, kind: str, mine: str) -> CacheFormatError:
    return CacheFormatError(f"{where}: its layer is a {kind}, not a {mine}")


class QuantStateMixin:
    """Export and import of a quantized layer; mixed into QuantizedKVCache."""

    def _coded_parts(self, st: QStorage, q: int) -> list[tuple[str, Any, int]]:
        """(saved name, array, positions or groups saved) of each coded array."""
        g = self._group
        return [
            ("k_codes", st.k_codes, q),
            ("k_scale", st.k_scale, q // g),
            ("k_zero", st.k_zero, q // g),
            ("v_codes", st.v_codes, q),
            ("v_scale", st.v_scale, q),
            ("v_zero", st.v_zero, q),
        ]

    def _saved_specs(self, held: int, q: int) -> dict[str, _Spec]:
        """The dtype and shape of each tensor a state holding ``held`` positions, ``q`` of
        them codes, saves."""
        b, h = self._batch, self._num_kv_heads
        specs = {
            name: _Spec(_code(a.dtype, self._dtype), (b, h, n, int(a.shape[3])))
            for name, a, n in self._coded_parts(self._st, q)
        }
        window = _Spec(_code(self._dtype, self._dtype), (b, h, held - q, self._head_dim))
        specs["k_window"] = specs["v_window"] = window
        return specs

    def _meta(self) -> dict:
        meta = super()._meta()
        meta.update(
            max_seq_len=self._max_seq_len,
            bits=list(self._bits),
            group_size=self._group,
            residual=self._residual,
            q_len=self._q_len,
        )
        if self._st is not None:
            meta["tensors"] = {
                name: [spec.code, list(spec.shape)]
                for name, spec in self._saved_specs(self._seq_len, self._q_len).items()
            }
        return meta

    def _held_tensors(self) -> dict | None:
        """The saved tensors as host arrays (the module docstring), or None."""
        if self._st is None:
            return None
        be, st, q = self._backend, self._st, self._q_len
        host = {
            name: np.ascontiguousarray(be.to_host(a[:, :, :n]))
            for name, a, n in self._coded_parts(st, q)
        }
        slots = np.arange(q, self._seq_len) % self.window_capacity
        for name, a in (("k_window", st.k_win), ("v_window", st.v_win)):
            host[name] = np.ascontiguousarray(be.to_host(a, self._dtype)[:, :, slots])
        return host

    def export_state(self) -> CacheState:
        """This cache as a :class:`~nbkv.protocol.CacheState` of its codes, scales and
        window as stored (nothing dequantized)."""
        return CacheState(self.state_type, [LayerState(self._meta(), self._held_tensors)])

    @classmethod
    def _read_meta(cls, m: _format.MetaReader) -> dict:
        bits = m.get("bits")
        ok = isinstance(bits, list) and len(bits) == 2
        if not ok or any(type(b) is not int or b not in BITS for b in bits):
            raise m.fail(f"metadata bits must be a pair of ints in {BITS}, got {bits!r:.40}")
        return {
            "max_seq_len": m.int("max_seq_len", minimum=1),
            "bits": tuple(bits),
            "group_size": m.int("group_size", minimum=1),
            "residual": m.int("residual", minimum=0),
        }

    def _check_layer(self, layer: LoadedLayer, where: str) -> tuple[int, int]:
        """Everything about a saved layer this cache must agree with; ``(seq_len, q_len)``."""
        _format.check_loaded_layer(layer, None, where)
        meta = layer.meta
        m = _format.MetaReader(meta, where)
        if meta["type"] != self.state_type:
            raise CacheFormatError(
                f"{where}: its layer is a {meta['type']}, not a {self.state_type}"
            )
        theirs = {**self._read_meta(m), **{f: meta[f] for f in _layout.SIZES}}
        mine = {
            "max_seq_len": self._max_seq_len,
            "bits": self._bits,
            "group_size": self._group,
            "residual": self._residual,
            "batch": self._batch,
            "num_kv_heads": self._num_kv_heads,
            "head_dim": self._head_dim,
        }
        for field, want in mine.items():
            if theirs[field] != want:
                raise CacheFormatError(
                    f"{where} holds a quantized layer of {field} {theirs[field]}, but this "
                    f"cache has {field} {want}"
                )
        dtype = _format.meta_dtype(meta)
        if dtype != self._dtype:
            raise CacheFormatError(
                f"{where} holds dtype {dtype}, but this cache holds {self._dtype}"
            )
        held = meta["seq_len"]
        if not meta["allocated"]:
            return 0, 0
        q, g = m.int("q_len"), self._group
        if held > self._max_seq_len or q > held or q % g or q > (self._max_seq_len // g) * g:
            raise m.fail(
                f"seq_len {held} and q_len {q} are not a state of a cache of max_seq_len "
                f"{self._max_seq_len} and group_size {g}"
            )
        if held - q > self.window_capacity:
            raise m.fail(
                f"its window holds {held - q} positions, more than the {self.window_capacity} "
                "this cache's window has"
            )
        declared = meta.get("tensors")
        if not isinstance(declared, dict):
            raise m.fail("a quantized layer declares its tensors (metadata tensors)")
        for name, spec in self._saved_specs(held, q).items():
            if declared.get(name) != [spec.code, list(spec.shape)]:
                raise m.fail(
                    f"tensor {name} is {declared.get(name)!r:.60}, not "
                    f"[{spec.code!r}, {list(spec.shape)}]"
                )
        return held, q

    def check_layer_state(self, layer: LoadedLayer, where: str) -> None:
        """Raise unless :meth:`stage_layer_state` of ``layer`` would succeed."""
        self._check_layer(layer, where)

    def stage_layer_state(self, layer: LoadedLayer, where: str) -> Callable[[], None]:
        """Check a saved layer and copy its tensors into new arrays on the device,
        changing nothing; the function returned installs them (and allocates nothing)."""
        held, q = self._check_layer(layer, where)
        store = None
        if layer.meta["allocated"]:
            t = {n: x.read() if hasattr(x, "read") else x for n, x in layer.tensors.items()}
            store = self._new_storage(self._configured, self._max_seq_len)
            self._fill_store(store.arrays, t, held, q)

        def commit() -> None:
            self._reset_counters()
            if store is not None:
                self._install(store)
                self._seq_len, self._q_len = held, q

        return commit

    def _fill_store(self, st: QStorage, t: dict, held: int, q: int) -> None:
        """Saved host tensors ``t`` into the new arrays ``st`` on the device."""
        be = self._inner
        for name, a, n in self._coded_parts(st, q):
            if n:
                be.write_cache(be.to_kernel(np.ascontiguousarray(t[name])), 0, a)
        kd = kernel_dtype(self._dtype)
        for name, a in (("k_window", st.k_win), ("v_window", st.v_win)):
            rows = np.ascontiguousarray(t[name]).view(kd)
            for s0, s1, p0 in self._ring_ranges(q, held):
                part = np.ascontiguousarray(rows[:, :, p0 - q : p0 - q + s1 - s0])
                be.write_cache(be.to_kernel(part), s0, a)

    @classmethod
    def from_layer_state(
        cls, layer: LoadedLayer, where: str, *, device: str = "cpu", layout: str | None = None
    ):
        """A new quantized cache holding one saved layer (what ``load`` and KVCache use)."""
        _format.check_loaded_layer(layer, None, where)
        meta = layer.meta
        if meta["type"] != cls.state_type:
            raise CacheFormatError(
                f"{where}: its layer is a {meta['type']}, not a {cls.state_type}"
            )
        args = cls._read_meta(_format.MetaReader(meta, where))
        layout = meta["layout"] if layout is None else _layout.check_layout(layout)
        dtype = _format.meta_dtype(meta)
        sizes = {f: meta[f] for f in _layout.SIZES}
        if dtype is None or None in sizes.values():
            raise CacheFormatError(f"{where}: a quantized layer has its sizes and dtype")
        try:
            cache = cls(**args, **sizes, dtype=dtype, device=device, layout=layout)
        except (InvalidArgumentError, ArgumentTypeError, ShapeMismatchError) as err:
            raise CacheFormatError(f"{where}: {err}") from None
        if not meta["allocated"]:
            cache.deallocate()
        cache.stage_layer_state(layer, where)()
        return cache
