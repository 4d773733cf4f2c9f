"""nbkv: a KV cache for transformer decoding, on Numba CPU and CUDA kernels.

>>> import numpy as np, nbkv
>>> cache = nbkv.LayerKVCache(128, batch=1, num_kv_heads=8, head_dim=64, dtype="float32")
>>> k = np.random.default_rng(0).standard_normal((1, 8, 5, 64), dtype=np.float32)
>>> cache.append(k, k)
>>> K, V = cache.get_kv()
>>> K.shape, cache.seq_len, cache.max_seq_len, cache.nbytes
((1, 8, 5, 64), 5, 128, 524288)
"""

from . import launch, protocol, reference
from ._config import override_tunables, tunables
from .attention import append_and_attend, attention
from .backends import to_host
from .base import BaseKVCache
from .cache import DEFAULT_MAX_SEQ_LEN, LayerKVCache
from .decode_step import DecodeStep
from .dtypes import supported_dtypes
from .errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    CacheFormatError,
    CacheOverflowError,
    DeviceMismatchError,
    DTypeMismatchError,
    InvalidArgumentError,
    KVCacheError,
    LayerIndexError,
    OutOfBlocksError,
    ShapeMismatchError,
    StaleStepError,
    StoreError,
)
from .kvcache import KVCache
from .launch import attention_grid, launch_config
from .layout import LAYOUTS
from .paged import PagedKVCache
from .paged_attention import paged_append_and_attend, paged_attention
from .persist import load, load_state, save
from .quantized import QuantizedKVCache
from .rotating import RotatingKVCache

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MAX_SEQ_LEN",
    "LAYOUTS",
    "BaseKVCache",
    "LayerKVCache",
    "KVCache",
    "RotatingKVCache",
    "PagedKVCache",
    "QuantizedKVCache",
    "attention",
    "paged_attention",
    "paged_append_and_attend",
    "append_and_attend",
    "DecodeStep",
    "attention_grid",
    "launch_config",
    "launch",
    "protocol",
    "reference",
    "supported_dtypes",
    "to_host",
    "tunables",
    "override_tunables",
    "save",
    "load",
    "load_state",
    "KVCacheError",
    "CacheOverflowError",
    "ShapeMismatchError",
    "DTypeMismatchError",
    "BackendUnavailableError",
    "DeviceMismatchError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "LayerIndexError",
    "CacheFormatError",
    "OutOfBlocksError",
    "StaleStepError",
    "StoreError",
    "__version__",
]
