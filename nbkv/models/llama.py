"""A small Llama-style decoder in NumPy whose keys and values live in an nbkv cache.

RMSNorm, rotary position embeddings (plain, linear or "llama3" scaled), grouped-query
attention through nbkv, and a SwiGLU MLP, with Hugging Face's weight names, so that a
Llama-architecture checkpoint (``config.json`` + safetensors) loads as it is. Matrix
products run in NumPy float32; the elementwise steps (RMSNorm, rotary, SwiGLU) are small
fused ``@njit`` kernels.

It exists to drive the cache the way a real decoder does, and to check it against a
decoder that keeps no cache (:meth:`Llama.forward_nocache`) and against transformers.

>>> import numpy as np
>>> from nbkv.models import Llama
>>> model = Llama.default()
>>> out = model.generate(np.array([72, 105, 33]), 5, eos_token_id=None)
>>> out.shape, out.dtype
((1, 8), dtype('int64'))
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from numba import njit
from numpy.typing import ArrayLike, NDArray

from .._safetensors import SafetensorsError, load_file
from .._units import human_bytes
from .._validate import positive_int
from ..attention import attention
from ..backends import DEVICES
from ..cache import DEFAULT_MAX_SEQ_LEN, KVCache
from ..errors import (
    ArgumentTypeError,
    CacheOverflowError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
)
from ..rotating import RotatingKVCache

__all__ = ["Llama", "LlamaConfig"]

_F32 = np.dtype(np.float32)

ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
# model_type values whose checkpoints are this architecture under these weight names
_MODEL_TYPES = ("llama", "mistral")


# -- configuration -----------------------------------------------------------------


def _real(value: object, name: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise InvalidArgumentError(f"{name} must be a positive finite number, got {value}")
    return value


def _token_id(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def _eos_ids(value: object, name: str) -> tuple[int, ...]:
    """``None``, an id or a sequence of ids, as a tuple of ids (empty for None)."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(_token_id(v, name) for v in value)
    return (_token_id(value, name),)


