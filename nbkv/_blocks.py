"""The block pool of a paged cache: reference counts, free and evictable blocks, and the
prefix index. Plain Python and NumPy: it knows no buffer and runs no kernel.

A block is in exactly one of three states:

- *used*: in the block table of at least one sequence (``refs[b] > 0``);
- *cached*: unreferenced but holding a prefix key, so that a later sequence can reuse
  its K/V; evictable, least recently released first (:attr:`BlockPool.cached`);
- *free*: unreferenced and holding no key.

Prefix keys form a hash chain over full blocks: ``key = sha256(parent_key + token bytes)``,
the first block's parent being :func:`root_key`, a documented constant mixed with the
block size, dtype and layout, so that processes and machines agree on keys. A registered
block also keeps its token ids and its parent block's identity (its id and generation),
and a lookup compares them, so a hash collision can never hand out wrong K/V.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict, deque

import numpy as np

__all__ = ["ROOT_SALT", "root_key", "block_key", "BlockPool"]

# the first block's parent key is sha256 of this, a "|", then block size, dtype, layout
ROOT_SALT = b"nbkv-prefix-cache-v1"


def root_key(block_size: int, dtype: str, layout: str) -> bytes:
    """The parent key of a sequence's first block (32 bytes).

    >>> root_key(16, "float16", "nhd").hex()[:16]
    'b6c2c5d311a24006'
    """
    return hashlib.sha256(ROOT_SALT + f"|{block_size}|{dtype}|{layout}".encode()).digest()


def block_key(parent: bytes, tokens: np.ndarray) -> bytes:
    """The key of a full block: sha256 of its parent's key and its token ids (int32 LE)."""
    return hashlib.sha256(parent + np.asarray(tokens, "<i4").tobytes()).digest()


class BlockPool:
    """Reference counts, free list, evictable LRU and prefix index of ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refs = np.zeros(num_blocks, np.int32)
        self.free: deque[int] = deque(range(num_blocks))  # no key, unreferenced
        self.cached: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced, oldest first
        self.gen = np.zeros(num_blocks, np.int64)  # bumped when a block is handed out anew
        self.key: list[bytes | None] = [None] * num_blocks
        self.tokens: list[np.ndarray | None] = [None] * num_blocks
        self.parent: list[tuple[int, int] | None] = [None] * num_blocks
        self.index: dict[bytes, list[int]] = {}  # key -> the blocks registered with it

    @property
    def available(self) -> int:
        """Blocks that can be handed out: free ones, then cached ones by eviction."""
        return len(self.free) + len(self.cached)

    def peek(self, n: int) -> list[int]:
        """The blocks the next ``n`` :meth:`take` calls return, if nothing else changes."""
        out = list(itertools.islice(self.free, n))
        return out + list(itertools.islice(self.cached, n - len(out)))

    def take(self, b: int | None = None) -> int:
        """A block for new data, referenced once: a free one, else the oldest cached (or
        block ``b``, which must be free or cached, e.g. one :meth:`spare` named)."""
        if b is None:
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.cached.popitem(last=False)
                self._unregister(b)
        elif b in self.cached:
            self.cached.pop(b)
            self._unregister(b)
        else:
            self.free.remove(b)
        self.gen[b] += 1
        self.refs[b] = 1
        return b

    def spare(self, n: int, keep: set[int]) -> list[int]:
        """Up to ``n`` blocks that could be taken without touching those in ``keep``: free
        ones first, then cached ones, oldest first (nothing is changed)."""
        out = list(itertools.islice(self.free, n))
        more = (b for b in self.cached if b not in keep)
        return out + list(itertools.islice(more, n - len(out)))

    def share(self, b: int) -> None:
        """One more reference to block ``b`` (a fork, or a prefix hit on a cached block)."""
        if self.refs[b] == 0:
            self.cached.pop(b)
        self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """One reference fewer to each of ``blocks`` (in table order); unreferenced ones
        become cached (keyed) or free. Released together, the tail is evicted first."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.key[b] is None:
                    self.free.append(b)
                else:
                    self.cached[b] = None  # the newest: evicted after those released before

    def register(
        self, b: int, key: bytes, tokens: np.ndarray, parent: tuple[int, int] | None
    ) -> None:
        """Give full block ``b`` its prefix key (once: a block is registered at most once)."""
        if self.key[b] is not None:
            return
        self.key[b], self.tokens[b], self.parent[b] = key, tokens.copy(), parent
        self.index.setdefault(key, []).append(b)

    def lookup(self, key: bytes, tokens: np.ndarray, parent: tuple[int, int] | None) -> int | None:
        """A registered block of ``key`` holding exactly ``tokens`` after ``parent``, or None."""
        for b in self.index.get(key, ()):
            if self.parent[b] == parent and np.array_equal(self.tokens[b], tokens):
                return b
        return None

    def forget(self, b: int) -> None:
        """Cached block ``b`` leaves the prefix cache for the free list (its contents are
        no longer what its key says: a copy into it failed part-way)."""
        self.cached.pop(b)
        self._unregister(b)
        self.free.append(b)

    def identity(self, b: int) -> tuple[int, int]:
        """What a child block records as its parent: the id and its current generation."""
        return (b, int(self.gen[b]))

    def _unregister(self, b: int) -> None:
        blocks = self.index[self.key[b]]
        blocks.remove(b)
        if not blocks:
            del self.index[self.key[b]]
        self.key[b] = self.tokens[b] = self.parent[b] = None
