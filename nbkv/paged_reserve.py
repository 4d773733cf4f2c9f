"""The step half of :class:`nbkv.PagedKVCache`: ``reserve`` (room for the next positions
of the sequences named, all or nothing), ``blocks_needed`` (what it would take, nothing
changed) and ``check_step`` (is a step this cache's and still valid).

:class:`PagedReserveMixin` is part of :class:`nbkv.PagedKVCache`: it works on the cache's
sizes, kernel-form pools, backend and block pool, and on its sequences, version and the
blocks a step fills (``_seqs``, ``_version``, ``_uid``, ``_pending``, ``_root``, with
``_seq`` and ``_changed``), all set in ``PagedKVCache.__init__``. A reservation is planned
(every check, nothing changed), counted (new blocks and copies on write), then committed:
the step's arrays (:class:`nbkv.paged_step.PagedStep`) and the copies on write are made
first, the tables and counters changed last. Also here: a sequence's record (``_Seq``) and
the checks of the token ids a sequence is given.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._blocks import block_key
from .errors import ArgumentTypeError, InvalidArgumentError, OutOfBlocksError, StaleStepError
from .paged_step import PagedStep

__all__ = ["PagedReserveMixin"]


@dataclass
class _Seq:
    # its block table: int32, replaced as a whole, never written in place
    blocks: np.ndarray
    seq_len: int = 0
    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    keys: list[bytes] = field(default_factory=list)  # the prefix key of each full block


def _count_or_tokens(value: Any, sid: int) -> tuple[int, np.ndarray | None]:
    """A reserve entry: a count (int >= 1) or token ids (1-D integer array, >= 1 long)."""
    if type(value) is int and value >= 1:  # the common case, without the ABC checks below
        return value, None
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"reserve[{sid}] must be a count (int) or token ids, got bool")
    if isinstance(value, numbers.Integral):
        if value < 1:
            raise InvalidArgumentError(f"reserve[{sid}] must be a count >= 1, got {value}")
        return int(value), None
    tokens = _tokens(value, f"reserve[{sid}]")
    return len(tokens), tokens


def _tokens(value: Any, name: str) -> np.ndarray:
    if isinstance(value, (str, bytes, float, numbers.Real)) or value is None:
        raise ArgumentTypeError(
            f"{name} must be a 1-D integer array of token ids, got {type(value).__name__}"
        )
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as err:
        raise ArgumentTypeError(
            f"{name} must be a 1-D integer array of token ids ({err})"
        ) from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ArgumentTypeError(
            f"{name} must be a 1-D integer array of token ids, got dtype {arr.dtype}, "
            f"shape {arr.shape}"
        )
    if arr.size == 0:
        raise InvalidArgumentError(f"{name} must hold at least one token id")
    if arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max:
        raise InvalidArgumentError(f"{name} holds ids outside int32")
    return arr.astype(np.int32)


def _step_arrays(plan: list, tables: list[np.ndarray], bs: int) -> dict[str, np.ndarray]:
    """A step's host arrays (:class:`nbkv.paged_step.PagedStep`), int32, from the plan
    ``(sid, sequence, new positions, tokens)`` and each sequence's table after the step."""
    ns = np.array([n for _, _, n, _ in plan], np.int64)
    starts = np.array([seq.seq_len for _, seq, _, _ in plan], np.int64)
    counts = np.array([len(t) for t in tables], np.int64)
    q_indptr = np.zeros(len(plan) + 1, np.int64)
    np.cumsum(ns, out=q_indptr[1:])
    kv_indptr = np.zeros(len(plan) + 1, np.int64)
    np.cumsum(counts, out=kv_indptr[1:])
    kv_indices = np.concatenate(tables)
    seq_of = np.repeat(np.arange(len(plan)), ns)  # the sequence of each new position
    positions = np.arange(q_indptr[-1]) - q_indptr[seq_of] + starts[seq_of]
    page = kv_indices[kv_indptr[seq_of] + positions // bs].astype(np.int64)
    lens = starts + ns
    return {
        "seq_ids": np.array([sid for sid, _, _, _ in plan], np.int32),
        "q_indptr": q_indptr.astype(np.int32),
        "positions": positions.astype(np.int32),
        "slot_mapping": (page * bs + positions % bs).astype(np.int32),
        "seq_lens": lens.astype(np.int32),
        "kv_indptr": kv_indptr.astype(np.int32),
        "kv_indices": kv_indices.astype(np.int32, copy=False),
        "last_page_len": (lens - (counts - 1) * bs).astype(np.int32),
    }


class PagedReserveMixin:
    """Reserving a step, and checking one; mixed into PagedKVCache."""

    # -- steps -------------------------------------------------------------------------

    def reserve(self, requests: Any) -> PagedStep:
        """Room for the next positions of the sequences named; the step's arrays.

        ``requests`` maps a live sequence id to a count (int >= 1) or to the token ids
        of its new positions (a 1-D integer array; required with prefix caching). Blocks
        a write would share (forked, or registered in the prefix cache) are copied
        first, in every layer, so that the step's slots point at private blocks. All or
        nothing.

        Raises
        ------
        ArgumentTypeError, InvalidArgumentError
            Not a dict, no sequence named, an id not live, a bad count or token array,
            a count where prefix caching needs token ids.
        OutOfBlocksError
            The step needs more new blocks (copies included) than ``num_free_blocks``.
        """
        plan = self._plan(requests)
        copies, need = self._count(plan)
        pool = self._pool
        if need > pool.available:
            raise OutOfBlocksError(
                f"the step needs {need} blocks ({need - len(copies)} new, {len(copies)} "
                f"copies on write) but {pool.available} are free or evictable "
                f"(num_blocks {self._num_blocks}); free or trim sequences, or build the "
                "cache with more blocks"
            )
        return self._commit(plan, copies, need)

    def blocks_needed(self, requests: Any) -> int:
        """The blocks ``reserve(requests)`` would take (new ones and copies on write),
        with every check ``reserve`` makes and nothing changed: a scheduler compares it
        with :attr:`num_free_blocks` before it commits to a step."""
        return self._count(self._plan(requests))[1]

    def _count(self, plan) -> tuple[list, int]:
        """(sequences whose last block is copied on write, blocks the step takes)."""
        pool, bs = self._pool, self._block_size
        # a copy of every shared (or registered) last block that receives positions, in
        # order: a sequence that leaves a shared block lets its last holder write in place
        leaving: dict[int, int] = {}
        copies, need = [], 0
        for _, seq, n, _ in plan:
            if seq.seq_len % bs:
                last = int(seq.blocks[-1])
                holders = int(pool.refs[last]) - leaving.get(last, 0)
                if holders > 1 or pool.key[last] is not None:
                    copies.append(seq)
                    leaving[last] = leaving.get(last, 0) + 1
            need += -(-(seq.seq_len + n) // bs) - len(seq.blocks)
        return copies, need + len(copies)

    def _plan(self, requests: Any) -> list[tuple[int, _Seq, int, np.ndarray | None]]:
        """``(sid, sequence, new positions, token ids or None)`` of each request, checked."""
        if not isinstance(requests, dict):
            raise ArgumentTypeError(
                f"reserve takes a dict of sequence id -> count or token ids, got "
                f"{type(requests).__name__}"
            )
        if not requests:
            raise InvalidArgumentError("reserve needs at least one sequence")
        plan = []
        for sid, value in requests.items():
            seq = self._seq(sid)
            n, toks = _count_or_tokens(value, sid)
            if self._prefix_caching and toks is None:
                raise InvalidArgumentError(
                    f"reserve[{sid}] is a count, but a prefix-caching cache needs the token "
                    "ids of the new positions"
                )
            plan.append((int(sid), seq, n, toks))
        return plan

    def _commit(self, plan, copies, need: int) -> PagedStep:
        """Make the step: its arrays, their device copies and the copies on write first
        (nothing a sequence holds has changed if they fail), then the tables and counters.
        The arrays are built with whole-array NumPy operations from each sequence's table
        (an int32 array already), not from Python lists of every page (those cost 200 us
        a decode step of 8 sequences of 4,096 positions at block 16; benchmarks/)."""
        pool, bs = self._pool, self._block_size
        fresh = np.array(pool.peek(need), np.int32)  # what the takes below return, in order
        copying = {id(s) for s in copies}
        tables, cow, at = [], [], 0
        for _, seq, n, _ in plan:
            table = seq.blocks
            if id(seq) in copying:  # copy on write: a private copy of the last block
                cow.append((int(table[-1]), int(fresh[at])))
                table = np.concatenate([table[:-1], fresh[at : at + 1]])
                at += 1
            grow = -(-(seq.seq_len + n) // bs) - len(table)
            if grow:
                table = np.concatenate([table, fresh[at : at + grow]])
                at += grow
            tables.append(table)
        host = _step_arrays(plan, tables, bs)
        be = self._backend
        step = PagedStep(self._uid, self._version + 1, host, be.to_device, bs)
        if cow:  # into blocks no table holds yet, every layer, one launch each
            src_d = be.to_device(np.array([a for a, _ in cow], np.int32))
            dst_d = be.to_device(np.array([b for _, b in cow], np.int32))
            try:
                for i in range(self._num_layers):
                    be.copy_blocks(src_d, dst_d, self._kk[i], self._vk[i])
            except BaseException:
                for _, b in cow:  # a cached block copied into in part: no longer its key's
                    if b in pool.cached:
                        pool.forget(b)
                raise
        # every allocation and copy is made: from here on only bookkeeping
        for _ in range(need):
            pool.take()
        pending = []
        for (_, seq, n, toks), table in zip(plan, tables, strict=True):
            start = seq.seq_len
            seq.blocks = table
            seq.seq_len = start + n
            if toks is not None and self._prefix_caching:  # else only counted
                seq.tokens = np.concatenate([seq.tokens, toks])
            if self._prefix_caching:
                pending += self._filled(seq, start)
        pool.release([a for a, _ in cow])
        self._changed()
        self._pending = pending
        return step

    def _filled(self, seq: _Seq, start: int) -> list:
        """Blocks of ``seq`` that its new positions fill: (block, key, tokens, parent)."""
        bs, pool, out = self._block_size, self._pool, []
        for i in range(start // bs, seq.seq_len // bs):
            tokens = seq.tokens[i * bs : (i + 1) * bs]
            parent_key = seq.keys[i - 1] if i else self._root
            key = block_key(parent_key, tokens)
            seq.keys.append(key)
            parent = pool.identity(int(seq.blocks[i - 1])) if i else None
            out.append((int(seq.blocks[i]), key, tokens, parent))
        return out

    def check_step(self, step: Any) -> PagedStep:
        """``step`` if it is this cache's and still valid, else a typed error."""
        if not isinstance(step, PagedStep):
            raise ArgumentTypeError(
                f"step must be a PagedStep (from reserve), got {type(step).__name__}"
            )
        if step.cache_id != self._uid:
            raise StaleStepError("step was made by another PagedKVCache")
        if step.version != self._version:
            raise StaleStepError(
                "step is stale: the cache changed since it was made (reserve, add, fork, "
                "trim or free); make a new one with reserve"
            )
        return step
