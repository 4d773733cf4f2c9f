"""Elementwise ``@njit`` kernels of the reference decoder (nbkv.models): RMSNorm, SwiGLU
and rotary embeddings, fused so that each is one pass over its rows. Pure functions over
arrays; each writes only its ``out``."""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["rms_norm", "silu_mul", "rope"]


@njit(cache=True)
def rms_norm(x, weight, eps, out):
    """RMSNorm of each row. x, out: [rows, hidden] float32; weight: [hidden]. Writes out."""
    rows, hidden = x.shape
    for r in range(rows):
        # mean of squares in float64, so long rows lose nothing
        acc = 0.0
        for i in range(hidden):
            acc += np.float64(x[r, i]) * x[r, i]
        inv = np.float32(1.0 / np.sqrt(acc / hidden + eps))
        for i in range(hidden):
            out[r, i] = weight[i] * (x[r, i] * inv)


@njit(cache=True)
def silu_mul(gate_up, out):
    """SwiGLU: out = silu(gate) * up. gate_up: [rows, 2 * inter] ([gate | up]);
    out: [rows, inter]. Writes out."""
    rows, inter = out.shape
    one = np.float32(1.0)
    for r in range(rows):
        for i in range(inter):
            g = gate_up[r, i]
            # exp overflows to inf for very negative g, and g / inf is the right 0
            out[r, i] = g / (one + np.exp(-g)) * gate_up[r, inter + i]


@njit(cache=True)
def rope(x, cos, sin, out):
    """Rotate pairs (i, i + half) of each head: the "rotate_half" convention of Llama.

    x, out: [batch, n, heads, head_dim], any strides (out is usually a transposed view of
    a cache-layout array); cos, sin: [n, head_dim // 2]. Writes out.
    """
    batch, n, heads, head_dim = x.shape
    half = head_dim // 2
    for b in range(batch):
        for t in range(n):
            for h in range(heads):
                for i in range(half):
                    x1 = x[b, t, h, i]
                    x2 = x[b, t, h, i + half]
                    out[b, t, h, i] = x1 * cos[t, i] - x2 * sin[t, i]
                    out[b, t, h, i + half] = x2 * cos[t, i] + x1 * sin[t, i]
