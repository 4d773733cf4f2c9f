"""The append half of :class:`nbkv.QuantizedKVCache`'s cache protocol: check the values
(codes cannot hold NaN, infinity or values past the scales' reach), allocate after a
``deallocate``, quantize the groups that leave the window and put the new positions in it,
all or nothing (see :mod:`nbkv.protocol`).

:class:`QuantAppendMixin` is part of :class:`nbkv.QuantizedKVCache`, ahead of
:class:`nbkv.BaseKVCache`, whose checks ``prepare_append`` extends. It works on the
cache's sizes, arrays (``_st``), counters (``_seq_len``, ``_q_len``), quantizer settings
(``_bits``, ``_group``, ``_v_group``, ``_residual``, ``_kind``, ``_limit``, ``_table``) and
kernels (``_qbe``), all set in ``QuantizedKVCache.__init__`` and ``_install``, and on its
storage methods (``_new_storage``, ``_install``, ``_current_storage``, ``_release``,
``_ring_ranges``, ``_inner``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import InvalidArgumentError
from .protocol import AppendPlan, StagedAppend
from .quant_state import Store

__all__ = ["QuantAppendMixin"]


class QuantAppendMixin:
    """Appending to a quantized layer (the protocol's append half); mixed into
    QuantizedKVCache."""

    # -- appending (the protocol) ----------------------------------------------------

    def _next_q(self, q_len: int, total: int) -> int:
        """Codes held once ``total`` positions are: whole groups leave the window while
        it would hold at least ``residual + G``."""
        g = self._group
        return q_len + g * max(0, (total - q_len - self._residual) // g)

    def _check_values(self, x: Any, name: str) -> None:
        """Host K/V must be finite and within the scales' reach (codes cannot hold more)."""
        if not isinstance(x, np.ndarray) or x.size == 0:
            return  # device arrays are not scanned (see QuantizedKVCache's docstring)
        top = float(np.abs(x).max())  # one pass: NaN and inf make it fail below too
        if not top <= self._limit:
            what = "NaN or infinity" if not np.isfinite(top) else f"{top:g}"
            raise InvalidArgumentError(
                f"{name} holds {what}, which a quantized cache cannot store: values must be "
                f"finite and within the {self._limit:g} its 16-bit scales reach"
            )

    def prepare_append(self, k: Any, v: Any) -> AppendPlan:
        """Every check ``append(k, v)`` makes, values included; changes nothing."""
        plan = super().prepare_append(k, v)
        self._check_values(plan.k, "k")
        self._check_values(plan.v, "v")
        return plan

    def _storage_for(self, plan: AppendPlan) -> Store | None:
        if self._st is not None or plan.dims.seq == 0:
            return None
        return self._new_storage(self._configured, self._max_seq_len)

    def stage_append(self, plan: AppendPlan) -> StagedAppend:
        """Allocate what the append needs (after ``deallocate``) and copy the inputs to the
        device, changing nothing. ``fused`` is None: codes are no slots a kernel fills."""
        self._check_key(plan.key, "plan")
        storage = self._storage_for(plan)
        be = self._backend
        k, v = be.to_device(plan.k), be.to_device(plan.v)
        return StagedAppend(plan, k, v, None, storage, plan.key)

    def _save_slots(self, ranges: list[tuple[int, int]]) -> list:
        """Copies of the window rows at ``ranges`` (what an undo puts back)."""
        be, st = self._inner, self._st
        saved = []
        for a, b, _ in ranges:
            shape = (self._batch, self._num_kv_heads, b - a, self._head_dim)
            ks, vs = (be.kernel_view(be.empty(shape, self._dtype)) for _ in "kv")
            be.write_kv(st.k_win[:, :, a:b], st.v_win[:, :, a:b], 0, ks, vs)
            saved.append((a, ks, vs))
        return saved

    def commit_append(
        self, staged: StagedAppend, *, written: bool = False, undoable: bool = False
    ) -> Callable[[], None] | None:
        """Quantize the groups that leave the window and put the new positions in it;
        with ``undoable``, return what puts the cache back (the window rows it
        overwrites are copied first)."""
        self._check_key(staged.key, "staged append")
        if written:
            raise InvalidArgumentError(
                "a quantized cache writes its own positions: commit_append(written=True) "
                "has no fused kernel to rely on"
            )
        n = staged.plan.dims.seq
        held, q_len, capacity = self._seq_len, self._q_len, self._max_seq_len
        old = self._current_storage() if undoable and staged.storage is not None else None
        if staged.storage is not None:
            self._install(staged.storage)
        total = held + n
        new_q = self._next_q(q_len, total)
        saved = self._save_slots(self._ring_ranges(max(new_q, held), total)) if undoable else []
        if n:
            be = self._backend
            self._qbe.append(
                be.kernel_view(staged.k), be.kernel_view(staged.v), held, q_len, new_q,
                self._bits, self._group, self._v_group, self._kind, self._table, self._st,
            )  # fmt: skip
        self._seq_len, self._q_len = total, new_q
        if not undoable:
            return None

        def undo() -> None:
            if staged.storage is not None:
                if old is None:
                    self._release()
                    self._max_seq_len = capacity
                else:
                    self._install(old)
            else:
                for a, ks, vs in saved:
                    self._inner.write_kv(ks, vs, a, self._st.k_win, self._st.v_win)
            self._seq_len, self._q_len = held, q_len

        return undo
