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

from .._validate import nonnegative_int, optional_positive_int, positive_int
from ..dtypes import resolve_dtype
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..models.config import LlamaConfig
from ..models.llama import default_weights as _model_weights

__all__ = [
    "MODEL_SHAPES",
    "ModelShape",
    "PassCost",
    "attention_weights",
    "default_weights",
    "forward_cost",
    "held_positions",
    "kv_bytes_per_token",
    "kv_head_of",
    "model_shape",
]


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: object = "float16"
) -> int:
    """Bytes of K and V one token adds to a model's cache: ``2 * L * H_kv * D * itemsize``.

    >>> kv_bytes_per_token(32, 8, 128)  # Llama-3.1-8B in float16: 128 KiB
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
    """The sizes of a decoder that decide its KV cache (and, optionally, its weights).

    ``sliding_window``: the positions a windowed layer attends to and caches (a rolling
    buffer of that many positions); ``window_layers``: how many of the layers use it (all of
    them when not given; Gemma-2 alternates, so half). ``max_context``: the longest sequence
    the model is made for; sizing a cache past it raises. ``hidden_size``,
    ``intermediate_size`` and ``vocab_size`` (a Llama-style gated MLP) give the parameter
    counts that :func:`forward_cost` needs; without them only the cache can be sized.

    >>> s = ModelShape("Falcon-7B", num_layers=32, num_attention_heads=71, num_kv_heads=1,
    ...                head_dim=64)
    >>> s.kind, s.kv_bytes_per_token(), s.kv_cache_bytes(4096) // 2**20  # MiB
    ('multi-query', 8192, 32)
    >>> w = ModelShape("windowed", 4, 8, 2, 32, sliding_window=16, window_layers=2)
    >>> w.kv_positions(100), w.kv_positions(10)  # 2 layers x 16 + 2 layers x 100; 4 x 10
    (232, 40)
    """

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int | None = None
    sliding_window: int | None = None
    window_layers: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            positive_int(getattr(self, f), f"ModelShape.{f}")
        for f in (
            "max_context",
            "sliding_window",
            "window_layers",
            "hidden_size",
            "intermediate_size",
            "vocab_size",
        ):
            optional_positive_int(getattr(self, f), f"ModelShape.{f}")
        if self.num_attention_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"ModelShape.num_kv_heads = {self.num_kv_heads} must divide "
                f"num_attention_heads = {self.num_attention_heads}"
            )
        if self.window_layers is not None:
            if self.sliding_window is None:
                raise InvalidArgumentError(
                    f"ModelShape.window_layers = {self.window_layers} needs a sliding_window"
                )
            if self.window_layers > self.num_layers:
                raise InvalidArgumentError(
                    f"ModelShape.window_layers = {self.window_layers} must be at most "
                    f"num_layers = {self.num_layers}"
                )

    @classmethod
    def from_config(cls, config: LlamaConfig, name: str = "model") -> ModelShape:
        """The shape of a :class:`nbkv.models.LlamaConfig` (its window, if any, on every
        layer; its context limit ``max_position_embeddings``)."""
        return cls(
            name,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            max_context=config.max_position_embeddings,
            sliding_window=config.sliding_window,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(config.tie_word_embeddings),
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

    @property
    def num_window_layers(self) -> int:
        """Layers with a sliding window (0 without one)."""
        if self.sliding_window is None:
            return 0
        return self.num_layers if self.window_layers is None else self.window_layers

    def kv_bytes_per_token(self, dtype: object = "float16") -> int:
        """Bytes of K and V per position held in every layer (batch 1)."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype)

    def _check_seq_len(self, seq_len: int) -> int:
        seq_len = positive_int(seq_len, "seq_len")
        if self.max_context is not None and seq_len > self.max_context:
            raise InvalidArgumentError(
                f"seq_len = {seq_len:,} is past {self.name}'s context of "
                f"{self.max_context:,} positions; size it at most there"
            )
        return seq_len

    def kv_positions(self, seq_len: int) -> int:
        """Positions held summed over the layers, once ``seq_len`` tokens have been seen:
        ``seq_len`` in a global layer, at most ``sliding_window`` in a windowed one."""
        seq_len = self._check_seq_len(seq_len)
        windowed = self.num_window_layers
        held = held_positions(seq_len, self.sliding_window)
        return windowed * held + (self.num_layers - windowed) * seq_len

    def kv_cache_bytes(self, seq_len: int, batch: int = 1, dtype: object = "float16") -> int:
        """Bytes of a cache that has seen ``seq_len`` tokens for each of ``batch``
        sequences: a windowed layer stops growing at its window."""
        batch = positive_int(batch, "batch")
        per_layer = self.kv_bytes_per_token(dtype) // self.num_layers
        return batch * self.kv_positions(seq_len) * per_layer

    def matmul_parameters(self) -> int:
        """Weights that take part in a matrix product for every token: the q, k, v and
        output projections, the gated MLP (gate, up, down) and the output head. The
        embedding table is only looked up, and the norms are elementwise."""
        missing = [
            f
            for f in ("hidden_size", "intermediate_size", "vocab_size")
            if getattr(self, f) is None
        ]
        if missing:
            raise InvalidArgumentError(
                f"{self.name}'s ModelShape has no {', '.join(missing)}: give them to count "
                "its weights"
            )
        d, inner = self.hidden_size, self.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = d * inner + 2 * d * kv + inner * d
        mlp = 3 * d * self.intermediate_size
        return self.num_layers * (attn + mlp) + self.vocab_size * d

    def num_parameters(self) -> int:
        """Every parameter: :meth:`matmul_parameters`, the embedding table (unless tied to
        the output head) and the RMSNorm weights (two per layer and a final one)."""
        matmul = self.matmul_parameters()  # raises first if the sizes are missing
        embed = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return matmul + embed + norms


