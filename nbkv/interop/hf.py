"""A ``transformers`` Cache whose keys and values live in nbkv buffers.

:class:`NbkvCache` holds one :class:`nbkv.LayerKVCache` per decoder layer, sized from the
model's config and allocated at once, in transformers' layout
``[batch, num_kv_heads, seq, head_dim]`` (nbkv's ``"bhsd"``). Each attention layer's
``update`` writes the new positions with nbkv's kernel and hands back torch views of the
``seq_len`` positions held: no copy, no growth by concatenation. It behaves as
transformers' ``DynamicCache`` does towards the model (masks cover the positions held,
not the capacity), with a fixed capacity: a write past ``max_cache_len`` raises
:class:`nbkv.CacheOverflowError` and changes nothing.

Importing this module imports torch and transformers (``pip install "nbkv[hf]"``);
bfloat16 also needs ``nbkv[bf16]``.

Examples
--------
>>> import torch
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> from nbkv.interop.hf import NbkvCache
>>> _ = torch.manual_seed(0)
>>> config = LlamaConfig(
...     hidden_size=64, intermediate_size=128, num_hidden_layers=2,
...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
... )
>>> model = LlamaForCausalLM(config).eval()
>>> cache = NbkvCache(model.config, max_cache_len=32)
>>> prompt = torch.tensor([[3, 14, 15, 92, 65]])
>>> out = model.generate(prompt, max_new_tokens=4, do_sample=False, cache=cache)
>>> out.shape, cache.get_seq_length(), cache.nbkv.seq_len  # the last token is never fed
(torch.Size([1, 9]), 8, 8)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache

from .._validate import positive_int
from ..dtypes import resolve_dtype
from ..errors import DTypeMismatchError, InvalidArgumentError
from ..kvcache import KVCache
from ..quantized import QuantizedKVCache
from ._hf_layer import NbkvLayer

__all__ = ["NbkvCache", "NbkvLayer"]

# what transformers calls these dtypes, by the name nbkv (and NumPy) gives them
_TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


# -- constructor arguments -----------------------------------------------------------


def _config_field(config: Any, name: str) -> Any:
    value = getattr(config, name, None)
    if value is None:
        raise InvalidArgumentError(
            f"config must have {name} (a positive int, as a LlamaConfig has), but the "
            f"{type(config).__name__} given has none"
        )
    return value


def _sizes_from_config(config: Any) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a decoder config, or a typed error."""
    if hasattr(config, "get_text_config"):  # multimodal configs nest the decoder's
        config = config.get_text_config(decoder=True)
    num_layers = positive_int(
        _config_field(config, "num_hidden_layers"), "config.num_hidden_layers"
    )
    num_kv_heads = getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None)
    if num_kv_heads is None or head_dim is None:
        num_heads = positive_int(
            _config_field(config, "num_attention_heads"), "config.num_attention_heads"
        )
    if num_kv_heads is None:  # no grouped-query attention: one KV head per query head
        num_kv_heads = num_heads
    num_kv_heads = positive_int(num_kv_heads, "config.num_key_value_heads")
    if head_dim is None:
        hidden = positive_int(_config_field(config, "hidden_size"), "config.hidden_size")
        if hidden % num_heads:
            raise InvalidArgumentError(
                f"config has no head_dim and config.hidden_size {hidden} is not a multiple "
                f"of config.num_attention_heads {num_heads}; set config.head_dim"
            )
        head_dim = hidden // num_heads
    head_dim = positive_int(head_dim, "config.head_dim")

    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # as transformers infers them
        if getattr(config, "sliding_window", None) is not None:
            layer_types = ["sliding_attention"]
        elif getattr(config, "attention_chunk_size", None) is not None:
            layer_types = ["chunked_attention"]
        else:
            layer_types = []
    others = sorted({str(t) for t in layer_types} - {"full_attention"})
    if others:
        raise InvalidArgumentError(
            f"config has layers of type {others}, but NbkvCache holds full-attention "
            f"layers only (every layer attends to every position held)"
        )
    return num_layers, num_kv_heads, head_dim


