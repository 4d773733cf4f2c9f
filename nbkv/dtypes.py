"""Storage dtypes.

nbkv stores float32, float64, float16 and bfloat16 (``ml_dtypes.bfloat16``, installed
with the ``bf16`` extra). Numba's CPU target has no 16-bit float type, and a KV write is
a copy, so kernels see 16-bit data as ``uint16`` bit patterns: the copy is bit-exact,
NaN payloads and signed zeros included.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .errors import DTypeMismatchError

__all__ = ["supported_dtypes", "resolve_dtype", "kernel_dtype", "widen_table", "BITS16"]

# what kernels see 16-bit floats as
BITS16 = np.dtype(np.uint16)


def _bfloat16() -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


@lru_cache(maxsize=1)
def supported_dtypes() -> tuple[np.dtype, ...]:
    """The dtypes a cache can hold here (bfloat16 only where ml_dtypes is installed)."""
    found = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)]
    bf16 = _bfloat16()
    if bf16 is not None:
        found.append(bf16)
    return tuple(found)


def _names() -> str:
    return ", ".join(str(d) for d in supported_dtypes())


def resolve_dtype(dtype: object, name: str = "dtype") -> np.dtype:
    """Turn a dtype-like (``"float16"``, ``np.float32``, ``"bfloat16"``) into a supported dtype.

    Raises
    ------
    DTypeMismatchError
        If it names no dtype, or one that nbkv does not store.
    """
    if isinstance(dtype, str) and dtype == "bfloat16":
        resolved = _bfloat16()
        if resolved is None:
            raise DTypeMismatchError(f"{name}='bfloat16' needs ml_dtypes: pip install 'nbkv[bf16]'")
        return resolved
    try:
        resolved = np.dtype(dtype)  # type: ignore[arg-type]
    except TypeError:
        resolved = None
    if resolved is None or resolved not in supported_dtypes():
        raise DTypeMismatchError(f"{name} must be one of {_names()}, got {dtype!r}")
    return resolved


def check_supported(dtype: np.dtype, name: str) -> np.dtype:
    """Return ``dtype`` if nbkv stores it, else raise DTypeMismatchError naming ``name``."""
    if dtype not in supported_dtypes():
        raise DTypeMismatchError(f"{name} has dtype {dtype}, but nbkv stores only {_names()}")
    return dtype


def kernel_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype kernels see for ``dtype``: ``uint16`` for 16-bit floats, else itself."""
    return BITS16 if dtype.itemsize == 2 else dtype


@lru_cache(maxsize=4)
def _table(name: str) -> np.ndarray:
    bits = np.arange(2**16, dtype=np.uint32)
    if name == "float16":
        table = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    else:  # bfloat16 is the upper half of a float32: shift the bits into place
        table = (bits << 16).view(np.float32)
    table.flags.writeable = False  # shared by every caller
    return table


def widen_table(dtype: np.dtype) -> np.ndarray:
    """float32 value of every 16-bit pattern of ``dtype`` (float16 or bfloat16).

    Kernels take it as their ``table`` argument. The attention kernels read it only to
    tell the two formats apart (``table[0x3C00]`` is 1.0 for float16) and widen each value
    as they load it, by the CPU's float16 conversion or bfloat16's 16-bit shift; the
    quantized kernels look up their 16-bit scales in it; the CUDA paged kernels read
    ``table[0x3C00]`` to tell the formats apart and look up float16 bits only (a hand
    launch's). For other dtypes an empty table, which kernels never read.
    """
    if dtype.itemsize != 2:
        return _table_empty
    return _table("float16" if dtype == np.float16 else "bfloat16")


_table_empty = np.empty(0, np.float32)
