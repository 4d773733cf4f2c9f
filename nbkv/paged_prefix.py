"""The second-tier half of :class:`nbkv.PagedKVCache`: blocks in and out of the cache for
a K/V store (:mod:`nbkv.store`, through :mod:`nbkv.serving`).

:class:`PagedPrefixMixin` is part of :class:`nbkv.PagedKVCache`: it works on the cache's
sizes, pools, backend, block pool and prefix root (all set in ``PagedKVCache.__init__``),
with its ``_match`` and ``_changed``. ``prefix_keys`` names a prompt's full blocks as
the prefix cache does; ``read_blocks`` copies blocks out to the host; ``load_prefix`` puts
blocks computed elsewhere into the prefix cache, all or nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._blocks import block_key
from ._validate import nonnegative_int
from .errors import (
    ArgumentTypeError,
    DTypeMismatchError,
    InvalidArgumentError,
    OutOfBlocksError,
    ShapeMismatchError,
)
from .paged_reserve import _tokens

__all__ = ["PagedPrefixMixin"]


class PagedPrefixMixin:
    """Blocks in and out for a second tier; mixed into PagedKVCache."""

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
