"""Reference decoders that run on nbkv caches.

>>> from nbkv.models import Llama, LlamaConfig
"""

from .llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
