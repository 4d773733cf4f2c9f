"""The weights of :class:`nbkv.models.Llama`: their names and shapes, checks, the
shipped model's files, seeded random weights, and safetensors checkpoints (one file or
shards).

>>> from nbkv.models.weights import weight_shapes
>>> from nbkv.models import DEFAULT_CONFIG
>>> weight_shapes(DEFAULT_CONFIG)["model.embed_tokens.weight"]
(256, 256)
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._safetensors import SafetensorsError, load_file
from .._validate import nonnegative_int
from ..errors import ArgumentTypeError, DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
from .config import DEFAULT_CONFIG, LlamaConfig

__all__ = [
    "weight_shapes",
    "float32_weights",
    "default_weights",
    "default_training_record",
    "seeded_weights",
    "shipped_weights",
    "load_safetensors",
    "DEFAULT_MODEL_DIR",
    "DEFAULT_WEIGHTS_SHA256",
]


def weight_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
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


def float32_weights(
    config: LlamaConfig, weights: Mapping[str, ArrayLike]
) -> dict[str, NDArray[np.float32]]:
    """Check names, shapes and dtypes; return float32 copies of every expected weight."""
    if not isinstance(weights, Mapping):
        raise ArgumentTypeError(
            f"weights must be a mapping of Hugging Face name -> array, got {type(weights).__name__}"
        )
    shapes = weight_shapes(config)
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


# the default model's files, shipped in the package (trained by nbkv.models.train)
DEFAULT_MODEL_DIR = Path(__file__).resolve().with_name("default")
# sha256 of DEFAULT_MODEL_DIR / "model.safetensors": a damaged install is refused
DEFAULT_WEIGHTS_SHA256 = "c673e83375b037b89f964d7552a3fbdab9498d64aab4a8598ee16d08498daaf3"


@functools.lru_cache(maxsize=1)
def shipped_weights() -> dict[str, NDArray[np.float32]]:
    """The shipped model's weights, read once (its sha256 checked) and shared: every
    array is read-only (what :meth:`Llama.default` uses; :func:`default_weights` gives
    copies)."""
    path = DEFAULT_MODEL_DIR / "model.safetensors"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != DEFAULT_WEIGHTS_SHA256:
        raise InvalidArgumentError(
            f"{path} has sha256 {digest}, not the {DEFAULT_WEIGHTS_SHA256} nbkv shipped: the "
            "installation is damaged; reinstall nbkv"
        )
    weights = {n: np.array(a, np.float32) for n, a in load_file(path).items()}
    for a in weights.values():
        a.flags.writeable = False  # shared by every Llama.default(): nobody writes them
    return weights


def default_training_record() -> dict:
    """What the shipped model's training run recorded (``default/training.json``): corpus,
    steps, tokens seen, train and held-out bits per byte, wall time, versions."""
    return json.loads((DEFAULT_MODEL_DIR / "training.json").read_text())


def default_weights() -> dict[str, NDArray[np.float32]]:
    """The weights of :meth:`Llama.default` (Hugging Face names -> float32 arrays), a
    fresh copy on every call: the trained model nbkv ships (``nbkv/models/default``).

    >>> from nbkv.models import default_weights
    >>> w = default_weights()
    >>> w["model.embed_tokens.weight"].shape, w["model.embed_tokens.weight"].dtype
    ((256, 256), dtype('float32'))
    """
    return {n: a.copy() for n, a in shipped_weights().items()}


def seeded_weights(seed: int = 0) -> dict[str, NDArray[np.float32]]:
    """The weights of :meth:`Llama.seeded`: :data:`DEFAULT_CONFIG`'s shape, random from
    ``np.random.default_rng(seed)`` (see :func:`_seeded_weights` for their scale)."""
    return _seeded_weights(DEFAULT_CONFIG, nonnegative_int(seed, "seed"))


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
    for name, shape in weight_shapes(c).items():
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


def load_safetensors(root: str) -> dict[str, np.ndarray]:
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
