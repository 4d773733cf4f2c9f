"""Tunables: block sizes, thresholds and licences of the kernels, in one place.

Two kinds:

- *fixed at import* (``FASTMATH``, ``WARP``, ``ATTENTION_THREADS``, ``ATTENTION_ROWS``,
  ``ATTENTION_MAX_HEAD_DIM``, ``ATTENTION_MIN_BLOCKS_PER_SM``): Numba bakes them into
  the kernels when a kernel module is first imported (they size shared and local
  arrays, or set floating-point flags), so they cannot change afterwards;
- *read per call* (everything else): the backends read them at every launch, so
  :func:`override_tunables` changes them for a block of code.

``nbkv.tunables()`` shows the current values; ``with nbkv.override_tunables(NAME=value):``
changes read-per-call ones and restores them on the way out, even after an exception.
Overrides are process-wide (not per thread).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import ArgumentTypeError, InvalidArgumentError

# floating-point licences for the attention kernels: reassociation lets LLVM vectorise the
# dot products and sums; no "nnan"/"ninf": masked scores are -inf by design, and NaN and
# infinities must flow through as IEEE arithmetic says. Fixed at import.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

# CPU attention runs on the thread pool from this much work (query rows x K/V elements
# read) up; below it, on the calling thread (waking the pool costs more than it saves for
# a small model's decode step, and much more on a busy machine). Read per call.
ATTENTION_PARALLEL_MIN = 1 << 21

# CUDA copy kernels: threads per block (a multiple of the 32-thread warp) and the cap on
# the grid, beyond which each thread loops. Read per call.
THREADS_PER_BLOCK = 256
MAX_BLOCKS = 65_535
WARP = 32

# CUDA attention (nbkv.kernels.cuda_attention): threads per block, which is also the
# number of positions per tile; the query rows one block handles; the largest head_dim.
# The simulator runs every thread as a Python thread, so it gets a 32-thread block.
# Fixed at import (they size shared and local arrays).
ATTENTION_THREADS = 32 if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else 128
ATTENTION_ROWS = 16
ATTENTION_MAX_HEAD_DIM = 256
# CUDA attention: the resident blocks per SM each kernel is compiled to allow (its
# launch bound: at most 65,536 / (ATTENTION_THREADS * this) registers a thread). Fixed.
ATTENTION_MIN_BLOCKS_PER_SM = 4
# blocks per SM that flash-decoding aims for when it splits the sequence; None: as many
# as the kernel's occupancy allows (one full wave of resident blocks). Read per call.
ATTENTION_BLOCKS_PER_SM = None
# force the number of splits (to exercise or show the combine), of CUDA attention and of
# the CPU's paged attention; None: automatic. Per call.
ATTENTION_SPLITS = None

_FIXED = (
    "FASTMATH",
    "WARP",
    "ATTENTION_THREADS",
    "ATTENTION_ROWS",
    "ATTENTION_MAX_HEAD_DIM",
    "ATTENTION_MIN_BLOCKS_PER_SM",
)
_PER_CALL = (
    "ATTENTION_PARALLEL_MIN",
    "THREADS_PER_BLOCK",
    "MAX_BLOCKS",
    "ATTENTION_BLOCKS_PER_SM",
    "ATTENTION_SPLITS",
)

_OPTIONAL = ("ATTENTION_SPLITS", "ATTENTION_BLOCKS_PER_SM")  # None: automatic


def tunables() -> dict[str, object]:
    """The current value of every tunable, by name (a snapshot; changing it changes nothing).

    >>> import nbkv
    >>> nbkv.tunables()["ATTENTION_ROWS"]
    16
    """
    return {name: globals()[name] for name in (*_PER_CALL, *_FIXED)}


def _checked(name: str, value: object) -> object:
    if name not in _PER_CALL:
        if name in _FIXED:
            raise InvalidArgumentError(
                f"{name} is fixed when the kernels are compiled (it sizes their arrays or "
                f"sets their floating-point flags) and cannot be overridden at run time"
            )
        raise InvalidArgumentError(
            f"override_tunables got an unknown tunable {name!r}; the ones read per call "
            f"are {', '.join(_PER_CALL)}"
        )
    if value is None and name in _OPTIONAL:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(
            f"{name} must be a positive int"
            + (" or None" if name in _OPTIONAL else "")
            + f", got {type(value).__name__} {value!r}"
        )
    if not 1 <= value <= 2**31 - 1:
        raise InvalidArgumentError(f"{name} must be in [1, 2**31 - 1], got {value}")
    if name == "THREADS_PER_BLOCK" and (value % WARP or value > 1024):
        raise InvalidArgumentError(
            f"THREADS_PER_BLOCK must be a multiple of the {WARP}-thread warp, at most 1024, "
            f"got {value}"
        )
    return int(value)


@contextmanager
def override_tunables(**values: object) -> Iterator[dict[str, object]]:
    """Change read-per-call tunables inside a ``with`` block; restore them after it.

    Every value is checked before any is set. Yields the values now in force.

    Raises
    ------
    InvalidArgumentError
        An unknown name, one fixed at import, or a value out of range.
    ArgumentTypeError
        A value that is not an int (``ATTENTION_SPLITS`` may also be None).

    >>> import nbkv
    >>> with nbkv.override_tunables(ATTENTION_SPLITS=3):
    ...     nbkv.tunables()["ATTENTION_SPLITS"]
    3
    >>> nbkv.tunables()["ATTENTION_SPLITS"] is None
    True
    """
    checked = {name: _checked(name, value) for name, value in values.items()}
    saved = {name: globals()[name] for name in checked}
    globals().update(checked)
    try:
        yield tunables()
    finally:
        globals().update(saved)
