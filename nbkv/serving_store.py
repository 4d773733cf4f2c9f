"""The engine's second tier: K/V blocks looked up in, and published to, a store
(:mod:`nbkv.store`) shared with other engines, on this machine or across a fleet.

A :class:`StoreTier` belongs to one :class:`nbkv.serving.Engine` and its paged cache:

- **fetch** (on admission, on the engine's thread): the full blocks of a prompt that the
  pool does not hold are asked of the store in one round trip (``get_many``); the
  leading run of records that decode (right model, geometry, version and checksum:
  :func:`nbkv.store.decode_block`) is copied into the pool's prefix cache
  (:meth:`nbkv.PagedKVCache.load_prefix`), so that admitting the request starts past
  them. A miss, a rejected record, or a store that raises costs recomputation, never a
  wrong token: after an error the store is left alone for a back-off that doubles up to
  :data:`MAX_BACKOFF_S`, so that a store that is down does not slow every admission.
- **publish** (after a forward pass): the blocks a step filled are copied to the host
  (:meth:`nbkv.PagedKVCache.read_blocks`) and handed to a background thread that encodes
  them (:func:`nbkv.store.encode_block`) and writes them in one batch (``put_many``), so
  decoding never waits on the network; a block already sent (requests prefilled side by
  side compute the same prefix) is not sent again. If the thread falls behind by
  :data:`MAX_PENDING` batches, new batches are dropped (and counted), not queued.

Keys: the pool's own prefix keys (:meth:`nbkv.PagedKVCache.prefix_keys`, a hash chain of
token ids rooted in block size, dtype and layout) mixed with the model's identity
(:attr:`nbkv.models.Llama.identity`) and the geometry (:func:`nbkv.store.namespace`).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any

import numpy as np

from .errors import ArgumentTypeError, CacheFormatError
from .store import BlockGeometry, decode_block, encode_block, get_many, namespace, put_many
from .store import store_key as _store_key

__all__ = ["StoreTier", "MAX_PENDING", "MAX_SENT", "MAX_BACKOFF_S"]

MAX_PENDING = 64  # publish batches waiting for the background thread; more are dropped
MAX_SENT = 1 << 16  # store keys remembered as published, so that none is sent twice
MAX_BACKOFF_S = 30.0  # the longest a failed store is left alone before it is asked again
_FIRST_BACKOFF_S = 0.5

_COUNTERS = (
    "store_lookups",  # admissions that asked the store
    "store_hit_blocks",  # blocks loaded from it
    "store_miss_blocks",  # blocks asked for and not loaded (absent or rejected)
    "store_rejected",  # records refused (another model or geometry, corrupt, truncated)
    "store_errors",  # store calls that raised (down, timed out), and failed copies
    "store_skipped",  # lookups not made while the store was backed off
    "store_bytes_read",
    "store_published_blocks",
    "store_bytes_written",
    "store_publish_dropped",  # blocks not published: the thread was behind, or put failed
)


class StoreTier:
    """A store used as a second tier of one engine's paged cache (see the module doc)."""

    def __init__(self, store: Any, model: Any, cache: Any) -> None:
        if not all(callable(getattr(store, m, None)) for m in ("put", "get", "contains")):
            raise ArgumentTypeError(
                "store must implement nbkv.store.Store (put, get, contains), got "
                f"{type(store).__name__}"
            )
        identity = getattr(model, "identity", None)
        if not isinstance(identity, bytes):
            raise ArgumentTypeError(
                f"a store needs the model's identity (bytes), got {type(identity).__name__}"
            )
        self.store = store
        self.geometry = BlockGeometry(
            cache.num_layers, cache.block_size, cache.num_kv_heads, cache.head_dim,
            str(cache.dtype), cache.layout,
        )  # fmt: skip
        self.namespace = namespace(identity, self.geometry)
        self._lock = threading.Lock()  # the counters, shared with the publisher thread
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._retry_at = 0.0
        self._backoff = _FIRST_BACKOFF_S
        self._queue: queue.Queue = queue.Queue(MAX_PENDING)
        self._thread: threading.Thread | None = None
        self._sent: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    # -- counters and back-off -------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counts[name] += d

    def _failed(self) -> None:
        with self._lock:
            self._counts["store_errors"] += 1
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(MAX_BACKOFF_S, 2 * self._backoff)

    def _worked(self) -> None:
        with self._lock:
            self._backoff = _FIRST_BACKOFF_S

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counts)
        out["store_pending"] = self._queue.qsize()
        return out

    def key(self, block_key: bytes) -> bytes:
        return _store_key(self.namespace, block_key)

    # -- fetch -----------------------------------------------------------------------

    def fetch(self, cache: Any, tokens: np.ndarray, limit: int) -> int:
        """Load into ``cache``'s prefix cache the blocks of ``tokens`` after those it holds
        that the store has (at most ``limit``); the blocks loaded."""
        if limit <= 0:
            return 0
        if time.monotonic() < self._retry_at:
            self._count(store_skipped=1)
            return 0
        bs = cache.block_size
        hit, _ = cache.match(tokens)
        first, usable = hit // bs, (len(tokens) - 1) // bs  # add() never matches every token
        keys = cache.prefix_keys(tokens[: usable * bs])[first : min(usable, first + limit)]
        if not keys:
            return 0
        skeys = [self.key(k) for k in keys]
        self._count(store_lookups=1)
        try:
            records = get_many(self.store, skeys)
            if len(records) != len(skeys):
                raise TypeError(f"get_many returned {len(records)} values for {len(skeys)} keys")
        except Exception:  # down, timed out, or answering nonsense: recompute
            self._failed()
            self._count(store_miss_blocks=len(keys))
            return 0
        self._worked()
        ks, vs, nbytes = [], [], 0
        for skey, record in zip(skeys, records, strict=True):
            if record is None:
                break
            try:
                k, v = decode_block(record, self.namespace, skey, self.geometry)
            except CacheFormatError:
                self._count(store_rejected=1)
                break
            ks.append(k)
            vs.append(v)
            nbytes += len(record)
        self._count(store_miss_blocks=len(keys) - len(ks), store_bytes_read=nbytes)
        if not ks:
            return 0
        try:
            cache.load_prefix(tokens, np.stack(ks, 1), np.stack(vs, 1), first_block=first)
        except Exception:  # (a failed device copy) the cache is as it was: recompute
            self._failed()
            self._count(store_miss_blocks=len(ks))
            return 0
        self._count(store_hit_blocks=len(ks))
        return len(ks)

    # -- publish ---------------------------------------------------------------------

    def publish(self, cache: Any, sid: int, tokens: np.ndarray, first: int, last: int) -> None:
        """Hand blocks ``first..last-1`` of sequence ``sid`` (holding ``tokens``) to the
        publisher thread; never raises, never waits."""
        try:
            keys = cache.prefix_keys(tokens[: last * cache.block_size])[first:last]
            skeys = [self.key(key) for key in keys]
            new = [j for j, skey in enumerate(skeys) if skey not in self._sent]
            if not new:  # (requests prefilled side by side compute the same blocks)
                return
            k, v = cache.read_blocks(cache.block_table(sid)[first:last][new])
        except Exception:
            self._count(store_errors=1, store_publish_dropped=last - first)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._publisher, name="nbkv-store", daemon=True)
            self._thread.start()
        batch = [skeys[j] for j in new]
        try:
            self._queue.put_nowait((batch, k, v))
        except queue.Full:
            self._count(store_publish_dropped=len(batch))
            return
        with self._lock:
            for skey in batch:
                self._sent[skey] = None
            while len(self._sent) > MAX_SENT:
                self._sent.popitem(last=False)

    def _publisher(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                skeys, k, v = item
                records = [
                    encode_block(self.namespace, skey, self.geometry, k[:, j], v[:, j])
                    for j, skey in enumerate(skeys)
                ]
                try:
                    put_many(self.store, list(zip(skeys, records, strict=True)))
                except Exception:
                    self._failed()
                    self._count(store_publish_dropped=len(skeys))
                    with self._lock:  # not in the store after all: a later step may send them
                        for skey in skeys:
                            self._sent.pop(skey, None)
                else:
                    self._worked()
                    self._count(
                        store_published_blocks=len(skeys),
                        store_bytes_written=sum(len(r) for r in records),
                    )
            finally:
                self._queue.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch handed to the publisher is written (or dropped); whether
        it finished within ``timeout`` seconds (None: wait as long as it takes)."""
        if self._thread is None:
            return True
        if timeout is None:
            self._queue.join()
            return True
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Finish what is queued, then stop the publisher thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
