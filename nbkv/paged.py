"""PagedKVCache: K/V in fixed-size blocks of a pool shared by many sequences.

Every layer has one K pool and one V pool of ``num_blocks`` blocks of ``block_size``
positions, allocated at construction. A sequence is a list of block ids (its block
table, shared by all layers) and a length; blocks are reference-counted, so that
:meth:`~PagedKVCache.fork` shares a sequence's blocks and copies one only when it is
written (copy-on-write), and with ``prefix_caching=True`` full blocks are registered under
a hash chain of their tokens so that a new sequence starting with the same tokens reuses
them (:mod:`nbkv._blocks`). A forward pass goes:

1. ``step = cache.reserve({sid: tokens_or_count, ...})``: room for the next positions of
   the sequences named, all or nothing, and the int32 arrays of the step
   (:class:`nbkv.paged_step.PagedStep`: slots, positions, page tables, in nbkv's,
   FlashInfer's and vLLM's forms);
2. per layer, ``cache.write(layer, step, k, v)`` and ``nbkv.paged_attention(q, cache,
   layer, step)`` (or both at once, ``nbkv.paged_append_and_attend``), with packed ragged
   ``[total_new, heads, head_dim]`` arrays.

The whole state is plain NumPy (int32 tables, reference counts) a learner can print:
:meth:`~PagedKVCache.block_table`, :meth:`~PagedKVCache.block_refs`,
:meth:`~PagedKVCache.cached_blocks`, :meth:`~PagedKVCache.stats`.

The seam paged attention (and any other reader or writer of the pools) uses, public and
nothing else: :meth:`~PagedKVCache.view` (a layer's pools in the kernels' form and the
checked step), :meth:`~PagedKVCache.check_rows` (new K/V rows checked against a step),
:meth:`~PagedKVCache.written` (a fused kernel wrote the step's rows of a layer: once
every layer has them, the blocks the step filled join the prefix cache) and
:meth:`~PagedKVCache.check_step`. A paged cache is not a :class:`nbkv.protocol.LayerCache`
(it holds many sequences, not one batch): ``nbkv.attention`` and ``nbkv.save`` do not take
it.
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from . import layout as _layout
from ._blocks import BlockPool, block_key, root_key
from ._units import human_bytes
from ._validate import nonnegative_int, positive_int
from .backends import get_backend
from .dtypes import check_supported, resolve_dtype
from .errors import (
    ArgumentTypeError,
    DTypeMismatchError,
    InvalidArgumentError,
    LayerIndexError,
    OutOfBlocksError,
    ShapeMismatchError,
    StaleStepError,
)
from .paged_step import PagedStep

_MAX_SLOTS = 2**31 - 1  # slots are int32
_CACHE_IDS = itertools.count()  # never reused, unlike id(): a step names its cache by one

__all__ = ["PagedKVCache", "PAGED_LAYOUTS", "PagedView"]

# "nhd": [num_blocks, block_size, num_kv_heads, head_dim] (vLLM's and FlashInfer's
# default); "hnd": [num_blocks, num_kv_heads, block_size, head_dim]. A block of "nhd" is
# laid out as a "bshd" batch row, one of "hnd" as a "bhsd" one: the backends' layouts.
PAGED_LAYOUTS = {"nhd": "bshd", "hnd": "bhsd"}


@dataclass
class _Seq:
    blocks: list[int]
    seq_len: int = 0
    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    keys: list[bytes] = field(default_factory=list)  # the prefix key of each full block


class PagedView(NamedTuple):
    """What paged attention reads of one layer for one step (see :meth:`PagedKVCache.view`)."""

    backend: Any
    k_pool: Any  # attention form (16-bit as the kernels read them)
    v_pool: Any
    step: PagedStep
    dtype: np.dtype
    num_kv_heads: int
    head_dim: int


def _count_or_tokens(value: Any, sid: int) -> tuple[int, np.ndarray | None]:
    """A reserve entry: a count (int >= 1) or token ids (1-D integer array, >= 1 long)."""
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


class PagedKVCache:
    """K/V of many sequences in blocks of a shared pool, per layer.

    Parameters
    ----------
    num_blocks : int
        Blocks in each layer's pool (the cache holds ``num_blocks * block_size``
        positions in all).
    block_size : int, default 16
        Positions a block holds (any >= 1).
    num_layers, num_kv_heads, head_dim : int
    dtype : dtype-like
        float32, float64, float16 or "bfloat16", as :class:`nbkv.LayerKVCache`.
    device : {"cpu", "cuda"}
    layout : {"nhd", "hnd"}
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` or ``[num_blocks,
        num_kv_heads, block_size, head_dim]`` pools.
    prefix_caching : bool, default False
        Register full blocks under a hash chain of their token ids; ``add(tokens)`` then
        starts a sequence with the longest run of them that matches its prompt, and
        ``reserve`` takes token ids (not counts).

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError, DTypeMismatchError, BackendUnavailableError

    Examples
    --------
    >>> import numpy as np, nbkv
    >>> cache = nbkv.PagedKVCache(8, 4, num_kv_heads=1, head_dim=2, dtype="float32")
    >>> a, b = cache.add(), cache.add()
    >>> step = cache.reserve({a: 6, b: 2})  # 6 new positions for a, 2 for b
    >>> step.slot_mapping.tolist(), cache.block_table(a).tolist(), cache.block_table(b).tolist()
    ([0, 1, 2, 3, 4, 5, 8, 9], [0, 1], [2])
    >>> k = np.ones((8, 1, 2), np.float32)
    >>> cache.write(0, step, k, 2 * k)
    >>> q = np.ones((8, 1, 2), np.float32)
    >>> nbkv.paged_attention(q, cache, 0, step)[[5, 7], 0].tolist()
    [[2.0, 2.0], [2.0, 2.0]]
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        num_layers: int = 1,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any,
        device: str = "cpu",
        layout: str = "nhd",
        prefix_caching: bool = False,
    ) -> None:
        self._num_blocks = positive_int(num_blocks, "num_blocks")
        self._block_size = positive_int(block_size, "block_size")
        self._num_layers = positive_int(num_layers, "num_layers")
        self._num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
        self._head_dim = positive_int(head_dim, "head_dim")
        self._dtype = resolve_dtype(dtype)
        if self._num_blocks * self._block_size > _MAX_SLOTS:
            raise InvalidArgumentError(
                f"num_blocks * block_size must be at most {_MAX_SLOTS} (slots and positions "
                f"are int32, as vLLM's and FlashInfer's tables), got {self._num_blocks} * "
                f"{self._block_size} = {self._num_blocks * self._block_size}"
            )
        if not isinstance(layout, str) or layout not in PAGED_LAYOUTS:
            raise InvalidArgumentError(
                f"layout must be one of {tuple(PAGED_LAYOUTS)}, got {layout!r:.40}"
            )
        if not isinstance(prefix_caching, (bool, np.bool_)):
            raise ArgumentTypeError(
                f"prefix_caching must be a bool, got {type(prefix_caching).__name__}"
            )
        self._layout, self._prefix_caching = layout, bool(prefix_caching)
        self._backend = be = get_backend(device, PAGED_LAYOUTS[layout])
        shape = _layout.buffer_shape(
            be.layout, self._num_blocks, self._num_kv_heads, self._block_size, self._head_dim
        )
        nbytes = 2 * self._num_layers * int(np.prod(shape)) * self._dtype.itemsize
        if nbytes > np.iinfo(np.int64).max:
            raise InvalidArgumentError(f"pools of {nbytes} bytes: more than any machine addresses")
        self._k = [be.empty(shape, self._dtype) for _ in range(self._num_layers)]
        self._v = [be.empty(shape, self._dtype) for _ in range(self._num_layers)]
        self._kk = [be.kernel_view(x) for x in self._k]
        self._vk = [be.kernel_view(x) for x in self._v]
        self._pool = BlockPool(self._num_blocks)
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self._version = 0  # bumped by every change: a step is valid for one version
        self._uid = next(_CACHE_IDS)
        self._root = root_key(self._block_size, str(self._dtype), layout)
        self._pending: list = []  # blocks the current step fills: registered once written
        self._written: set[int] = set()  # layers the current step has written
        self._queries = self._hits = 0

    # -- what it is --------------------------------------------------------------------

    num_blocks = property(lambda self: self._num_blocks)
    block_size = property(lambda self: self._block_size)
    num_layers = property(lambda self: self._num_layers)
    num_kv_heads = property(lambda self: self._num_kv_heads)
    head_dim = property(lambda self: self._head_dim)
    dtype = property(lambda self: self._dtype)
    device = property(lambda self: self._backend.name)
    layout = property(lambda self: self._layout)
    prefix_caching = property(lambda self: self._prefix_caching)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's K and V pools (fixed at construction)."""
        return sum(int(x.nbytes) for x in self._k + self._v)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a step can take: free ones, and cached ones it may evict."""
        return self._pool.available

    @property
    def seq_ids(self) -> list[int]:
        """The live sequence ids, in creation order."""
        return list(self._seqs)

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"PagedKVCache(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"layers={self._num_layers}, kv_heads={self._num_kv_heads}, head_dim={self._head_dim}, "
            f"dtype={self._dtype}, device={self.device!r}, layout={self._layout!r}, "
            f"sequences={len(self._seqs)}, blocks used/cached/free={s['blocks_used']}/"
            f"{s['blocks_cached']}/{s['blocks_free']}, nbytes={human_bytes(self.nbytes)})"
        )

    def _seq(self, sid: Any) -> _Seq:
        if isinstance(sid, (bool, np.bool_)) or not isinstance(sid, numbers.Integral):
            raise ArgumentTypeError(
                f"a sequence id is an int, got {type(sid).__name__} {sid!r:.40}"
            )
        seq = self._seqs.get(int(sid))
        if seq is None:
            raise InvalidArgumentError(f"sequence {sid} is not live (live: {self.seq_ids[:8]}...)")
        return seq

    def _layer(self, layer: Any) -> int:
        n = self._num_layers
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, numbers.Integral):
            raise LayerIndexError(f"layer must be an int, got {type(layer).__name__} {layer!r:.40}")
        if not -n <= layer < n:
            raise LayerIndexError(f"layer must be in [-{n}, {n}), got {layer}")
        return int(layer) % n

    def seq_len(self, sid: int) -> int:
        """Positions sequence ``sid`` holds."""
        return self._seq(sid).seq_len

    def block_table(self, sid: int) -> np.ndarray:
        """Its block ids in position order (int32, a copy): ``ceil(seq_len / block_size)``."""
        return np.array(self._seq(sid).blocks, np.int32)

    def block_refs(self) -> np.ndarray:
        """Every block's reference count (int32 ``[num_blocks]``, a copy): how many
        sequences' tables hold it; 0 for a free or a cached block."""
        return self._pool.refs.copy()

    def cached_blocks(self) -> np.ndarray:
        """The cached (evictable) blocks, oldest first: the order eviction takes them
        (int32, a copy). Empty without prefix caching."""
        return np.array(list(self._pool.cached), np.int32)

    def pools(self, layer: int):
        """Layer ``layer``'s ``(K, V)`` pools themselves (no copy)."""
        i = self._layer(layer)
        return self._k[i], self._v[i]

    def _bytes_per_slot(self) -> int:
        return 2 * self._num_layers * self._num_kv_heads * self._head_dim * self._dtype.itemsize

    def stats(self) -> dict[str, int]:
        """Blocks used, cached (evictable) and free (summing to ``num_blocks``); positions
        held (per sequence); bytes of the blocks in use against bytes of the positions in
        them (a shared block counted once); prefix-cache queries and hits, in tokens."""
        pool, bs = self._pool, self._block_size
        fill: dict[int, int] = {}
        for seq in self._seqs.values():
            for i, b in enumerate(seq.blocks):
                here = min(bs, seq.seq_len - i * bs)
                fill[b] = max(fill.get(b, 0), here)
        used = int(np.count_nonzero(pool.refs))
        per_slot = self._bytes_per_slot()
        return {
            "blocks_used": used,
            "blocks_cached": len(pool.cached),
            "blocks_free": len(pool.free),
            "positions": sum(s.seq_len for s in self._seqs.values()),
            "bytes_reserved": used * bs * per_slot,
            "bytes_data": sum(fill.values()) * per_slot,
            "prefix_query_tokens": self._queries,
            "prefix_hit_tokens": self._hits,
        }

    # -- sequences ---------------------------------------------------------------------

    def _changed(self) -> None:
        self._version += 1
        self._pending, self._written = [], set()

    def add(self, tokens: Any = None) -> int:
        """A new sequence; with prefix caching and ``tokens``, holding the longest run of
        cached full blocks that match a prefix of them (never all: one token is left to
        compute). Pass ``tokens[seq_len(sid):]`` to the first ``reserve``."""
        toks = None if tokens is None else _tokens(tokens, "tokens")
        matched, keys = self._match(toks)
        if toks is not None and self._prefix_caching:
            self._queries += len(toks)
            self._hits += len(matched) * self._block_size
        for b in matched:
            self._pool.share(b)
        held = len(matched) * self._block_size
        sid = self._next_id
        self._next_id += 1
        tokens_held = toks[:held].copy() if toks is not None else np.empty(0, np.int32)
        self._seqs[sid] = _Seq(matched, held, tokens_held, keys)
        self._changed()
        return sid

    def match(self, tokens: Any) -> tuple[int, int]:
        """What ``add(tokens)`` would find now, with nothing changed (and nothing counted
        in ``stats()``): ``(positions the new sequence would hold, how many of those
        blocks are cached rather than in use)`` (taking a cached block makes it
        unavailable to a step: a scheduler subtracts it from ``num_free_blocks``)."""
        matched, _ = self._match(_tokens(tokens, "tokens"))
        cached = sum(1 for b in matched if self._pool.refs[b] == 0)
        return len(matched) * self._block_size, cached

    def _match(self, toks: np.ndarray | None) -> tuple[list[int], list[bytes]]:
        """The cached full blocks matching a prefix of ``toks`` (never all of it)."""
        matched: list[int] = []
        keys: list[bytes] = []
        if toks is None or not self._prefix_caching:
            return matched, keys
        bs, pool = self._block_size, self._pool
        parent_key, parent = self._root, None
        for i in range((len(toks) - 1) // bs):
            block_toks = toks[i * bs : (i + 1) * bs]
            key = block_key(parent_key, block_toks)
            b = pool.lookup(key, block_toks, parent)
            if b is None:
                break
            matched.append(b)
            keys.append(key)
            parent_key, parent = key, pool.identity(b)
        return matched, keys

    def fork(self, sid: int) -> int:
        """A new sequence sharing every block of ``sid`` (no copy until one is written)."""
        seq = self._seq(sid)
        for b in seq.blocks:
            self._pool.share(b)
        new = self._next_id
        self._next_id += 1
        self._seqs[new] = _Seq(list(seq.blocks), seq.seq_len, seq.tokens.copy(), list(seq.keys))
        self._changed()
        return new

    def trim(self, sid: int, n: int) -> int:
        """Drop the last ``n`` positions of ``sid`` (all of them if fewer); return how many.
        Blocks no longer needed are released."""
        seq = self._seq(sid)
        dropped = min(nonnegative_int(n, "n"), seq.seq_len)
        new_len = seq.seq_len - dropped
        keep = -(-new_len // self._block_size)
        self._pool.release(seq.blocks[keep:])
        del seq.blocks[keep:]
        seq.seq_len = new_len
        seq.tokens = seq.tokens[: min(new_len, len(seq.tokens))]
        del seq.keys[new_len // self._block_size :]
        self._changed()
        return dropped

    def free(self, sid: int) -> None:
        """Release every block of ``sid`` and forget it (its id is never reused)."""
        seq = self._seq(sid)
        self._pool.release(seq.blocks)
        del self._seqs[int(sid)]
        self._changed()

    def get_kv(self, layer: int, sid: int):
        """Copies of ``(K, V)`` that ``sid`` holds in ``layer``, ``[num_kv_heads, seq_len,
        head_dim]`` on the cache's device, or None at length 0 (for tests and teaching)."""
        i = self._layer(layer)
        seq = self._seq(sid)
        if seq.seq_len == 0:
            return None
        be = self._backend
        blocks = [be.to_host(self._k[i][b], self._dtype) for b in seq.blocks]
        vblocks = [be.to_host(self._v[i][b], self._dtype) for b in seq.blocks]
        axis = 0 if self._layout == "nhd" else 1  # the positions' axis inside a block
        k = np.concatenate(blocks, axis=axis)
        v = np.concatenate(vblocks, axis=axis)
        if self._layout == "nhd":
            k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
        k, v = (np.ascontiguousarray(x[:, : seq.seq_len]) for x in (k, v))
        return be.to_device(k), be.to_device(v)

    # -- blocks in and out: a second tier (nbkv.store, through nbkv.serving) -------------

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block of one layer's K (or V) pool: ``(block_size, num_kv_heads, head_dim)``
        for ``"nhd"``, ``(num_kv_heads, block_size, head_dim)`` for ``"hnd"``."""
        return tuple(int(x) for x in self._k[0].shape[1:])

    def prefix_keys(self, tokens: Any) -> list[bytes]:
        """The prefix-cache key of every full block of ``tokens``, in order (the hash chain
        of :mod:`nbkv._blocks`, rooted in this cache's block size, dtype and layout: two
        caches agree on a key exactly when they agree on those and on the tokens before
        it). Nothing is changed or counted."""
        toks, bs = _tokens(tokens, "tokens"), self._block_size
        keys, parent = [], self._root
        for i in range(len(toks) // bs):
            parent = block_key(parent, toks[i * bs : (i + 1) * bs])
            keys.append(parent)
        return keys

    def _block_ids(self, blocks: Any) -> list[int]:
        try:
            arr = np.asarray(blocks)
        except (TypeError, ValueError) as err:
            raise ArgumentTypeError(f"blocks must be a 1-D array of block ids ({err})") from None
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ArgumentTypeError(
                f"blocks must be a 1-D integer array of block ids, got dtype {arr.dtype}, "
                f"shape {arr.shape}"
            )
        if arr.size and (arr.min() < 0 or arr.max() >= self._num_blocks):
            raise InvalidArgumentError(
                f"blocks must be ids in [0, {self._num_blocks}), got {arr.min()}..{arr.max()}"
            )
        return [int(b) for b in arr]

    def read_blocks(self, blocks: Any) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of ``blocks``' K and V in every layer: two arrays
        ``[num_layers, len(blocks), *block_shape]`` of the cache's dtype (what a K/V store
        keeps of a block). Nothing is changed."""
        ids = self._block_ids(blocks)
        shape = (self._num_layers, len(ids), *self.block_shape)
        k, v = np.empty(shape, self._dtype), np.empty(shape, self._dtype)
        be = self._backend
        for i in range(self._num_layers):
            for j, b in enumerate(ids):
                k[i, j] = be.to_host(self._k[i][b], self._dtype)
                v[i, j] = be.to_host(self._v[i][b], self._dtype)
        return k, v

    def load_prefix(self, tokens: Any, k: Any, v: Any, *, first_block: int) -> int:
        """Put K/V computed elsewhere into the prefix cache, as if this cache had computed
        them: full blocks ``first_block, first_block + 1, ...`` of ``tokens``, whose first
        ``first_block`` blocks this cache must already match (``match(tokens)``). ``k`` and
        ``v``: host arrays ``[num_layers, n, *block_shape]`` of the cache's dtype. The
        blocks join the prefix cache as cached (evictable) blocks, newest last, so that
        ``add(tokens)`` then starts past them. Returns the positions ``add(tokens)`` would
        now hold from cached blocks. All or nothing (a failed copy leaves no block keyed).

        Raises
        ------
        ArgumentTypeError, InvalidArgumentError, ShapeMismatchError, DTypeMismatchError
            Bad tokens or arrays; no prefix caching; ``first_block`` is not what the cache
            matches; more blocks than ``tokens`` fills.
        OutOfBlocksError
            More blocks than are free or evictable (the matched ones excepted).
        """
        if not self._prefix_caching:
            raise InvalidArgumentError("load_prefix needs a cache built with prefix_caching=True")
        toks, bs = _tokens(tokens, "tokens"), self._block_size
        first = nonnegative_int(first_block, "first_block")
        k, v = (self._host_blocks(x, name) for x, name in ((k, "k"), (v, "v")))
        if k.shape != v.shape:
            raise ShapeMismatchError(f"k and v must have one shape, got {k.shape} and {v.shape}")
        n = k.shape[1]
        matched, keys = self._match(toks)
        if len(matched) != first:
            raise InvalidArgumentError(
                f"first_block must be the blocks the cache matches of tokens ({len(matched)}), "
                f"got {first}"
            )
        if (first + n) * bs > len(toks):
            raise InvalidArgumentError(
                f"{n} blocks after block {first} need {(first + n) * bs} tokens, got {len(toks)}"
            )
        if n == 0:
            return first * bs
        pool = self._pool
        targets = pool.spare(n, keep=set(matched))  # free blocks first, then the oldest cached
        if len(targets) < n:
            raise OutOfBlocksError(
                f"load_prefix needs {n} blocks but {len(targets)} are free or evictable "
                f"(the {first} blocks it extends excepted)"
            )
        self._copy_in(targets, k, v)
        # every copy is made: from here on only bookkeeping
        parent_key = keys[-1] if keys else self._root
        parent = pool.identity(matched[-1]) if matched else None
        for j, b in enumerate(targets):
            pool.take(b)
            block_toks = toks[(first + j) * bs : (first + j + 1) * bs]
            parent_key = block_key(parent_key, block_toks)
            pool.register(b, parent_key, block_toks, parent)
            parent = pool.identity(b)
        pool.release(targets)
        self._changed()
        return (first + n) * bs

    def _host_blocks(self, x: Any, name: str) -> np.ndarray:
        arr = np.asarray(x) if isinstance(x, np.ndarray) else None
        if arr is None:
            raise ArgumentTypeError(f"{name} must be a host NumPy array, got {type(x).__name__}")
        want = (self._num_layers, *self.block_shape)
        if arr.ndim != 5 or (arr.shape[0], *arr.shape[2:]) != want:
            raise ShapeMismatchError(
                f"{name} must be [num_layers, n, *block_shape] = [{want[0]}, n, "
                f"{', '.join(map(str, want[1:]))}], got shape {arr.shape}"
            )
        if arr.dtype != self._dtype:
            raise DTypeMismatchError(
                f"{name} has dtype {arr.dtype} but this cache holds {self._dtype}; nbkv never casts"
            )
        return arr

    def _copy_in(self, targets: list[int], k: np.ndarray, v: np.ndarray) -> None:
        """K/V blocks into ``targets`` of every layer's pools, as rows at their slots; if a
        copy fails, a cached block written into part-way leaves the prefix cache."""
        bs, be = self._block_size, self._backend
        slots = (np.array(targets, np.int64)[:, None] * bs + np.arange(bs)).ravel()
        rows = (-1, self._num_kv_heads, self._head_dim)

        def as_rows(x: np.ndarray) -> np.ndarray:  # [n, *block] -> [n * bs, heads, dim]
            x = x if self._layout == "nhd" else x.transpose(0, 2, 1, 3)
            return np.ascontiguousarray(x).reshape(rows)

        try:
            slots_d = be.to_device(slots.astype(np.int32))
            for i in range(self._num_layers):
                kr = be.to_kernel(be.adopt(as_rows(k[i]), "k"))
                vr = be.to_kernel(be.adopt(as_rows(v[i]), "v"))
                be.write_paged(kr, vr, slots_d, self._kk[i], self._vk[i])
        except BaseException:
            for b in targets:
                if b in self._pool.cached:
                    self._pool.forget(b)
            raise

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
        for seq, n, _ in plan:
            if seq.seq_len % bs:
                last = seq.blocks[-1]
                holders = int(pool.refs[last]) - leaving.get(last, 0)
                if holders > 1 or pool.key[last] is not None:
                    copies.append(seq)
                    leaving[last] = leaving.get(last, 0) + 1
            need += -(-(seq.seq_len + n) // bs) - len(seq.blocks)
        return copies, need + len(copies)

    def _plan(self, requests: Any) -> list[tuple[_Seq, int, np.ndarray | None]]:
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
            plan.append((seq, n, toks))
        return plan

    def _commit(self, plan, copies, need: int) -> PagedStep:
        """Make the step: its arrays, their device copies and the copies on write first
        (nothing a sequence holds has changed if they fail), then the tables and counters."""
        pool, bs = self._pool, self._block_size
        fresh = iter(pool.peek(need))  # what the takes below will return, in order
        copying = {id(s) for s in copies}
        ids = {id(seq): sid for sid, seq in self._seqs.items()}
        tables, cow = [], []
        q_indptr, kv_indptr, positions, slots = [0], [0], [], []
        for seq, n, _ in plan:
            table = list(seq.blocks)
            if id(seq) in copying:  # copy on write: a private copy of the last block
                table[-1] = next(fresh)
                cow.append((seq.blocks[-1], table[-1]))
            start = seq.seq_len
            while len(table) * bs < start + n:
                table.append(next(fresh))
            tables.append(table)
            pos = np.arange(start, start + n)
            positions.append(pos)
            touched = np.array(table[start // bs :], np.int64)  # the blocks written
            slots.append(touched[pos // bs - start // bs] * bs + pos % bs)
            q_indptr.append(q_indptr[-1] + n)
            kv_indptr.append(kv_indptr[-1] + len(table))
        lens = [seq.seq_len + n for seq, n, _ in plan]
        host = {
            "seq_ids": np.array([ids[id(seq)] for seq, _, _ in plan], np.int32),
            "q_indptr": np.array(q_indptr, np.int32),
            "positions": np.concatenate(positions).astype(np.int32),
            "slot_mapping": np.concatenate(slots).astype(np.int32),
            "seq_lens": np.array(lens, np.int32),
            "kv_indptr": np.array(kv_indptr, np.int32),
            "kv_indices": np.fromiter(
                itertools.chain.from_iterable(tables), np.int32, kv_indptr[-1]
            ),
            "last_page_len": np.array(
                [n - (len(t) - 1) * bs for n, t in zip(lens, tables, strict=True)], np.int32
            ),
        }
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
        for (seq, n, toks), table in zip(plan, tables, strict=True):
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
            parent = pool.identity(seq.blocks[i - 1]) if i else None
            out.append((seq.blocks[i], key, tokens, parent))
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

    # -- writing, and what attention reads ----------------------------------------------

    def check_rows(self, x: Any, name: str, step: PagedStep):
        """``x`` adopted as the step's K or V rows, or a typed error (what write checks)."""
        be = self._backend
        arr = be.adopt(x, name)
        want = (step.num_tokens, self._num_kv_heads, self._head_dim)
        if arr.ndim != 3 or tuple(arr.shape) != want:
            raise ShapeMismatchError(
                f"{name} must be [total_new, num_kv_heads, head_dim] = {list(want)}, got "
                f"shape {tuple(arr.shape)}"
            )
        dtype = np.dtype(arr.dtype)
        bits = be.name == "cuda" and dtype == np.uint16 and not isinstance(arr, np.ndarray)
        if dtype != self._dtype and not (
            bits and self._dtype.itemsize == 2 and self._dtype.kind != "f"
        ):
            check_supported(dtype, name)
            raise DTypeMismatchError(
                f"{name} has dtype {dtype} but this cache holds {self._dtype}; nbkv never casts"
            )
        return arr

    def write(self, layer: int, step: PagedStep, k: Any, v: Any) -> None:
        """Write the step's new K/V rows (``[total_new, num_kv_heads, head_dim]``, in the
        step's order) into ``layer``'s pools at their slots.

        Raises
        ------
        LayerIndexError, ArgumentTypeError, StaleStepError, ShapeMismatchError,
        DTypeMismatchError, DeviceMismatchError
        """
        i = self._layer(layer)
        self.check_step(step)
        k, v = self.check_rows(k, "k", step), self.check_rows(v, "v", step)
        be = self._backend
        be.write_paged(
            be.to_kernel(k), be.to_kernel(v), step.slot_mapping, self._kk[i], self._vk[i]
        )
        self.written(i, step)

    def written(self, layer: int, step: PagedStep) -> None:
        """Record that ``step``'s K/V are in ``layer``'s pools (by :meth:`write`, or a fused
        kernel); once every layer has them, the blocks the step filled join the prefix
        cache."""
        i = self._layer(layer)
        self.check_step(step)
        self._written.add(i)
        if len(self._written) == self._num_layers and self._pending:
            for b, key, tokens, parent in self._pending:
                self._pool.register(b, key, tokens, parent)
            self._pending = []

    def view(self, layer: int, step: PagedStep) -> PagedView:
        """What paged attention reads of ``layer`` for ``step`` (after checking both)."""
        i = self._layer(layer)
        self.check_step(step)
        be = self._backend
        return PagedView(
            be,
            be.attention_form(self._k[i]),
            be.attention_form(self._v[i]),
            step,
            self._dtype,
            self._num_kv_heads,
            self._head_dim,
        )
