"""Reference decoders that run on nbkv caches.

>>> from nbkv.models import Llama, LlamaConfig
"""

from .config import DEFAULT_CONFIG
from .llama import Llama, LlamaConfig, default_weights

__all__ = ["Llama", "LlamaConfig", "DEFAULT_CONFIG", "default_weights"]
