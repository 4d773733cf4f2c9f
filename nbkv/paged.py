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

The class is in three modules: this one (what it is, sequences, writing and what attention
reads), :mod:`nbkv.paged_reserve` (``reserve``, ``blocks_needed``, ``check_step``) and
:mod:`nbkv.paged_prefix` (blocks in and out for a K/V store: ``block_shape``,
``prefix_keys``, ``read_blocks``, ``load_prefix``), mixed in.
"""

from __future__ import annotations

import itertools
import numbers
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
    ShapeMismatchError,
)
from .paged_prefix import PagedPrefixMixin
from .paged_reserve import PagedReserveMixin, _Seq, _tokens
from .paged_step import PagedStep

_MAX_SLOTS = 2**31 - 1  # slots are int32
_CACHE_IDS = itertools.count()  # never reused, unlike id(): a step names its cache by one

__all__ = ["PagedKVCache", "PAGED_LAYOUTS", "PagedView"]

# "nhd": [num_blocks, block_size, num_kv_heads, head_dim] (vLLM's and FlashInfer's
# default); "hnd": [num_blocks, num_kv_heads, block_size, head_dim]. A block of "nhd" is
# laid out as a "bshd" batch row, one of "hnd" as a "bhsd" one: the backends' layouts.
PAGED_LAYOUTS = {"nhd": "bshd", "hnd": "bhsd"}


class PagedView(NamedTuple):
    """What paged attention reads of one layer for one step (see :meth:`PagedKVCache.view`)."""

    backend: Any
    k_pool: Any  # attention form (16-bit as the kernels read them)
    v_pool: Any
    step: PagedStep
    dtype: np.dtype
    num_kv_heads: int
    head_dim: int


class PagedKVCache(PagedReserveMixin, PagedPrefixMixin):
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
        if type(sid) is not int and (
            isinstance(sid, (bool, np.bool_)) or not isinstance(sid, numbers.Integral)
        ):
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
        return self._seq(sid).blocks.copy()

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
            for i, b in enumerate(seq.blocks.tolist()):
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
        self._seqs[sid] = _Seq(np.array(matched, np.int32), held, tokens_held, keys)
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
        for b in seq.blocks.tolist():
            self._pool.share(b)
        new = self._next_id
        self._next_id += 1
        self._seqs[new] = _Seq(seq.blocks.copy(), seq.seq_len, seq.tokens.copy(), list(seq.keys))
        self._changed()
        return new

    def trim(self, sid: int, n: int) -> int:
        """Drop the last ``n`` positions of ``sid`` (all of them if fewer); return how many.
        Blocks no longer needed are released."""
        seq = self._seq(sid)
        dropped = min(nonnegative_int(n, "n"), seq.seq_len)
        new_len = seq.seq_len - dropped
        keep = -(-new_len // self._block_size)
        self._pool.release(seq.blocks[keep:].tolist())
        seq.blocks = seq.blocks[:keep].copy()
        seq.seq_len = new_len
        seq.tokens = seq.tokens[: min(new_len, len(seq.tokens))]
        del seq.keys[new_len // self._block_size :]
        self._changed()
        return dropped

    def free(self, sid: int) -> None:
        """Release every block of ``sid`` and forget it (its id is never reused)."""
        seq = self._seq(sid)
        self._pool.release(seq.blocks.tolist())
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
        blocks = [be.to_host(self._k[i][b], self._dtype) for b in seq.blocks.tolist()]
        vblocks = [be.to_host(self._v[i][b], self._dtype) for b in seq.blocks.tolist()]
        axis = 0 if self._layout == "nhd" else 1  # the positions' axis inside a block
        k = np.concatenate(blocks, axis=axis)
        v = np.concatenate(vblocks, axis=axis)
        if self._layout == "nhd":
            k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
        k, v = (np.ascontiguousarray(x[:, : seq.seq_len]) for x in (k, v))
        return be.to_device(k), be.to_device(v)

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
