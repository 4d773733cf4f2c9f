"""LayerKVCache: one attention layer's K and V, positions in order, a cursor and a capacity.

The reference runtime's per-layer cache (``new``, ``with_capacity``, ``append``,
``get_kv``, ``clear``, ``deallocate``, the deprecated ``k``/``v``/``set_k``/``set_v``),
its flaws fixed, plus rollback (``crop``, ``trim``) and growth (``on_overflow="grow"``).
What it shares with the ring of :mod:`nbkv.rotating` lives in :mod:`nbkv.base`.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _format
from . import layout as _layout
from ._validate import nonnegative_int, positive_int
from .base import BaseKVCache, Storage
from .errors import CacheOverflowError, InvalidArgumentError, ShapeMismatchError
from .protocol import AppendPlan, register_cache_type

__all__ = ["DEFAULT_MAX_SEQ_LEN", "DEFAULT_GROW_STEP", "LayerKVCache"]

DEFAULT_MAX_SEQ_LEN = 2048
DEFAULT_GROW_STEP = 256
OVERFLOW_POLICIES = ("error", "grow")

_ndarray = np.ndarray


@register_cache_type("LayerKVCache")
class LayerKVCache(BaseKVCache):
    """Keys and values of one attention layer, in preallocated buffers.

    Buffers have shape ``[batch, num_kv_heads, max_seq_len, head_dim]`` (layout "bhsd",
    the default) or ``[batch, max_seq_len, num_kv_heads, head_dim]`` (layout "bshd").
    ``append`` writes new positions in place; ``get_kv`` returns views of the
    ``seq_len`` positions held.

    Parameters
    ----------
    max_seq_len : int, default DEFAULT_MAX_SEQ_LEN (2048)
        Capacity in positions (at most 2**31 - 1). Fixed unless ``on_overflow="grow"``.
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
    on_overflow : {"error", "grow"}
        What an append past the capacity does: raise :class:`~nbkv.CacheOverflowError`,
        or reallocate to the next multiple of ``grow_step`` and copy the positions held.
    grow_step : int, default DEFAULT_GROW_STEP (256)

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError
        A size that is not a positive int, an unknown layout, device or policy; buffers
        larger than the machine can address.
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
        if not isinstance(on_overflow, str) or on_overflow not in OVERFLOW_POLICIES:
            raise InvalidArgumentError(
                f"on_overflow must be one of {OVERFLOW_POLICIES}, got {on_overflow!r}"
            )
        self._on_overflow = on_overflow
        self._grow_step = positive_int(grow_step, "grow_step")
        self._fast = None  # see append()
        self._slots = None  # see write_slots(): a weak reference to them
        super().__init__(
            max_seq_len,
            batch=batch,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            layout=layout,
        )

    # -- the reference API's constructors ------------------------------------------

    @classmethod
    def new(cls) -> LayerKVCache:
        """A lazy cache of capacity DEFAULT_MAX_SEQ_LEN (the reference's ``new()``)."""
        return cls()

    @classmethod
    def with_capacity(cls, max_seq_len: int, **kwargs: Any) -> LayerKVCache:
        """A cache of capacity ``max_seq_len``; lazy unless ``kwargs`` fix every size."""
        return cls(max_seq_len, **kwargs)

    @property
    def on_overflow(self) -> str:
        """ "error" (an append past capacity raises) or "grow" (capacity grows)."""
        return self._on_overflow

    @property
    def grow_step(self) -> int:
        """Positions a growth rounds the capacity up to a multiple of."""
        return self._grow_step

    # -- hooks of the base -----------------------------------------------------------

    def _release(self) -> None:
        super()._release()
        self._forget_buffers()

    def _storage_changed(self) -> None:
        self._forget_buffers()

    def _forget_buffers(self) -> None:
        """Drop what points at the buffers: the append's fast path and the slots."""
        self._fast = None
        slots = self._live_slots()
        if slots is not None and slots.owner is self:  # a copy starts from our __dict__
            slots._drop()  # stale, and holding the buffers no longer (deallocate frees)
        self._slots = None

    def _check_room(self, n: int, what: str) -> None:
        if self._on_overflow != "grow":
            super()._check_room(n, what)

    def _grown_capacity(self, needed: int) -> int:
        """The capacity that holds ``needed``: the current one, or the next multiple of
        ``grow_step`` above it."""
        if needed <= self._max_seq_len:
            return self._max_seq_len
        return -(-needed // self._grow_step) * self._grow_step

    def _grown(self, needed: int, sizes: tuple) -> Storage | None:
        """New buffers of the next multiple of ``grow_step`` that holds ``needed``, with
        the positions held copied in, or None when they fit. The cache is unchanged: if
        the allocation fails, capacity, buffers and data are as they were."""
        if needed <= self._max_seq_len:
            return None
        st = self._new_storage(sizes, self._grown_capacity(needed))
        held = self._seq_len
        if self._k is not None and held:
            index = _layout.seq_index(self._layout, 0, held)
            self._backend.write_kv(self._kk[index], self._vk[index], 0, st.kk, st.vk)
        return st

    def _storage_for(self, plan: AppendPlan) -> Storage | None:
        d = plan.dims
        if d.seq == 0 or (self._k is not None and self._seq_len + d.seq <= self._max_seq_len):
            return None  # the decode loop's case: the buffers hold it
        sizes = (d.batch, d.num_kv_heads, d.head_dim, plan.dtype)
        grown = self._grown(self._seq_len + d.seq, sizes)
        return grown if grown is not None else super()._storage_for(plan)

    # -- the reference API -----------------------------------------------------------

    def append(self, k: Any, v: Any, *, undoable: bool = False) -> Callable[[], None] | None:
        """Write ``n`` new positions of keys and values after the ``seq_len`` held.

        Parameters
        ----------
        k, v : arrays of shape [batch, num_kv_heads, n, head_dim] (in the cache's layout)
            Any strides. On a CUDA cache: device arrays (Numba, CuPy, torch: anything
            with ``__cuda_array_interface__``, no copy) or host arrays (copied once).
        undoable : bool, default False
            Return a function that puts the cache back as it was before this append
            (cursor, and buffers after a growth), for a caller that may fail later.

        Returns
        -------
        None, or with ``undoable`` the undo function.

        Raises
        ------
        ArgumentTypeError, ShapeMismatchError, DTypeMismatchError, DeviceMismatchError
            Input that is not an array, not 4-D, k and v disagreeing, or not fitting the
            buffers.
        CacheOverflowError
            ``seq_len + n > max_seq_len``; the message says how many positions are free.
        """
        # Fast path for the decode loop: arrays of the backend's own class (host arrays on
        # the CPU, Numba device arrays on CUDA) of the very shape and dtype the last append
        # validated need only the room check; written to the buffers in the form the
        # kernels take (16-bit data seen as uint16 bits on the CPU, float16 as it is on
        # CUDA, where a Numba view costs microseconds). Anything else takes every check.
        pos = self._seq_len
        fast = self._fast
        if fast is not None:
            kind, shape, dtype, last_pos, n, write, k_buf, v_buf, bits = fast
            if (
                type(k) is kind
                and type(v) is kind
                and k.shape == shape
                and v.shape == shape
                and k.dtype is dtype
                and v.dtype is dtype
                and pos <= last_pos
            ):
                if bits is None:
                    write(k, v, pos, k_buf, v_buf)
                else:
                    write(k.view(bits), v.view(bits), pos, k_buf, v_buf)
                self._seq_len = pos + n
                return self._back_to(pos) if undoable else None
        plan = self.prepare_append(k, v)
        undo = self.commit_append(self.stage_append(plan), undoable=undoable)
        be = self._backend
        k, n = plan.k, plan.dims.seq
        kind = be.array_type
        if n and type(k) is kind and type(plan.v) is kind and k.dtype == plan.v.dtype:
            k_buf, v_buf = be.attention_form(self._k), be.attention_form(self._v)
            bits = None if k.dtype == k_buf.dtype else k_buf.dtype
            last_pos = self._max_seq_len - n
            self._fast = (kind, k.shape, k.dtype, last_pos, n, be.write_kv, k_buf, v_buf, bits)
        return undo

    def write_slots(self) -> _Slots | None:
        """The buffers as slots for a caller's kernel that writes new positions itself.

        What :class:`nbkv.DecodeStep` binds to (the protocol's optional ``write_slots``,
        :mod:`nbkv.protocol`): ``k``, ``v`` (the buffers in the attention kernels' form),
        ``capacity``, ``held()``, ``commit(pos, n)`` and ``valid``, which turns False (and
        the slots let go of the buffers) once the cache replaces or drops its buffers.

        Returns
        -------
        The slots, or None while the cache has no buffers. While anyone holds them and
        they are valid, every call returns the same object (the cache holds it weakly).

        Examples
        --------
        >>> import numpy as np, nbkv
        >>> cache = nbkv.LayerKVCache(4, batch=1, num_kv_heads=1, head_dim=2, dtype="float32")
        >>> slots = cache.write_slots()
        >>> slots.k[0, 0, 0] = 1.0  # as a kernel would write position 0
        >>> slots.commit(slots.held(), 1)
        >>> cache.seq_len, cache.get_kv()[0][0, 0, 0].tolist()
        (1, [1.0, 1.0])
        >>> cache.deallocate()
        >>> slots.valid, slots.k is None
        (False, True)
        """
        slots = self._live_slots()
        if slots is not None and slots.valid and slots.owner is self:
            return slots
        self._slots = None
        if self._k is None:
            return None
        be = self._backend
        k, v = be.attention_form(self._k), be.attention_form(self._v)
        slots = _Slots(self, k, v, self._max_seq_len)
        self._slots = weakref.ref(slots)  # the slots hold the cache: no cycle back
        return slots

    def _live_slots(self) -> _Slots | None:
        ref = self.__dict__.get("_slots")  # absent while the base initialises
        return None if ref is None else ref()

    def _hold(self, slots: _Slots, pos: int, n: int) -> None:
        """``slots.commit``: hold ``n`` positions a kernel wrote at ``pos``."""
        if slots is not self._live_slots() or not slots.valid:
            raise InvalidArgumentError(
                "these write slots were made for buffers this cache has since replaced or "
                "dropped; ask write_slots() again"
            )
        if pos != self._seq_len or n < 0 or pos + n > self._max_seq_len:
            raise InvalidArgumentError(
                f"commit(pos={pos}, n={n}): the cache holds {self._seq_len} of "
                f"{self._max_seq_len} positions, so the next n positions go at pos = "
                f"{self._seq_len}, and at most {self._max_seq_len - self._seq_len} fit"
            )
        self._seq_len = pos + n

    def _back_to(self, held: int) -> Callable[[], None]:
        def undo() -> None:  # the fast path never grows: the cursor is all there is
            self._seq_len = held

        return undo

    # -- sequence management -----------------------------------------------------------

    def offset_after_trim(self, n: int) -> int:
        """The ``offset`` (here ``seq_len``) that ``trim(n)`` would leave; nothing changes."""
        return self._seq_len - min(nonnegative_int(n, "n"), self._seq_len)

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

    # -- state (nbkv.protocol) -----------------------------------------------------------

    def _meta(self) -> dict:
        meta = super()._meta()
        meta.update(
            max_seq_len=self._max_seq_len,
            on_overflow=self._on_overflow,
            grow_step=self._grow_step,
        )
        return meta

    @classmethod
    def _read_meta(cls, m: _format.MetaReader) -> dict:
        return {
            "max_seq_len": m.int("max_seq_len", minimum=1),
            "on_overflow": m.choice("on_overflow", OVERFLOW_POLICIES),
            "grow_step": m.int("grow_step", minimum=1),
        }

    @classmethod
    def _check_counts(cls, m: _format.MetaReader, args: dict, held: int) -> None:
        if held > args["max_seq_len"]:
            raise m.fail(f"seq_len {held} is more than its max_seq_len {args['max_seq_len']}")

    def _check_import(self, args: dict, held: int, where: str) -> None:
        if held > self._max_seq_len and self._on_overflow != "grow":
            raise CacheOverflowError(
                f"{where} holds {held} positions, more than this cache's capacity "
                f"max_seq_len = {self._max_seq_len}; build it with max_seq_len >= {held} "
                "or on_overflow='grow'"
            )

    def _capacity_for(self, held: int) -> int:
        return self._grown_capacity(held) if self._on_overflow == "grow" else self._max_seq_len

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

    def _set(self, x: Any, name: str):
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
        if d.seq > self._max_seq_len and self._on_overflow != "grow":
            raise CacheOverflowError(
                f"set_k of {d.seq} positions does not fit: the cache holds "
                f"{self._max_seq_len} positions at most; build it with max_seq_len >= {d.seq}"
            )
        sizes = (d.batch, d.num_kv_heads, d.head_dim, dtype)
        storage = self._grown(d.seq, sizes)
        if storage is None and self._k is None:
            storage = self._new_storage(sizes, self._max_seq_len)
        be = self._backend
        x = be.to_kernel(arr) if d.seq else None  # the host->device copy, before any change
        if storage is not None:
            self._install(storage)
        if d.seq:
            be.write_cache(x, 0, self._kk)
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
            self._backend.write_cache(self._backend.to_kernel(arr), 0, self._vk)


class _Slots:
    """A LayerKVCache's buffers as slots (:class:`nbkv.protocol.WriteSlots`)."""

    __slots__ = ("owner", "k", "v", "capacity", "_valid", "__weakref__")

    def __init__(self, owner: LayerKVCache, k: Any, v: Any, capacity: int) -> None:
        self.owner, self.k, self.v, self.capacity, self._valid = owner, k, v, capacity, True

    @property
    def valid(self) -> bool:
        """False once the cache replaced or dropped these buffers."""
        return self._valid

    def _drop(self) -> None:
        self._valid = False
        self.k = self.v = None

    def held(self) -> int:
        """Positions held: the next one is written there."""
        return self.owner.seq_len

    def commit(self, pos: int, n: int) -> None:
        """Hold ``n`` positions a kernel wrote at ``[pos, pos + n)``."""
        self.owner._hold(self, pos, n)

    def __repr__(self) -> str:
        state = "valid" if self.valid else "stale"
        return f"<write slots of a LayerKVCache, capacity {self.capacity}, {state}>"
