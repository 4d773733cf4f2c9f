"""Human-readable units for reports and reprs."""

from __future__ import annotations


def human_bytes(nbytes: float) -> str:
    """``nbytes`` in B, KiB, MiB or GiB, one decimal: ``human_bytes(3 * 2**20) == '3.0 MiB'``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"
