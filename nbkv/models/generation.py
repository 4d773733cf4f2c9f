"""Generation, apart from the model: the next token from logits (greedy or sampled),
:meth:`nbkv.models.Llama.generate`'s arguments checked, and its decoding loop over any
function from new token ids to the next token's logits.

>>> import numpy as np
>>> from nbkv.models.generation import pick_next
>>> pick_next(np.array([[0.0, 2.0, 1.0]]), 0.0, None)
array([1])
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..errors import ArgumentTypeError, InvalidArgumentError
from .config import LlamaConfig, _real, eos_ids

__all__ = ["FROM_CONFIG", "pick_next", "generate_args", "generate_tokens"]

FROM_CONFIG = object()  # generate(eos_token_id=...) default: the config's


def pick_next(
    logits: np.ndarray, temperature: float, rng: np.random.Generator | None
) -> NDArray[np.int64]:
    """Next ids [batch] from logits [batch, vocab]: argmax (``rng`` None), or a sample of
    ``softmax(logits / temperature)`` with one ``rng.random`` draw per row (what
    :meth:`nbkv.models.Llama.generate` and :class:`nbkv.serving.Engine` do)."""
    if rng is None:
        return logits.argmax(axis=-1).astype(np.int64)
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(len(cdf))[:, None] * cdf[:, -1:]
    # first index whose cumulative weight exceeds u
    return np.minimum((cdf <= u).sum(axis=-1), logits.shape[-1] - 1).astype(np.int64)


def generate_args(
    config: LlamaConfig, max_new_tokens: Any, temperature: Any, eos_token_id: Any, callback: Any
) -> tuple:
    """:meth:`nbkv.models.Llama.generate`'s arguments checked: ``(max_new_tokens, temperature, end
    ids)``; ``eos_token_id`` :data:`FROM_CONFIG` means ``config``'s end ids."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise ArgumentTypeError(
            f"max_new_tokens must be an int >= 0, got {type(max_new_tokens).__name__} "
            f"{max_new_tokens!r}"
        )
    if max_new_tokens < 0:
        raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    temperature = _real(temperature, "temperature", positive=False)
    if temperature < 0:
        raise InvalidArgumentError(f"temperature must be >= 0, got {temperature}")
    if eos_token_id is FROM_CONFIG:
        eos = config.eos_token_ids
    else:
        eos = eos_ids(eos_token_id, "eos_token_id")
    if callback is not None and not callable(callback):
        raise ArgumentTypeError(f"callback must be callable, got {type(callback).__name__}")
    return int(max_new_tokens), temperature, eos


def generate_tokens(
    next_logits: Callable[[np.ndarray], np.ndarray],
    ids: np.ndarray,
    max_new_tokens: int,
    temperature: float,
    eos: tuple[int, ...],
    seed: int | None,
    callback: Callable[[int, np.ndarray], Any] | None,
) -> NDArray[np.int64]:
    """:meth:`nbkv.models.Llama.generate`'s loop, its arguments checked (``max_new_tokens >= 1``).

    ``next_logits(new_ids)`` runs new ids [batch, n] after all before them and gives the
    logits after the last, [batch, vocab]; it gets the prompt ``ids`` [batch, prompt]
    first, then each token picked but the last. Returns int64 [batch, prompt + new].
    """
    batch, prompt = ids.shape
    rng = np.random.default_rng(seed) if temperature > 0 else None
    eos_arr = np.array(eos, np.int64)
    out = np.empty((batch, prompt + max_new_tokens), np.int64)
    out[:, :prompt] = ids
    done = np.zeros(batch, bool)
    logits = next_logits(ids)
    end = prompt + max_new_tokens
    for step in range(max_new_tokens):
        token = pick_next(logits, temperature, rng)
        if eos:
            token[done] = eos[0]
            done |= np.isin(token, eos_arr)
        out[:, prompt + step] = token
        if callback is not None:
            callback(step, token.copy())
        if done.all():
            end = prompt + step + 1
            break
        if step + 1 < max_new_tokens:
            logits = next_logits(token[:, None])
    return out[:, :end].copy()
