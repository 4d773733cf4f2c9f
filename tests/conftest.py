"""Shared fixtures: which backend the suite runs on, random data, host copies.

The suite runs twice (see README): once plainly, on the CPU backend, and once with
``NUMBA_ENABLE_CUDASIM=1`` set before Numba is imported, on the CUDA backend under the
simulator. ``NBKV_TEST_DEVICE=cuda`` runs it on the CUDA backend on a real GPU.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
DEVICE = os.environ.get("NBKV_TEST_DEVICE", "cuda" if SIMULATOR else "cpu")

# the simulator runs every CUDA thread as a Python thread: fewer, smaller examples
settings.register_profile(
    "simulator",
    max_examples=12,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "cpu",
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("simulator" if DEVICE == "cuda" else "cpu")

cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="exercises the CPU backend only")


def pytest_report_header(config) -> str:
    under = " under Numba's CUDA simulator" if SIMULATOR else ""
    return f"nbkv backend: {DEVICE}{under}"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def rng(request) -> np.random.Generator:
    # fresh data per test, reproducible from the test's name (crc32: hash() of a str
    # changes from one process to the next)
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def dtype_of(name: str) -> np.dtype:
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


DTYPES = ["float32", "float64", "float16", "bfloat16"]
LAYOUTS = ["bhsd", "bshd"]


def shape_of(layout: str, batch: int, heads: int, seq: int, head_dim: int) -> tuple:
    if layout == "bhsd":
        return (batch, heads, seq, head_dim)
    return (batch, seq, heads, head_dim)


def randn(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random normal data of ``dtype`` (never zeros: they hide unwritten memory)."""
    x = rng.standard_normal(shape) * 3.0 + 0.5
    return x.astype(dtype_of(dtype) if isinstance(dtype, str) else dtype)


def host(x, dtype=None) -> np.ndarray:
    """A host copy of a view ``get_kv`` returned, in the cache's logical dtype."""
    if hasattr(x, "copy_to_host"):
        x = x.copy_to_host()
    x = np.asarray(x)
    if dtype is not None and x.dtype != dtype:
        x = x.view(dtype)  # bfloat16 on a CUDA cache arrives as uint16 bit patterns
    return x


def bits(x: np.ndarray) -> np.ndarray:
    """Bit patterns, so that equality is exact (NaN payloads, signed zeros)."""
    return np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}")


def assert_bits_equal(got, want: np.ndarray) -> None:
    got = host(got, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(bits(got), bits(want))
