"""Continuous batching: many requests served at once over one paged cache, the whole loop
in this file.

An :class:`Engine` keeps its requests in two queues: **waiting** (not admitted yet, or
preempted) and **running** (holding a sequence of the :class:`nbkv.PagedKVCache`). A
request's *known* tokens are its prompt and what it has generated; the cache holds the
K/V of all of them but the last sampled token, which is the next one fed. Each
:meth:`Engine.step` builds **one packed ragged batch** and runs **one forward pass**:

1. *Decodes*: every running request whose known tokens are all computed but the last
   gets that one token. If the pool cannot take them, the most recently admitted
   running request is **preempted**: its sequence is freed and it goes back to the head
   of the waiting queue, to be recomputed later from its prompt plus what it has
   generated (with prefix caching, its full blocks are likely still cached, so little is
   recomputed).
2. *Prefill chunks*: running requests still prefilling, then waiting requests admitted
   first come, first served (``cache.add(known tokens)``: a prefix-cache hit starts them
   past the cached blocks), each taking as many of its remaining tokens as the step's
   budget (``max_batch_tokens``) and the free blocks allow; a prompt longer than that is
   prefilled in **chunks** over several steps, beside the running decodes. At most
   ``max_seqs`` requests run at once.
3. ``step = cache.reserve(...)``, ``logits = model.forward_paged(ids, cache, step)``: one
   row of logits per sequence, after its last new token. A sequence whose chunk reached
   the end of its known tokens samples its next token; a request that produced an end
   token or ``max_new_tokens`` tokens finishes and frees its sequence.

With ``store=`` (:mod:`nbkv.store`: a :class:`~nbkv.store.LocalStore` directory or a
:class:`~nbkv.store.RedisStore` shared by many engines) the prefix cache gains a second
tier (:mod:`nbkv.serving_store`): on admission, the prompt's full blocks the pool misses
are fetched from the store in one round trip and copied in; the blocks each step fills
are published by a background thread. A store that is slow, down or returns garbage
costs recomputation, never a wrong token; :meth:`Engine.stats` counts hits, misses,
bytes and errors.

A request that could never fit (its prompt and new tokens need more blocks than the
pool has) is refused by :meth:`Engine.add_request`, not left to starve. Greedy outputs
equal :meth:`nbkv.models.Llama.generate` run alone on each prompt (the tests check it),
and a seeded sampled request draws as ``generate`` does for one prompt.

>>> import numpy as np
>>> from nbkv.models import Llama
>>> from nbkv.serving import Engine
>>> engine = Engine(Llama.default(), num_blocks=32, block_size=16)
>>> outs = engine.generate([np.array([100, 101, 102]), np.array([35, 32])], max_new_tokens=4)
>>> [len(o) for o in outs]
[7, 6]
"""

from __future__ import annotations

import collections
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ._validate import positive_int
from .errors import ArgumentTypeError, InvalidArgumentError, OutOfBlocksError
from .models.config import eos_ids
from .models.llama import pick_next
from .paged import PagedKVCache
from .serving_store import StoreTier

__all__ = ["Engine", "StepRecord", "DEFAULT_KV_BYTES"]

# num_blocks=None: blocks for max_seqs sequences of the model's context (capped at 2048
# positions), but no more K/V than this
DEFAULT_KV_BYTES = 256 << 20
_MAX_CONTEXT = 2048


class StepRecord(NamedTuple):
    """What one :meth:`Engine.step` did: sequences and tokens in its batch (decodes
    among them), blocks in use while it ran (after its ``reserve``, before requests that
    finished freed theirs), requests preempted, and its wall time."""

    num_seqs: int
    num_tokens: int
    num_decodes: int
    blocks_used: int
    preempted: int
    seconds: float


@dataclass
class _Request:
    rid: int
    prompt: np.ndarray  # int64 [n]
    max_new_tokens: int
    eos: tuple[int, ...]
    temperature: float
    rng: np.random.Generator | None
    generated: list[int] = field(default_factory=list)
    tokens: np.ndarray | None = None  # prompt + generated, room for every new token
    sid: int | None = None  # its sequence while running
    computed: int = 0  # known tokens whose K/V the cache holds
    published: int = 0  # full blocks of its known tokens already in the store (or sent)
    looked_up: bool = False  # the store was asked for its prompt since it last waited
    admitted: int = -1  # admission order while running (preemption takes the newest)
    added_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None

    def known(self) -> np.ndarray:
        """The prompt and what has been generated (a view)."""
        if self.tokens is None:
            self.tokens = np.empty(len(self.prompt) + self.max_new_tokens, np.int64)
            self.tokens[: len(self.prompt)] = self.prompt
        return self.tokens[: len(self.prompt) + len(self.generated)]

    def next(self, n: int) -> np.ndarray:
        """The next ``n`` known tokens to compute."""
        return self.known()[self.computed : self.computed + n]

    def pending(self) -> int:
        """Known tokens not yet computed (at least 1 while the request is unfinished)."""
        return len(self.prompt) + len(self.generated) - self.computed


