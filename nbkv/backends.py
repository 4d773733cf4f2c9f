"""Backends: where buffers live, which kernel runs, and the host side of a launch.

A backend is chosen once, when a cache is built (``device="cpu"`` or ``"cuda"``). Caches
talk to it with plain arrays and ints; it never validates shapes (the cache has done so)
but it does decide whether an input lives on its device.

Arrays come in three forms here:

- *user* arrays: what the caller passed and what ``get_kv`` returns (logical dtype; on
  CUDA, 16-bit floats are stored as ``uint16`` because Numba has no bfloat16 device array);
- *kernel* arrays: the same memory seen with :func:`nbkv.dtypes.kernel_dtype`
  (``uint16`` for 16-bit floats), which is what kernels are called with.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

import numpy as np

from . import _config
from .dtypes import kernel_dtype, widen_table
from .errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    DeviceMismatchError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
)
from .kernels import cpu as cpu_kernels
from .kernels import cpu_attention

__all__ = ["DEVICES", "get_backend", "CPUBackend", "CUDABackend", "launch_config"]

DEVICES = ("cpu", "cuda")


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


class CPUBackend:
    """Buffers are NumPy arrays in host memory; kernels are :mod:`nbkv.kernels.cpu`."""

    name = "cpu"

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised buffer (user form)."""
        return np.empty(shape, dtype)

    def adopt(self, x: Any, name: str) -> np.ndarray:
        """``x`` as an array this backend can read, without copying, or a typed error."""
        if hasattr(x, "__cuda_array_interface__") and not isinstance(x, np.ndarray):
            raise DeviceMismatchError(
                f"{name} is a CUDA array but this cache lives on the cpu; copy it to the "
                f"host first or build the cache with device='cuda'"
            )
        return _host_array(x, name)

    def kernel_view(self, x: np.ndarray) -> np.ndarray:
        """The kernel form of an adopted array or a buffer (a view, never a copy)."""
        kd = kernel_dtype(x.dtype)
        return x if kd == x.dtype else x.view(kd)

    to_kernel = kernel_view  # host arrays are already where CPU kernels read them

    @staticmethod
    def kv_writer(layout: str):
        """The kernel that writes K and V in ``layout``: ``f(k, v, pos, k_cache, v_cache)``."""
        return cpu_kernels.write_kv if layout == "bhsd" else cpu_kernels.write_kv_bshd

    def write_kv(self, layout, k, v, pos, k_cache, v_cache) -> None:
        """Write kernel-form ``k``, ``v`` at ``pos`` into kernel-form caches."""
        self.kv_writer(layout)(k, v, pos, k_cache, v_cache)

    def write_cache(self, layout, x, pos, cache) -> None:
        """Write one kernel-form array at ``pos`` into a kernel-form cache."""
        if layout == "bhsd":
            cpu_kernels.write_cache(x, pos, cache)
        else:
            cpu_kernels.write_cache_bshd(x, pos, cache)

    # -- attention -----------------------------------------------------------------

    def attention_arrays(self, q, acc: np.dtype, out):
        return _attention_arrays(q, acc, out, np.empty)

    attention_form = kernel_view  # what attention kernels read: 16-bit as uint16

    @staticmethod
    def attention_table(dtype: np.dtype) -> np.ndarray:
        return widen_table(dtype)

    @staticmethod
    def check_attention(dims) -> None:
        """Nothing the CPU kernels cannot do."""

    def attend(self, layout, q, k_cache, v_cache, seq_len, scale, causal, window, table, out):
        if layout == "bshd":  # the kernel reads [batch, num_kv_heads, seq, head_dim] views
            k_cache, v_cache = k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3)
        batch, num_heads, n_q, head_dim = q.shape
        span = seq_len - (max(0, seq_len - n_q - window + 1) if window else 0)
        # elements of K and V read, times the query rows each serves: the work to split
        work = batch * num_heads * n_q * span * head_dim
        parallel = work >= _config.ATTENTION_PARALLEL_MIN
        kernel = cpu_attention.attend if parallel else cpu_attention.attend_serial
        kernel(q, k_cache, v_cache, seq_len, scale, causal, window, table, out)

    def append_attend(
        self, layout, q, k, v, pos, k_cache, v_cache, scale, causal, window, table, out
    ):
        # two cached kernels back to back: on the CPU one call buys nothing more
        self.write_kv(layout, k, v, pos, k_cache, v_cache)
        n = k.shape[2 if layout == "bhsd" else 1]
        self.attend(layout, q, k_cache, v_cache, pos + n, scale, causal, window, table, out)

    @staticmethod
    def finish_attention(result, out):
        """Cast the kernel's result into ``out`` when they differ (16-bit queries)."""
        if result is not out:
            np.copyto(out, result, casting="unsafe")
        return out


def _attention_arrays(q, acc: np.dtype, out, empty):
    """(q in the accumulator dtype, the array the kernel writes, the array returned)."""
    q_dtype = np.dtype(q.dtype)
    q_kernel = q if q_dtype == acc else q.astype(acc)
    if out is None:
        out = empty(q.shape, q_dtype)
    result = out if q_dtype == acc else empty(q.shape, acc)
    return q_kernel, result, out


