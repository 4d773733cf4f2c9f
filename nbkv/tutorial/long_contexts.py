"""Helpers for ``notebooks/04_long_contexts.ipynb``: rollback, beams, growth, sliding windows.

- :func:`speculate` is one round of speculative decoding on a cache: append the draft
  tokens' K/V, keep the first ``accepted``, ``trim`` the rest.
- :func:`held_positions` says which sequence positions a
  :class:`nbkv.RotatingKVCache` holds after ``offset`` tokens (the first ``sinks`` and the
  last ``window - sinks``), in the temporal order ``get_kv`` returns them;
  :func:`held_matrix` stacks that over decode steps, and :func:`window_reference` takes
  those positions out of full K/V arrays (what the rotating cache must equal).
- :func:`trace_decode` appends random positions to a cache step by step and records
  ``seq_len``, ``offset``, capacity and bytes after each step.

>>> held_positions(10, window=6, sinks=2).tolist()
[0, 1, 6, 7, 8, 9]
"""

from __future__ import annotations

import numpy as np

from ..cache import LayerKVCache

__all__ = ["held_matrix", "held_positions", "speculate", "trace_decode", "window_reference"]


def held_positions(offset: int, window: int, sinks: int = 0) -> np.ndarray:
    """The positions a ``RotatingKVCache(window, sinks=sinks)`` holds after ``offset`` tokens.

    The sinks ``[0, min(offset, sinks))`` then the last ``window - sinks`` positions after
    them, ascending (the order of ``get_kv``), as int64.

    >>> held_positions(3, window=4, sinks=1).tolist(), held_positions(9, 4, 1).tolist()
    ([0, 1, 2], [0, 6, 7, 8])
    """
    if not 0 <= sinks < window:
        raise ValueError(f"need 0 <= sinks < window, got sinks={sinks}, window={window}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    head = np.arange(min(offset, sinks))
    tail = np.arange(max(sinks, offset - (window - sinks)), offset)
    return np.concatenate([head, tail]).astype(np.int64)


def held_matrix(window: int, sinks: int, steps: int) -> np.ndarray:
    """Boolean ``[positions, steps]``: entry ``[p, t]`` is True when position ``p`` is held
    after step ``t`` (one token appended per step, so ``t + 1`` tokens seen)."""
    out = np.zeros((steps, steps), bool)
    for t in range(steps):
        out[held_positions(t + 1, window, sinks), t] = True
    return out


def window_reference(
    K: np.ndarray, V: np.ndarray, window: int, sinks: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The positions of full ``K``, ``V`` (``[batch, heads, seq, head_dim]``) that a rotating
    cache which saw all of them holds, in temporal order (new arrays)."""
    keep = held_positions(K.shape[2], window, sinks)
    return K[:, :, keep], V[:, :, keep]


def speculate(cache: LayerKVCache, draft_k: np.ndarray, draft_v: np.ndarray, accepted: int) -> int:
    """Append the K/V of ``n`` draft tokens, keep the first ``accepted``, trim the rest.

    Returns how many positions ``trim`` dropped (``n - accepted``). The verification that
    decides ``accepted`` is the caller's (here: any number in ``[0, n]``).
    """
    n = draft_k.shape[2]
    if not 0 <= accepted <= n:
        raise ValueError(f"accepted must be in [0, {n}], got {accepted}")
    cache.append(draft_k, draft_v)
    return cache.trim(n - accepted)


def trace_decode(
    cache: LayerKVCache, steps: int, *, chunk: int = 1, seed: int = 0
) -> dict[str, np.ndarray]:
    """Append ``chunk`` random positions ``steps`` times; record the cache after each append.

    The cache must have its sizes fixed (batch, num_kv_heads, head_dim, dtype given).
    Returns arrays of length ``steps``: ``tokens`` (appended so far), ``seq_len``,
    ``offset`` (a rotating cache's; ``seq_len`` for any other), ``capacity``
    (``max_seq_len``) and ``nbytes``.
    """
    if None in (cache.batch, cache.num_kv_heads, cache.head_dim, cache.dtype):
        raise ValueError(
            "trace_decode needs a cache built with batch, num_kv_heads, head_dim and dtype"
        )
    rng = np.random.default_rng(seed)
    shape = (cache.batch, cache.num_kv_heads, chunk, cache.head_dim)
    k = rng.standard_normal(shape).astype(cache.dtype)
    v = rng.standard_normal(shape).astype(cache.dtype)
    rows = {
        name: np.zeros(steps, np.int64)
        for name in ("tokens", "seq_len", "offset", "capacity", "nbytes")
    }
    for t in range(steps):
        cache.append(k, v)
        rows["tokens"][t] = (t + 1) * chunk
        rows["seq_len"][t] = cache.seq_len
        rows["offset"][t] = getattr(cache, "offset", cache.seq_len)
        rows["capacity"][t] = cache.max_seq_len
        rows["nbytes"][t] = cache.nbytes
    return rows
