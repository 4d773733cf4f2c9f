"""RotatingKVCache: a fixed window of the most recent positions, plus attention sinks.

Buffers hold ``window`` positions. The first ``sinks`` positions of the sequence are kept
forever in slots ``[0, sinks)`` (streaming LLMs attend to them heavily); every later
position ``p`` lives in ring slot ``sinks + (p - sinks) % (window - sinks)``, so the ring
keeps the last ``window - sinks`` positions and memory never grows.

Two counters, never one: ``offset`` is how many tokens the cache has seen (the position
a new token's rotary embedding uses) and ``seq_len`` how many rows it holds.

It is a sibling of :class:`nbkv.LayerKVCache` on :class:`nbkv.BaseKVCache`, overriding
the protocol where a ring differs: where an append writes, what attention reads, what a
saved state holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _format
from . import layout as _layout
from ._validate import nonnegative_int, positive_int
from .base import BaseKVCache
from .errors import CacheFormatError, InvalidArgumentError
from .protocol import AppendPlan, AttentionView, StagedAppend, register_cache_type

__all__ = ["RotatingKVCache"]


@register_cache_type("RotatingKVCache")
class RotatingKVCache(BaseKVCache):
    """A layer cache of the last ``window - sinks`` positions and the first ``sinks``.

    Parameters
    ----------
    window : int
        Positions held at most (the buffers' capacity, ``max_seq_len``).
    sinks : int, default 0
        Leading positions kept forever; ``0 <= sinks < window``.
    batch, num_kv_heads, head_dim, dtype, device, layout
        As for :class:`nbkv.LayerKVCache`.

    Notes
    -----
    ``append`` never overflows: an append of more than the ring holds keeps its last
    ``window - sinks`` positions (and any that are still sinks). ``get_kv`` returns the
    held positions in temporal order: views of the buffers until the ring wraps (more
    tokens seen than the window holds), a new copy after. ``nbkv.attention`` reads the
    buffers in place for a decode step (one query, all held positions visible); other
    calls attend over the ordered copy. ``trim(n)`` drops held positions newest first
    (sinks last) and lowers ``offset`` by as many (see :meth:`trim` for drops that reach
    the sinks).

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

    def __init__(
        self,
        window: int,
        *,
        sinks: int = 0,
        batch: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: Any = None,
        device: str = "cpu",
        layout: str = "bhsd",
        **others: Any,
    ) -> None:
        if others:
            raise InvalidArgumentError(
                f"{', '.join(sorted(others))} does not apply to a RotatingKVCache (its capacity "
                f"is window, it never overflows nor grows)"
            )
        window = positive_int(window, "window")
        sinks = nonnegative_int(sinks, "sinks")
        if sinks >= window:
            raise InvalidArgumentError(
                f"sinks must be smaller than window ({window}) so that a ring remains, got {sinks}"
            )
        self._window, self._sinks = window, sinks
        super().__init__(
            window,
            batch=batch,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            layout=layout,
        )

    def _reset_counters(self) -> None:
        self._seq_len = 0
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

    def _repr_extra(self) -> str:
        return f", window={self._window}, sinks={self._sinks}, offset={self._offset}"

    # -- where positions live ----------------------------------------------------------

    @property
    def _ring(self) -> int:
        return self._window - self._sinks

    def _slot(self, p: int) -> int:
        return p if p < self._sinks else self._sinks + (p - self._sinks) % self._ring

    def _slots_in_use(self) -> int:
        return self._window if self._offset else 0

    def _copy_counters(self, other: BaseKVCache) -> None:
        self._seq_len, self._offset = other._seq_len, other._offset
        self._sink_count, self._ring_count = other._sink_count, other._ring_count

    def _wrapped(self) -> bool:
        """Whether positions no longer sit at their own slot (the ring has come round)."""
        return self._offset > self._window

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

    def _runs(self, start: int, n: int):
        """Position runs an append of ``n`` at ``start`` writes: the sinks it reaches, and
        the last ``ring`` positions that land in the ring (the others would be overwritten
        within the same append)."""
        ring_from = max(start, self._sinks, start + n - self._ring)
        return ((start, min(start + n, self._sinks)), (ring_from, start + n))

    # -- the protocol: appending -------------------------------------------------------

    def _check_room(self, n: int, what: str) -> None:
        """A ring never overflows."""

    def _held_after(self, n: int) -> int:
        # the sinks held are all the sinks seen, so the rows fill up to the window
        return min(self._seq_len + n, self._window)

    def stage_append(self, plan: AppendPlan) -> StagedAppend:
        """Allocate (a lazy cache's first buffers), copy inputs to the device; no fused
        write: new positions land in ring slots, not in one contiguous run."""
        staged = super().stage_append(plan)
        return staged._replace(fused=None)

    def _written_slots(self, start: int, n: int) -> list[tuple[int, int]]:
        """``(slot, length)`` runs an append of ``n`` at ``start`` writes (held or not)."""
        return [
            (slot, length)
            for lo, hi in self._runs(start, n)
            for _, slot, length in self._pieces(lo, hi)
        ]

    def commit_append(
        self, staged: StagedAppend, *, written: bool = False, undoable: bool = False
    ) -> Callable[[], None] | None:
        """Write the staged positions into their slots (only those kept) and count them.

        With ``undoable``, the rows about to be overwritten are saved first (at most
        ``window - sinks`` rows) and the returned function puts them and the counters back.
        """
        if written:
            raise InvalidArgumentError("a ring takes no fused write: stage_append gave none")
        self._check_key(staged.key, "staged append")
        n = staged.plan.dims.seq
        counters = (self._seq_len, self._offset, self._sink_count, self._ring_count)
        old = self._current_storage()
        saved = self._save_rows(self._written_slots(self._offset, n)) if undoable and old else []
        if staged.storage is not None:
            self._install(staged.storage)
        if n:
            self._write_positions(staged, n)
        if not undoable:
            return None

        def undo() -> None:
            if staged.storage is not None and old is None:
                self._release()
                return
            be = self._backend
            for slot, (k, v) in saved:
                be.write_kv(k, v, slot, self._kk, self._vk)
            self._seq_len, self._offset, self._sink_count, self._ring_count = counters

        return undo

    def _save_rows(self, runs: list[tuple[int, int]]) -> list:
        """Copies of the rows in ``runs`` (allocated before anything is written)."""
        be = self._backend
        saved = []
        for slot, length in runs:
            index = _layout.seq_index(self._layout, slot, slot + length)
            shape = _layout.buffer_shape(
                self._layout, self._batch, self._num_kv_heads, length, self._head_dim
            )
            k, v = (be.kernel_view(be.empty(shape, self._dtype)) for _ in "kv")
            be.write_kv(self._kk[index], self._vk[index], 0, k, v)
            saved.append((slot, (k, v)))
        return saved

    def _write_positions(self, staged: StagedAppend, n: int) -> None:
        be = self._backend
        kk, vk = be.kernel_view(staged.k), be.kernel_view(staged.v)
        start = self._offset
        for lo, hi in self._runs(start, n):
            for p, slot, length in self._pieces(lo, hi):
                src = _layout.seq_index(self._layout, p - start, p - start + length)
                be.write_kv(kk[src], vk[src], slot, self._kk, self._vk)
        self._offset = start + n
        if start < self._sinks:
            self._sink_count = min(start + n, self._sinks)
        ring_new = max(0, start + n - max(start, self._sinks))
        self._ring_count = min(self._ring, self._ring_count + ring_new)
        self._seq_len = self._sink_count + self._ring_count

    def append(self, k: Any, v: Any, *, undoable: bool = False) -> Callable[[], None] | None:
        """Write ``n`` new positions; of a long append only the positions kept are written.

        ``undoable`` as for :meth:`nbkv.LayerKVCache.append` (the rows overwritten are
        saved first, so the undo puts them back).
        """
        return self.commit_append(self.stage_append(self.prepare_append(k, v)), undoable=undoable)

    # -- views -----------------------------------------------------------------------

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

    def get_kv(self):
        """The held positions in temporal order: views until the ring wraps, a new copy
        (of ``seq_len`` positions) after."""
        if self._seq_len == 0:
            return None
        n = self._prefix()
        if n is not None and not self._wrapped():
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
                be.write_kv(self._kk[src], self._vk[src], at, ok, ov)
                at += length
        return out_k, out_v

    def attention_view(self, n_q: int, window: int | None) -> AttentionView:
        """The buffers in place when a decode step sees every held position (order does
        not matter to a softmax), else the ordered copy."""
        if self._seq_len == 0:
            raise self._no_positions()
        # the first query of a chunk sees the ring's span (or a narrower window) back
        # from itself: the ring must still hold that, not have overwritten it
        oldest = self._offset - self._ring_count  # the oldest ring position held
        span = self._ring if window is None else min(window, self._ring)
        needs = max(self._sinks, self._offset - n_q - span + 1)
        if n_q > 1 and self._ring_count and oldest > needs:
            raise InvalidArgumentError(
                f"a chunk of {n_q} queries over this ring would miss positions it has "
                f"overwritten: it holds positions from {oldest} on, and its first query "
                f"needs them from {needs}; once a ring is full, give it one token a step"
            )
        n = self._prefix()
        be = self._backend
        if n_q == 1 and n is not None and (window is None or window >= n):
            k, v, held = self._k, self._v, n
        else:
            (k, v), held = self._ordered(), self._seq_len
        dims = _layout.Dims(self._batch, self._num_kv_heads, held, self._head_dim)
        return AttentionView(
            be, be.attention_form(k), be.attention_form(v), held, dims, self._dtype
        )

    # -- sequence management -----------------------------------------------------------

    def offset_after_trim(self, n: int) -> int:
        """The ``offset`` that ``trim(n)`` would leave (nothing changes)."""
        dropped = min(nonnegative_int(n, "n"), self._seq_len)
        from_ring = min(dropped, self._ring_count)
        if dropped > from_ring:
            return self._sink_count - (dropped - from_ring)
        return self._offset - from_ring

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

    def _meta(self) -> dict:
        meta = super()._meta()
        meta.update(
            window=self._window,
            sinks=self._sinks,
            offset=self._offset,
            sink_count=self._sink_count,
        )
        return meta

    @classmethod
    def _read_meta(cls, m: _format.MetaReader) -> dict:
        window, sinks = m.int("window", minimum=1), m.int("sinks", minimum=0)
        if sinks >= window:
            raise m.fail(f"sinks {sinks} must be smaller than window {window}")
        return {"window": window, "sinks": sinks}

    @classmethod
    def _check_counts(cls, m: _format.MetaReader, args: dict, held: int) -> None:
        window, sinks = args["window"], args["sinks"]
        offset, sink_count = m.int("offset", minimum=0), m.int("sink_count", minimum=0)
        ring = held - sink_count
        # the sinks held are all the sinks seen (a trim into the sinks lowers offset to
        # them); the ring holds positions [offset - ring, offset), all after the sinks
        if not (
            sink_count == min(sinks, offset)
            and 0 <= ring <= window - sinks
            and offset >= held
            and (ring == 0 or offset - ring >= sinks)
        ):
            raise m.fail(
                f"window {window}, sinks {sinks}, sink_count {sink_count}, seq_len {held} "
                f"and offset {offset} do not describe a rotating cache"
            )

    def _check_import(self, args: dict, held: int, where: str) -> None:
        if (args["window"], args["sinks"]) != (self._window, self._sinks):
            raise CacheFormatError(
                f"{where} holds a rotating cache of window {args['window']} and sinks "
                f"{args['sinks']}, but this one has window {self._window} and sinks {self._sinks}"
            )

    _rows_in_order = False  # rows go to ring slots

    def _write_rows(self, meta: dict, kk: Any, vk: Any) -> None:
        """Rows in position order (the sinks held, then the ring's oldest first) into
        the slots a cache that has seen ``offset`` tokens keeps them in."""
        be = self._backend
        sink_count, offset = meta["sink_count"], meta["offset"]
        ring = kk.shape[be.seq_axis] - sink_count
        at = 0
        for lo, hi in ((0, sink_count), (offset - ring, offset)):
            for _, slot, length in self._pieces(lo, hi):
                src = _layout.seq_index(self._layout, at, at + length)
                be.write_kv(kk[src], vk[src], slot, self._kk, self._vk)
                at += length

    def _set_counters(self, meta: dict, held: int) -> None:
        self._offset, self._sink_count = meta["offset"], meta["sink_count"]
        self._ring_count = held - meta["sink_count"]
        self._seq_len = held
