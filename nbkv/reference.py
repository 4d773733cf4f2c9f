"""Slow, obvious NumPy references that tests, notebooks and benchmarks compare against.

Nothing here is fast or clever: each function says what the result must be in the
plainest NumPy there is. The cache references grow by concatenation, exactly what nbkv's
preallocated buffers exist to avoid, so they are easy to trust.
"""

from __future__ import annotations

import numpy as np

from .layout import SEQ_AXIS, check_layout

__all__ = ["append", "empty_kv"]


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
