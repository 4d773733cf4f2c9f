"""Boundary checks. Each message names the argument, the expectation and the value."""

from __future__ import annotations

import numbers

from .errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["positive_int", "optional_positive_int"]


def positive_int(value: object, name: str) -> int:
    """``value`` as an ``int`` if it is an integer >= 1, else a typed error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(
            f"{name} must be a positive int, got {type(value).__name__} {value!r}"
        )
    if value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value}")
    return int(value)


def optional_positive_int(value: object, name: str) -> int | None:
    """``None``, or ``value`` checked by :func:`positive_int`."""
    return None if value is None else positive_int(value, name)
