"""A small Llama-style decoder in NumPy whose keys and values live in an nbkv cache.

RMSNorm, rotary position embeddings (plain, linear or "llama3" scaled), grouped-query
attention through nbkv, and a SwiGLU MLP, with Hugging Face's weight names, so that a
Llama-architecture checkpoint (``config.json`` + safetensors) loads as it is. Matrix
products run in NumPy float32; the elementwise steps (RMSNorm, rotary, SwiGLU) are small
fused ``@njit`` kernels.

It exists to drive the cache the way a real decoder does, and to check it against a
decoder that keeps no cache (:meth:`Llama.forward_nocache`) and against transformers.
The pass's arithmetic is in :mod:`nbkv.models.decoder`, the checks of ids and caches in
:mod:`nbkv.models.checks`, the sampler and the decoding loop in :mod:`nbkv.models.generation`.

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
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._units import human_bytes
from ..attention import attention
from ..backends import DEVICES, to_host
from ..cache import DEFAULT_MAX_SEQ_LEN
from ..dtypes import resolve_dtype
from ..errors import ArgumentTypeError, DTypeMismatchError, InvalidArgumentError
from ..kvcache import KVCache
from ..rotating import RotatingKVCache
from .checks import CACHE_DTYPES, check_cache, check_paged, check_token_ids
from .config import _F32, DEFAULT_CONFIG, LlamaConfig
from .decoder import Decoder, dense_attention
from .generation import FROM_CONFIG, generate_args, generate_tokens, pick_next
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
        self._decoder = Decoder(config, w)
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
            for a in self._decoder.arrays():
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
        if dtype not in CACHE_DTYPES:
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
        check_cache(self._config, cache, ids.shape[0], ids.shape[1], "token_ids")
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
            return dense_attention(q, k, v, window, sinks)

        return self._decoder.run(ids, 0, attend, "bhsd")

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
        check_paged(self._config, cache, step, ids, token_ids)
        window = self._config.sliding_window

        def attend(i: int, q, k, v):
            out = paged_append_and_attend(
                q[0].transpose(1, 0, 2), k[0], v[0], cache, i, step, window=window
            )
            return to_host(out).transpose(1, 0, 2)[None]  # [1, heads, total, head_dim]

        last = step.host("q_indptr")[1:] - 1
        return self._decoder.run(ids, step.host("positions"), attend, "bshd", last)[0]

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
            return self._decoder.run(ids, cache.offset, attend, cache.layout)
        except BaseException:
            for put_back in reversed(undo):
                put_back()
            raise

    # -- generation ------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: ArrayLike,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        eos_token_id: Any = FROM_CONFIG,
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
        max_new_tokens, temperature, eos = generate_args(
            self._config, max_new_tokens, temperature, eos_token_id, callback
        )
        batch, prompt = ids.shape
        if max_new_tokens == 0:
            return ids.copy()
        cache = self._generate_cache(cache, batch, prompt, max_new_tokens)

        def next_logits(new_ids: np.ndarray) -> np.ndarray:
            return self._forward_cached(new_ids, cache)[:, -1]

        return generate_tokens(next_logits, ids, max_new_tokens, temperature, eos, seed, callback)

    def _generate_cache(self, cache, batch: int, prompt: int, max_new_tokens: int) -> KVCache:
        """:meth:`generate`'s cache: the one given, checked for room, or a new one."""
        needed = prompt + max_new_tokens - 1  # the last new token is never fed back
        if cache is None:
            return self.new_cache(batch, needed)
        check_cache(
            self._config, cache, batch, needed, f"prompt_ids and max_new_tokens={max_new_tokens}"
        )
        return cache

    # -- validation ------------------------------------------------------------------

    def token_ids(self, x: ArrayLike, name: str = "token_ids") -> NDArray[np.int64]:
        """``x`` as int64 [batch, n] (1-D: batch 1), every id in [0, vocab_size), or a
        typed error naming ``name``."""
        return check_token_ids(x, self._config.vocab_size, name)
