"""Boundary checks. Each message names the argument, the expectation and the value."""

from __future__ import annotations

import numbers

from .errors import ArgumentTypeError, InvalidArgumentError, ShapeMismatchError

__all__ = ["MAX_SIZE", "positive_int", "optional_positive_int", "nonnegative_int", "batch_indices"]


# the largest size or count nbkv takes (positions, batch rows, heads, head_dim, layers):
# kernels index with 64-bit ints, but no real cache comes near this, and a bound here
# turns a typo like 2**62 into a typed error rather than an OverflowError deep inside
MAX_SIZE = 2**31 - 1


def positive_int(value: object, name: str, maximum: int = MAX_SIZE) -> int:
    """``value`` as an ``int`` if it is an integer in [1, maximum], else a typed error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(
            f"{name} must be a positive int, got {type(value).__name__} {value!r:.60}"
        )
    if value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value}")
    if value > maximum:
        raise InvalidArgumentError(f"{name} must be at most {maximum}, got {value}")
    return int(value)


def optional_positive_int(value: object, name: str) -> int | None:
    """``None``, or ``value`` checked by :func:`positive_int`."""
    return None if value is None else positive_int(value, name)


def nonnegative_int(value: object, name: str) -> int:
    """``value`` as an ``int`` if it is an integer >= 0 (of any size), else a typed error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(
            f"{name} must be a non-negative int, got {type(value).__name__} {value!r:.60}"
        )
    if value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value}")
    return int(value)


def batch_indices(indices: object, batch: int, name: str, length: int | None) -> list[int]:
    """``indices`` as a list of batch rows, each in ``[0, batch)``, of ``length`` if given."""
    import numpy as np

    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__len__"):
        raise ArgumentTypeError(
            f"{name} must be a sequence of ints, got {type(indices).__name__} {indices!r}"
        )
    try:
        arr = np.asarray(indices)
    except (TypeError, ValueError) as err:  # ragged lists, objects numpy cannot read
        raise ArgumentTypeError(
            f"{name} must be a 1-D sequence of ints, got {type(indices).__name__} ({err})"
        ) from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ArgumentTypeError(
            f"{name} must be a 1-D sequence of ints, got shape {arr.shape}, dtype {arr.dtype}"
        )
    if length is not None and arr.size != length:
        raise ShapeMismatchError(
            f"{name} must hold one index per batch row ({length}), got {arr.size}"
        )
    if arr.size == 0:
        raise InvalidArgumentError(f"{name} must hold at least one index, got none")
    bad = arr[(arr < 0) | (arr >= batch)]
    if bad.size:
        raise InvalidArgumentError(
            f"{name} must lie in [0, {batch}), got {int(bad[0])} (indices are batch rows)"
        )
    return [int(i) for i in arr]
