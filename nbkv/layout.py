"""Cache layouts, defined once.

A layout names the order of the four axes of every K/V array nbkv stores or accepts:

- ``"bhsd"``: ``[batch, num_kv_heads, seq, head_dim]`` (the default, as the reference API
  and transformers store it);
- ``"bshd"``: ``[batch, seq, num_kv_heads, head_dim]`` (as FlashAttention and many
  inference engines store it).

Everything else in nbkv speaks of the logical axes ``batch, num_kv_heads, seq, head_dim``
and asks this module where they are.
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import InvalidArgumentError

__all__ = [
    "LAYOUTS",
    "SEQ_AXIS",
    "SIZES",
    "Dims",
    "check_layout",
    "dims",
    "buffer_shape",
    "seq_index",
]

LAYOUTS = ("bhsd", "bshd")

# position of the seq and head axes in each layout
SEQ_AXIS = {"bhsd": 2, "bshd": 1}

# the logical sizes a cache fixes besides its positions
SIZES = ("batch", "num_kv_heads", "head_dim")


class Dims(NamedTuple):
    """The four logical sizes of a K/V array, whatever its layout."""

    batch: int
    num_kv_heads: int
    seq: int
    head_dim: int


def check_layout(layout: object) -> str:
    """Return ``layout`` if it names a known layout, else raise InvalidArgumentError."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r:.60}")
    return layout  # type: ignore[return-value]


def dims(shape: tuple[int, ...], layout: str) -> Dims:
    """Read the logical sizes from a 4-D shape in ``layout``."""
    if layout == "bhsd":
        return Dims(shape[0], shape[1], shape[2], shape[3])
    return Dims(shape[0], shape[2], shape[1], shape[3])


def buffer_shape(
    layout: str, batch: int, num_kv_heads: int, seq: int, head_dim: int
) -> tuple[int, int, int, int]:
    """The 4-D shape of an array with these logical sizes in ``layout``."""
    if layout == "bhsd":
        return (batch, num_kv_heads, seq, head_dim)
    return (batch, seq, num_kv_heads, head_dim)


def seq_index(layout: str, start: int, stop: int) -> tuple[slice, ...]:
    """An index that selects positions ``[start, stop)`` of a 4-D array in ``layout``."""
    index = [slice(None)] * (SEQ_AXIS[layout] + 1)
    index[SEQ_AXIS[layout]] = slice(start, stop)
    return tuple(index)
