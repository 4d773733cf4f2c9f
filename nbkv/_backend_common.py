"""What both backends share: adopting a host input without a copy, and the positions
attention reads.

:mod:`nbkv.backends` (the CPU backend) and :mod:`nbkv.cuda_backend` (the CUDA one) import
these; they live apart from both so that :mod:`nbkv.cuda_backend` need not import
:mod:`nbkv.backends`, which imports it (no import circle).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import ArgumentTypeError


def _not_an_array(x: Any, name: str) -> ArgumentTypeError:
    return ArgumentTypeError(
        f"{name} must be an array (numpy.ndarray, or anything numpy.asarray takes "
        f"without copying, such as a CPU torch tensor), got {type(x).__name__}"
    )


def _host_array(x: Any, name: str) -> np.ndarray:
    """``x`` as a NumPy array without a copy; raise if it is no array."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple)) or np.isscalar(x) or x is None:
        raise _not_an_array(x, name)
    if hasattr(x, "__array_interface__") or hasattr(x, "__array__"):
        try:
            return np.asarray(x)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ArgumentTypeError(
                f"{name} ({type(x).__name__}) cannot be seen as a NumPy array: {err}"
            ) from None
    raise _not_an_array(x, name)


def _span(seq_len: int, n_q: int, window: int) -> int:
    """Positions any of the ``n_q`` last queries can see (all of them without a window)."""
    return seq_len - (max(0, seq_len - n_q - window + 1) if window else 0)
