"""The decoder's arithmetic over plain float32 arrays, with no cache of its own.

:class:`Decoder` holds a Llama-architecture model's weights, each layer's fused for fewer
matrix products, and runs the pass through every layer (RMSNorm, rotary position
embeddings, grouped-query attention, a SwiGLU MLP) around an ``attend`` callback that
decides where each layer's K/V go. :class:`nbkv.models.Llama` owns one and supplies the
attention: through an nbkv cache, a paged cache, or :func:`dense_attention` over the
whole sequence (the baseline a cache must match).

>>> import numpy as np
>>> from nbkv.models import DEFAULT_CONFIG, seeded_weights
>>> from nbkv.models.decoder import Decoder, dense_attention
>>> from nbkv.models.weights import float32_weights
>>> decoder = Decoder(DEFAULT_CONFIG, float32_weights(DEFAULT_CONFIG, seeded_weights(0)))
>>> logits = decoder.run(
...     np.array([[72, 105, 33]]), 0, lambda i, q, k, v: dense_attention(q, k, v, None), "bhsd"
... )
>>> logits.shape, logits.dtype
((1, 3, 256), dtype('float32'))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..kernels.cpu_model import rms_norm, rope, silu_mul
from .config import _F32, LlamaConfig, _inv_freq

__all__ = ["Decoder", "dense_attention"]

# -- attention -----------------------------------------------------------------------


def dense_attention(
    q: NDArray[np.float32],
    k: NDArray[np.float32],
    v: NDArray[np.float32],
    window: int | None,
    sinks: int = 0,
) -> NDArray[np.float32]:
    """Causal attention over a whole sequence, in batched float32 NumPy, no cache.

    q: [batch, num_heads, n, head_dim]; k, v: [batch, num_kv_heads, n, head_dim].
    Queries are grouped per KV head by a reshape, so K/V are never repeated.
    """
    batch, num_heads, n, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qg = q.reshape(batch, num_kv_heads, group * n, head_dim)
    scores = (qg @ k.transpose(0, 1, 3, 2)).reshape(batch, num_kv_heads, group, n, n)
    scores *= np.float32(1.0 / math.sqrt(head_dim))
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    visible = j <= i
    if window is not None:
        visible &= (j > i - window) | (j < sinks)  # sinks stay visible beside the window
    scores = np.where(visible, scores, np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out = weights.reshape(batch, num_kv_heads, group * n, n) @ v
    return out.reshape(batch, num_heads, n, head_dim)


# -- the decoder ---------------------------------------------------------------------


class _Layer:
    """One decoder layer's weights, fused for fewer matrix products."""

    __slots__ = ("input_norm", "wqkv", "wo", "post_norm", "wgu", "wdown")

    def __init__(self, w: Mapping[str, np.ndarray], i: int) -> None:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        self.input_norm = w[p + "input_layernorm.weight"]
        # [q; k; v] rows: one product gives all three, [out, in] as stored
        self.wqkv = np.concatenate(
            [w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]
        )
        self.wo = w[a + "o_proj.weight"]
        self.post_norm = w[p + "post_attention_layernorm.weight"]
        self.wgu = np.concatenate([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        self.wdown = w[p + "mlp.down_proj.weight"]


class Decoder:
    """A Llama-architecture decoder's weights as it computes with them, and its pass.

    Parameters
    ----------
    config : LlamaConfig
    w : mapping of str -> float32 array
        Hugging Face names, checked and converted
        (:func:`nbkv.models.weights.float32_weights`).
    """

    __slots__ = ("config", "embed", "layers", "norm", "lm_head", "inv_freq")

    def __init__(self, config: LlamaConfig, w: Mapping[str, np.ndarray]) -> None:
        self.config = config
        self.embed = w["model.embed_tokens.weight"]
        self.layers = [_Layer(w, i) for i in range(config.num_hidden_layers)]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else w["lm_head.weight"]
        self.inv_freq = _inv_freq(config)

    def arrays(self) -> list[np.ndarray]:
        """Every weight as the pass uses it (fused), in a fixed order: what
        :attr:`nbkv.models.Llama.identity` hashes."""
        arrays = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            arrays += [layer.input_norm, layer.wqkv, layer.wo, layer.post_norm]
            arrays += [layer.wgu, layer.wdown]
        return arrays

    def run(
        self, ids: np.ndarray, pos: Any, attend: Callable, layout: str, last: Any = None
    ) -> np.ndarray:
        """The decoder over ids [batch, n] at positions [pos, pos + n) (or at ``pos[j]``
        for column j, when ``pos`` is an array: a packed batch of several sequences).

        ``attend(i, q, k, v)`` gives layer i's attention output [batch, num_heads, n,
        head_dim] for rotated q [batch, num_heads, n, head_dim] and k, v in ``layout``.
        ``last``: the columns whose logits are wanted (all by default), [batch, len(last),
        vocab].
        """
        c = self.config
        batch, n = ids.shape
        rows = batch * n
        heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
        eps = c.rms_norm_eps
        # rotary angles of these positions, in float32 as transformers computes them
        at = np.arange(pos, pos + n) if np.isscalar(pos) else np.asarray(pos)
        angles = at.astype(np.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        bshd = layout == "bshd"

        x = self.embed[ids.reshape(rows)]  # [rows, hidden], our own copy
        h = np.empty_like(x)
        for i, layer in enumerate(self.layers):
            rms_norm(x, layer.input_norm, eps, h)
            qkv = h @ layer.wqkv.T  # [rows, q_dim + 2 * kv_dim]
            q_in = qkv[:, :q_dim].reshape(batch, n, heads, head_dim)
            k_in = qkv[:, q_dim : q_dim + kv_dim].reshape(batch, n, kv_heads, head_dim)
            v = qkv[:, q_dim + kv_dim :].reshape(batch, n, kv_heads, head_dim)
            # rotated q in [batch, heads, n, head_dim]; rotated k in the cache's layout
            q = np.empty((batch, heads, n, head_dim), _F32)
            rope(q_in, cos, sin, q.transpose(0, 2, 1, 3))
            if bshd:
                k = np.empty((batch, n, kv_heads, head_dim), _F32)
                rope(k_in, cos, sin, k)
            else:
                k = np.empty((batch, kv_heads, n, head_dim), _F32)
                rope(k_in, cos, sin, k.transpose(0, 2, 1, 3))
                v = v.transpose(0, 2, 1, 3)
            o = attend(i, q, k, v)  # [batch, heads, n, head_dim]
            x += o.transpose(0, 2, 1, 3).reshape(rows, q_dim) @ layer.wo.T
            rms_norm(x, layer.post_norm, eps, h)
            gate_up = h @ layer.wgu.T  # [rows, 2 * intermediate]
            act = np.empty((rows, c.intermediate_size), _F32)
            silu_mul(gate_up, act)
            x += act @ layer.wdown.T
        rms_norm(x, self.norm, eps, h)
        if last is not None:  # only these columns' logits: the lm_head is the largest product
            h = np.ascontiguousarray(h.reshape(batch, n, -1)[:, last]).reshape(-1, h.shape[-1])
            n = h.shape[0] // batch
        return (h @ self.lm_head.T).reshape(batch, n, c.vocab_size)
