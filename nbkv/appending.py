"""The append half of the cache protocol: check, stage and commit new positions, all or
nothing (see :mod:`nbkv.protocol`).

:class:`AppendMixin` is part of :class:`nbkv.BaseKVCache`: ``prepare_append`` makes every
check and changes nothing, ``stage_append`` makes every allocation (and copies the inputs
to the device) and changes nothing, ``commit_append`` writes and holds the positions and
cannot fail on memory; ``append`` is the three in a row. It works on the base's buffers
and counters, and each cache type adapts it through a few hooks (``_check_room``,
``_held_after``, ``_storage_for``) or overrides a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._validate import nonnegative_int
from .errors import InvalidArgumentError
from .protocol import AppendPlan, StagedAppend

__all__ = ["AppendMixin"]


class AppendMixin:
    """Appending new positions to one layer cache; mixed into BaseKVCache."""

    # -- the protocol: appending (see nbkv.protocol) ---------------------------------

    def check_room(self, n: int) -> None:
        """Raise :class:`~nbkv.CacheOverflowError` unless ``n`` more positions would fit."""
        self._check_room(nonnegative_int(n, "n"), "append")

    def prepare_append(self, k: Any, v: Any) -> AppendPlan:
        """Every check ``append(k, v)`` makes; changes nothing."""
        k, v, d, dtype = self._check_pair(k, v)
        self._check_room(d.seq, "append")
        return AppendPlan(k, v, d, dtype, self.offset, self._held_after(d.seq), self._stage_key())

    def _stage_key(self) -> tuple:
        """What a plan is valid for: this cache, its counters and its buffers."""
        return (id(self), self.offset, self._seq_len, self._max_seq_len, id(self._k))

    def _check_key(self, key: tuple, what: str) -> None:
        if key != self._stage_key():
            raise InvalidArgumentError(
                f"this {what} was made for another state of the cache (or another cache): "
                "it changed since; prepare the append again"
            )

    def write_slots(self):
        """None: this cache's positions are not contiguous slots (see the subclass)."""
        return None

    def _held_after(self, n: int) -> int:
        """Hook: positions held after an append of ``n``."""
        return self._seq_len + n

    def stage_append(self, plan: AppendPlan) -> StagedAppend:
        """Allocate what the append needs (and copy new inputs to the device), changing
        nothing; ``fused`` gives the buffers and slot a fused kernel writes."""
        self._check_key(plan.key, "plan")
        storage = self._storage_for(plan)
        be = self._backend
        k, v = be.to_device(plan.k), be.to_device(plan.v)
        if storage is not None:
            fused = (storage.k, storage.v, self._seq_len)
        else:
            fused = None if self._k is None else (self._k, self._v, self._seq_len)
        return StagedAppend(plan, k, v, fused, storage, plan.key)

    def commit_append(
        self, staged: StagedAppend, *, written: bool = False, undoable: bool = False
    ) -> Callable[[], None] | None:
        """Write the staged positions after those held (unless a fused kernel has,
        ``written=True``) and hold them. With ``undoable``, return what puts it back."""
        self._check_key(staged.key, "staged append")
        n = staged.plan.dims.seq
        held, capacity = self._seq_len, self._max_seq_len
        old = self._current_storage() if undoable and staged.storage is not None else None
        if staged.storage is not None:
            self._install(staged.storage)
        if n and not written:
            be = self._backend
            be.write_kv(
                be.kernel_view(staged.k), be.kernel_view(staged.v), held, self._kk, self._vk
            )
        self._seq_len = held + n
        if not undoable:
            return None

        def undo() -> None:
            # rows past the old seq_len were never visible, so the cursor (and the old
            # buffers, after a growth) is all there is to restore
            if staged.storage is not None:
                if old is None:
                    self._release()
                    self._max_seq_len = capacity  # a lazy cache's growth, undone too
                else:
                    self._install(old)
            self._seq_len = held

        return undo

    def append(self, k: Any, v: Any, *, undoable: bool = False) -> Callable[[], None] | None:
        """Write ``n`` new positions after those held (see the subclass for details).

        With ``undoable=True``, return a function that puts the cache back as it was
        before this append (what a caller that may fail later, as a model's forward
        pass, keeps); else ``None``.
        """
        return self.commit_append(self.stage_append(self.prepare_append(k, v)), undoable=undoable)
