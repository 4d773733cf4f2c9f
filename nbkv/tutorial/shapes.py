"""Model shapes, KV-cache sizes and attention weights, for ``notebooks/02_attention_decoding``.

A decoder caches one key and one value vector per KV head, per layer, per token, so

    bytes per token = 2 * num_layers * num_kv_heads * head_dim * itemsize

and grouped-query attention (fewer KV heads than query heads; query head ``h`` reads KV
head ``h // group``) divides it by ``group = num_attention_heads // num_kv_heads``.

>>> from nbkv.tutorial.shapes import MODEL_SHAPES
>>> llama2, llama3 = MODEL_SHAPES[0], MODEL_SHAPES[1]
>>> llama2.kind, llama2.kv_bytes_per_token()  # 2 * 32 * 32 * 128 * 2 bytes
('multi-head', 524288)
>>> llama3.kind, llama3.group, llama3.kv_bytes_per_token()
('grouped-query', 4, 131072)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._validate import positive_int
from ..dtypes import resolve_dtype
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..models.config import LlamaConfig
from ..models.llama import default_weights as _model_weights

__all__ = [
    "MODEL_SHAPES",
    "ModelShape",
    "attention_weights",
    "default_weights",
    "kv_bytes_per_token",
    "kv_head_of",
]


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: object = "float16"
) -> int:
    """Bytes of K and V one token adds to a model's cache: ``2 * L * H_kv * D * itemsize``.

    >>> kv_bytes_per_token(32, 8, 128)  # Llama-3-8B in float16: 128 KiB
    131072
    >>> kv_bytes_per_token(4, 2, 32, "float32")  # nbkv.models.Llama.default()
    2048
    """
    num_layers = positive_int(num_layers, "num_layers")
    num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
    head_dim = positive_int(head_dim, "head_dim")
    return 2 * num_layers * num_kv_heads * head_dim * resolve_dtype(dtype).itemsize


def kv_head_of(h: int, num_heads: int, num_kv_heads: int) -> int:
    """The KV head query head ``h`` reads: ``h // (num_heads // num_kv_heads)``.

    >>> [kv_head_of(h, 8, 2) for h in range(8)]
    [0, 0, 0, 0, 1, 1, 1, 1]
    """
    num_heads = positive_int(num_heads, "num_heads")
    num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
    if num_heads % num_kv_heads:
        raise InvalidArgumentError(
            f"num_kv_heads = {num_kv_heads} must divide num_heads = {num_heads}"
        )
    if not 0 <= h < num_heads:
        raise InvalidArgumentError(f"h must be in [0, {num_heads}), got {h}")
    return h // (num_heads // num_kv_heads)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that decide its KV cache.

    >>> s = ModelShape("Falcon-7B", num_layers=32, num_attention_heads=71, num_kv_heads=1,
    ...                head_dim=64)
    >>> s.kind, s.kv_bytes_per_token(), s.kv_cache_bytes(4096) // 2**20  # MiB
    ('multi-query', 8192, 32)
    """

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            positive_int(getattr(self, f), f"ModelShape.{f}")
        if self.num_attention_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"ModelShape.num_kv_heads = {self.num_kv_heads} must divide "
                f"num_attention_heads = {self.num_attention_heads}"
            )

    @classmethod
    def from_config(cls, config: LlamaConfig, name: str = "model") -> ModelShape:
        """The shape of a :class:`nbkv.models.LlamaConfig`."""
        return cls(
            name,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_kv_heads

    @property
    def kind(self) -> str:
        """``"multi-head"`` (a KV head per query head), ``"multi-query"`` (one KV head)
        or ``"grouped-query"`` (in between)."""
        if self.num_kv_heads == self.num_attention_heads:
            return "multi-head"
        return "multi-query" if self.num_kv_heads == 1 else "grouped-query"

    def kv_bytes_per_token(self, dtype: object = "float16") -> int:
        """Bytes of K and V per token, all layers (batch 1)."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype)

    def kv_cache_bytes(self, seq_len: int, batch: int = 1, dtype: object = "float16") -> int:
        """Bytes of a cache holding ``seq_len`` tokens for each of ``batch`` sequences."""
        seq_len = positive_int(seq_len, "seq_len")
        batch = positive_int(batch, "batch")
        return batch * seq_len * self.kv_bytes_per_token(dtype)


# published configs (config.json on the Hugging Face Hub)
MODEL_SHAPES: tuple[ModelShape, ...] = (
    ModelShape("Llama-2-7B", num_layers=32, num_attention_heads=32, num_kv_heads=32, head_dim=128),
    ModelShape("Llama-3-8B", num_layers=32, num_attention_heads=32, num_kv_heads=8, head_dim=128),
    ModelShape("Mistral-7B", num_layers=32, num_attention_heads=32, num_kv_heads=8, head_dim=128),
    ModelShape("Falcon-7B", num_layers=32, num_attention_heads=71, num_kv_heads=1, head_dim=64),
)


def attention_weights(
    q: ArrayLike, K: ArrayLike, *, scale: float | None = None, causal: bool = True
) -> NDArray[np.float64]:
    """Softmax attention weights of ``q`` over cached keys ``K``, in float64.

    q: [batch, num_heads, n_q, head_dim], the queries of the last ``n_q`` positions;
    K: [batch, num_kv_heads, seq_len, head_dim] ("bhsd"). Query head ``h`` reads KV head
    ``h // group``. Returns [batch, num_heads, n_q, seq_len]; each row sums to 1, and
    ``weights @ V`` (V of KV head ``h // group``) is :func:`nbkv.reference.attention`.

    >>> import numpy as np
    >>> q = np.zeros((1, 4, 1, 8)); K = np.ones((1, 2, 3, 8))
    >>> attention_weights(q, K)[0, :, 0].round(3).tolist()[0]  # equal scores: uniform
    [0.333, 0.333, 0.333]
    """
    q64 = np.asarray(q, np.float64)
    K64 = np.asarray(K, np.float64)
    if q64.ndim != 4 or K64.ndim != 4:
        raise ShapeMismatchError(f"q and K must be 4-D, got shapes {q64.shape} and {K64.shape}")
    batch, num_heads, n_q, head_dim = q64.shape
    kb, num_kv_heads, seq_len, kd = K64.shape
    if (kb, kd) != (batch, head_dim) or num_heads % num_kv_heads or n_q > seq_len:
        raise ShapeMismatchError(
            f"q of shape {q64.shape} does not fit K of shape {K64.shape} (batch and "
            "head_dim must match, num_kv_heads divide num_heads, n_q <= seq_len)"
        )
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    # [batch, kv_heads, group, n_q, head_dim] @ [batch, kv_heads, 1, head_dim, seq_len]
    qg = q64.reshape(batch, num_kv_heads, group, n_q, head_dim)
    scores = (qg @ K64[:, :, None].swapaxes(-1, -2)) * scale
    scores = scores.reshape(batch, num_heads, n_q, seq_len)
    if causal:
        pos = np.arange(seq_len - n_q, seq_len)[:, None]
        scores = np.where(np.arange(seq_len)[None, :] <= pos, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def default_weights() -> dict[str, NDArray[np.float32]]:
    """The weights of :meth:`nbkv.models.Llama.default`, by Hugging Face name (float32).

    ``Llama`` keeps its weights private (and fused: ``[q; k; v]`` in one matrix); this
    gives the same seeded arrays, one per checkpoint tensor, for following a forward pass
    by hand.

    >>> w = default_weights()
    >>> w["model.layers.0.self_attn.k_proj.weight"].shape  # [kv_heads * head_dim, hidden]
    (64, 256)
    """
    return _model_weights()
