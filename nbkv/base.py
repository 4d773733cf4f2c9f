"""BaseKVCache: what every layer cache shares, and its side of the cache protocol.

Sizes, dtype, device and layout; the buffers; the boundary checks; the protocol's
``prepare_append`` / ``stage_append`` / ``commit_append``, ``attention_view`` and state
export/import (see :mod:`nbkv.protocol`); and the operations that move whole batch rows
(``reorder``, ``select``, ``copy``). :class:`nbkv.LayerKVCache` (positions in order, a
capacity that may grow) and :class:`nbkv.RotatingKVCache` (a ring with sinks) are its
two siblings; each overrides the few hooks where they differ. The protocol's append half
is :class:`nbkv.appending.AppendMixin`'s and its state half :class:`nbkv.state.StateMixin`'s,
both mixed in here.

The classes validate once at the boundary, own their counters as plain ints and call
kernels through a backend bound to their layout. Every check, and every allocation, runs
before anything is written, so a call that raises leaves the cache exactly as it was.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import numpy as np

from . import layout as _layout
from ._gather import SCRATCH, gather_schedule
from ._units import human_bytes
from ._validate import batch_indices, nonnegative_int, optional_positive_int, positive_int
from .appending import AppendMixin
from .backends import get_backend
from .dtypes import check_supported, resolve_dtype
from .errors import (
    CacheOverflowError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
)
from .protocol import AppendPlan, AttentionView
from .state import StateMixin

__all__ = ["BaseKVCache"]

AXES = {
    "bhsd": "[batch, num_kv_heads, seq, head_dim]",
    "bshd": "[batch, seq, num_kv_heads, head_dim]",
}


class Storage(NamedTuple):
    """A pair of buffers (user and kernel form) and what they were made for."""

    k: Any
    v: Any
    kk: Any
    vk: Any
    sizes: tuple  # (batch, num_kv_heads, head_dim, dtype)
    capacity: int


class BaseKVCache(AppendMixin, StateMixin):
    """The base of every layer cache: use ``isinstance(x, nbkv.BaseKVCache)`` to accept any.

    Not built directly: see :class:`nbkv.LayerKVCache` and :class:`nbkv.RotatingKVCache`.
    Buffers have shape ``[batch, num_kv_heads, capacity, head_dim]`` (layout "bhsd") or
    ``[batch, capacity, num_kv_heads, head_dim]`` ("bshd").
    """

    state_type: str  # set by nbkv.protocol.register_cache_type

    def __init__(
        self,
        capacity: int,
        *,
        batch: int | None,
        num_kv_heads: int | None,
        head_dim: int | None,
        dtype: Any,
        device: str,
        layout: str,
    ) -> None:
        self._max_seq_len = positive_int(capacity, "max_seq_len")
        self._layout = _layout.check_layout(layout)
        configured = (
            optional_positive_int(batch, "batch"),
            optional_positive_int(num_kv_heads, "num_kv_heads"),
            optional_positive_int(head_dim, "head_dim"),
            None if dtype is None else resolve_dtype(dtype),
        )
        self._backend = get_backend(device, self._layout)
        # what the constructor fixed; deallocate() returns to it
        self._configured = configured
        self._release()
        if all(c is not None for c in configured):
            self._install(self._new_storage(configured, self._max_seq_len))

    # -- storage ---------------------------------------------------------------------

    def _release(self) -> None:
        """Drop the buffers and forget every position; sizes fall back to the constructor's."""
        self._batch, self._num_kv_heads, self._head_dim, self._dtype = self._configured
        self._k = self._v = None  # buffers as users see them
        self._kk = self._vk = None  # the same memory in kernel form
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._seq_len = 0

    def _new_storage(self, sizes: tuple, capacity: int) -> Storage:
        """New buffers for ``sizes`` and ``capacity``, not yet the cache's (may raise)."""
        batch, heads, dim, dtype = sizes
        nbytes = 2 * batch * heads * capacity * dim * dtype.itemsize
        if nbytes > sys.maxsize:
            raise InvalidArgumentError(
                f"buffers of batch {batch}, num_kv_heads {heads}, {capacity} positions and "
                f"head_dim {dim} would need {nbytes} bytes, more than this machine can address"
            )
        shape = _layout.buffer_shape(self._layout, batch, heads, capacity, dim)
        be = self._backend
        k, v = be.empty(shape, dtype), be.empty(shape, dtype)
        return Storage(k, v, be.kernel_view(k), be.kernel_view(v), sizes, capacity)

    def _install(self, st: Storage) -> None:
        """Make ``st`` the cache's buffers (nothing can fail here)."""
        self._k, self._v, self._kk, self._vk = st.k, st.v, st.kk, st.vk
        self._batch, self._num_kv_heads, self._head_dim, self._dtype = st.sizes
        self._max_seq_len = st.capacity
        self._storage_changed()

    def _current_storage(self) -> Storage | None:
        if self._k is None:
            return None
        sizes = (self._batch, self._num_kv_heads, self._head_dim, self._dtype)
        return Storage(self._k, self._v, self._kk, self._vk, sizes, self._max_seq_len)

    def _storage_changed(self) -> None:
        """Hook: the buffers were replaced (a subclass drops what pointed at the old ones)."""

    def _storage_for(self, plan: AppendPlan) -> Storage | None:
        """Hook: new buffers the append needs (None: the current ones serve)."""
        if self._k is not None or plan.dims.seq == 0:
            return None
        d = plan.dims
        return self._new_storage(
            (d.batch, d.num_kv_heads, d.head_dim, plan.dtype), self._max_seq_len
        )

    # -- properties ------------------------------------------------------------------

    @property
    def seq_len(self) -> int:
        """Positions held."""
        return self._seq_len

    @property
    def max_seq_len(self) -> int:
        """Capacity in positions (rows the buffers hold)."""
        return self._max_seq_len

    @property
    def offset(self) -> int:
        """Tokens seen: the position of the next token (for its rotary embedding)."""
        return self._seq_len

    @property
    def is_empty(self) -> bool:
        return self._seq_len == 0

    @property
    def is_allocated(self) -> bool:
        return self._k is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V buffers (0 when not allocated)."""
        return 0 if self._k is None else int(self._k.nbytes + self._v.nbytes)

    @property
    def dtype(self) -> np.dtype | None:
        """The stored dtype, once known."""
        return self._dtype

    @property
    def device(self) -> str:
        return self._backend.name

    @property
    def layout(self) -> str:
        return self._layout

    @property
    def batch(self) -> int | None:
        return self._batch

    @property
    def num_kv_heads(self) -> int | None:
        return self._num_kv_heads

    @property
    def head_dim(self) -> int | None:
        return self._head_dim

    @property
    def shape(self) -> tuple[int, int, int, int] | None:
        """Shape of each buffer (capacity included), or None when not allocated."""
        return None if self._k is None else tuple(self._k.shape)

    def __len__(self) -> int:
        return self._seq_len

    def __repr__(self) -> str:
        shape = "unallocated" if self._k is None else str(tuple(self._k.shape))
        return (
            f"{type(self).__name__}(shape={shape}, dtype={self._dtype}, "
            f"device={self.device!r}, layout={self._layout!r}, "
            f"seq_len={self._seq_len}/{self._max_seq_len}, "
            f"nbytes={self.nbytes} ({human_bytes(self.nbytes)}){self._repr_extra()})"
        )

    def _repr_extra(self) -> str:
        return ""

    def to_host(self, x: Any) -> np.ndarray:
        """A host array of ``x`` (a view this cache returned): the one device->host copy
        on CUDA (bfloat16 seen as bfloat16), ``x`` itself on the CPU."""
        return self._backend.to_host(x, self._dtype)

    # -- validation ------------------------------------------------------------------

    def _adopt(self, x: Any, name: str):
        """``x`` as an array of this cache's device, 4-D, of a dtype that fits."""
        arr = self._backend.adopt(x, name)
        if arr.ndim != 4:
            raise ShapeMismatchError(
                f"{name} must be 4-D {AXES[self._layout]} (layout {self._layout!r}), "
                f"got a {arr.ndim}-D array of shape {tuple(arr.shape)}"
            )
        return arr

    def _dtype_of(self, arr: Any, name: str) -> np.dtype:
        """The logical dtype of an adopted array, checked against the cache's."""
        dtype = np.dtype(arr.dtype)
        want = self._dtype
        if want is not None and dtype == want:
            return dtype
        if (
            want is not None
            and self._backend.name == "cuda"
            and dtype == np.uint16
            and want.itemsize == 2
            and want.kind != "f"
            and not isinstance(arr, np.ndarray)
        ):
            # a device array of bfloat16 bit patterns, as the CUDA views give them
            return want
        if want is None:
            return check_supported(dtype, name)
        raise DTypeMismatchError(
            f"{name} has dtype {dtype} but this cache holds {want}; nbkv never casts: "
            f"convert it first ({name}.astype(...))"
        )

    def _check_fits(self, name: str, arr: Any, d: _layout.Dims) -> None:
        """Batch, heads and head_dim of ``arr`` against the buffers (or the constructor)."""
        if (d.batch, d.num_kv_heads, d.head_dim) == (
            self._batch,
            self._num_kv_heads,
            self._head_dim,
        ):
            return  # the decode loop's case: the sizes set (each at least 1) and matched
        for field, want in zip(
            _layout.SIZES, (self._batch, self._num_kv_heads, self._head_dim), strict=True
        ):
            got = getattr(d, field)
            if got < 1:
                raise ShapeMismatchError(
                    f"{name} has shape {tuple(arr.shape)}: {field} must be at least 1"
                )
            if want is not None and got != want:
                raise ShapeMismatchError(
                    f"{name} has shape {tuple(arr.shape)} but this cache holds {field} "
                    f"{want} (layout {self._layout!r}: {AXES[self._layout]})"
                )

    def _check_pair(self, k: Any, v: Any):
        k = self._adopt(k, "k")
        v = self._adopt(v, "v")
        kd = _layout.dims(k.shape, self._layout)
        vd = kd if k.shape == v.shape else _layout.dims(v.shape, self._layout)
        if kd != vd:
            field = next(f for f in _layout.Dims._fields if getattr(kd, f) != getattr(vd, f))
            raise ShapeMismatchError(
                f"k and v disagree in {field}: k has shape {tuple(k.shape)}, "
                f"v has shape {tuple(v.shape)} (layout {self._layout!r})"
            )
        kt, vt = np.dtype(k.dtype), np.dtype(v.dtype)
        if kt != vt:
            raise DTypeMismatchError(f"k has dtype {kt} but v has dtype {vt}")
        dtype = self._dtype_of(k, "k")
        self._check_fits("k", k, kd)
        return k, v, kd, dtype

    def _check_room(self, n: int, what: str) -> None:
        """Hook: raise CacheOverflowError unless ``n`` more positions fit."""
        free = self._max_seq_len - self._seq_len
        if n > free:
            raise CacheOverflowError(
                f"{what} of {n} positions does not fit: the cache holds {self._seq_len} of "
                f"{self._max_seq_len} positions and {free} are free for it; build it "
                f"with max_seq_len >= {self._seq_len + n}"
            )

    # -- the protocol: attention -----------------------------------------------------

    def _no_positions(self) -> InvalidArgumentError:
        return InvalidArgumentError("the cache holds no position: there is nothing to attend to")

    def attention_view(self, n_q: int, window: int | None) -> AttentionView:
        """The buffers in place, with ``seq_len``: attention reads ``[0, seq_len)``."""
        if self._seq_len == 0:
            raise self._no_positions()
        be = self._backend
        dims = _layout.Dims(self._batch, self._num_kv_heads, self._seq_len, self._head_dim)
        k, v = be.attention_form(self._k), be.attention_form(self._v)
        return AttentionView(be, k, v, self._seq_len, dims, self._dtype)

    # -- views -----------------------------------------------------------------------

    def get_kv(self):
        """Views ``(K, V)`` of the positions held, or ``None`` when empty.

        Zero-copy views into the buffers, in the cache's layout: ``[batch, num_kv_heads,
        seq_len, head_dim]`` for "bhsd". Writing into them writes the cache (allowed:
        the positions stay held). On a CUDA cache they are Numba device arrays, which
        ``torch.as_tensor`` and ``cupy.asarray`` wrap without a copy (bfloat16 arrives as
        ``uint16`` bit patterns: ``torch.as_tensor(K).view(torch.bfloat16)``).
        """
        if self._seq_len == 0:
            return None
        index = _layout.seq_index(self._layout, 0, self._seq_len)
        return self._k[index], self._v[index]

    def crop(self, new_len: int) -> None:
        """Keep ``new_len`` held positions, dropping the newest (``trim`` of the rest);
        no data moves.

        Raises
        ------
        InvalidArgumentError
            ``new_len`` below 0 or above ``seq_len``.
        """
        new_len = nonnegative_int(new_len, "new_len")
        if new_len > self._seq_len:
            raise InvalidArgumentError(
                f"new_len must be at most seq_len = {self._seq_len} (crop only shortens), "
                f"got {new_len}"
            )
        self.trim(self._seq_len - new_len)

    def trim(self, n: int) -> int:
        """Hook: drop the last ``n`` held positions; return how many (see the subclass)."""
        raise NotImplementedError

    def offset_after_trim(self, n: int) -> int:
        """Hook: the ``offset`` that ``trim(n)`` would leave, changing nothing."""
        raise NotImplementedError

    def clear(self) -> None:
        """Forget every position; keep the buffers for reuse."""
        self._reset_counters()

    def deallocate(self) -> None:
        """Free the buffers; keep the capacity (and the sizes the constructor fixed)."""
        self._release()

    # -- whole batch rows ------------------------------------------------------------

    def _slots_in_use(self) -> int:
        """Hook: leading buffer positions that hold data (all of them in a ring)."""
        return self._seq_len

    def _indices(self, indices: Any, length: int | None) -> list[int]:
        if self._batch is None:
            raise InvalidArgumentError(
                "the cache has no batch rows yet (nothing allocated, no batch given)"
            )
        return batch_indices(indices, self._batch, "indices", length)

    def check_indices(self, indices: Any, length: int | None = None) -> list[int]:
        """``indices`` as batch rows of this cache (``length`` of them if given), or a
        typed error; changes nothing (what ``reorder`` and ``select`` check)."""
        return self._indices(indices, length)

    def _row(self, buf, row: int, n: int):
        """Positions ``[0, n)`` of batch row ``row`` of a kernel-form buffer, kept 4-D."""
        return buf[row : row + 1][_layout.seq_index(self._layout, 0, n)]

    def reorder(self, indices: Any) -> None:
        """Row ``i`` becomes old row ``indices[i]``, for every batch row, in place.

        Beam search's reorder: rows may repeat (two beams from one parent) and vanish.
        ``len(indices) == batch``, each in ``[0, batch)``, checked before anything moves.
        Done by the cache's copy kernel on its device, row by row in an order that reads
        every row before it is overwritten; cycles (a swap) borrow one scratch batch row,
        the only allocation, made before anything moves.
        """
        rows = self._indices(indices, self._batch)
        held = self._slots_in_use()
        if self._k is None or held == 0:
            return
        ops = gather_schedule(rows)
        be = self._backend
        scratch = None
        if any(SCRATCH in op for op in ops):
            shape = _layout.buffer_shape(self._layout, 1, self._num_kv_heads, held, self._head_dim)
            scratch = tuple(be.kernel_view(be.empty(shape, self._dtype)) for _ in "kv")
        for dst, src in ops:
            if src == SCRATCH:
                k_src, v_src = scratch
            else:
                k_src, v_src = self._row(self._kk, src, held), self._row(self._vk, src, held)
            if dst == SCRATCH:
                k_dst, v_dst = scratch
            else:
                k_dst, v_dst = self._kk[dst : dst + 1], self._vk[dst : dst + 1]
            be.write_kv(k_src, v_src, 0, k_dst, v_dst)

    def _blank_like(self, batch: int | None):
        """A new cache of this type and configuration, holding nothing, no buffers."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        if batch is not None:
            _, heads, dim, dtype = self._configured
            new._configured = (batch, heads, dim, dtype)
        new._release()
        return new

    def _copy_counters(self, other: BaseKVCache) -> None:
        """Hook: take ``other``'s counters (a ring has more than one)."""
        self._seq_len = other._seq_len

    def select(self, indices: Any):
        """A new cache whose row ``i`` is this cache's row ``indices[i]`` (any length >= 1).

        Same capacity, dtype, device, layout and configuration; rows copied by the kernel.
        """
        rows = self._indices(indices, None)
        new = self._blank_like(len(rows))
        if self._k is not None:
            sizes = (len(rows), self._num_kv_heads, self._head_dim, self._dtype)
            new._install(new._new_storage(sizes, self._max_seq_len))
            held = self._slots_in_use()
            for i, src in enumerate(rows):
                if held:
                    self._backend.write_kv(
                        self._row(self._kk, src, held),
                        self._row(self._vk, src, held),
                        0,
                        new._kk[i : i + 1],
                        new._vk[i : i + 1],
                    )
            new._copy_counters(self)
        return new

    def copy(self):
        """An independent copy: new buffers, the positions held copied by the kernel."""
        new = self._blank_like(None)
        new._configured = self._configured
        if self._k is not None:
            new._install(new._new_storage(self._current_storage().sizes, self._max_seq_len))
            held = self._slots_in_use()
            if held:
                index = _layout.seq_index(self._layout, 0, held)
                self._backend.write_kv(self._kk[index], self._vk[index], 0, new._kk, new._vk)
            new._copy_counters(self)
        else:
            new._max_seq_len = self._max_seq_len
        return new

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo: dict):
        return self.copy()
