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

import hashlib
import json
import math
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._units import human_bytes
from ..attention import attention
from ..backends import DEVICES, to_host
from ..cache import DEFAULT_MAX_SEQ_LEN
from ..dtypes import resolve_dtype, supported_dtypes
from ..errors import (
    ArgumentTypeError,
    CacheOverflowError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
)
from ..kernels.cpu_model import rms_norm, rope, silu_mul
from ..kvcache import KVCache
from ..rotating import RotatingKVCache
from .config import _F32, DEFAULT_CONFIG, LlamaConfig, _inv_freq, _real, eos_ids
from .weights import (
    DEFAULT_MODEL_DIR,
    default_training_record,
    default_weights,
    float32_weights,
    load_safetensors,
    seeded_weights,
    shipped_weights,
)

__all__ = [
    "Llama",
    "LlamaConfig",
    "default_weights",
    "default_training_record",
    "seeded_weights",
    "pick_next",
    "DEFAULT_MODEL_DIR",
]

# the dtypes a model's cache may store (the model computes in float32)
_CACHE_DTYPES = tuple(d for d in supported_dtypes() if d.itemsize <= 4)

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
        w = float32_weights(config, weights)
        self._config = config
        self._device = device
        self._embed = w["model.embed_tokens.weight"]
        self._layers = [_Layer(w, i) for i in range(config.num_hidden_layers)]
        self._norm = w["model.norm.weight"]
        self._lm_head = self._embed if config.tie_word_embeddings else w["lm_head.weight"]
        self._inv_freq = _inv_freq(config)
        self._num_parameters = sum(a.size for a in w.values())
        self._identity: bytes | None = None

    # -- constructors ----------------------------------------------------------------

    @classmethod
    def default(cls, *, device: str = "cpu") -> Llama:
        """The built-in model: :data:`DEFAULT_CONFIG` (byte vocabulary, 4 layers of
        hidden 256, 8 query / 2 KV heads of head_dim 32), trained on the Python standard
        library by :mod:`nbkv.models.train` and shipped in the package (float16 weights,
        run in float32). Its held-out figure is in ``nbkv/models/default/training.json``
        and ``python -m nbkv eval`` measures it again."""
        return cls(DEFAULT_CONFIG, shipped_weights(), device=device)

    @classmethod
    def seeded(cls, seed: int = 0, *, device: str = "cpu") -> Llama:
        """A random model of :data:`DEFAULT_CONFIG`'s shape, from ``seed``: untrained,
        deterministic and varied (greedy runs do not repeat one byte), for tests and
        demonstrations that need a fixed model which has learned nothing."""
        return cls(DEFAULT_CONFIG, seeded_weights(seed), device=device)

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
        return cls(config, load_safetensors(root), device=device)

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

    @property
    def identity(self) -> bytes:
        """What this model is, as 32 bytes: sha256 of its config and every weight (as the
        model computes with them, float32). Two models share it exactly when they compute
        the same K/V; a K/V store (:mod:`nbkv.store`) mixes it into its keys so that two
        models never share blocks. Computed once, on first use."""
        if self._identity is None:
            h = hashlib.sha256(repr(self._config).encode())
            arrays = [self._embed, self._norm, self._lm_head]
            for layer in self._layers:
                arrays += [layer.input_norm, layer.wqkv, layer.wo, layer.post_norm]
                arrays += [layer.wgu, layer.wdown]
            for a in arrays:
                h.update(np.ascontiguousarray(a).tobytes())
            self._identity = h.digest()
        return self._identity

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
        dtype: Any = "float32",
        bits: Any = None,
        group_size: int = 64,
        residual: int = 128,
    ) -> KVCache:
        """An empty :class:`nbkv.KVCache` for this model, allocated at once.

        One layer per decoder layer, ``num_key_value_heads`` heads of ``head_dim``, on the
        model's device, storing ``dtype`` (float32, float16 or bfloat16: the model computes
        in float32 and rounds K/V to the cache's dtype as it appends them). ``max_seq_len``
        defaults to ``max_position_embeddings`` capped at ``nbkv.DEFAULT_MAX_SEQ_LEN``
        (2048), so that a long-context config does not allocate its whole context by
        surprise. With ``window``, every layer is an :class:`nbkv.RotatingKVCache` of that
        window and ``sinks`` (streaming decoding: memory bounded, positions from the
        cache's ``offset``). With ``bits`` (8, 4, 2 or a pair ``(k_bits, v_bits)``), every
        layer is an :class:`nbkv.QuantizedKVCache` of that ``group_size`` and
        ``residual`` (KIVI: K per channel, V per token, the newest positions in ``dtype``).
        """
        c = self._config
        dtype = resolve_dtype(dtype)
        if dtype not in _CACHE_DTYPES:
            raise DTypeMismatchError(
                f"dtype must be float32, float16 or bfloat16 for the model's cache, got {dtype}"
            )
        sizes = dict(
            batch=batch,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            dtype=dtype,
            device=self._device,
            layout=layout,
        )
        if window is not None:
            if bits is not None:
                raise InvalidArgumentError(
                    "window and bits cannot be combined: a quantized rotating cache is not "
                    "available; give one of them"
                )
            return KVCache.from_layers(
                RotatingKVCache(window, sinks=sinks, **sizes) for _ in range(c.num_hidden_layers)
            )
        if max_seq_len is None:
            max_seq_len = min(c.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        if bits is not None:
            from ..quantized import QuantizedKVCache

            return KVCache.from_layers(
                QuantizedKVCache(
                    max_seq_len, bits=bits, group_size=group_size, residual=residual, **sizes
                )
                for _ in range(c.num_hidden_layers)
            )
        return KVCache(c.num_hidden_layers, max_seq_len, **sizes)

    # -- forward passes --------------------------------------------------------------

    def forward(self, token_ids: ArrayLike, cache: KVCache) -> NDArray[np.float32]:
        """Logits of ``token_ids``, the next positions after what ``cache`` holds.

        Rotary positions start at ``cache.offset`` (the tokens the cache has seen:
        ``seq_len`` for a LayerKVCache, more for a ring that has wrapped); every layer's
        new K/V is appended to ``cache`` and the queries attend causally over all that
        layer holds (under the config's ``sliding_window``, if any).

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

        Every layer of ``cache`` is checked before any is written, and a forward pass
        that fails part-way (out of memory, an interrupt) puts every layer back as it was.
        """
        ids = self.token_ids(token_ids, "token_ids")
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
        ids = self.token_ids(token_ids, "token_ids")
        if window is None:
            window = self._config.sliding_window
        if window is not None and sinks:
            window -= sinks  # the ring: the last window - sinks positions, beside the sinks

        def attend(i: int, q, k, v):
            return _dense_attention(q, k, v, window, sinks)

        return self._run(ids, 0, attend, "bhsd")

    def forward_paged(self, token_ids: ArrayLike, cache: Any, step: Any) -> NDArray[np.float32]:
        """Logits after each sequence's new tokens in a step of a paged cache: one forward
        pass over the packed ragged batch of several sequences (continuous batching).

        Parameters
        ----------
        token_ids : int array [step.num_tokens]
            The step's new tokens in its order (sequence ``i``'s at ``step.q_indptr[i] ..
            step.q_indptr[i + 1] - 1``), at the positions ``step.positions``.
        cache : nbkv.PagedKVCache
            Of the model's shape: ``num_hidden_layers`` layers of ``num_key_value_heads``
            heads of ``head_dim``, float32.
        step : nbkv.PagedStep
            From ``cache.reserve``, still valid. Every layer's new K/V are written at its
            slots (``nbkv.paged_append_and_attend``) and attended causally over what each
            sequence holds (under the config's ``sliding_window``, if any).

        Returns
        -------
        ndarray, float32, [num_seqs, vocab_size]: the logits after each sequence's last
        new token (the next token's distribution).

        Raises
        ------
        ArgumentTypeError, ShapeMismatchError, InvalidArgumentError, StaleStepError
            Bad token ids, a cache of another shape, a step that is not this cache's or
            is stale, token ids that do not match the step. Checked before anything is
            written; a pass that fails part-way leaves its step's slots part-written
            (run the step again: it writes them all).
        """
        from ..paged_attention import paged_append_and_attend

        ids = self.token_ids(token_ids, "token_ids")
        c = self._config
        if not hasattr(type(cache), "check_step"):
            raise ArgumentTypeError(
                f"cache must be an nbkv.PagedKVCache, got {type(cache).__name__}"
            )
        got = (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype)
        want = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim, _F32)
        if got != want:
            raise ShapeMismatchError(
                f"cache holds (layers, kv_heads, head_dim, dtype) {got} but the model needs {want}"
            )
        cache.check_step(step)
        if ids.shape != (1, step.num_tokens):
            raise ShapeMismatchError(
                f"token_ids must be 1-D with the step's {step.num_tokens} new tokens, got shape "
                f"{np.shape(token_ids)}"
            )
        window = c.sliding_window

        def attend(i: int, q, k, v):
            out = paged_append_and_attend(
                q[0].transpose(1, 0, 2), k[0], v[0], cache, i, step, window=window
            )
            return to_host(out).transpose(1, 0, 2)[None]  # [1, heads, total, head_dim]

        last = step.host("q_indptr")[1:] - 1
        return self._run(ids, step.host("positions"), attend, "bshd", last)[0]

    def _forward_cached(self, ids: np.ndarray, cache: KVCache) -> NDArray[np.float32]:
        window = self._config.sliding_window
        undo = []  # how to put back each layer written so far, should a later step fail

        def attend(i: int, q, k, v):
            layer = cache[i]
            if layer.dtype is not None and layer.dtype != _F32:
                k, v = k.astype(layer.dtype), v.astype(layer.dtype)  # a 16-bit cache
            undo.append(layer.append(k, v, undoable=True))
            # a CUDA cache answers with a device array: one explicit device->host copy
            return to_host(attention(q, layer, window=window))

        try:
            return self._run(ids, cache.offset, attend, cache.layout)
        except BaseException:
            for put_back in reversed(undo):
                put_back()
            raise

    def _run(
        self, ids: np.ndarray, pos: Any, attend: Callable, layout: str, last: Any = None
    ) -> np.ndarray:
        """The decoder over ids [batch, n] at positions [pos, pos + n) (or at ``pos[j]``
        for column j, when ``pos`` is an array: a packed batch of several sequences).

        ``attend(i, q, k, v)`` gives layer i's attention output [batch, num_heads, n,
        head_dim] for rotated q [batch, num_heads, n, head_dim] and k, v in ``layout``.
        ``last``: the columns whose logits are wanted (all by default), [batch, len(last),
        vocab].
        """
        c = self._config
        batch, n = ids.shape
        rows = batch * n
        heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
        eps = c.rms_norm_eps
        # rotary angles of these positions, in float32 as transformers computes them
        at = np.arange(pos, pos + n) if np.isscalar(pos) else np.asarray(pos)
        angles = at.astype(np.float32)[:, None] * self._inv_freq[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        bshd = layout == "bshd"

        x = self._embed[ids.reshape(rows)]  # [rows, hidden], our own copy
        h = np.empty_like(x)
        for i, layer in enumerate(self._layers):
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
        rms_norm(x, self._norm, eps, h)
        if last is not None:  # only these columns' logits: the lm_head is the largest product
            h = np.ascontiguousarray(h.reshape(batch, n, -1)[:, last]).reshape(-1, h.shape[-1])
            n = h.shape[0] // batch
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
        ids = self.token_ids(prompt_ids, "prompt_ids")
        max_new_tokens, temperature, eos = self._generate_args(
            max_new_tokens, temperature, eos_token_id, callback
        )
        batch, prompt = ids.shape
        if max_new_tokens == 0:
            return ids.copy()
        cache = self._generate_cache(cache, batch, prompt, max_new_tokens)
        rng = np.random.default_rng(seed) if temperature > 0 else None
        eos_arr = np.array(eos, np.int64)
        out = np.empty((batch, prompt + max_new_tokens), np.int64)
        out[:, :prompt] = ids
        done = np.zeros(batch, bool)
        logits = self._forward_cached(ids, cache)[:, -1]
        end = prompt + max_new_tokens
        for step in range(max_new_tokens):
            token = pick_next(logits, temperature, rng)
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

    def _generate_cache(self, cache, batch: int, prompt: int, max_new_tokens: int) -> KVCache:
        """:meth:`generate`'s cache: the one given, checked for room, or a new one."""
        needed = prompt + max_new_tokens - 1  # the last new token is never fed back
        if cache is None:
            return self.new_cache(batch, needed)
        self._check_cache(cache, batch, needed, f"prompt_ids and max_new_tokens={max_new_tokens}")
        return cache

    def _generate_args(self, max_new_tokens, temperature, eos_token_id, callback) -> tuple:
        """:meth:`generate`'s arguments checked: ``(max_new_tokens, temperature, end
        ids)``."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise ArgumentTypeError(
                f"max_new_tokens must be an int >= 0, got {type(max_new_tokens).__name__} "
                f"{max_new_tokens!r}"
            )
        if max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        temperature = _real(temperature, "temperature", positive=False)
        if temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {temperature}")
        if eos_token_id is _FROM_CONFIG:
            eos = self._config.eos_token_ids
        else:
            eos = eos_ids(eos_token_id, "eos_token_id")
        if callback is not None and not callable(callback):
            raise ArgumentTypeError(f"callback must be callable, got {type(callback).__name__}")
        return int(max_new_tokens), temperature, eos

    # -- validation ------------------------------------------------------------------

    def token_ids(self, x: ArrayLike, name: str = "token_ids") -> NDArray[np.int64]:
        """``x`` as int64 [batch, n] (1-D: batch 1), every id in [0, vocab_size), or a
        typed error naming ``name``."""
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
        seen = sorted({layer.offset for layer in cache})
        if len(seen) > 1:
            raise InvalidArgumentError(
                f"cache layers have seen different numbers of tokens ({seen}), as after an "
                "interrupted forward pass; clear() the cache"
            )
        want = (batch, c.num_key_value_heads, c.head_dim, _F32, cache.layout)
        for i, layer in enumerate(cache):  # every layer, before anything is written
            dtype = _F32 if layer.dtype in _CACHE_DTYPES else layer.dtype
            got = (layer.batch, layer.num_kv_heads, layer.head_dim, dtype, layer.layout)
            if got != want:  # only then find out which, if any, is wrong (None: lazy)
                self._check_layer(i, got, want)
        if cache.seq_len + n <= cache.max_seq_len:
            return  # room in every layer
        try:
            cache.check_room(n)
        except CacheOverflowError as err:
            held, capacity = cache.seq_len, cache.max_seq_len
            raise CacheOverflowError(
                f"{what} need {n} positions but the cache holds {held} of {capacity} and "
                f"{capacity - held} are free; build it with max_seq_len >= {held + n} ({err})"
            ) from None

    @staticmethod
    def _check_layer(i: int, got: tuple, want: tuple) -> None:
        """Raise the typed error for the first size, dtype or layout of cache layer ``i``
        that does not fit the model (sizes and dtype may be None: a lazy layer)."""
        for field, g, w in zip(("batch", "num_kv_heads", "head_dim"), got, want, strict=False):
            if g is not None and g != w:
                source = "token_ids" if field == "batch" else "the model"
                raise ShapeMismatchError(f"cache layer {i} holds {field} {g} but {source} has {w}")
        if got[3] is not None and got[3] != want[3]:
            raise DTypeMismatchError(
                f"cache layer {i} must hold float32, float16 or bfloat16, got {got[3]}"
            )
        if got[4] != want[4]:
            raise InvalidArgumentError(
                f"cache layer {i} has layout {got[4]!r} but layer 0 has {want[4]!r}; a "
                "model's cache holds one layout"
            )


def pick_next(
    logits: np.ndarray, temperature: float, rng: np.random.Generator | None
) -> NDArray[np.int64]:
    """Next ids [batch] from logits [batch, vocab]: argmax (``rng`` None), or a sample of
    ``softmax(logits / temperature)`` with one ``rng.random`` draw per row (what
    :meth:`Llama.generate` and :class:`nbkv.serving.Engine` do)."""
    if rng is None:
        return logits.argmax(axis=-1).astype(np.int64)
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(len(cdf))[:, None] * cdf[:, -1:]
    # first index whose cumulative weight exceeds u
    return np.minimum((cdf <= u).sum(axis=-1), logits.shape[-1] - 1).astype(np.int64)