def _rope_scaling(scaling: object, max_position_embeddings: int) -> dict | None:
    """Check a rope scaling dict; return it with ``rope_type`` set, or None for plain."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ArgumentTypeError(
            f"rope_scaling must be None or a dict, got {type(scaling).__name__} {scaling!r}"
        )
    s = dict(scaling)
    kind = s.pop("rope_type", s.pop("type", None))
    s.pop("type", None)
    s.pop("rope_theta", None)  # kept in LlamaConfig.rope_theta
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise InvalidArgumentError(
            f"rope_scaling type must be one of {ROPE_TYPES}, got {kind!r} (in {dict(scaling)})"
        )
    s["factor"] = _real(s.get("factor"), f"rope_scaling[{kind!r}]['factor']")
    if kind == "llama3":
        for key in _LLAMA3_KEYS[1:]:
            s[key] = _real(s.get(key), f"rope_scaling['llama3'][{key!r}]")
        if s["high_freq_factor"] <= s["low_freq_factor"]:
            raise InvalidArgumentError(
                "rope_scaling['llama3'] needs high_freq_factor > low_freq_factor, got "
                f"{s['high_freq_factor']} and {s['low_freq_factor']}"
            )
        # transformers falls back to max_position_embeddings here
        original = s.get("original_max_position_embeddings")
        s["original_max_position_embeddings"] = positive_int(
            max_position_embeddings if original is None else original,
            "rope_scaling['llama3']['original_max_position_embeddings']",
        )
    return {"rope_type": kind, **s}


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """The sizes and constants of a Llama-style decoder (Hugging Face's names).

    Parameters
    ----------
    vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads : int
    num_key_value_heads : int, optional
        KV heads (grouped-query attention); must divide ``num_attention_heads``. Default:
        ``num_attention_heads``.
    head_dim : int, optional
        Even. Default: ``hidden_size // num_attention_heads``.
    rms_norm_eps : float, default 1e-6
    rope_theta : float, default 10000.0
        The rotary base.
    rope_scaling : dict, optional
        None for plain rotary, or ``{"rope_type": "linear", "factor": f}`` or
        ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}`` (the last defaults to
        ``max_position_embeddings``), computed as transformers computes them.
    max_position_embeddings : int, default 2048
    tie_word_embeddings : bool, default False
        The output projection is the embedding matrix.
    bos_token_id : int, optional
    eos_token_id : int or tuple of int, optional
        Where :meth:`Llama.generate` stops by default.
    sliding_window : int, optional
        Each query sees only the last ``sliding_window`` positions (itself included).

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError
        A size that is not a positive int, heads that do not group, an odd head_dim, an
        unsupported rope scaling.

    Examples
    --------
    >>> from nbkv.models import LlamaConfig
    >>> c = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
    ...                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> c.head_dim, c.eos_token_ids
    (8, (2,))
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            put(name, positive_int(getattr(self, name), f"LlamaConfig.{name}"))
        heads = self.num_attention_heads
        kv = heads if self.num_key_value_heads is None else self.num_key_value_heads
        put("num_key_value_heads", positive_int(kv, "LlamaConfig.num_key_value_heads"))
        if heads % self.num_key_value_heads:
            raise InvalidArgumentError(
                f"LlamaConfig.num_key_value_heads must divide num_attention_heads = {heads}, "
                f"got {self.num_key_value_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % heads:
                raise InvalidArgumentError(
                    f"LlamaConfig.hidden_size = {self.hidden_size} is not a multiple of "
                    f"num_attention_heads = {heads}; give head_dim"
                )
            put("head_dim", self.hidden_size // heads)
        put("head_dim", positive_int(self.head_dim, "LlamaConfig.head_dim"))
        if self.head_dim % 2:
            raise InvalidArgumentError(
                f"LlamaConfig.head_dim must be even (rotary pairs), got {self.head_dim}"
            )
        put("rms_norm_eps", _real(self.rms_norm_eps, "LlamaConfig.rms_norm_eps"))
        put("rope_theta", _real(self.rope_theta, "LlamaConfig.rope_theta"))
        put("rope_scaling", _rope_scaling(self.rope_scaling, self.max_position_embeddings))
        if not isinstance(self.tie_word_embeddings, (bool, np.bool_)):
            raise ArgumentTypeError(
                f"LlamaConfig.tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}"
            )
        put("tie_word_embeddings", bool(self.tie_word_embeddings))
        if self.bos_token_id is not None:
            put("bos_token_id", _token_id(self.bos_token_id, "LlamaConfig.bos_token_id"))
        eos = _eos_ids(self.eos_token_id, "LlamaConfig.eos_token_id")
        if self.eos_token_id is not None and not isinstance(self.eos_token_id, (list, tuple)):
            put("eos_token_id", eos[0])
        elif self.eos_token_id is not None:
            put("eos_token_id", eos)
        if self.sliding_window is not None:
            put("sliding_window", positive_int(self.sliding_window, "LlamaConfig.sliding_window"))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids, as a tuple (empty when there is none)."""
        return _eos_ids(self.eos_token_id, "eos_token_id")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LlamaConfig:
        """Read a Hugging Face ``config.json`` dict of a Llama-architecture model.

        ``rope_theta`` is taken where the config keeps it: inside ``rope_parameters`` (as
        transformers 5 writes it) or ``rope_scaling``, else at the top level, else
        10000. Keys this model does not use are ignored; ones that would change the
        architecture (an activation other than SiLU, biases, partial rotary, rotary
        types other than default/linear/llama3) raise.

        Raises
        ------
        ArgumentTypeError, InvalidArgumentError
        """
        if not isinstance(d, Mapping):
            raise ArgumentTypeError(f"config must be a dict, got {type(d).__name__}")
        model_type = d.get("model_type", "llama")
        if model_type not in _MODEL_TYPES:
            raise InvalidArgumentError(
                f"config model_type must be one of {_MODEL_TYPES}, got {model_type!r}"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise InvalidArgumentError(f"config hidden_act must be 'silu', got {act!r}")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise InvalidArgumentError(f"config {key} must be false (no biases), got true")
        missing = [f.name for f in fields(cls) if f.name in _REQUIRED and d.get(f.name) is None]
        if missing:
            raise InvalidArgumentError(f"config lacks {', '.join(missing)}")
        theta, scaling = _rope_from_dict(d)
        kwargs = {f.name: d[f.name] for f in fields(cls) if d.get(f.name) is not None}
        kwargs.pop("rope_scaling", None)
        kwargs["rope_theta"] = theta
        kwargs["rope_scaling"] = scaling
        if "eos_token_id" in d:  # null means none, not the default
            kwargs["eos_token_id"] = d["eos_token_id"]
        if "bos_token_id" in d:
            kwargs["bos_token_id"] = d["bos_token_id"]
        if d.get("use_sliding_window") is False:
            kwargs.pop("sliding_window", None)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict (``LlamaForCausalLM``) of this config."""
        d: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        for f in fields(self):
            value = getattr(self, f.name)
            d[f.name] = list(value) if isinstance(value, tuple) else value
        d["rope_scaling"] = None if self.rope_scaling is None else dict(self.rope_scaling)
        d["hidden_act"] = "silu"
        d["attention_bias"] = d["mlp_bias"] = False
        return d


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def _rope_from_dict(d: Mapping[str, Any]) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from a config.json dict, old and new styles."""
    theta = d.get("rope_theta")
    inner_theta = None
    scaling = None
    for key in ("rope_parameters", "rope_scaling"):
        params = d.get(key)
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise InvalidArgumentError(f"config {key} must be a dict or null, got {params!r}")
        if params and all(isinstance(v, Mapping) or v is None for v in params.values()):
            raise InvalidArgumentError(
                f"config {key} holds per-layer-type rotary parameters ({sorted(params)}), "
                "which a Llama decoder does not have"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise InvalidArgumentError(
                f"config {key} partial_rotary_factor must be 1, got "
                f"{params['partial_rotary_factor']}"
            )
        if inner_theta is None and params.get("rope_theta") is not None:
            inner_theta = params["rope_theta"]
        kind = params.get("rope_type", params.get("type", "default"))
        if scaling is None and kind != "default":
            scaling = dict(params)
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise InvalidArgumentError(
            f"config partial_rotary_factor must be 1, got {d['partial_rotary_factor']}"
        )
    # transformers: rope_parameters.setdefault("rope_theta", config.rope_theta)
    theta = inner_theta if inner_theta is not None else theta
    return (10000.0 if theta is None else theta), scaling


def _inv_freq(config: LlamaConfig) -> NDArray[np.float32]:
    """Rotary inverse frequencies, [head_dim // 2] float32, as transformers computes them."""
    dim = config.head_dim
    # float32 throughout, as transformers does (a Python float stays weak under NEP 50)
    inv = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2).astype(np.float32) / dim))
    s = config.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    factor, low, high = (s[k] for k in _LLAMA3_KEYS)
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv
    # long wavelengths are divided by factor, short ones kept, the middle interpolated
    scaled = np.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


