"""Helpers for ``notebooks/04_long_contexts.ipynb``: rollback, beams, growth, sliding windows.

- :func:`speculative_greedy` decodes greedily with a model by speculation: a draft
  (by default :func:`lookup_draft`, which copies what followed the last occurrence of the
  newest few tokens) proposes ``k`` tokens, the model checks them in one forward pass, the
  cache is ``crop``-ped back to what it accepted; the result equals plain greedy decoding.
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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ..cache import LayerKVCache

__all__ = [
    "SpeculativeRun",
    "held_matrix",
    "held_positions",
    "lookup_draft",
    "speculative_greedy",
    "trace_decode",
    "window_reference",
]


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


# -- speculative decoding with a model -----------------------------------------------------


def lookup_draft(
    tokens: ArrayLike, k: int, *, max_ngram: int = 4, min_ngram: int = 1
) -> NDArray[np.int64]:
    """Up to ``k`` proposed next tokens, copied from what followed the latest earlier
    occurrence of the last ``n`` tokens, for the longest ``n`` from ``max_ngram`` down to
    ``min_ngram`` that occurs; empty when none does. No model runs: the draft is free.

    A copy that reaches the end of ``tokens`` continues from its own proposals (as an LZ77
    match may overlap itself), so a repeating pattern is continued for all ``k``.

    >>> [bytes(lookup_draft(list(s), 3).tolist()) for s in (b"abcXabc", b"abab")]
    [b'Xab', b'aba']
    >>> lookup_draft(list(b"abc"), 3).tolist()
    []
    """
    seq = np.asarray(tokens, np.int64).ravel()
    for n in range(min(max_ngram, len(seq) - 1), max(min_ngram, 1) - 1, -1):
        # every window of n tokens that ends before the last token, against the last n
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        starts = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if len(starts) and k > 0:
            after = int(starts[-1]) + n  # the token that followed the latest occurrence
            ext = seq.tolist()
            for i in range(k):
                ext.append(ext[after + i])
            return np.array(ext[len(seq) :], np.int64)
    return np.zeros(0, np.int64)


@dataclass(frozen=True)
class SpeculativeRun:
    """What :func:`speculative_greedy` did.

    Attributes
    ----------
    tokens : int64 [prompt + new]
        The prompt and the tokens decoded.
    drafted, accepted : int64 [rounds]
        Tokens the draft proposed and the model accepted in each verification round.
    cache_len : int64 [rounds]
        The cache's ``offset`` after each round's ``crop``: the tokens decoded so far, less
        the newest one (the model's own token, fed at the start of the next round).
    forward_passes : int
        Forward passes of the model, the prefill included (greedy decoding of ``new``
        tokens takes ``new``: the prefill gives the first).
    """

    tokens: NDArray[np.int64]
    drafted: NDArray[np.int64]
    accepted: NDArray[np.int64]
    cache_len: NDArray[np.int64]
    forward_passes: int


def speculative_greedy(
    model: Any,
    prompt_ids: ArrayLike,
    max_new_tokens: int,
    *,
    k: int = 4,
    draft: Callable[[NDArray[np.int64], int], ArrayLike] = lookup_draft,
    cache: Any = None,
) -> SpeculativeRun:
    """Greedy decoding of one sequence by speculation: draft ``k``, verify in one pass, crop.

    Each round, ``draft(tokens, k)`` proposes up to ``k`` tokens after ``tokens`` (all so
    far). The model runs one forward pass over its own newest token and the proposals;
    its logits give its greedy choice after each of them. The longest prefix of proposals
    equal to those choices is accepted, ``cache.crop`` drops the K/V of the rest, and the
    model's choice after the accepted prefix is appended (a correction, or one token
    more when all were accepted). The tokens are those of ``model.generate(prompt_ids,
    max_new_tokens, eos_token_id=None)``; only the number of forward passes differs.

    Parameters
    ----------
    model : nbkv.models.Llama
    prompt_ids : int array [prompt] (or [1, prompt])
    max_new_tokens : int >= 1
    k : int >= 0, default 4
        Tokens proposed per round at most (fewer in the last rounds, so that exactly
        ``max_new_tokens`` come out).
    draft : callable, default :func:`lookup_draft`
    cache : nbkv.KVCache, optional
        Empty, with room for ``prompt + max_new_tokens + k`` positions; by default
        ``model.new_cache(1, that)``.

    Returns
    -------
    SpeculativeRun

    >>> from nbkv.models import Llama
    >>> model = Llama.default()
    >>> prompt = list(b"def add(a, b):")
    >>> run = speculative_greedy(model, prompt, 12)
    >>> run.tokens.tolist() == model.generate(prompt, 12, eos_token_id=None)[0].tolist()
    True
    """
    prompt = np.asarray(prompt_ids, np.int64)
    if prompt.ndim == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.ndim != 1 or len(prompt) == 0:
        raise ValueError(f"prompt_ids must be one non-empty sequence, got shape {prompt.shape}")
    if max_new_tokens < 1 or k < 0:
        raise ValueError(f"need max_new_tokens >= 1 and k >= 0, got {max_new_tokens} and {k}")
    if cache is None:
        cache = model.new_cache(1, len(prompt) + max_new_tokens + k)
    elif cache.offset:
        raise ValueError(f"cache must be empty, it has seen {cache.offset} tokens")
    out = list(prompt.tolist())
    out.append(int(model.forward(prompt[None], cache)[0, -1].argmax()))  # prefill
    passes, drafted, accepted, cache_len = 1, [], [], []
    while len(out) - len(prompt) < max_new_tokens:
        room = min(k, max_new_tokens - (len(out) - len(prompt)) - 1)
        proposal = np.asarray(draft(np.array(out, np.int64), room), np.int64).ravel()[:room]
        start = cache.offset  # every token so far but the newest
        logits = model.forward(np.array([[out[-1], *proposal.tolist()]]), cache)[0]
        passes += 1
        choice = logits.argmax(axis=-1)  # the model's greedy token after each fed token
        m = 0
        while m < len(proposal) and proposal[m] == choice[m]:
            m += 1
        cache.crop(start + 1 + m)  # keep the newest token and the accepted proposals
        out.extend(proposal[:m].tolist())
        out.append(int(choice[m]))
        drafted.append(len(proposal))
        accepted.append(m)
        cache_len.append(cache.offset)
    return SpeculativeRun(
        np.array(out, np.int64),
        np.array(drafted, np.int64),
        np.array(accepted, np.int64),
        np.array(cache_len, np.int64),
        passes,
    )