def _resolve_dtypes(dtype: Any, config: Any) -> tuple[np.dtype, torch.dtype]:
    """The storage dtype as NumPy and torch see it; ``None`` takes the config's."""
    name = "dtype"
    if dtype is None:
        name = "config.dtype"
        dtype = getattr(config, "dtype", None)
        if dtype is None:  # transformers 4.x kept it as torch_dtype (5.x warns on access)
            dtype = getattr(config, "__dict__", {}).get("torch_dtype")
        if dtype is None:
            dtype = torch.float32
    if isinstance(dtype, torch.dtype):
        label = str(dtype).removeprefix("torch.")
        if label not in _TORCH_DTYPES:
            raise DTypeMismatchError(
                f"{name} must be one of {', '.join(map(str, _TORCH_DTYPES.values()))} (or "
                f"their NumPy names), got {dtype}"
            )
        dtype = label
    np_dtype = resolve_dtype(dtype, name)
    return np_dtype, _TORCH_DTYPES[np_dtype.name]


def _resolve_device(device: Any) -> torch.device:
    """``device`` as a torch.device of type cpu or cuda (index 0), or a typed error."""
    resolved = None
    if isinstance(device, (str, torch.device)):
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda") or resolved.index not in (None, 0):
        raise InvalidArgumentError(
            f"device must be 'cpu' or 'cuda' (a str or torch.device; nbkv allocates CUDA "
            f"buffers on the current device, so 'cuda:0' at most), got {device!r}"
        )
    return resolved


# -- the model's cache ------------------------------------------------------------------


