"""Reference decoders that run on nbkv caches.

>>> from nbkv.models import Llama, LlamaConfig
"""

from .config import DEFAULT_CONFIG
from .llama import (
    DEFAULT_MODEL_DIR,
    Llama,
    LlamaConfig,
    default_training_record,
    default_weights,
    seeded_weights,
)

__all__ = [
    "Llama",
    "LlamaConfig",
    "DEFAULT_CONFIG",
    "DEFAULT_MODEL_DIR",
    "default_weights",
    "default_training_record",
    "seeded_weights",
]
