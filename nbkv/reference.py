"""Slow, obvious NumPy references that tests, notebooks and benchmarks compare against.

Nothing here is fast or clever: each function says what the result must be in the
plainest NumPy there is. The cache references grow by concatenation, exactly what nbkv's
preallocated buffers exist to avoid, so they are easy to trust.
"""

from __future__ import annotations

import numpy as np

from .layout import SEQ_AXIS, check_layout

__all__ = ["append", "attention", "empty_kv", "quantize", "dequantize", "quantized_kv"]


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


# -- the quantized cache (KIVI), as nbkv.QuantizedKVCache defines it -----------------


def _to16(x: np.ndarray, kind: str) -> np.ndarray:
    """float32 ``x`` rounded to the 16-bit type ``kind`` ("float16" or "bfloat16"), back
    as float32 (round to nearest, ties to even)."""
    x = np.asarray(x, np.float32)
    if kind == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def quantize(
    x: np.ndarray, bits: int, axis: int, kind: str = "float16"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize ``x`` (float32) with one scale and zero point per slice along ``axis``
    (the group's members): ``(codes, scale, zero)``, scale and zero as float32 values of
    their 16-bit storage (``kind``), reduced along ``axis`` with keepdims.

    ``scale = (max - min) / (2**bits - 1)`` and ``zero = min`` in float32, each rounded to
    ``kind``; ``code = clip(rint((x - zero) / scale), 0, 2**bits - 1)``, 0 where the scale
    is 0."""
    x = np.asarray(x, np.float32)
    levels = np.float32(2**bits - 1)
    lo = x.min(axis=axis, keepdims=True)
    hi = x.max(axis=axis, keepdims=True)
    scale = _to16((hi - lo) / levels, kind)
    zero = _to16(lo, kind)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.rint((x - zero) / np.where(scale == 0, np.float32(1), scale))
    codes = np.where(scale == 0, 0, np.clip(c, 0, levels)).astype(np.uint8)
    return codes, scale, zero


def dequantize(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """``zero + code * scale`` in float32."""
    return (zero + codes.astype(np.float32) * scale).astype(np.float32)


def quantized_kv(
    k: np.ndarray,
    v: np.ndarray,
    q_len: int,
    *,
    bits: tuple[int, int],
    group_size: int,
    kind: str = "float16",
) -> tuple[np.ndarray, np.ndarray]:
    """What a quantized cache holding ``k``, ``v`` (float32, [batch, heads, seq, head_dim])
    with positions ``[0, q_len)`` in codes returns (float32, before rounding to its dtype):
    K quantized per channel over groups of ``group_size`` positions, V per position over
    groups of ``min(group_size, head_dim)`` channels, the window ``[q_len, seq)`` as is."""
    batch, heads, seq, dim = k.shape
    G, Gv = group_size, min(group_size, dim)
    K, V = np.array(k, np.float32), np.array(v, np.float32)
    if q_len:
        kg = K[:, :, :q_len].reshape(batch, heads, q_len // G, G, dim)
        K[:, :, :q_len] = dequantize(*quantize(kg, bits[0], 3, kind)).reshape(
            batch, heads, q_len, dim
        )
        vg = V[:, :, :q_len].reshape(batch, heads, q_len, dim // Gv, Gv)
        V[:, :, :q_len] = dequantize(*quantize(vg, bits[1], 4, kind)).reshape(
            batch, heads, q_len, dim
        )
    return K, V
