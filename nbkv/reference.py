"""Slow, obvious NumPy references that tests, notebooks and benchmarks compare against.

Nothing here is fast or clever: each function says what the result must be in the
plainest NumPy there is. The cache references grow by concatenation, exactly what nbkv's
preallocated buffers exist to avoid, so they are easy to trust.
"""

from __future__ import annotations

import numpy as np

from .layout import SEQ_AXIS, check_layout

__all__ = ["append", "attention", "empty_kv"]


def empty_kv(
    batch: int, num_kv_heads: int, head_dim: int, dtype, layout: str = "bhsd"
) -> tuple[np.ndarray, np.ndarray]:
    """K and V holding no position: shape [batch, num_kv_heads, 0, head_dim] (in layout)."""
    check_layout(layout)
    shape = [batch, num_kv_heads, head_dim]
    shape.insert(SEQ_AXIS[layout], 0)
    return np.empty(shape, dtype), np.empty(shape, dtype)


def append(
    K: np.ndarray, V: np.ndarray, k: np.ndarray, v: np.ndarray, layout: str = "bhsd"
) -> tuple[np.ndarray, np.ndarray]:
    """What a cache holding ``(K, V)`` must hold after ``append(k, v)``: new arrays."""
    axis = SEQ_AXIS[check_layout(layout)]
    return np.concatenate([K, k], axis=axis), np.concatenate([V, v], axis=axis)


def attention(
    q: np.ndarray,
    K: np.ndarray,
    V: np.ndarray,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
    layout: str = "bhsd",
) -> np.ndarray:
    """Attention of ``q`` over the cached ``K``, ``V``, in float64, the obvious way.

    q: shape [batch, num_heads, n_q, head_dim]; the queries are the last ``n_q`` of the
    ``seq_len`` positions held. K, V: shape [batch, num_kv_heads, seq_len, head_dim] (in
    ``layout``). Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    Query ``i`` (at position ``p = seq_len - n_q + i``) sees positions ``j <= p`` when
    ``causal``, and ``j > p - window`` when ``window`` is given.

    Returns float64, shape [batch, num_heads, n_q, head_dim].
    """
    if check_layout(layout) == "bshd":
        K, V = K.transpose(0, 2, 1, 3), V.transpose(0, 2, 1, 3)
    q64, K64, V64 = (np.asarray(x, np.float64) for x in (q, K, V))
    batch, num_heads, n_q, head_dim = q64.shape
    seq_len = K64.shape[2]
    group = num_heads // K64.shape[1]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    pos = np.arange(seq_len - n_q, seq_len)[:, None]  # each query's own position
    j = np.arange(seq_len)[None, :]
    visible = np.ones((n_q, seq_len), bool)
    if causal:
        visible &= j <= pos
    if window is not None:
        visible &= j > pos - window
    out = np.empty_like(q64)
    for b in range(batch):
        for h in range(num_heads):
            scores = q64[b, h] @ K64[b, h // group].T * scale  # [n_q, seq_len]
            scores = np.where(visible, scores, -np.inf)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            out[b, h] = weights @ V64[b, h // group]
    return out