class Engine:
    """Continuous batching of :class:`nbkv.models.Llama` requests over a
    :class:`nbkv.PagedKVCache` (see the module docstring for the loop).

    Parameters
    ----------
    model : nbkv.models.Llama
    num_blocks : int, optional
        Blocks of the pool. Default: enough for ``max_seqs`` sequences of the model's
        context (``max_position_embeddings``, at most 2048 positions), but no more than
        :data:`DEFAULT_KV_BYTES` (256 MiB) of K/V.
    block_size : int, default 16
    max_batch_tokens : int, default 512
        Tokens of one step's batch (decodes and prefill chunks together); at least
        ``max_seqs`` would let every running request decode in every step.
    max_seqs : int, default 64
        Requests running at once.
    prefix_caching : bool, default True
    device : {"cpu", "cuda"}, default "cpu"
        Where the cache lives (the model's products run on the host).
    store : nbkv.store.Store, optional
        A second tier for the prefix cache, shared with other engines of the same model
        (needs ``prefix_caching``): blocks the pool misses are fetched from it on
        admission, the blocks prefill and decode fill are published to it in the
        background. Call :meth:`flush` to wait for publication, :meth:`close` at the end.
    """

    def __init__(
        self,
        model: Any,
        *,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_batch_tokens: int = 512,
        max_seqs: int = 64,
        prefix_caching: bool = True,
        device: str = "cpu",
        store: Any = None,
    ) -> None:
        if not hasattr(model, "forward_paged") or not hasattr(model, "config"):
            raise ArgumentTypeError(
                f"model must be an nbkv.models.Llama, got {type(model).__name__}"
            )
        c = model.config
        block_size = positive_int(block_size, "block_size")
        self._max_batch_tokens = positive_int(max_batch_tokens, "max_batch_tokens")
        self._max_seqs = positive_int(max_seqs, "max_seqs")
        if not isinstance(prefix_caching, (bool, np.bool_)):
            raise ArgumentTypeError(f"prefix_caching must be a bool, got {prefix_caching!r:.40}")
        if num_blocks is None:
            per_block = (
                2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4 * block_size
            )
            context = min(c.max_position_embeddings, _MAX_CONTEXT)
            want = self._max_seqs * math.ceil(context / block_size)
            num_blocks = max(1, min(want, DEFAULT_KV_BYTES // per_block))
        self._model = model
        self._cache = PagedKVCache(
            num_blocks, block_size, num_layers=c.num_hidden_layers,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype="float32",
            device=device, prefix_caching=bool(prefix_caching),
        )  # fmt: skip
        if store is not None and not prefix_caching:
            raise InvalidArgumentError("store= needs prefix_caching=True (blocks are found by key)")
        self._tier = None if store is None else StoreTier(store, model, self._cache)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []  # in admission order
        self._requests: dict[int, _Request] = {}
        self._next_rid = 0
        self._admissions = 0
        self._held: list[tuple[int, np.ndarray]] = []  # finished during generate(), not its
        self.history: list[StepRecord] = []
        self.preemptions = 0

    # -- what it is ------------------------------------------------------------------

    @property
    def cache(self) -> PagedKVCache:
        """The paged cache (read it; the engine owns its sequences)."""
        return self._cache

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running (or finished, not yet returned by
        :meth:`step`)."""
        return bool(self._waiting or self._running or self._held)

    def stats(self) -> dict[str, int]:
        """Counters: requests waiting, running and preempted, steps run, the paged cache's
        :meth:`~nbkv.PagedKVCache.stats`, and with a store its tier's: lookups, blocks hit
        and missed, records rejected, errors, lookups skipped while it was backed off,
        bytes read and written, blocks published, dropped and pending."""
        out = {
            "requests_waiting": len(self._waiting),
            "requests_running": len(self._running),
            "preemptions": self.preemptions,
            "steps": len(self.history),
            **self._cache.stats(),
        }
        if self._tier is not None:
            out.update(self._tier.stats())
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the blocks handed to the store are written (True), or ``timeout``
        seconds pass (False). Without a store, True at once. ``timeout``: a number of
        seconds >= 0, or None to wait as long as it takes."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
                raise ArgumentTypeError(
                    f"timeout must be a number of seconds or None, got {type(timeout).__name__}"
                )
            if not timeout >= 0:  # NaN fails too
                raise InvalidArgumentError(f"timeout must be >= 0 seconds, got {timeout!r}")
        return (
            True
            if self._tier is None
            else self._tier.flush(float(timeout) if timeout is not None else None)
        )

    def close(self) -> None:
        """Publish what is queued and stop the store's background thread (the engine stays
        usable: a later publication starts it again)."""
        if self._tier is not None:
            self._tier.close()

    def times(self, rid: int) -> dict[str, float | None]:
        """``perf_counter`` times of request ``rid``: ``added``, ``first_token``,
        ``finished`` (None until it happens)."""
        r = self._requests.get(rid)
        if r is None:
            raise InvalidArgumentError(f"no request {rid!r:.40}")
        return {"added": r.added_at, "first_token": r.first_token_at, "finished": r.finished_at}

    # -- requests --------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: Any,
        *,
        max_new_tokens: int,
        eos_token_id: Any = None,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> int:
        """Queue a request; its id. ``prompt_ids``: a 1-D array of token ids (at least
        one). ``eos_token_id``: an id or a sequence of ids that end it (None: exactly
        ``max_new_tokens``). ``temperature`` 0 decodes greedily; above 0 samples, seeded
        by ``seed``.

        Raises
        ------
        ArgumentTypeError, ShapeMismatchError, InvalidArgumentError
            Bad prompt ids, ``max_new_tokens`` not an int >= 0, a bad temperature or end id.
        OutOfBlocksError
            The prompt and its new tokens need more blocks than the whole pool.
        """
        ids = self._model.token_ids(prompt_ids, "prompt_ids")
        if ids.shape[0] != 1:
            raise InvalidArgumentError(
                f"prompt_ids must be one prompt (1-D), got shape {np.shape(prompt_ids)}"
            )
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise ArgumentTypeError(
                f"max_new_tokens must be an int >= 0, got {max_new_tokens!r:.40}"
            )
        if max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise ArgumentTypeError(f"temperature must be a number >= 0, got {temperature!r:.40}")
        if not math.isfinite(temperature) or temperature < 0:
            raise InvalidArgumentError(f"temperature must be finite and >= 0, got {temperature}")
        eos = eos_ids(eos_token_id, "eos_token_id")
        prompt = ids[0]
        bs, blocks = self._cache.block_size, self._cache.num_blocks
        need = math.ceil((len(prompt) + max(int(max_new_tokens), 1) - 1) / bs)
        if need > blocks:
            raise OutOfBlocksError(
                f"a prompt of {len(prompt)} tokens with max_new_tokens={max_new_tokens} "
                f"needs {need} blocks of {bs} but the pool has {blocks}; it could never run"
            )
        rid = self._next_rid
        self._next_rid += 1
        rng = np.random.default_rng(seed) if temperature > 0 else None
        r = _Request(rid, prompt.copy(), int(max_new_tokens), eos, float(temperature), rng)
        r.added_at = time.perf_counter()
        self._requests[rid] = r
        self._waiting.append(r)
        return rid

    def generate(self, prompts: Any, **options: Any) -> list[np.ndarray]:
        """Serve every prompt (keyword options as :meth:`add_request`) until all finish;
        each ``prompt + new`` ids (int64, 1-D), in the order given. All or nothing: a bad
        prompt queues none of them. Requests added before and finished meanwhile are
        returned by the next :meth:`step`."""
        rids: list[int] = []
        try:
            for p in prompts:
                rids.append(self.add_request(p, **options))
        except BaseException:  # all or nothing: the ones queued before the bad one leave
            for rid in rids:
                self._waiting.remove(self._requests.pop(rid))
            raise
        mine, done = set(rids), {}
        while len(done) < len(rids):
            for rid, ids in self.step():
                if rid in mine:
                    done[rid] = ids
                else:  # another caller's request: the next step() returns it
                    self._held.append((rid, ids))
        return [done[rid] for rid in rids]

    # -- the loop --------------------------------------------------------------------

    def step(self) -> list[tuple[int, np.ndarray]]:
        """One scheduling step and forward pass; the requests it finished, as
        ``(request id, prompt + generated ids)``. If the forward pass raises (an
        interrupt), the step's positions are taken back and the engine stays usable: the
        next step computes them again."""
        t0 = time.perf_counter()
        finished, self._held = self._held + self._finish_empty(), []
        preempted_before = self.preemptions
        batch = self._schedule()
        if not batch:
            return finished
        cache = self._cache
        step = cache.reserve({r.sid: r.next(n) for r, n in batch})
        in_use = cache.num_blocks - cache.num_free_blocks  # the step's peak
        ids = np.concatenate([r.next(n) for r, n in batch])
        try:
            logits = self._model.forward_paged(ids, cache, step)
            # the next token of every sequence whose chunk reached its last known token,
            # sampled before any request changes (all or nothing)
            picks = [
                int(pick_next(row[None], r.temperature, r.rng)[0]) if r.pending() == n else None
                for (r, n), row in zip(batch, logits, strict=True)
            ]
        except BaseException:  # (an interrupt, out of memory) undo the reserve: the
            for r, n in batch:  # next step computes these tokens again
                cache.trim(r.sid, n)
            raise
        decodes = sum(r.pending() == 1 for r, _ in batch)
        now = time.perf_counter()
        for (r, n), token in zip(batch, picks, strict=True):
            r.computed += n
            full = r.computed // cache.block_size
            if self._tier is not None and full > r.published:  # before _finish frees it
                self._tier.publish(cache, r.sid, r.known(), r.published, full)
                r.published = full
            if token is None:
                continue
            r.known()  # (its buffer exists)
            r.tokens[len(r.prompt) + len(r.generated)] = token
            r.generated.append(token)
            if r.first_token_at is None:
                r.first_token_at = now
            if token in r.eos or len(r.generated) == r.max_new_tokens:
                finished.append(self._finish(r))
        self.history.append(
            StepRecord(
                len(batch), len(ids), decodes, in_use, self.preemptions - preempted_before,
                time.perf_counter() - t0,
            )
        )  # fmt: skip
        return finished

    def _finish_empty(self) -> list[tuple[int, np.ndarray]]:
        """Requests asked for no new token finish at once, without running."""
        out = []
        for r in [r for r in self._waiting if r.max_new_tokens == 0]:
            self._waiting.remove(r)
            out.append(self._finish(r))
        return out

    def _finish(self, r: _Request) -> tuple[int, np.ndarray]:
        if r.sid is not None:
            self._cache.free(r.sid)
            self._running.remove(r)
            r.sid = None
        r.finished_at = time.perf_counter()
        return r.rid, r.known().copy()

    def _schedule(self) -> list[tuple[_Request, int]]:
        """This step's batch, as (request, tokens) in order: decodes, then prefill chunks."""
        cache, bs = self._cache, self._cache.block_size
        # 1. one token for every decode; preempt the newest running request until they fit
        while True:
            decodes = [r for r in self._running if r.pending() == 1]
            need = cache.blocks_needed({r.sid: r.next(1) for r in decodes}) if decodes else 0
            if need <= cache.num_free_blocks:
                break
            self._preempt(self._running[-1])
        batch = [(r, 1) for r in decodes]
        budget = self._max_batch_tokens - len(batch)

        def room(seq_len: int, copy: bool, taken: int = 0) -> int:
            """New tokens a sequence can take in the blocks still free (``copy``: its
            last block must be copied first; ``taken``: cached blocks a hit takes)."""
            free = cache.num_free_blocks - need - taken - copy
            return max(0, (-seq_len) % bs + free * bs) if free >= 0 else 0

        # 2. prefill chunks: running requests first, then admissions, first come first served
        for r in self._running:
            if budget <= 0:
                break
            if r.pending() > 1:
                held = cache.seq_len(r.sid)  # a copy on write: its partial last block is keyed
                copy = bool(held % bs) and cache.blocks_needed({r.sid: r.next(1)}) == 1
                n = min(r.pending(), budget, room(held, copy))
                if n > 0:
                    batch.append((r, n))
                    budget -= n
                    need += cache.blocks_needed({r.sid: r.next(n)})
        while self._waiting and budget > 0 and len(self._running) < self._max_seqs:
            r = self._waiting[0]
            if self._tier is not None and not r.looked_up:  # blocks the pool misses, from
                r.looked_up = True  # the store: one round trip, into the prefix cache
                self._tier.fetch(cache, r.known(), cache.num_free_blocks - need)
            hit, taken = cache.match(r.known())  # what add() would find, nothing changed
            n = min(len(r.known()) - hit, budget, room(hit, False, taken))
            if n <= 0:
                break  # it waits for blocks: first come, first served
            self._waiting.popleft()
            sid = cache.add(r.known())  # starts past the cached blocks it matched
            r.sid, r.computed = sid, cache.seq_len(sid)
            r.published = max(r.published, r.computed // bs)  # those blocks exist already
            r.admitted = self._admissions
            self._admissions += 1
            self._running.append(r)
            batch.append((r, n))
            budget -= n
            need += cache.blocks_needed({sid: r.next(n)})
        return batch

    def _preempt(self, r: _Request) -> None:
        """Free ``r``'s sequence and put it back at the head of the waiting queue; it is
        recomputed from its prompt plus what it has generated when admitted again."""
        self._cache.free(r.sid)
        self._running.remove(r)
        r.sid, r.computed, r.admitted, r.looked_up = None, 0, -1, False
        self._waiting.appendleft(r)
        self.preemptions += 1
