"""LayerKVCache (one attention layer's K and V) and KVCache (a model's layers).

The classes validate once at the boundary, own the cursor (``seq_len``, a plain ``int``)
and call kernels through a backend. Every check runs before anything is allocated or
written, so a call that raises leaves the cache exactly as it was.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from . import layout as _layout
from ._gather import SCRATCH, gather_schedule
from ._units import human_bytes
from ._validate import batch_indices, nonnegative_int, optional_positive_int, positive_int
from .backends import get_backend
from .dtypes import check_supported, resolve_dtype
from .errors import (
    ArgumentTypeError,
    CacheOverflowError,
    DTypeMismatchError,
    InvalidArgumentError,
    LayerIndexError,
    ShapeMismatchError,
)

__all__ = ["DEFAULT_MAX_SEQ_LEN", "DEFAULT_GROW_STEP", "LayerKVCache", "KVCache"]

DEFAULT_MAX_SEQ_LEN = 2048
DEFAULT_GROW_STEP = 256
OVERFLOW_POLICIES = ("error", "grow")

_ndarray = np.ndarray

_AXES = {
    "bhsd": "[batch, num_kv_heads, seq, head_dim]",
    "bshd": "[batch, seq, num_kv_heads, head_dim]",
}


class LayerKVCache:
    """Keys and values of one attention layer, in preallocated buffers.

    Buffers have shape ``[batch, num_kv_heads, max_seq_len, head_dim]`` (layout "bhsd",
    the default) or ``[batch, max_seq_len, num_kv_heads, head_dim]`` (layout "bshd").
    ``append`` writes new positions in place; ``get_kv`` returns views of the
    ``seq_len`` positions held.

    Parameters
    ----------
    max_seq_len : int, default DEFAULT_MAX_SEQ_LEN (2048)
        Capacity in positions. Never changes.
    batch, num_kv_heads, head_dim : int, optional
        Buffer sizes. Give all of them and ``dtype`` to allocate at once (recommended);
        otherwise the buffers are allocated by the first ``append`` or ``set_k``, taking
        what was not given from that array (and what was given constrains it).
    dtype : dtype-like, optional
        float32, float64, float16 or "bfloat16" (needs ``nbkv[bf16]``). Never cast.
    device : {"cpu", "cuda"}
        "cuda" keeps the buffers as Numba device arrays (a GPU, or the CUDA simulator).
    layout : {"bhsd", "bshd"}
        Axis order of the buffers and of every array passed in or returned.

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError
        A size that is not a positive int, an unknown layout or device.
    DTypeMismatchError
        A dtype nbkv does not store.
    BackendUnavailableError
        ``device="cuda"`` where neither a GPU nor the CUDA simulator is available.

    Examples
    --------
    >>> import numpy as np, nbkv
    >>> cache = nbkv.LayerKVCache(16, batch=1, num_kv_heads=2, head_dim=4, dtype="float32")
    >>> k = np.ones((1, 2, 3, 4), np.float32)
    >>> cache.append(k, 2 * k)
    >>> K, V = cache.get_kv()
    >>> K.shape, cache.seq_len, float(V[0, 0, 2, 0])
    ((1, 2, 3, 4), 3, 2.0)
    """

    def __init__(
        self,
        max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
        *,
        batch: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: Any = None,
        device: str = "cpu",
        layout: str = "bhsd",
        on_overflow: str = "error",
        grow_step: int = DEFAULT_GROW_STEP,
    ) -> None:
        self._max_seq_len = positive_int(max_seq_len, "max_seq_len")
        self._layout = _layout.check_layout(layout)
        if on_overflow not in OVERFLOW_POLICIES:
            raise InvalidArgumentError(
                f"on_overflow must be one of {OVERFLOW_POLICIES}, got {on_overflow!r}"
            )
        self._on_overflow = on_overflow
        self._grow_step = positive_int(grow_step, "grow_step")
        configured = (
            optional_positive_int(batch, "batch"),
            optional_positive_int(num_kv_heads, "num_kv_heads"),
            optional_positive_int(head_dim, "head_dim"),
            None if dtype is None else resolve_dtype(dtype),
        )
        self._backend = get_backend(device)
        # what the constructor fixed; deallocate() returns to it
        self._configured = configured
        self._release()
        if all(c is not None for c in configured):
            self._allocate(*configured)

    # -- the reference API's constructors ------------------------------------------

    @classmethod
    def new(cls) -> LayerKVCache:
        """A lazy cache of capacity DEFAULT_MAX_SEQ_LEN (the reference's ``new()``)."""
        return cls()

    @classmethod
    def with_capacity(cls, max_seq_len: int, **kwargs: Any) -> LayerKVCache:
        """A cache of capacity ``max_seq_len``; lazy unless ``kwargs`` fix every size."""
        return cls(max_seq_len, **kwargs)

    # -- state -----------------------------------------------------------------------

    def _release(self) -> None:
        """Drop the buffers; sizes fall back to what the constructor fixed."""
        self._batch, self._num_kv_heads, self._head_dim, self._dtype = self._configured
        self._k = self._v = None  # buffers as users see them
        self._kk = self._vk = None  # the same memory in kernel form
        self._seq_len = 0
        self._fast = None  # see append()

    def _allocate(self, batch: int, num_kv_heads: int, head_dim: int, dtype: np.dtype) -> None:
        shape = _layout.buffer_shape(self._layout, batch, num_kv_heads, self._max_seq_len, head_dim)
        be = self._backend
        self._k, self._v = be.empty(shape, dtype), be.empty(shape, dtype)
        self._kk, self._vk = be.kernel_view(self._k), be.kernel_view(self._v)
        self._batch, self._num_kv_heads, self._head_dim, self._dtype = (
            batch,
            num_kv_heads,
            head_dim,
            dtype,
        )

    @property
    def seq_len(self) -> int:
        """Positions held."""
        return self._seq_len

    @property
    def max_seq_len(self) -> int:
        """Capacity in positions."""
        return self._max_seq_len

    @property
    def offset(self) -> int:
        """Tokens seen: the position of the next token. Equal to ``seq_len`` here; a
        :class:`nbkv.RotatingKVCache` holds fewer rows than it has seen."""
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
            f"nbytes={self.nbytes} ({human_bytes(self.nbytes)}))"
        )

    # -- validation ------------------------------------------------------------------

    def _adopt(self, x: Any, name: str):
        """``x`` as an array of this cache's device, 4-D, of a dtype that fits."""
        arr = self._backend.adopt(x, name)
        if arr.ndim != 4:
            raise ShapeMismatchError(
                f"{name} must be 4-D {_AXES[self._layout]} (layout {self._layout!r}), "
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
            # a device array of bfloat16 bit patterns, as device_view(bf16) gives them
            return want
        if want is None:
            return check_supported(dtype, name)
        raise DTypeMismatchError(
            f"{name} has dtype {dtype} but this cache holds {want}; nbkv never casts: "
            f"convert it first ({name}.astype(...))"
        )

    def _check_fits(self, name: str, arr: Any, d: _layout.Dims) -> None:
        """Batch, heads and head_dim of ``arr`` against the buffers (or the constructor)."""
        for field, want in (
            ("batch", self._batch),
            ("num_kv_heads", self._num_kv_heads),
            ("head_dim", self._head_dim),
        ):
            got = getattr(d, field)
            if got < 1:
                raise ShapeMismatchError(
                    f"{name} has shape {tuple(arr.shape)}: {field} must be at least 1"
                )
            if want is not None and got != want:
                raise ShapeMismatchError(
                    f"{name} has shape {tuple(arr.shape)} but this cache holds {field} "
                    f"{want} (layout {self._layout!r}: {_AXES[self._layout]})"
                )

    def _check_room(self, n: int, start: int, what: str) -> None:
        free = self._max_seq_len - start
        if n > free and self._on_overflow != "grow":
            raise CacheOverflowError(
                f"{what} of {n} positions does not fit: the cache holds {self._seq_len} of "
                f"{self._max_seq_len} positions and {free} are free for it; build it "
                f"with max_seq_len >= {start + n}"
            )

    def _check_pair(self, k: Any, v: Any):
        k = self._adopt(k, "k")
        v = self._adopt(v, "v")
        kd = _layout.dims(k.shape, self._layout)
        vd = _layout.dims(v.shape, self._layout)
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

    # -- for nbkv's own callers (attention): the steps of append, apart ---------------

    def _check_append(self, k: Any, v: Any):
        """Every check ``append(k, v)`` makes, changing nothing: ``(k, v, dims, dtype)``."""
        k, v, d, dtype = self._check_pair(k, v)
        self._check_room(d.seq, self._seq_len, "append")
        return k, v, d, dtype

    def _ensure_allocated(self, d: _layout.Dims, dtype: np.dtype) -> None:
        if self._k is None:
            self._allocate(d.batch, d.num_kv_heads, d.head_dim, dtype)

    def _buffers(self):
        """The full K and V buffers (None before allocation)."""
        return self._k, self._v

    def _advance(self, n: int) -> None:
        """Count ``n`` positions written by a kernel at ``seq_len`` as held."""
        self._seq_len += n

    def _make_room(self, needed: int) -> None:
        """Grow the capacity to the next multiple of ``grow_step`` that holds ``needed``.

        Only with ``on_overflow="grow"`` (the checks have refused anything else). New
        buffers are allocated and the positions held copied once; views taken before keep
        the old buffers and the old data.
        """
        if needed <= self._max_seq_len:
            return
        capacity = -(-needed // self._grow_step) * self._grow_step
        old_k, old_v, held = self._kk, self._vk, self._seq_len
        self._max_seq_len = capacity
        if old_k is None:
            return  # a lazy cache: the first write allocates at the new capacity
        self._allocate(self._batch, self._num_kv_heads, self._head_dim, self._dtype)
        self._fast = None  # it points at the old buffers
        if held:
            index = _layout.seq_index(self._layout, 0, held)
            self._backend.write_kv(self._layout, old_k[index], old_v[index], 0, self._kk, self._vk)

    # -- the reference API -----------------------------------------------------------

    def append(self, k: Any, v: Any) -> None:
        """Write ``n`` new positions of keys and values after the ``seq_len`` held.

        Parameters
        ----------
        k, v : arrays of shape [batch, num_kv_heads, n, head_dim] (in the cache's layout)
            Any strides. On a CUDA cache: device arrays (Numba, CuPy, torch: anything
            with ``__cuda_array_interface__``, no copy) or host arrays (copied once).

        Raises
        ------
        ArgumentTypeError, ShapeMismatchError, DTypeMismatchError, DeviceMismatchError
            Input that is not an array, not 4-D, k and v disagreeing, or not fitting the
            buffers.
        CacheOverflowError
            ``seq_len + n > max_seq_len``; the message says how many positions are free.
        """
        # Fast path for the decode loop: host arrays of the very shape and dtype the last
        # append validated need only the room check. It is taken on the CPU backend for
        # dtypes kernels read as they are; anything else goes through every check below.
        pos = self._seq_len
        fast = self._fast
        if fast is not None:
            shape, dtype, last_pos, n, write, k_buf, v_buf = fast
            if (
                type(k) is _ndarray
                and type(v) is _ndarray
                and k.shape == shape
                and v.shape == shape
                and k.dtype is dtype
                and v.dtype is dtype
                and pos <= last_pos
            ):
                write(k, v, pos, k_buf, v_buf)
                self._seq_len = pos + n
                return
        k, v, d, dtype = self._check_append(k, v)
        if d.seq == 0:
            return
        self._make_room(self._seq_len + d.seq)
        self._ensure_allocated(d, dtype)
        be = self._backend
        be.write_kv(self._layout, be.to_kernel(k), be.to_kernel(v), pos, self._kk, self._vk)
        self._seq_len = pos + d.seq
        if be.name == "cpu" and type(k) is _ndarray and type(v) is _ndarray:
            if self._kk.dtype == self._dtype:  # 16-bit data need a view: no fast path
                last_pos = self._max_seq_len - d.seq
                write = be.kv_writer(self._layout)
                self._fast = (k.shape, self._dtype, last_pos, d.seq, write, self._kk, self._vk)

    def get_kv(self):
        """Views ``(K, V)`` of the positions held, or ``None`` when empty.

        Zero-copy views into the buffers (writing into them writes the cache), in the
        cache's layout: ``[batch, num_kv_heads, seq_len, head_dim]`` for "bhsd". On a CUDA
        cache they are Numba device arrays, which ``torch.as_tensor`` and
        ``cupy.asarray`` wrap without a copy (bfloat16 arrives as ``uint16`` bit
        patterns: ``torch.as_tensor(K).view(torch.bfloat16)``).
        """
        if self._seq_len == 0:
            return None
        index = _layout.seq_index(self._layout, 0, self._seq_len)
        return self._k[index], self._v[index]

    def clear(self) -> None:
        """Forget every position; keep the buffers for reuse."""
        self._seq_len = 0

    def deallocate(self) -> None:
        """Free the buffers; keep the capacity (and the sizes the constructor fixed)."""
        self._release()

    # -- sequence management -----------------------------------------------------------

    @property
    def on_overflow(self) -> str:
        """ "error" (an append past capacity raises) or "grow" (capacity grows)."""
        return self._on_overflow

    @property
    def grow_step(self) -> int:
        """Positions a growth rounds the capacity up to a multiple of."""
        return self._grow_step

    def crop(self, new_len: int) -> None:
        """Keep the first ``new_len`` positions; no data moves.

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
        self._seq_len = new_len

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions (all of them if fewer are held); return how many.

        >>> import numpy as np, nbkv
        >>> cache = nbkv.LayerKVCache(8)
        >>> cache.append(np.ones((1, 1, 5, 2), np.float32), np.ones((1, 1, 5, 2), np.float32))
        >>> cache.trim(2), cache.seq_len, cache.trim(9), cache.seq_len
        (2, 3, 3, 0)
        """
        dropped = min(nonnegative_int(n, "n"), self._seq_len)
        self._seq_len -= dropped
        return dropped

    def _indices(self, indices: Any, length: int | None) -> list[int]:
        if self._batch is None:
            raise InvalidArgumentError(
                "the cache has no batch rows yet (nothing allocated, no batch given)"
            )
        return batch_indices(indices, self._batch, "indices", length)

    def _slots_in_use(self) -> int:
        """Leading buffer positions that hold data (all of them in a rotating cache)."""
        return self._seq_len

    def _copy_counters(self, other: LayerKVCache) -> None:
        """Take ``other``'s cursor (a rotating cache has more than one)."""
        self._seq_len = other._seq_len

    def _row(self, buf, row: int, n: int):
        """Positions ``[0, n)`` of batch row ``row`` of a kernel-form buffer, kept 4-D."""
        return buf[row : row + 1][_layout.seq_index(self._layout, 0, n)]

    def reorder(self, indices: Any) -> None:
        """Row ``i`` becomes old row ``indices[i]``, for every batch row, in place.

        Beam search's reorder: rows may repeat (two beams from one parent) and vanish.
        ``len(indices) == batch``, each in ``[0, batch)``, checked before anything moves.
        Done by the cache's copy kernel on its device, row by row in an order that reads
        every row before it is overwritten; cycles (a swap) borrow one scratch batch row,
        the only allocation.
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
            be.write_kv(self._layout, k_src, v_src, 0, k_dst, v_dst)

    def select(self, indices: Any) -> LayerKVCache:
        """A new cache whose row ``i`` is this cache's row ``indices[i]`` (any length >= 1).

        Same capacity, dtype, device, layout and overflow policy; rows copied by the kernel.
        """
        rows = self._indices(indices, None)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        _, heads, dim, dtype = self._configured
        new._configured = (len(rows), heads, dim, dtype)
        new._release()
        if self._k is not None:
            new._allocate(len(rows), self._num_kv_heads, self._head_dim, self._dtype)
            held = self._slots_in_use()
            for i, src in enumerate(rows):
                if held:
                    self._backend.write_kv(
                        self._layout,
                        self._row(self._kk, src, held),
                        self._row(self._vk, src, held),
                        0,
                        new._kk[i : i + 1],
                        new._vk[i : i + 1],
                    )
            new._copy_counters(self)
        return new

    def load_state(self, path: Any) -> None:
        """Replace the positions held with those saved at ``path`` (see nbkv.save).

        Checked in full before anything is written, so on any error the cache is
        unchanged; see :func:`nbkv.persist.load_state` for what must fit.
        """
        from .persist import load_state

        load_state(self, path)

    # -- copies ----------------------------------------------------------------------

    def copy(self) -> LayerKVCache:
        """An independent copy: new buffers, the positions held copied by the kernel."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._k = new._v = new._kk = new._vk = new._fast = None  # nothing of self's storage
        if self._k is not None:
            new._allocate(self._batch, self._num_kv_heads, self._head_dim, self._dtype)
            held = self._slots_in_use()
            if held:
                index = _layout.seq_index(self._layout, 0, held)
                self._backend.write_kv(
                    self._layout, self._kk[index], self._vk[index], 0, new._kk, new._vk
                )
        return new

    def __copy__(self) -> LayerKVCache:
        return self.copy()

    def __deepcopy__(self, memo: dict) -> LayerKVCache:
        return self.copy()

    # -- deprecated legacy calls of the reference API --------------------------------

    @staticmethod
    def _deprecated(old: str, new: str) -> None:
        warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)

    def k(self):
        """Deprecated: the key view of ``get_kv()``, or None when empty."""
        self._deprecated("LayerKVCache.k()", "get_kv()[0]")
        kv = self.get_kv()
        return None if kv is None else kv[0]

    def v(self):
        """Deprecated: the value view of ``get_kv()``, or None when empty."""
        self._deprecated("LayerKVCache.v()", "get_kv()[1]")
        kv = self.get_kv()
        return None if kv is None else kv[1]

    def _set(self, x: Any, name: str) -> tuple[Any, _layout.Dims, np.dtype]:
        arr = self._adopt(x, name)
        d = _layout.dims(arr.shape, self._layout)
        dtype = self._dtype_of(arr, name)
        self._check_fits(name, arr, d)
        return arr, d, dtype

    def set_k(self, k: Any) -> None:
        """Deprecated: replace the keys with ``k`` and set ``seq_len`` to its length.

        ``k`` is copied into the buffers (allocating them if needed), so the capacity is
        kept and later appends work (the reference adopted the tensor, leaving no room).
        Values at those positions are left as they were until ``set_v``.
        """
        self._deprecated("LayerKVCache.set_k()", "clear() then append(k, v)")
        arr, d, dtype = self._set(k, "k")
        self._check_room(d.seq, 0, "set_k")
        self._make_room(d.seq)
        if self._k is None:
            self._allocate(d.batch, d.num_kv_heads, d.head_dim, dtype)
        if d.seq:
            self._backend.write_cache(self._layout, self._backend.to_kernel(arr), 0, self._kk)
        self._seq_len = d.seq

    def set_v(self, v: Any) -> None:
        """Deprecated: replace the values with ``v``, which must hold ``seq_len`` positions.

        (The reference neither checked nor updated the length here.)
        """
        self._deprecated("LayerKVCache.set_v()", "clear() then append(k, v)")
        arr, d, _ = self._set(v, "v")
        if d.seq != self._seq_len:
            raise ShapeMismatchError(
                f"v has shape {tuple(arr.shape)}: set_v needs exactly seq_len = "
                f"{self._seq_len} positions, as the keys hold, got {d.seq}"
            )
        if d.seq:
            self._backend.write_cache(self._layout, self._backend.to_kernel(arr), 0, self._vk)


class KVCache:
    """A model's cache: one :class:`LayerKVCache` per layer, all built alike.

    Parameters
    ----------
    num_layers : int
    max_seq_len : int, default DEFAULT_MAX_SEQ_LEN
    **kwargs
        The keyword arguments of :class:`LayerKVCache` (``batch``, ``num_kv_heads``,
        ``head_dim``, ``dtype``, ``device``, ``layout``), applied to every layer.

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
    def from_layers(cls, layers: Iterable[LayerKVCache]) -> KVCache:
        """A model's cache of layer caches built by the caller (e.g. RotatingKVCache)."""
        layers = list(layers)
        if not layers or not all(isinstance(layer, LayerKVCache) for layer in layers):
            raise ArgumentTypeError(
                "layers must be one or more LayerKVCache (or RotatingKVCache) objects"
            )
        new = object.__new__(cls)
        new._layers = layers
        return new

    @property
    def offset(self) -> int:
        """Tokens every layer has seen (the minimum over layers)."""
        return min(layer.offset for layer in self._layers)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, i: int) -> LayerKVCache:
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

    def __iter__(self) -> Iterator[LayerKVCache]:
        return iter(self._layers)

    @property
    def seq_len(self) -> int:
        """Positions held by every layer (the minimum over layers)."""
        return min(layer.seq_len for layer in self._layers)

    @property
    def max_seq_len(self) -> int:
        return self._layers[0].max_seq_len

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

    def clear(self) -> None:
        """Clear every layer, keeping the buffers."""
        for layer in self._layers:
            layer.clear()

    def deallocate(self) -> None:
        """Free every layer's buffers, keeping the capacity."""
        for layer in self._layers:
            layer.deallocate()

    def crop(self, new_len: int) -> None:
        """Keep the first ``new_len`` positions of every layer (at most ``seq_len``)."""
        new_len = nonnegative_int(new_len, "new_len")
        if new_len > self.seq_len:
            raise InvalidArgumentError(
                f"new_len must be at most seq_len = {self.seq_len} (crop only shortens), "
                f"got {new_len}"
            )
        for layer in self._layers:
            layer.crop(new_len)

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions of every layer; return how many ``seq_len`` lost."""
        n = nonnegative_int(n, "n")
        before = self.seq_len
        for layer in self._layers:
            layer.trim(n)
        return before - self.seq_len

    def reorder(self, indices: Any) -> None:
        """:meth:`LayerKVCache.reorder` on every layer (checked once, before any moves)."""
        first = self._layers[0]
        first._indices(indices, first.batch)
        for layer in self._layers:
            layer.reorder(indices)

    def select(self, indices: Any) -> KVCache:
        """A new KVCache of :meth:`LayerKVCache.select` of every layer."""
        self._layers[0]._indices(indices, None)
        new = object.__new__(type(self))
        new._layers = [layer.select(indices) for layer in self._layers]
        return new

    def load_state(self, path: Any) -> None:
        """Replace every layer's positions with those saved at ``path`` (see nbkv.save).

        All layers are checked before any is written; see :func:`nbkv.persist.load_state`.
        """
        from .persist import load_state

        load_state(self, path)

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