# -- elementwise kernels -------------------------------------------------------------


@njit(cache=True)
def _rms_norm_kernel(x, weight, eps, out):
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
def _silu_mul_kernel(gate_up, out):
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
def _rope_kernel(x, cos, sin, out):
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


# -- attention -----------------------------------------------------------------------


def _dense_attention(
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


# -- weights -------------------------------------------------------------------------


def _weight_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a checkpoint holds, by Hugging Face name, with its shape."""
    hidden = c.hidden_size
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, hidden)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, hidden)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, c.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    return shapes


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name == "bfloat16"


def _float32_weights(
    config: LlamaConfig, weights: Mapping[str, ArrayLike]
) -> dict[str, NDArray[np.float32]]:
    """Check names, shapes and dtypes; return float32 copies of every expected weight."""
    if not isinstance(weights, Mapping):
        raise ArgumentTypeError(
            f"weights must be a mapping of Hugging Face name -> array, got {type(weights).__name__}"
        )
    shapes = _weight_shapes(config)
    missing = [name for name in shapes if name not in weights]
    if missing:
        raise InvalidArgumentError(
            f"weights lack {len(missing)} of the {len(shapes)} the config needs, "
            f"first {missing[:3]}"
            + (" (the config unties embeddings)" if "lm_head.weight" in missing else "")
        )
    # old checkpoints carry the rotary table; a tied checkpoint may still carry lm_head
    ignorable = ("rotary_emb.inv_freq", "lm_head.weight")
    unexpected = [n for n in weights if n not in shapes and not n.endswith(ignorable)]
    if unexpected:
        raise InvalidArgumentError(
            f"weights hold {len(unexpected)} this architecture does not use (biases are "
            f"not supported), first {unexpected[:3]}"
        )
    out = {}
    for name, shape in shapes.items():
        arr = weights[name]
        if not hasattr(arr, "dtype") or not hasattr(arr, "shape"):
            raise ArgumentTypeError(f"weights[{name!r}] must be an array, got {type(arr).__name__}")
        if not _is_float(np.dtype(arr.dtype)):
            raise DTypeMismatchError(
                f"weights[{name!r}] must be floating point, got dtype {arr.dtype}"
            )
        if tuple(arr.shape) != shape:
            raise ShapeMismatchError(
                f"weights[{name!r}] has shape {tuple(arr.shape)} but the config needs {shape}"
            )
        out[name] = np.array(arr, dtype=np.float32, order="C", copy=True)
    return out


def _seeded_weights(c: LlamaConfig, seed: int = 0) -> dict[str, NDArray[np.float32]]:
    """Random weights whose activations stay of order one through every layer.

    Projections are normal with std 2/sqrt(fan_in), not the 0.02 of training inits:
    near-uniform logits make greedy decoding repeat one token, and at 1/sqrt(fan_in) the
    embedding still dominates the residual stream, so runs of one token are common. At
    2/sqrt(fan_in) the untrained network is a varied, deterministic map from context to
    next token (greedy runs of 128 tokens hold ~90 distinct bytes).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in _weight_shapes(c).items():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            w = rng.standard_normal(shape)
        elif name == "lm_head.weight":
            w = 2.0 * rng.standard_normal(shape) / math.sqrt(shape[1])
        else:
            w = 2.0 * rng.standard_normal(shape) / math.sqrt(shape[1])
        out[name] = w.astype(np.float32)
    return out


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


_FROM_CONFIG = object()  # generate(eos_token_id=...) default: the config's

DEFAULT_CONFIG = LlamaConfig(
    vocab_size=256,  # bytes
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=2,  # ASCII STX, "start of text"
    eos_token_id=3,  # ASCII ETX, "end of text"
)


class Llama:
    """A Llama-style decoder over Hugging Face-named weights, caching K/V in nbkv.

    Parameters
    ----------
    config : LlamaConfig
    weights : mapping of str -> array
        Hugging Face names (``model.embed_tokens.weight``,
        ``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight`` unless
        tied), any floating dtype (float16 and bfloat16 included); copied to float32.
    device : {"cpu", "cuda"}, default "cpu"
        Where caches from :meth:`new_cache` keep K/V. Compute runs on the host.

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError, ShapeMismatchError, DTypeMismatchError
        A config that is not a LlamaConfig, weights missing, unexpected, misshapen or
        not floating point, an unknown device.

    Examples
    --------
    >>> import numpy as np
    >>> from nbkv.models import Llama
    >>> model = Llama.default()
    >>> cache = model.new_cache(batch=1, max_seq_len=64)
    >>> logits = model.forward(np.array([[72, 105]]), cache)  # prefill
    >>> logits = model.forward(np.array([[33]]), cache)  # one decode step
    >>> logits.shape, cache.seq_len
    ((1, 1, 256), 3)
    """

    def __init__(
        self, config: LlamaConfig, weights: Mapping[str, ArrayLike], *, device: str = "cpu"
    ) -> None:
        if not isinstance(config, LlamaConfig):
            raise ArgumentTypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        if device not in DEVICES:
            raise InvalidArgumentError(f"device must be one of {DEVICES}, got {device!r}")
        w = _float32_weights(config, weights)
        self._config = config
        self._device = device
        self._embed = w["model.embed_tokens.weight"]
        self._layers = [_Layer(w, i) for i in range(config.num_hidden_layers)]
        self._norm = w["model.norm.weight"]
        self._lm_head = self._embed if config.tie_word_embeddings else w["lm_head.weight"]
        self._inv_freq = _inv_freq(config)
        self._num_parameters = sum(a.size for a in w.values())

    # -- constructors ----------------------------------------------------------------

    @classmethod
    def default(cls, *, device: str = "cpu") -> Llama:
        """The built-in model: :data:`DEFAULT_CONFIG` (byte vocabulary, 4 layers of
        hidden 256, 8 query / 2 KV heads of head_dim 32) with weights seeded by
        ``np.random.default_rng(0)``. Untrained, but deterministic and varied."""
        return cls(DEFAULT_CONFIG, _seeded_weights(DEFAULT_CONFIG), device=device)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, device: str = "cpu") -> Llama:
        """Load a Hugging Face checkpoint directory of a Llama-architecture model.

        The directory holds ``config.json`` and either ``model.safetensors`` or shards
        listed in ``model.safetensors.index.json``; weights in float32, float16 or
        bfloat16 are converted to float32. Only safetensors are read, never pickles.

        Raises
        ------
        InvalidArgumentError
            No such directory, no config.json or weights in it, a config this model
            cannot run, weights missing or unexpected.
        SafetensorsError
            A weights file or index that breaks the format.
        ShapeMismatchError, DTypeMismatchError
            Weights whose shape or dtype does not fit the config.
        """
        root = os.fspath(path)
        if not os.path.isdir(root):
            raise InvalidArgumentError(f"path must be a checkpoint directory, got {root!r}")
        config_path = os.path.join(root, "config.json")
        if not os.path.isfile(config_path):
            raise InvalidArgumentError(f"path {root!r} holds no config.json")
        try:
            with open(config_path, encoding="utf-8") as f:
                config = LlamaConfig.from_dict(json.load(f))
        except json.JSONDecodeError as err:
            raise InvalidArgumentError(f"{config_path} is not valid JSON: {err}") from None
        return cls(config, _load_safetensors(root), device=device)

    # -- properties ------------------------------------------------------------------

    @property
    def config(self) -> LlamaConfig:
        return self._config

    @property
    def device(self) -> str:
        return self._device

    @property
    def num_parameters(self) -> int:
        return self._num_parameters

    def __repr__(self) -> str:
        c = self._config
        return (
            f"Llama(layers={c.num_hidden_layers}, hidden_size={c.hidden_size}, "
            f"heads={c.num_attention_heads}/{c.num_key_value_heads}, head_dim={c.head_dim}, "
            f"vocab_size={c.vocab_size}, parameters={self._num_parameters:,} "
            f"({human_bytes(4 * self._num_parameters)} float32), device={self._device!r})"
        )

    # -- caches ----------------------------------------------------------------------

    def new_cache(
        self,
        batch: int = 1,
        max_seq_len: int | None = None,
        *,
        layout: str = "bhsd",
        window: int | None = None,
        sinks: int = 0,
    ) -> KVCache:
        """An empty float32 :class:`nbkv.KVCache` for this model, allocated at once.

        One layer per decoder layer, ``num_key_value_heads`` heads of ``head_dim``, on the
        model's device. ``max_seq_len`` defaults to ``max_position_embeddings`` capped at
        ``nbkv.DEFAULT_MAX_SEQ_LEN`` (2048), so that a long-context config does not
        allocate its whole context by surprise. With ``window``, every layer is an
        :class:`nbkv.RotatingKVCache` of that window and ``sinks`` (streaming decoding:
        memory bounded, positions from the cache's ``offset``).
        """
        c = self._config
        if window is not None:
            return KVCache.from_layers(
                RotatingKVCache(
                    window,
                    sinks=sinks,
                    batch=batch,
                    num_kv_heads=c.num_key_value_heads,
                    head_dim=c.head_dim,
                    dtype=_F32,
                    device=self._device,
                    layout=layout,
                )
                for _ in range(c.num_hidden_layers)
            )
        if max_seq_len is None:
            max_seq_len = min(c.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        return KVCache(
            c.num_hidden_layers,
            max_seq_len,
            batch=batch,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            dtype=_F32,
            device=self._device,
            layout=layout,
        )

    # -- forward passes --------------------------------------------------------------

    def forward(self, token_ids: ArrayLike, cache: KVCache) -> NDArray[np.float32]:
        """Logits of ``token_ids``, the next positions after what ``cache`` holds.

        Rotary positions start at ``cache.seq_len``; every layer's new K/V is appended
        to ``cache`` and the queries attend causally over all that layer holds.

        Parameters
        ----------
        token_ids : int array, [batch, n] (or [n] for batch 1)
        cache : KVCache
            From :meth:`new_cache`, or any float32 KVCache of the model's shape.

        Returns
        -------
        ndarray, float32, [batch, n, vocab_size]

        Raises
        ------
        ArgumentTypeError, ShapeMismatchError, InvalidArgumentError
            Token ids that are not integers, not 1-D/2-D, empty or out of range; a cache
            of another shape, batch or layer count.
        CacheOverflowError
            Fewer than ``n`` free positions; nothing is written.
        """
        ids = self._token_ids(token_ids, "token_ids")
        self._check_cache(cache, ids.shape[0], ids.shape[1], "token_ids")
        return self._forward_cached(ids, cache)

    def forward_nocache(
        self, token_ids: ArrayLike, *, window: int | None = None, sinks: int = 0
    ) -> NDArray[np.float32]:
        """Logits of a whole sequence from position 0, recomputed without a cache.

        Plain float32 NumPy attention over freshly computed K/V for all positions: the
        baseline a cache must match (and beat). ``window`` (default: the config's
        ``sliding_window``) and ``sinks`` give each position what a
        ``new_cache(window=..., sinks=...)`` decode sees: the first ``sinks`` positions
        and the last ``window - sinks``, its own included.

        Returns
        -------
        ndarray, float32, [batch, n, vocab_size]
        """
        ids = self._token_ids(token_ids, "token_ids")
        if window is None:
            window = self._config.sliding_window
        elif sinks:
            window -= sinks  # the ring: the last window - sinks positions, beside the sinks

        def attend(i: int, q, k, v):
            return _dense_attention(q, k, v, window, sinks)

        return self._run(ids, 0, attend, "bhsd")

    def _forward_cached(self, ids: np.ndarray, cache: KVCache) -> NDArray[np.float32]:
        window = self._config.sliding_window

        def attend(i: int, q, k, v):
            layer = cache[i]
            layer.append(k, v)
            o = attention(q, layer, window=window)
            # a CUDA cache answers with a device array: one explicit device->host copy
            return o if isinstance(o, np.ndarray) else o.copy_to_host()

        return self._run(ids, cache.offset, attend, cache.layout)

    def _run(self, ids: np.ndarray, pos: int, attend: Callable, layout: str) -> np.ndarray:
        """The decoder over ids [batch, n] at positions [pos, pos + n).

        ``attend(i, q, k, v)`` gives layer i's attention output [batch, num_heads, n,
        head_dim] for rotated q [batch, num_heads, n, head_dim] and k, v in ``layout``.
        """
        c = self._config
        batch, n = ids.shape
        rows = batch * n
        heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
        eps = c.rms_norm_eps
        # rotary angles of these positions, in float32 as transformers computes them
        angles = np.arange(pos, pos + n, dtype=np.float32)[:, None] * self._inv_freq[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        bshd = layout == "bshd"

        x = self._embed[ids.reshape(rows)]  # [rows, hidden], our own copy
        h = np.empty_like(x)
        for i, layer in enumerate(self._layers):
            _rms_norm_kernel(x, layer.input_norm, eps, h)
            qkv = h @ layer.wqkv.T  # [rows, q_dim + 2 * kv_dim]
            q_in = qkv[:, :q_dim].reshape(batch, n, heads, head_dim)
            k_in = qkv[:, q_dim : q_dim + kv_dim].reshape(batch, n, kv_heads, head_dim)
            v = qkv[:, q_dim + kv_dim :].reshape(batch, n, kv_heads, head_dim)
            # rotated q in [batch, heads, n, head_dim]; rotated k in the cache's layout
            q = np.empty((batch, heads, n, head_dim), _F32)
            _rope_kernel(q_in, cos, sin, q.transpose(0, 2, 1, 3))
            if bshd:
                k = np.empty((batch, n, kv_heads, head_dim), _F32)
                _rope_kernel(k_in, cos, sin, k)
            else:
                k = np.empty((batch, kv_heads, n, head_dim), _F32)
                _rope_kernel(k_in, cos, sin, k.transpose(0, 2, 1, 3))
                v = v.transpose(0, 2, 1, 3)
            o = attend(i, q, k, v)  # [batch, heads, n, head_dim]
            x += o.transpose(0, 2, 1, 3).reshape(rows, q_dim) @ layer.wo.T
            _rms_norm_kernel(x, layer.post_norm, eps, h)
            gate_up = h @ layer.wgu.T  # [rows, 2 * intermediate]
            act = np.empty((rows, c.intermediate_size), _F32)
            _silu_mul_kernel(gate_up, act)
            x += act @ layer.wdown.T
        _rms_norm_kernel(x, self._norm, eps, h)
        return (h @ self._lm_head.T).reshape(batch, n, c.vocab_size)

    # -- generation ------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: ArrayLike,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        eos_token_id: Any = _FROM_CONFIG,
        seed: int | None = None,
        cache: KVCache | None = None,
        callback: Callable[[int, np.ndarray], Any] | None = None,
    ) -> NDArray[np.int64]:
        """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens.

        The prompt is prefilled in one forward pass, then one token per step is decoded
        against the cache. A row that produces an end token is finished: it is padded
        with the first end token until every row is (as transformers does with
        ``pad_token_id = eos_token_id``), and generation stops early when all are.

        Parameters
        ----------
        prompt_ids : int array, [batch, prompt] (or [prompt] for batch 1)
        max_new_tokens : int >= 0
        temperature : float, default 0.0
            0 decodes greedily; above 0 samples from ``softmax(logits / temperature)``.
        eos_token_id : int, sequence of int or None, default the config's
            None generates exactly ``max_new_tokens``.
        seed : int, optional
            Seeds the sampler (``np.random.default_rng(seed)``).
        cache : KVCache, optional
            Continue after what it holds (it needs room for the prompt and
            ``max_new_tokens - 1`` more); by default a new one of just that size.
        callback : callable, optional
            ``callback(step, token_ids)`` after each step, with the ``[batch]`` new ids.

        Returns
        -------
        ndarray, int64, [batch, prompt + new]

        Raises
        ------
        ArgumentTypeError, ShapeMismatchError, InvalidArgumentError
            Bad prompt ids (see :meth:`forward`), max_new_tokens not an int >= 0, a
            negative or non-finite temperature, bad end ids.
        CacheOverflowError
            A given cache without room for the prompt and the new tokens.
        """
        ids = self._token_ids(prompt_ids, "prompt_ids")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise ArgumentTypeError(
                f"max_new_tokens must be an int >= 0, got {type(max_new_tokens).__name__} "
                f"{max_new_tokens!r}"
            )
        if max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        max_new_tokens = int(max_new_tokens)
        temperature = _real(temperature, "temperature", positive=False)
        if temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {temperature}")
        if eos_token_id is _FROM_CONFIG:
            eos = self._config.eos_token_ids
        else:
            eos = _eos_ids(eos_token_id, "eos_token_id")
        if callback is not None and not callable(callback):
            raise ArgumentTypeError(f"callback must be callable, got {type(callback).__name__}")
        batch, prompt = ids.shape
        if max_new_tokens == 0:
            return ids.copy()
        # the last new token is never fed back, so it needs no position
        needed = prompt + max_new_tokens - 1
        if cache is None:
            cache = self.new_cache(batch, needed)
        else:
            self._check_cache(
                cache, batch, needed, f"prompt_ids and max_new_tokens={max_new_tokens}"
            )
        rng = np.random.default_rng(seed) if temperature > 0 else None
        eos_arr = np.array(eos, np.int64)

        out = np.empty((batch, prompt + max_new_tokens), np.int64)
        out[:, :prompt] = ids
        done = np.zeros(batch, bool)
        logits = self._forward_cached(ids, cache)[:, -1]
        end = prompt + max_new_tokens
        for step in range(max_new_tokens):
            token = _pick(logits, temperature, rng)
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
                logits = self._forward_cached(token[:, None], cache)[:, -1]
        return out[:, :end].copy()

    # -- validation ------------------------------------------------------------------

    def _token_ids(self, x: ArrayLike, name: str) -> NDArray[np.int64]:
        """``x`` as int64 [batch, n], every id in [0, vocab_size)."""
        try:
            arr = np.asarray(x)
        except (TypeError, ValueError) as err:
            raise ArgumentTypeError(
                f"{name} must be an integer array of token ids, got {type(x).__name__} ({err})"
            ) from None
        if arr.dtype.kind in "OSUV":
            raise ArgumentTypeError(
                f"{name} must hold integer token ids, got {type(x).__name__} of dtype {arr.dtype}"
            )
        if arr.ndim == 1:
            arr = arr[None, :]
        if arr.ndim != 2:
            raise ShapeMismatchError(
                f"{name} must be 1-D [n] or 2-D [batch, n], got shape {arr.shape}"
            )
        if arr.size == 0:
            raise InvalidArgumentError(
                f"{name} must hold at least one token in each of at least one row, got "
                f"shape {arr.shape}"
            )
        if arr.dtype.kind not in "iu":
            raise ArgumentTypeError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
        vocab = self._config.vocab_size
        bad = (arr < 0) | (arr >= vocab)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise InvalidArgumentError(
                f"{name} must be in [0, vocab_size={vocab}), got {int(arr[where])} at index {where}"
            )
        return arr.astype(np.int64, copy=False)

    def _check_cache(self, cache: object, batch: int, n: int, what: str) -> None:
        """Raise unless ``cache`` fits this model and has room for ``n`` more positions."""
        c = self._config
        if not isinstance(cache, KVCache):
            raise ArgumentTypeError(
                f"cache must be an nbkv.KVCache (see Llama.new_cache), got {type(cache).__name__}"
            )
        if cache.num_layers != c.num_hidden_layers:
            raise InvalidArgumentError(
                f"cache has {cache.num_layers} layers but the model has "
                f"{c.num_hidden_layers}; build it with model.new_cache(...)"
            )
        lengths = sorted({layer.seq_len for layer in cache})
        if len(lengths) > 1:
            raise InvalidArgumentError(
                f"cache layers hold different seq_len ({lengths}), as after an "
                "interrupted forward pass; clear() the cache"
            )
        first = cache[0]
        for field, got, want in (
            ("batch", first.batch, batch),
            ("num_kv_heads", first.num_kv_heads, c.num_key_value_heads),
            ("head_dim", first.head_dim, c.head_dim),
        ):
            if got is not None and got != want:
                source = "token_ids" if field == "batch" else "the model"
                raise ShapeMismatchError(f"cache holds {field} {got} but {source} has {want}")
        if first.dtype is not None and first.dtype != _F32:
            raise DTypeMismatchError(f"cache must hold float32 (the model's), got {first.dtype}")
        held, capacity = cache.seq_len, cache.max_seq_len
        if held + n > capacity and not isinstance(first, RotatingKVCache):
            raise CacheOverflowError(
                f"{what} need {n} positions but the cache holds {held} of {capacity} and "
                f"{capacity - held} are free; build it with max_seq_len >= {held + n}"
            )


def _pick(
    logits: np.ndarray, temperature: float, rng: np.random.Generator | None
) -> NDArray[np.int64]:
    """Next ids [batch] from logits [batch, vocab]: argmax, or a softmax sample."""
    if rng is None:
        return logits.argmax(axis=-1).astype(np.int64)
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(len(cdf))[:, None] * cdf[:, -1:]
    # first index whose cumulative weight exceeds u
    return np.minimum((cdf <= u).sum(axis=-1), logits.shape[-1] - 1).astype(np.int64)


def _load_safetensors(root: str) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory: one file, or the shards its index lists."""
    single = os.path.join(root, "model.safetensors")
    index = os.path.join(root, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if not os.path.isfile(index):
        pickled = any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(root))
        raise InvalidArgumentError(
            f"path {root!r} holds neither model.safetensors nor "
            "model.safetensors.index.json"
            + (" (pickled weights are never read: convert them to safetensors)" if pickled else "")
        )
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as err:
        raise SafetensorsError(f"{index}: not a JSON object with a weight_map ({err})") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise SafetensorsError(f"{index}: weight_map must map tensor names to file names")
    out: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        if os.path.basename(shard) != shard or shard in (".", ".."):
            raise SafetensorsError(f"{index}: shard {shard!r} must be a file name in {root!r}")
        path = os.path.join(root, shard)
        if not os.path.isfile(path):
            raise SafetensorsError(f"{index}: lists shard {shard!r}, which does not exist")
        tensors = load_file(path)
        for name, file in weight_map.items():
            if file == shard:
                if name not in tensors:
                    raise SafetensorsError(f"{index}: {name!r} is not in shard {shard!r}")
                out[name] = tensors[name]
    return out
