"""LlamaConfig: the configuration of a Llama-architecture decoder, read from a Hugging
Face ``config.json`` (rotary scaling and ``rope_theta`` wherever newer transformers keep
them), and the rotary frequencies it implies."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._validate import positive_int
from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["LlamaConfig", "DEFAULT_CONFIG"]

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


def eos_ids(value: object, name: str = "eos_token_id") -> tuple[int, ...]:
    """``None``, an id or a sequence of ids, as a tuple of ids (empty for None), or a
    typed error naming ``name``."""
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
        eos = eos_ids(self.eos_token_id, "LlamaConfig.eos_token_id")
        if self.eos_token_id is not None and not isinstance(self.eos_token_id, (list, tuple)):
            put("eos_token_id", eos[0])
        elif self.eos_token_id is not None:
            put("eos_token_id", eos)
        if self.sliding_window is not None:
            put("sliding_window", positive_int(self.sliding_window, "LlamaConfig.sliding_window"))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids, as a tuple (empty when there is none)."""
        return eos_ids(self.eos_token_id, "eos_token_id")

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