def launch_config(n_elements: int) -> tuple[int, int]:
    """``(blocks, threads_per_block)`` for a grid-stride kernel over ``n_elements``.

    Blocks hold ``_config.THREADS_PER_BLOCK`` threads (fewer, in whole warps, for a small
    launch such as one decode token); the grid is capped at ``_config.MAX_BLOCKS``.
    """
    warps = math.ceil(max(n_elements, 1) / _config.WARP)
    threads = min(_config.THREADS_PER_BLOCK, warps * _config.WARP)
    blocks = min(math.ceil(max(n_elements, 1) / threads), _config.MAX_BLOCKS)
    return blocks, threads


class CUDABackend:
    """Buffers are Numba device arrays; kernels are :mod:`nbkv.kernels.cuda`.

    Host<->device copies happen only in :meth:`to_kernel` (a host input, once) and where
    the caller asks for them; everything else stays on the device.
    """

    name = "cuda"

    def __init__(self) -> None:
        simulated = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
        if not simulated and importlib.util.find_spec("numba_cuda") is None:
            raise BackendUnavailableError(
                "device='cuda' needs numba-cuda: pip install 'nbkv[cuda]' "
                "(or set NUMBA_ENABLE_CUDASIM=1 before numba is imported to run the "
                "CUDA code on the CPU simulator)"
            )
        from numba import cuda

        if not cuda.is_available():
            raise BackendUnavailableError(
                "device='cuda' was asked for, but no CUDA GPU is usable in this process "
                "and the CUDA simulator is off; on a machine without a GPU, set the "
                "environment variable NUMBA_ENABLE_CUDASIM=1 before numba is first "
                "imported to run the CUDA kernels on the simulator"
            )
        from numba.cuda.cudadrv.devicearray import is_cuda_ndarray

        from .kernels import cuda as cuda_kernels

        self._cuda = cuda
        self._is_device_array = is_cuda_ndarray
        self._kernels = cuda_kernels
        self._attn = None  # nbkv.kernels.cuda_attention, compiled on first use
        self._tables: dict = {}
        self._scratch_arrays = None
        self._sms: int | None = None

    def empty(self, shape: tuple[int, ...], dtype: np.dtype):
        """An uninitialised device buffer; 16-bit floats stored as ``uint16``."""
        return self._cuda.device_array(shape, self.stored_dtype(dtype))

    @staticmethod
    def stored_dtype(dtype: np.dtype) -> np.dtype:
        """What a device buffer of ``dtype`` holds: bfloat16 as ``uint16`` bit patterns.

        Numba has no bfloat16 device array; float16 it has, so torch and CuPy see fp16.
        """
        return dtype if dtype.kind == "f" else np.dtype(np.uint16)

    def adopt(self, x: Any, name: str):
        """A device array (no copy) or a host array (copied later, in :meth:`to_kernel`)."""
        if self._is_device_array(x):
            return x
        if hasattr(x, "__cuda_array_interface__"):
            return self._cuda.as_cuda_array(x)
        return _host_array(x, name)

    def is_host(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def kernel_view(self, x):
        """The kernel form of a device array (a view, never a copy)."""
        kd = kernel_dtype(np.dtype(x.dtype))
        return x if kd == x.dtype else x.view(kd)

    def to_kernel(self, x):
        """Kernel form on the device: device arrays as views, host arrays copied once."""
        if isinstance(x, np.ndarray):
            host = x.view(kernel_dtype(x.dtype))
            # the one explicit host->device copy of an append (contiguous for the DMA)
            return self._cuda.to_device(np.ascontiguousarray(host))
        return self.kernel_view(x)

    def write_kv(self, layout, k, v, pos, k_cache, v_cache) -> None:
        kernel = (
            self._kernels.write_kv_kernel
            if layout == "bhsd"
            else self._kernels.write_kv_bshd_kernel
        )
        blocks, threads = launch_config(int(np.prod(k.shape)))
        kernel[blocks, threads](k, v, pos, k_cache, v_cache)

    def write_cache(self, layout, x, pos, cache) -> None:
        kernel = (
            self._kernels.write_cache_kernel
            if layout == "bhsd"
            else self._kernels.write_cache_bshd_kernel
        )
        blocks, threads = launch_config(int(np.prod(x.shape)))
        kernel[blocks, threads](x, pos, cache)

    # -- attention (flash-decoding, nbkv.kernels.cuda_attention) -----------------------

    def _attention_kernels(self):
        if self._attn is None:
            from .kernels import cuda_attention

            self._attn = cuda_attention
        return self._attn

    def check_attention(self, dims) -> None:
        limit = _config.ATTENTION_MAX_HEAD_DIM
        if dims.head_dim > limit:
            raise ShapeMismatchError(
                f"head_dim {dims.head_dim} is larger than the CUDA attention kernel's "
                f"{limit} (nbkv._config.ATTENTION_MAX_HEAD_DIM)"
            )

    def attention_arrays(self, q, acc: np.dtype, out):
        """q on the device (copied once if on the host) and the output array."""
        q_dtype = np.dtype(q.dtype)
        if q_dtype.kind != "f":
            raise DTypeMismatchError(
                f"q has dtype {q_dtype}; CUDA attention takes float16, float32 or float64 "
                f"queries (a bfloat16 cache is fine: pass q as float32)"
            )
        if isinstance(q, np.ndarray):
            q = self._cuda.to_device(np.ascontiguousarray(q))  # the explicit copy
        if out is None:
            out = self._cuda.device_array(q.shape, q_dtype)
        elif isinstance(out, np.ndarray):
            raise DeviceMismatchError("out is a host array but this cache lives on cuda")
        return q, out, out

    def attention_form(self, x):
        """Storage form on the device: float16 stays float16, bfloat16 is uint16 bits."""
        if isinstance(x, np.ndarray):
            host = x.view(self.stored_dtype(np.dtype(x.dtype)))
            return self._cuda.to_device(np.ascontiguousarray(host))
        if np.dtype(x.dtype) == np.float16 or np.dtype(x.dtype).itemsize != 2:
            return x
        return x.view(np.uint16)

    def attention_table(self, dtype: np.dtype):
        """bfloat16's widening table on the device (cached); empty for other dtypes."""
        key = str(dtype) if dtype.itemsize == 2 and dtype.kind != "f" else "none"
        if key not in self._tables:
            host = widen_table(dtype) if key != "none" else np.empty(0, np.float32)
            self._tables[key] = self._cuda.to_device(host)
        return self._tables[key]

    def _scratch(self, shape_acc, shape_stats, shape_counters):
        """Partial results and counters, kept between calls (counters stay zeroed)."""
        sc = self._scratch_arrays
        if sc is None or sc[0].shape != shape_acc or sc[2].shape != shape_counters:
            counters = self._cuda.to_device(np.zeros(shape_counters, np.int32))
            sc = (
                self._cuda.device_array(shape_acc, np.float32),
                self._cuda.device_array(shape_stats, np.float32),
                counters,
            )
            self._scratch_arrays = sc
        return sc

    def _attention_launch(self, q, num_kv_heads, span):
        attn = self._attention_kernels()
        batch, num_heads, n_q, dim = (int(x) for x in q.shape)
        tasks = batch * num_kv_heads
        chunks = math.ceil(num_heads // num_kv_heads * n_q / attn.ROWS)
        if _config.ATTENTION_SPLITS is not None:
            splits = _config.ATTENTION_SPLITS
        else:
            want = _config.ATTENTION_BLOCKS_PER_SM * self._sm_count()
            splits = max(1, min(math.ceil(want / (tasks * chunks)), math.ceil(span / attn.TILE)))
        splits = max(1, min(splits, span))
        part = self._scratch(
            (batch, num_heads, n_q, splits, dim),
            (batch, num_heads, n_q, splits, 2),
            (tasks, chunks),
        )
        return (splits, tasks, chunks), attn.THREADS, part

    def _sm_count(self) -> int:
        if self._sms is None:
            device = self._cuda.get_current_device()
            self._sms = int(getattr(device, "MULTIPROCESSOR_COUNT", 1))
        return self._sms

    def attend(self, layout, q, k_cache, v_cache, seq_len, scale, causal, window, table, out):
        attn = self._attention_kernels()
        kernel = attn.attend_kernel if layout == "bhsd" else attn.attend_bshd_kernel
        kv_heads = k_cache.shape[1 if layout == "bhsd" else 2]
        span = seq_len - (max(0, seq_len - q.shape[2] - window + 1) if window else 0)
        grid, threads, part = self._attention_launch(q, kv_heads, span)
        kernel[grid, threads](
            q, k_cache, v_cache, seq_len, scale, causal, window, table, *part, out
        )

    def append_attend(
        self, layout, q, k, v, pos, k_cache, v_cache, scale, causal, window, table, out
    ):
        attn = self._attention_kernels()
        kernel = attn.append_attend_kernel if layout == "bhsd" else attn.append_attend_bshd_kernel
        kv_heads = k_cache.shape[1 if layout == "bhsd" else 2]
        grid, threads, part = self._attention_launch(
            q, kv_heads, pos + k.shape[2 if layout == "bhsd" else 1]
        )
        kernel[grid, threads](
            q, k, v, pos, k_cache, v_cache, scale, causal, window, table, *part, out
        )

    @staticmethod
    def finish_attention(result, out):
        return out


_CPU = CPUBackend()
_CUDA: CUDABackend | None = None


def get_backend(device: object) -> CPUBackend | CUDABackend:
    """The backend for ``device`` ("cpu" or "cuda"), or a typed error."""
    global _CUDA
    if device == "cpu":
        return _CPU
    if device == "cuda":
        if _CUDA is None:
            _CUDA = CUDABackend()
        return _CUDA
    raise InvalidArgumentError(f"device must be one of {DEVICES}, got {device!r}")
