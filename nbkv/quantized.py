"""QuantizedKVCache: one layer's K and V in 8, 4 or 2 bits (KIVI), the newest in full
precision, with attention that reads the codes.

KIVI's design (Liu et al., 2024): K is quantized per channel over groups of
``group_size`` consecutive positions (K's outlier channels get their own scale), V per
position over groups of ``min(group_size, head_dim)`` channels; the newest positions, a
window of between ``residual`` and ``residual + group_size - 1`` of them, stay in the
cache's dtype, and a whole group is quantized as it leaves the window. Codes are
bit-packed into ``uint8``; each group has a 16-bit scale and zero point (float16, or the
cache's dtype when that is bfloat16). The storage and the exact quantizer are
:mod:`nbkv.kernels.cpu_quant`'s (and :func:`nbkv.reference.quantize`'s).

Positions ``[0, q_len)`` are codes and ``[q_len, seq_len)`` the window, ``q_len`` a
multiple of ``group_size``: an append quantizes ``[q_len, q_len + G)`` whenever
``seq_len - q_len >= residual + G``. ``get_kv`` returns dequantized copies in the cache's
dtype; :func:`nbkv.attention` dequantizes block by block inside its kernel instead, never
materialising the cache. ``crop`` / ``trim`` never change a value kept: a cut inside the
codes gives the kept part of its group back to the window, dequantized, and nothing is
quantized twice.

A :class:`QuantizedKVCache` is a :class:`nbkv.BaseKVCache` (its sizes, validation and
errors), not a :class:`nbkv.LayerKVCache`: it has no growth policy, no ``set_k``, and its
``get_kv`` copies. It implements the cache protocol (:mod:`nbkv.protocol`), so
``attention``, ``append_and_attend``, ``KVCache.from_layers``, ``save`` / ``load``, the
model and the transformers adapter take it as they take any layer cache. Its append half is
:class:`nbkv.quant_appending.QuantAppendMixin`'s and its state half
:class:`nbkv.quant_state.QuantStateMixin`'s, both mixed into the class.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any

import numpy as np

from . import layout as _layout
from ._units import human_bytes
from ._validate import nonnegative_int, positive_int
from .base import BaseKVCache
from .dtypes import resolve_dtype, widen_table
from .errors import (
    ArgumentTypeError,
    InvalidArgumentError,
)
from .protocol import (
    AttentionView,
    register_cache_type,
)
from .quant_appending import QuantAppendMixin
from .quant_backends import CodesReader, QStorage, quant_backend
from .quant_state import QuantStateMixin, Store

__all__ = ["QuantizedKVCache", "BITS"]

BITS = (8, 4, 2)
_NAMES = QStorage._fields
_F16_MAX = 65504.0  # float16's largest finite value: the reach of float16 scales


def _check_bits(bits: Any) -> tuple[int, int]:
    pair = bits if isinstance(bits, (tuple, list)) else (bits, bits)
    if len(pair) != 2:
        raise InvalidArgumentError(
            f"bits must be one of {BITS} or a pair (k_bits, v_bits), got {bits!r}"
        )
    for b in pair:
        if isinstance(b, (bool, np.bool_)) or not isinstance(b, numbers.Integral):
            raise ArgumentTypeError(
                f"bits must be one of {BITS} or a pair of them, got {type(b).__name__} {b!r}"
            )
        if int(b) not in BITS:
            raise InvalidArgumentError(
                f"bits must be one of {BITS} or a pair (k_bits, v_bits) of them, got {bits!r}"
            )
    return int(pair[0]), int(pair[1])


@register_cache_type("QuantizedKVCache")
class QuantizedKVCache(QuantAppendMixin, QuantStateMixin, BaseKVCache):
    """Keys and values of one attention layer in 8, 4 or 2 bits (KIVI), the newest in
    full precision.

    Parameters
    ----------
    max_seq_len : int
        Capacity in positions; an append past it raises
        :class:`~nbkv.CacheOverflowError` (no growth).
    batch, num_kv_heads, head_dim : int
        Required. ``head_dim`` must be a multiple of V's channel group,
        ``min(group_size, head_dim)``.
    dtype : {"float32", "float16", "bfloat16"}
        Required: what ``append`` takes, ``get_kv`` returns and the window holds.
    bits : 8, 4, 2 or a pair ``(k_bits, v_bits)``
    group_size : int, default 64
        Positions per K group (one scale per channel each), channels per V group.
    residual : int, default 128
        Newest positions kept in ``dtype`` (at least; up to ``residual + group_size - 1``).
    device : {"cpu", "cuda"}
    layout : {"bhsd", "bshd"}
        Axis order of every array passed in or returned (the codes have their own).

    Notes
    -----
    Codes cannot hold NaN or infinity, nor (a float32 cache) values past float16's
    65504, the scales' range: ``append`` of host arrays holding them raises
    :class:`~nbkv.InvalidArgumentError` and changes nothing. Device arrays (CUDA) are
    not scanned, which would cost a reduction and a copy per append: there such a value
    makes its group's codes meaningless.

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError, DTypeMismatchError
        A size that is not a positive int, bits outside {8, 4, 2}, ``group_size < 1``,
        ``residual < 0``, a ``head_dim`` V's groups do not divide, a dtype other than
        float32, float16 or bfloat16.

    Examples
    --------
    >>> import numpy as np, nbkv
    >>> cache = nbkv.QuantizedKVCache(256, batch=1, num_kv_heads=2, head_dim=8,
    ...                               dtype="float32", bits=4, group_size=4, residual=4)
    >>> k = np.random.default_rng(0).standard_normal((1, 2, 10, 8), dtype=np.float32)
    >>> cache.append(k, k)
    >>> cache.seq_len, cache.q_len  # 8 positions in codes, the newest 2 in float32
    (10, 4)
    >>> K, V = cache.get_kv()
    >>> bool(np.abs(K - k).max() < 0.5), bool((K[:, :, 4:] == k[:, :, 4:]).all())
    (True, True)
    """

    def __init__(
        self,
        max_seq_len: int,
        *,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any,
        bits: Any = 8,
        group_size: int = 64,
        residual: int = 128,
        device: str = "cpu",
        layout: str = "bhsd",
    ) -> None:
        self._bits = _check_bits(bits)
        self._group = positive_int(group_size, "group_size")
        self._residual = nonnegative_int(residual, "residual")
        for value, name in ((batch, "batch"), (num_kv_heads, "num_kv_heads")):
            positive_int(value, name)
        head_dim = positive_int(head_dim, "head_dim")
        self._v_group = min(self._group, head_dim)
        if head_dim % self._v_group:
            raise InvalidArgumentError(
                f"head_dim must be a multiple of V's channel group min(group_size, head_dim) "
                f"= {self._v_group}, got head_dim {head_dim} (group_size {self._group})"
            )
        if dtype is None:
            raise ArgumentTypeError(
                "dtype is required: float32, float16 or bfloat16 (what append takes)"
            )
        dtype = resolve_dtype(dtype)
        if dtype.kind != "V" and dtype not in (np.float32, np.float16):
            raise InvalidArgumentError(
                f"dtype must be float32, float16 or bfloat16 for a quantized cache, got {dtype}"
            )
        # the scales' 16-bit type: bfloat16 for a bfloat16 cache, else float16
        self._kind = 1 if dtype.itemsize == 2 and dtype != np.float16 else 0
        self._limit = _F16_MAX if self._kind == 0 else float(np.finfo(np.float32).max) / 2
        self._qbe = None
        super().__init__(
            max_seq_len,
            batch=batch,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            layout=layout,
        )

    # -- what it is ------------------------------------------------------------------

    @property
    def bits(self) -> tuple[int, int]:
        """``(k_bits, v_bits)``."""
        return self._bits

    @property
    def group_size(self) -> int:
        return self._group

    @property
    def residual(self) -> int:
        return self._residual

    @property
    def q_len(self) -> int:
        """Positions held as codes, ``[0, q_len)``; the rest are the window."""
        return self._q_len

    @property
    def window_capacity(self) -> int:
        """Rows of the full-precision window: ``min(max_seq_len, residual + group_size
        - 1)`` (at least 1)."""
        return max(1, min(self._max_seq_len, self._residual + self._group - 1))

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer allocated: codes and scales for ``max_seq_len`` positions
        (whole groups), and the window."""
        if self._st is None:
            return 0
        return int(sum(a.nbytes for a in self._st))

    @property
    def shape(self) -> tuple[int, int, int, int] | None:
        """The shape of K (and V) at capacity, in the layout, or None when deallocated."""
        if self._st is None:
            return None
        return _layout.buffer_shape(
            self._layout, self._batch, self._num_kv_heads, self._max_seq_len, self._head_dim
        )

    def __repr__(self) -> str:
        return (
            f"QuantizedKVCache(bits={self._bits}, group_size={self._group}, "
            f"residual={self._residual}, batch={self._batch}, num_kv_heads="
            f"{self._num_kv_heads}, head_dim={self._head_dim}, dtype={self._dtype}, "
            f"device={self.device!r}, layout={self._layout!r}, seq_len={self._seq_len}/"
            f"{self._max_seq_len} ({self._q_len} in codes), nbytes={self.nbytes} "
            f"({human_bytes(self.nbytes)}))"
        )

    # -- storage ---------------------------------------------------------------------

    def _release(self) -> None:
        super()._release()
        self._st = None

    def _reset_counters(self) -> None:
        self._seq_len = 0
        self._q_len = 0

    def _new_storage(self, sizes: tuple, capacity: int) -> Store:
        batch, heads, dim, dtype = sizes
        g = self._group
        n_groups = capacity // g
        coded = n_groups * g
        k_row = -(-dim // (8 // self._bits[0]))
        v_row = -(-dim // (8 // self._bits[1]))
        w = max(1, min(capacity, self._residual + g - 1))
        shapes = (
            ((batch, heads, coded, k_row), np.uint8),
            ((batch, heads, n_groups, dim), np.uint16),
            ((batch, heads, n_groups, dim), np.uint16),
            ((batch, heads, coded, v_row), np.uint8),
            ((batch, heads, coded, dim // self._v_group), np.uint16),
            ((batch, heads, coded, dim // self._v_group), np.uint16),
            ((batch, heads, w, dim), dtype),
            ((batch, heads, w, dim), dtype),
        )
        nbytes = sum(int(np.prod(s)) * np.dtype(t).itemsize for s, t in shapes)
        if nbytes > sys.maxsize:
            raise InvalidArgumentError(
                f"a quantized layer of batch {batch}, num_kv_heads {heads}, {capacity} "
                f"positions and head_dim {dim} would need {nbytes} bytes, more than this "
                "machine can address"
            )
        be = self._backend
        arrays = QStorage(*(be.kernel_view(be.empty(s, np.dtype(t))) for s, t in shapes))
        return Store(arrays, sizes)

    def _install(self, st: Store) -> None:
        self._st = st.arrays
        self._k = st.arrays  # what "allocated" and a plan's key look at
        self._batch, self._num_kv_heads, self._head_dim, self._dtype = st.sizes
        if self._qbe is None:
            self._qbe = quant_backend(self._backend)
            scale_dtype = np.dtype(np.float16) if self._kind == 0 else np.dtype(np.uint16)
            table = widen_table(scale_dtype) if self._kind == 0 else widen_table(self._dtype)
            self._table = self._qbe_table(table)

    def _qbe_table(self, table: np.ndarray):
        """The scales' widening table where the kernels read it (the device, once)."""
        return self._backend.to_device(np.ascontiguousarray(table))

    def _current_storage(self) -> Store | None:
        if self._st is None:
            return None
        sizes = (self._batch, self._num_kv_heads, self._head_dim, self._dtype)
        return Store(self._st, sizes)

    def _ring_ranges(self, p0: int, p1: int) -> list[tuple[int, int, int]]:
        """The window slots of positions ``[p0, p1)`` (the last ``W`` of them, if more):
        at most two ``(first slot, end slot, first position)``."""
        w = self.window_capacity
        p0 = max(p0, p1 - w)
        if p1 <= p0:
            return []
        a = p0 % w
        first = min(p1 - p0, w - a)
        ranges = [(a, a + first, p0)]
        if p1 - p0 > first:
            ranges.append((0, p1 - p0 - first, p0 + first))
        return ranges

    @property
    def _inner(self):
        """The plain backend of this device in the storage's own order ("bhsd")."""
        from .backends import get_backend

        return get_backend(self._backend.name, "bhsd")

    # -- attention (the protocol) ----------------------------------------------------

    def attention_view(self, n_q: int, window: int | None) -> AttentionView:
        """The codes and the window in place: attention dequantizes inside its kernel."""
        if self._seq_len == 0:
            raise self._no_positions()
        dims = _layout.Dims(self._batch, self._num_kv_heads, self._seq_len, self._head_dim)
        reader = CodesReader(self._backend, self._qbe, self._q_len, self._bits, self._table)
        return AttentionView(reader, self._st, None, self._seq_len, dims, self._dtype)

    # -- views -----------------------------------------------------------------------

    def get_kv(self):
        """Dequantized copies ``(K, V)`` of the positions held, in ``dtype`` and the
        layout, or ``None`` when empty (on CUDA, device arrays; bfloat16 as uint16 bits).
        Writing into them does not change the cache."""
        if self._seq_len == 0:
            return None
        return self._read(0, self._seq_len)

    def _read(self, p0: int, p1: int):
        be = self._backend
        shape = _layout.buffer_shape(
            self._layout, self._batch, self._num_kv_heads, p1 - p0, self._head_dim
        )
        k, v = be.empty(shape, self._dtype), be.empty(shape, self._dtype)
        self._qbe.dequantize(
            self._st, self._q_len, p0, p1, self._bits, self._kind, self._table,
            be.kernel_view(k), be.kernel_view(v), self._layout,
        )  # fmt: skip
        return k, v

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions (all if fewer are held); return how many.

        Values kept never change: a cut inside the codes gives the kept part of its group,
        ``[floor(new_len / G) * G, new_len)``, back to the window as ``get_kv`` returned
        it, and ``q_len`` becomes ``floor(new_len / G) * G``.
        """
        dropped = min(nonnegative_int(n, "n"), self._seq_len)
        new_len = self._seq_len - dropped
        if new_len < self._q_len:
            new_q = (new_len // self._group) * self._group
            for a, b, p0 in self._ring_ranges(new_q, new_len):
                # slots [a, b) take positions p0 .. p0 + b - a - 1, read from the codes
                self._qbe.dequantize(
                    self._st, self._q_len, p0, p0 + b - a, self._bits, self._kind,
                    self._table, self._st.k_win[:, :, a:b], self._st.v_win[:, :, a:b],
                    "bhsd",
                )  # fmt: skip
            self._q_len = new_q
        self._seq_len = new_len
        return dropped

    def offset_after_trim(self, n: int) -> int:
        return self._seq_len - min(nonnegative_int(n, "n"), self._seq_len)

    # -- whole batch rows ------------------------------------------------------------

    def _rows_into(self, rows: list[int], store: Store) -> None:
        """Batch rows ``rows`` of this cache's arrays into ``store``'s rows 0, 1, ..."""
        for src, dst in zip(self._st, store.arrays, strict=True):
            for i, r in enumerate(rows):
                self._qbe.copy_row(src, r, dst, i)

    def reorder(self, indices: Any) -> None:
        """Row ``i`` becomes old row ``indices[i]`` (rows may repeat or vanish); new
        arrays are allocated first (the cache's size again), then replace the old ones."""
        rows = self._indices(indices, self._batch)
        if self._st is None or self._seq_len == 0:
            return
        store = self._new_storage(self._current_storage().sizes, self._max_seq_len)
        self._rows_into(rows, store)
        self._install(store)

    def select(self, indices: Any) -> QuantizedKVCache:
        """A new cache whose row ``i`` is this cache's row ``indices[i]`` (any length >= 1)."""
        rows = self._indices(indices, None)
        return self._with_rows(self._blank_like(len(rows)), rows)

    def copy(self) -> QuantizedKVCache:
        """An independent copy: new arrays, every row copied on the device."""
        return self._with_rows(self._blank_like(None), list(range(self._batch or 0)))

    def _with_rows(self, new: QuantizedKVCache, rows: list[int]) -> QuantizedKVCache:
        """``new`` (blank, of this configuration) holding this cache's ``rows``."""
        if self._st is not None:
            sizes = (len(rows), self._num_kv_heads, self._head_dim, self._dtype)
            store = self._new_storage(sizes, self._max_seq_len)
            self._rows_into(rows, store)
            new.adopt_rows(store, self._seq_len, self._q_len)
        return new

    def adopt_rows(self, store: Store, seq_len: int, q_len: int) -> None:
        """Install ``store`` (made by a cache of this configuration) holding ``seq_len``
        positions, ``q_len`` of them codes: how select and copy hand over their arrays."""
        self._install(store)
        self._seq_len, self._q_len = seq_len, q_len
