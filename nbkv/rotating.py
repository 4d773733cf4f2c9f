"""RotatingKVCache: a fixed window of the most recent positions, plus attention sinks.

Buffers hold ``window`` positions. The first ``sinks`` positions of the sequence are kept
forever in slots ``[0, sinks)`` (streaming LLMs attend to them heavily); every later
position ``p`` lives in ring slot ``sinks + (p - sinks) % (window - sinks)``, so the ring
keeps the last ``window - sinks`` positions and memory never grows.

Two counters, never one: ``offset`` is how many tokens the cache has seen (the position
a new token's rotary embedding uses) and ``seq_len`` how many rows it holds.
"""

from __future__ import annotations

from typing import Any

from . import layout as _layout
from ._validate import nonnegative_int, positive_int
from .cache import LayerKVCache
from .errors import InvalidArgumentError

__all__ = ["RotatingKVCache"]


class RotatingKVCache(LayerKVCache):
    """A layer cache of the last ``window - sinks`` positions and the first ``sinks``.

    Parameters
    ----------
    window : int
        Positions held at most (the buffers' capacity).
    sinks : int, default 0
        Leading positions kept forever; ``0 <= sinks < window``.
    batch, num_kv_heads, head_dim, dtype, device, layout
        As for :class:`LayerKVCache`.

    Notes
    -----
    ``append`` never overflows: an append of more than the ring holds keeps its last
    ``window - sinks`` positions (and any that are still sinks). ``get_kv`` returns the
    held positions in temporal order: views while the ring has not wrapped, a copy once it
    has. ``nbkv.attention`` reads the buffers in place for a decode step (one query, all
    held positions visible); other calls attend over the ordered copy. ``trim(n)`` drops
    held positions newest first (sinks last) and lowers ``offset`` by as many (see
    :meth:`trim` for drops that reach the sinks).

    Examples
    --------
    >>> import numpy as np, nbkv
    >>> cache = nbkv.RotatingKVCache(4, sinks=1)
    >>> for t in range(6):
    ...     x = np.full((1, 1, 1, 2), t, np.float32)
    ...     cache.append(x, x)
    >>> cache.offset, cache.seq_len, cache.get_kv()[0][0, 0, :, 0].tolist()
    (6, 4, [0.0, 3.0, 4.0, 5.0])
    """

    def __init__(self, window: int, *, sinks: int = 0, **kwargs: Any) -> None:
        window = positive_int(window, "window")
        sinks = nonnegative_int(sinks, "sinks")
        if sinks >= window:
            raise InvalidArgumentError(
                f"sinks must be smaller than window ({window}) so that a ring remains, got {sinks}"
            )
        for name in ("on_overflow", "grow_step", "max_seq_len"):
            if name in kwargs:
                raise InvalidArgumentError(
                    f"{name} does not apply to a RotatingKVCache (its capacity is window)"
                )
        self._window, self._sinks = window, sinks
        super().__init__(window, **kwargs)

    def _release(self) -> None:
        super()._release()
        self._offset = 0
        self._sink_count = 0  # sink slots holding data: positions [0, sink_count)
        self._ring_count = 0  # ring slots holding data: positions [offset - ring_count, offset)

    @property
    def window(self) -> int:
        return self._window

    @property
    def sinks(self) -> int:
        return self._sinks

    @property
    def offset(self) -> int:
        """Tokens seen: the position of the next token (for its rotary embedding)."""
        return self._offset

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + (
            f", window={self._window}, sinks={self._sinks}, offset={self._offset})"
        )

    # -- where positions live ----------------------------------------------------------

    @property
    def _ring(self) -> int:
        return self._window - self._sinks

    def _slot(self, p: int) -> int:
        return p if p < self._sinks else self._sinks + (p - self._sinks) % self._ring

    def _slots_in_use(self) -> int:
        return self._window if self._offset else 0

    def _copy_counters(self, other: LayerKVCache) -> None:
        super()._copy_counters(other)
        self._offset = other._offset
        self._sink_count, self._ring_count = other._sink_count, other._ring_count

    def _prefix(self) -> int | None:
        """``n`` if the held positions fill exactly slots ``[0, n)``, else None."""
        if self._ring_count == 0:
            return self._sink_count
        if self._sink_count != self._sinks:
            return None
        oldest = self._offset - self._ring_count
        if self._ring_count == self._ring or self._slot(oldest) == self._sinks:
            return self._sinks + self._ring_count
        return None

    def _pieces(self, start: int, stop: int):
        """Runs ``(first position, slot, length)`` of positions ``[start, stop)``, each
        contiguous in the buffers (a ring run is cut where it wraps)."""
        p = start
        while p < stop:
            slot = self._slot(p)
            end = self._sinks if p < self._sinks else self._sinks + self._ring
            length = min(stop - p, end - slot)
            yield p, slot, length
            p += length

    # -- the cache API -----------------------------------------------------------------

    def _check_room(self, n: int, start: int, what: str) -> None:
        """A rotating cache never overflows."""

    def append(self, k: Any, v: Any) -> None:
        """Write ``n`` new positions; of a long append only the positions kept are written."""
        k, v, d, dtype = self._check_append(k, v)
        n = d.seq
        if n == 0:
            return
        self._ensure_allocated(d, dtype)
        be = self._backend
        kk, vk = be.to_kernel(k), be.to_kernel(v)
        start = self._offset
        # positions that land in the ring: only the last `ring` of them survive
        ring_from = max(start, self._sinks, start + n - self._ring)
        for lo, hi in ((start, min(start + n, self._sinks)), (ring_from, start + n)):
            for p, slot, length in self._pieces(lo, hi):
                src = _layout.seq_index(self._layout, p - start, p - start + length)
                be.write_kv(self._layout, kk[src], vk[src], slot, self._kk, self._vk)
        self._offset = start + n
        if start < self._sinks:
            self._sink_count = min(start + n, self._sinks)
        ring_new = max(0, start + n - max(start, self._sinks))
        self._ring_count = min(self._ring, self._ring_count + ring_new)
        self._seq_len = self._sink_count + self._ring_count

    def get_kv(self):
        """The held positions in temporal order: views, or a copy once the ring wrapped."""
        if self._seq_len == 0:
            return None
        n = self._prefix()
        if n is not None and (self._ring_count == 0 or self._slot(self._offset - 1) == n - 1):
            index = _layout.seq_index(self._layout, 0, n)
            return self._k[index], self._v[index]
        return self._ordered()

    def _ordered(self):
        """A new pair of arrays holding the held positions in temporal order."""
        be = self._backend
        shape = _layout.buffer_shape(
            self._layout, self._batch, self._num_kv_heads, self._seq_len, self._head_dim
        )
        out_k, out_v = be.empty(shape, self._dtype), be.empty(shape, self._dtype)
        ok, ov = be.kernel_view(out_k), be.kernel_view(out_v)
        runs = [(0, self._sink_count), (self._offset - self._ring_count, self._offset)]
        at = 0
        for lo, hi in runs:
            for _, slot, length in self._pieces(lo, hi):
                src = _layout.seq_index(self._layout, slot, slot + length)
                be.write_kv(self._layout, self._kk[src], self._vk[src], at, ok, ov)
                at += length
        return out_k, out_v

    def _restore(self, offset: int, sink_count: int, k: Any, v: Any) -> None:
        """Hold rows ``k``, ``v`` (position order: ``sink_count`` sinks, then the ring's
        positions up to ``offset``) as a cache that has seen ``offset`` tokens. Checked
        by the caller (nbkv.persist); for loading a saved cache."""
        k, v, d, dtype = self._check_append(k, v)
        self._ensure_allocated(d, dtype)
        be = self._backend
        kk, vk = be.to_kernel(k), be.to_kernel(v)
        ring = d.seq - sink_count
        at = 0
        for lo, hi in ((0, sink_count), (offset - ring, offset)):
            for _, slot, length in self._pieces(lo, hi):
                src = _layout.seq_index(self._layout, at, at + length)
                be.write_kv(self._layout, kk[src], vk[src], slot, self._kk, self._vk)
                at += length
        self._offset, self._sink_count, self._ring_count = offset, sink_count, ring
        self._seq_len = d.seq

    def clear(self) -> None:
        """Forget every position (offset back to 0); keep the buffers."""
        self._seq_len = self._offset = self._sink_count = self._ring_count = 0

    def trim(self, n: int) -> int:
        """Drop the last ``n`` held positions, newest first and sinks last; return how many.

        Positions dropped from the ring lower ``offset`` by as many, so later appends
        continue from there (speculative decoding's rollback), also after the ring has
        wrapped. Once the ring is empty, drops come from the sinks; the cache then holds
        positions ``[0, sink_count)`` and nothing after them can come back (the ring had
        forgotten it), so ``offset`` falls to the sinks still held.
        """
        dropped = min(nonnegative_int(n, "n"), self._seq_len)
        from_ring = min(dropped, self._ring_count)
        self._ring_count -= from_ring
        self._offset -= from_ring
        if dropped > from_ring:
            self._sink_count -= dropped - from_ring
            self._offset = self._sink_count
        self._seq_len -= dropped
        return dropped

    def crop(self, new_len: int) -> None:
        """Keep ``new_len`` held positions, dropping the newest (``trim`` of the rest)."""
        new_len = nonnegative_int(new_len, "new_len")
        if new_len > self._seq_len:
            raise InvalidArgumentError(
                f"new_len must be at most seq_len = {self._seq_len} (crop only shortens), "
                f"got {new_len}"
            )
        self.trim(self._seq_len - new_len)

    def set_k(self, k: Any) -> None:
        raise InvalidArgumentError(
            "set_k is not available on a RotatingKVCache: use clear() then append(k, v)"
        )

    def set_v(self, v: Any) -> None:
        raise InvalidArgumentError(
            "set_v is not available on a RotatingKVCache: use clear() then append(k, v)"
        )

    # -- what nbkv.attention reads ------------------------------------------------------

    def _attention_view(self, n_q: int, window: int | None):
        """``(K, V, seq_len)`` for attention: the buffers in place when a decode step sees
        every held position (order does not matter to a softmax), else the ordered copy."""
        n = self._prefix()
        if n_q == 1 and n is not None and (window is None or window >= n):
            return self._k, self._v, n
        ordered = self._ordered()
        return ordered[0], ordered[1], self._seq_len