class NbkvCache(Cache):
    """A transformers Cache over nbkv buffers: one :class:`nbkv.LayerKVCache` per layer.

    Pass it to ``model.generate(..., cache=cache)`` (``past_key_values=`` before
    transformers 5) or to a forward call. Sizes come from the model's config; the
    buffers, ``[batch_size, num_kv_heads, max_cache_len, head_dim]`` per layer for K and
    for V, are allocated here, once. Towards the model it behaves as ``DynamicCache``:
    each layer's ``update`` returns the positions held (views, no copy), and masks are
    built over those positions, not over the capacity.

    Parameters
    ----------
    config : transformers config
        The model's (decoder) config: ``num_hidden_layers``, ``num_key_value_heads``
        (default ``num_attention_heads``), ``head_dim`` (default ``hidden_size //
        num_attention_heads``). Every layer must be a full-attention layer.
    max_cache_len : int
        Capacity in positions: prompt plus generated tokens. Writing past it raises
        :class:`nbkv.CacheOverflowError` and changes nothing.
    batch_size : int, default 1
        Rows; for generate, batch x num_beams x num_return_sequences.
    dtype : torch.dtype or dtype-like, optional
        float32, float64, float16 or bfloat16, as a torch dtype or a NumPy-style name
        (``"bfloat16"`` needs ``nbkv[bf16]``). ``None``: the config's ``dtype``
        (``torch_dtype`` in transformers 4.x), else float32. Must be the model's dtype.
    device : {"cpu", "cuda"} or torch.device
        Where the buffers live; the model's device. On CUDA (``nbkv[cuda]``) tensors
        cross through ``__cuda_array_interface__``, bfloat16 as uint16 bit patterns; nbkv
        writes on the default CUDA stream, so run the model there too.
    bits : 8, 4, 2 or a pair (k_bits, v_bits), optional
        Quantized layers (:class:`nbkv.QuantizedKVCache`, KIVI) of ``group_size`` and
        ``residual``: the cache holds codes, and ``update`` returns dequantized copies of
        the positions held (transformers' attention reads float tensors), as
        transformers' own ``QuantizedCache`` does; float32, float16 or bfloat16 only.
    group_size, residual : int, default 64 and 128

    Attributes
    ----------
    nbkv : nbkv.KVCache
        The underlying nbkv layers as a KVCache (``cache.nbkv[i].get_kv()`` gives layer
        ``i``'s views); made from the layers on each access, so it follows a change of
        batch.

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError
        A size that is not a positive int (``max_cache_len``, ``batch_size``, a config
        field), a config without the fields above or with non-full-attention layers, an
        unknown device.
    DTypeMismatchError
        A dtype nbkv does not store.
    BackendUnavailableError
        ``device="cuda"`` without a usable GPU.

    Notes
    -----
    Inference only: tensors that require grad are refused. ``crop`` moves no data (it
    lowers ``seq_len``: ``LayerKVCache.crop``); ``reorder_cache`` (beam search) gathers
    rows in place with nbkv's copy kernel; ``batch_repeat_interleave``
    (``num_return_sequences``) and ``batch_select_indices`` (contrastive search) change
    the batch through ``LayerKVCache.select``: new buffers of the new batch, every layer
    built before any is replaced. Not ``torch.compile``-able.

    Examples
    --------
    >>> import torch
    >>> from transformers import LlamaConfig
    >>> from nbkv.interop.hf import NbkvCache
    >>> config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                      num_key_value_heads=2)
    >>> cache = NbkvCache(config, 16, dtype=torch.float32)
    >>> k = torch.randn(1, 2, 3, 16)
    >>> keys, values = cache.update(k, k, 0)
    >>> keys.shape, cache.get_seq_length(0), cache.nbkv[0].seq_len
    (torch.Size([1, 2, 3, 16]), 3, 3)
    >>> bool((keys == k).all()), keys.data_ptr() == cache.nbkv[0].get_kv()[0].ctypes.data
    (True, True)
    """

    def __init__(
        self,
        config: Any,
        max_cache_len: int,
        *,
        batch_size: int = 1,
        dtype: Any = None,
        device: str | torch.device = "cpu",
        bits: Any = None,
        group_size: int = 64,
        residual: int = 128,
    ) -> None:
        max_cache_len = positive_int(max_cache_len, "max_cache_len")
        batch_size = positive_int(batch_size, "batch_size")
        num_layers, num_kv_heads, head_dim = _sizes_from_config(config)
        np_dtype, torch_dtype = _resolve_dtypes(dtype, config)
        torch_device = _resolve_device(device)
        sizes = dict(
            batch=batch_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=np_dtype,
            device=torch_device.type,
            layout="bhsd",
        )
        if bits is None:
            cache = KVCache(num_layers, max_cache_len, **sizes)
        else:
            # quantized layers: update() hands transformers dequantized copies (its
            # attention reads float tensors); nbkv.attention would read the codes
            cache = KVCache.from_layers(
                QuantizedKVCache(
                    max_cache_len, bits=bits, group_size=group_size, residual=residual, **sizes
                )
                for _ in range(num_layers)
            )
        self._dtype = torch_dtype
        self._device = torch_device
        super().__init__(layers=self._wrap(cache))

    def _wrap(self, cache: KVCache) -> list[NbkvLayer]:
        return [NbkvLayer(layer, self._dtype, self._device) for layer in cache]

    @property
    def nbkv(self) -> KVCache:
        return KVCache.from_layers(layer.nbkv for layer in self.layers)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` in every layer (see
        :meth:`NbkvLayer.batch_select_indices`); all or nothing."""
        self._rebatch(lambda layer: layer.batch_select_indices(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in every layer; all or nothing."""
        self._rebatch(lambda layer: layer.batch_repeat_interleave(repeats))

    def _rebatch(self, change) -> None:
        # every layer's new buffers are made on copies of the layer objects, then swapped
        # in together: an error (bad indices, out of memory) leaves every layer as it was
        fresh = []
        for layer in self.layers:
            twin = object.__new__(type(layer))
            twin.__dict__.update(layer.__dict__)
            change(twin)
            fresh.append(twin)
        for layer, twin in zip(self.layers, fresh, strict=True):
            layer.__dict__.update(twin.__dict__)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_cache_len(self) -> int:
        """Capacity in positions."""
        return self.nbkv.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.layers[0].batch_size

    def __repr__(self) -> str:
        return f"NbkvCache({self.nbkv!r})"

    def copy(self) -> NbkvCache:
        """An independent copy: new nbkv buffers holding the same positions."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.layers = new._wrap(self.nbkv.copy())
        return new

    def __copy__(self) -> NbkvCache:
        return self.copy()

    def __deepcopy__(self, memo: dict) -> NbkvCache:
        return self.copy()