def held_positions(seq_len: int, window: int | None) -> int:
    """Positions a layer holds after ``seq_len`` tokens: all of them, or at most ``window``.

    >>> held_positions(32768, None), held_positions(32768, 4096), held_positions(100, 4096)
    (32768, 4096, 100)
    """
    seq_len = nonnegative_int(seq_len, "seq_len")
    window = optional_positive_int(window, "window")
    return seq_len if window is None else min(seq_len, window)


# Published shapes: each model's config.json on the Hugging Face Hub (meta-llama/Llama-2-7b-hf,
# meta-llama/Llama-3.1-8B, meta-llama/Llama-3.1-70B, mistralai/Mistral-7B-v0.1,
# Qwen/Qwen2.5-7B, google/gemma-2-9b, tiiuae/falcon-7b), and for the windows and contexts:
# - Llama-2-7B: max_position_embeddings 4096, no GQA (32 KV heads);
# - Llama-3.1-8B / -70B: 131,072 positions (max_position_embeddings, llama3 RoPE scaling);
# - Mistral-7B-v0.1: sliding_window 4096 on every layer, a rolling buffer cache of 4,096
#   positions (Jiang et al. 2023, arXiv:2310.06825, section 2); trained at 8,192 positions
#   (its config says max_position_embeddings 32768; past the window it makes no difference
#   to the cache);
# - Qwen2.5-7B: 32,768 positions natively, 131,072 with YaRN rope scaling (Qwen2.5 model
#   cards);
# - Gemma-2-9B: 8,192 positions, layers alternating local (sliding window 4096) and global,
#   so 21 of its 42 layers windowed (Gemma 2 report, arXiv:2408.00118);
# - Falcon-7B: multi-query, trained at 2,048 positions (its model card).
# hidden/intermediate/vocab sizes are given where notebooks count weights (the Llamas): they
# reproduce the published parameter counts (tests/test_tutorial_shapes.py).
# Positional fields: name, num_layers, num_attention_heads, num_kv_heads, head_dim.
MODEL_SHAPES: tuple[ModelShape, ...] = (
    ModelShape(
        "Llama-2-7B",
        32,
        32,
        32,
        128,
        max_context=4096,
        hidden_size=4096,
        intermediate_size=11008,
        vocab_size=32000,
    ),
    ModelShape(
        "Llama-3.1-8B",
        32,
        32,
        8,
        128,
        max_context=131072,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
    ),
    ModelShape(
        "Llama-3.1-70B",
        80,
        64,
        8,
        128,
        max_context=131072,
        hidden_size=8192,
        intermediate_size=28672,
        vocab_size=128256,
    ),
    ModelShape("Mistral-7B-v0.1", 32, 32, 8, 128, max_context=8192, sliding_window=4096),
    ModelShape("Qwen2.5-7B", 28, 28, 4, 128, max_context=32768),
    ModelShape(
        "Gemma-2-9B", 42, 16, 8, 256, max_context=8192, sliding_window=4096, window_layers=21
    ),
    ModelShape("Falcon-7B", 32, 71, 1, 64, max_context=2048),
)


