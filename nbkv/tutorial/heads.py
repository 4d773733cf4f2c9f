"""What attention heads look at, for ``notebooks/02_attention_decoding.ipynb``.

:func:`attention_maps` runs a Llama forward pass over a prompt in plain NumPy, from its
Hugging Face-named weights, keeping every layer's and head's softmax weights (the model
itself never materialises them); :func:`head_patterns` scores each head against simple
patterns of code (:data:`PATTERNS`): the current byte, the previous byte and the one
before, the first byte (an attention sink), the bracket a closing bracket closes, the
innermost open bracket, the byte in the same column of the line above, the indentation, the
newlines, and the bytes that followed earlier copies of the current one (what an induction
head looks at). :func:`sharpness` measures how concentrated each head's weights are (the
largest weight and the entropy of each row), so that "sharp" and "broad" are numbers.

>>> import numpy as np
>>> from nbkv.models import Llama, default_weights
>>> ids = np.frombuffer(b"f(a)\\n", np.uint8).astype(np.int64)
>>> maps = attention_maps(default_weights(), Llama.default().config, ids)
>>> maps.weights.shape, bool(np.allclose(maps.weights.sum(-1), 1))
((4, 8, 5, 5), True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from ..errors import InvalidArgumentError, ShapeMismatchError

__all__ = ["AttentionMaps", "Sharpness", "attention_maps", "head_patterns", "sharpness", "PATTERNS"]

PATTERNS = (
    "current byte",  # the query's own position
    "previous byte",
    "two bytes back",
    "first byte (sink)",
    "matching bracket",  # from a closing bracket, the bracket it closes
    "innermost open bracket",  # from inside brackets, the last one still open
    "line above (same column)",  # the byte right above the query, one line up
    "indentation",  # the leading spaces of lines
    "newlines",
    "after an earlier copy (induction)",
)


class AttentionMaps(NamedTuple):
    weights: NDArray[np.float64]  # [layers, heads, n, n]: row i sums to 1 over j <= i
    logits: NDArray[np.float64]  # [n, vocab]: the model's output, for checking


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, inv_freq):
    ang = pos[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def attention_maps(weights: Mapping[str, np.ndarray], config, ids) -> AttentionMaps:
    """Every layer's and head's causal attention weights over ``ids`` (float64 NumPy).

    ``weights``: Hugging Face names (``default_weights()``); ``config``: its LlamaConfig
    (plain rotary embeddings); ``ids``: 1-D token ids, at least one.
    """
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise ShapeMismatchError(f"ids must be 1-D integer token ids, got {ids.dtype} {ids.shape}")
    if config.rope_scaling is not None:
        raise InvalidArgumentError("attention_maps knows plain rotary embeddings only")
    c, w = config, {k: np.asarray(v, np.float64) for k, v in weights.items()}
    n, H, Hkv, D = len(ids), c.num_attention_heads, c.num_key_value_heads, c.head_dim
    group = H // Hkv
    inv_freq = 1.0 / c.rope_theta ** (np.arange(0, D, 2) / D)
    pos = np.arange(n, dtype=np.float64)
    mask = np.tril(np.ones((n, n), bool))
    x = w["model.embed_tokens.weight"][ids]
    maps = np.empty((c.num_hidden_layers, H, n, n))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, H, D).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, Hkv, D).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, Hkv, D).transpose(1, 0, 2)
        q, k = _rope(q, pos, inv_freq), _rope(k, pos, inv_freq)
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # head h: KV h // group
        scores = np.where(mask, q @ k.transpose(0, 2, 1) / np.sqrt(D), -np.inf)
        a = np.exp(scores - scores.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        maps[i] = a
        x = x + (a @ v).transpose(1, 0, 2).reshape(n, H * D) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        x = (
            x
            + (g / (1 + np.exp(-g)) * (h @ w[p + "mlp.up_proj.weight"].T))
            @ w[p + "mlp.down_proj.weight"].T
        )
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    logits = _rms(x, w["model.norm.weight"], c.rms_norm_eps) @ head.T
    return AttentionMaps(maps, logits)


def _targets(ids: np.ndarray, skip: int) -> dict[str, list[tuple[int, list[int]]]]:
    """For each pattern, the queries it applies to and the keys it predicts."""
    text = bytes(int(b) for b in ids)
    n = len(text)
    stack, pairs, inner = [], {}, {}
    for i, b in enumerate(text):
        if stack:
            inner[i] = stack[-1]
        if chr(b) in "([{":
            stack.append(i)
        elif chr(b) in ")]}" and stack:
            pairs[i] = stack.pop()
    line_start, starts = 0, []
    for b in text:
        starts.append(line_start)
        if b == ord("\n"):
            line_start = len(starts)
    leading, at_start = [], True
    for j, b in enumerate(text):
        if b == ord("\n"):
            at_start = True
        elif at_start and b == ord(" "):
            leading.append(j)
        else:
            at_start = False
    out: dict[str, list[tuple[int, list[int]]]] = {name: [] for name in PATTERNS}
    for i in range(skip, n):
        out["current byte"].append((i, [i]))
        out["previous byte"].append((i, [i - 1]))
        out["two bytes back"].append((i, [i - 2]))
        out["first byte (sink)"].append((i, [0]))
        if i in pairs:
            out["matching bracket"].append((i, [pairs[i]]))
        if i in inner and i not in pairs:
            out["innermost open bracket"].append((i, [inner[i]]))
        if starts[i] > 0:  # a line above exists: the byte at the same column, if it is long enough
            above = starts[starts[i] - 1] + (i - starts[i])
            if above < starts[i] - 1:  # a byte of that line, not its newline
                out["line above (same column)"].append((i, [above]))
        indent = [j for j in leading if j < i]
        if indent:
            out["indentation"].append((i, indent))
        newlines = [j for j in range(i) if text[j] == ord("\n")]
        if newlines:
            out["newlines"].append((i, newlines))
        # the byte that followed an earlier occurrence of this query's byte: what an
        # induction head copies forward
        after = [j for j in range(1, i) if text[j - 1] == text[i]]
        if after:
            out["after an earlier copy (induction)"].append((i, after))
    return out


def head_patterns(maps: AttentionMaps, ids, *, skip: int = 8) -> dict[str, NDArray[np.float64]]:
    """Per pattern, each head's mean attention weight on the keys the pattern names
    ([layers, heads]), over the queries from position ``skip`` on that it applies to
    (NaN where none does). A head that always attends to the previous byte scores 1 on
    "previous byte"; a uniform head over ``n`` positions scores about ``1 / n``."""
    targets = _targets(np.asarray(ids), skip)
    w = maps.weights
    out = {}
    for name, pairs in targets.items():
        if not pairs:
            out[name] = np.full(w.shape[:2], np.nan)
            continue
        out[name] = np.mean([w[:, :, i, keys].sum(-1) for i, keys in pairs], axis=0)
    return out


class Sharpness(NamedTuple):
    """How concentrated attention rows are, averaged over the queries (:func:`sharpness`)."""

    max_weight: NDArray[np.float64]  # the largest weight of a row: 1 for a one-hot head
    entropy: NDArray[np.float64]  # -sum w ln w of a row, nats: 0 for a one-hot head
    uniform_entropy: float  # the mean ln(keys visible) over the same rows: a uniform head's


def sharpness(weights, *, skip: int = 0) -> Sharpness:
    """Mean largest weight and mean entropy of causal attention rows, queries ``skip`` on.

    ``weights``: [..., n_q, n_keys], row ``r`` seeing the first ``n_keys - n_q + r + 1``
    keys (the maps of :func:`attention_maps`, [layers, heads, n, n], or one decode step's
    weights with ``n_q`` 1). ``exp(entropy)`` is the number of positions a head spreads over
    as evenly; ``uniform_entropy`` is what a head spreading over all it sees would score.

    >>> import numpy as np
    >>> one_hot, uniform = np.eye(4)[None], np.tril(np.ones((4, 4)))[None]
    >>> uniform /= uniform.sum(-1, keepdims=True)
    >>> s = sharpness(np.concatenate([one_hot, uniform]))
    >>> s.max_weight.round(3).tolist(), s.entropy.round(3).tolist(), round(s.uniform_entropy, 3)
    ([1.0, 0.521], [0.0, 0.795], 0.795)
    """
    w = np.asarray(weights, np.float64)
    if w.ndim < 2 or w.shape[-2] > w.shape[-1]:
        raise ShapeMismatchError(
            f"weights must be [..., n_q, n_keys] with n_q <= n_keys, got {w.shape}"
        )
    n_q, n_keys = w.shape[-2:]
    if not 0 <= skip < n_q:
        raise InvalidArgumentError(f"skip must be in [0, {n_q}), got {skip}")
    w = w[..., skip:, :]
    plogp = np.where(w > 0, w * np.log(np.where(w > 0, w, 1.0)), 0.0)
    visible = n_keys - n_q + np.arange(skip, n_q) + 1
    return Sharpness(
        w.max(-1).mean(-1), (0.0 - plogp.sum(-1)).mean(-1), float(np.log(visible).mean())
    )