def model_shape(name: str) -> ModelShape:
    """The entry of :data:`MODEL_SHAPES` called ``name``.

    >>> model_shape("Llama-3.1-8B").group
    4
    """
    for s in MODEL_SHAPES:
        if s.name == name:
            return s
    raise InvalidArgumentError(
        f"no model shape called {name!r}; known: {', '.join(s.name for s in MODEL_SHAPES)}"
    )


def _keys_attended(past: int, tokens: int, window: int | None) -> int:
    """Sum over the ``tokens`` causal queries at positions ``past ... past + tokens - 1`` of
    the keys each attends to: ``p + 1`` for the query at ``p``, at most ``window``."""
    lo, hi = past + 1, past + tokens  # the key counts, before the window caps them
    if window is None or hi <= window:
        return (lo + hi) * tokens // 2
    if lo > window:
        return window * tokens
    return (lo + window) * (window - lo + 1) // 2 + window * (hi - window)


@dataclass(frozen=True)
class PassCost:
    """FLOPs and bytes of one forward pass over ``tokens`` new positions per sequence, with
    ``past`` positions already cached, for ``batch`` sequences (:func:`forward_cost`).

    Bytes count what must cross from memory at least once: every weight of a matrix product
    (once per pass, whatever the batch), the K/V of every position some query attends to,
    and the new K/V written. Activations are left out: they are small beside these.
    """

    tokens: int
    past: int
    batch: int
    weight_flops: int
    attention_flops: int
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int

    @property
    def flops(self) -> int:
        return self.weight_flops + self.attention_flops

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def flops_per_byte(self) -> float:
        """Arithmetic intensity: FLOPs done per byte moved."""
        return self.flops / self.bytes


def forward_cost(
    shape: ModelShape, tokens: int, past: int = 0, *, batch: int = 1, dtype: object = "bfloat16"
) -> PassCost:
    """FLOPs and bytes of one forward pass: a prefill (``tokens`` = the prompt, ``past`` 0)
    or a decode step (``tokens`` 1, ``past`` = the positions cached).

    - weights: ``2 * matmul_parameters`` FLOPs per token (a multiply and an add per weight),
      every position through every matrix, the output head included;
    - attention, per layer and query head: ``2 * head_dim`` FLOPs per key for the score
      ``q . k`` and as many for the weighted sum of V, so ``4 * n_q * S * heads * head_dim``
      for ``n_q`` queries over ``S`` keys; causal, the query at position ``p`` sees ``p + 1``
      keys (at most the window), so a prefill does about half of ``4 * n^2 * ...``;
    - K/V read: ``2 * S * kv_heads * head_dim * itemsize`` per layer, ``S`` the positions
      attended; written: the same for the ``tokens`` new positions.

    >>> s = ModelShape("toy", 1, 2, 1, 4, hidden_size=8, intermediate_size=8, vocab_size=16)
    >>> c = forward_cost(s, 1, past=3, dtype="float32")
    >>> c.attention_flops, c.kv_read_bytes, c.kv_write_bytes  # 4*4 keys*2 heads*4; 2*4*1*4*4
    (128, 128, 32)
    """
    tokens = positive_int(tokens, "tokens")
    past = nonnegative_int(past, "past")
    batch = positive_int(batch, "batch")
    shape._check_seq_len(past + tokens)
    itemsize = resolve_dtype(dtype).itemsize
    params = shape.matmul_parameters()
    per_position = 2 * shape.num_kv_heads * shape.head_dim * itemsize  # K and V, one layer
    windowed = shape.num_window_layers
    layers = ((windowed, shape.sliding_window), (shape.num_layers - windowed, None))
    keys = sum(n * _keys_attended(past, tokens, w) for n, w in layers)
    # the positions some query of the pass attends to, each read once
    touched = sum(
        n * (past + tokens if w is None else min(past + tokens, w + tokens - 1)) for n, w in layers
    )
    return PassCost(
        tokens=tokens,
        past=past,
        batch=batch,
        weight_flops=2 * params * tokens * batch,
        attention_flops=4 * shape.num_attention_heads * shape.head_dim * keys * batch,
        weight_bytes=params * itemsize,
        kv_read_bytes=touched * per_position * batch,
        kv_write_bytes=shape.num_layers * tokens * per_position * batch,
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
