"""Backends: where buffers live, which kernel runs, and the host side of a launch.

A backend is chosen once, when a cache is built, for a device and a layout:
``get_backend("cuda", "bshd")`` returns a backend bound to that layout, whose table of
kernels was picked then, so no call re-decides the layout. Caches talk to it with plain
arrays and ints; it never validates shapes (the cache has done so) but it does decide
whether an input lives on its device. :class:`Backend` declares the contract both
backends implement.

Arrays come in two forms here:

- *user* arrays: what the caller passed and what ``get_kv`` returns (logical dtype; on
  CUDA, bfloat16 is stored as ``uint16`` because Numba has no bfloat16 device array);
- *kernel* arrays: the same memory seen with :func:`nbkv.dtypes.kernel_dtype`
  (``uint16`` for 16-bit floats), which is what the copy kernels are called with.

Host<->device copies happen in two named places only: :meth:`Backend.to_kernel` (a host
input, copied once to the device) and :meth:`Backend.to_host` (a device array, copied
once to the host). :func:`to_host` is the same for any array, whatever its device.

This module holds the contract (:class:`Backend`), the CPU backend (:class:`CPUBackend`),
:func:`get_backend` and :func:`to_host`. The CUDA backend (:class:`CUDABackend`, the
process-wide :class:`_CUDADevice` and the attention launch plans) lives in
:mod:`nbkv.cuda_backend`, and what both share in :mod:`nbkv._backend_common`;
``CUDABackend`` stays importable from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np

from . import _config
from . import layout as _layout
from ._backend_common import _host_array, _span
from .cuda_backend import CUDABackend, _CUDADevice
from .dtypes import kernel_dtype, widen_table
from .errors import DeviceMismatchError, InvalidArgumentError
from .kernels import cpu as cpu_kernels
from .kernels import cpu_attention
from .paged_backends import CPUPaged

__all__ = ["DEVICES", "Backend", "get_backend", "to_host", "CPUBackend", "CUDABackend"]

DEVICES = ("cpu", "cuda")


class Backend(Protocol):
    """What a cache, ``attention`` and persistence may ask of a backend.

    ``k``/``v``/``x`` are kernel-form arrays on the backend's device; caches are
    ``[batch, num_kv_heads, max_seq_len, head_dim]`` or ``[batch, max_seq_len,
    num_kv_heads, head_dim]`` buffers in :attr:`layout`.
    """

    name: str  # "cpu" or "cuda"
    layout: str  # the layout every array passed in is in
    seq_axis: int  # where the positions are in that layout
    # append_attend is one launch, worth checking and staging an append for; else it is
    # write_kv then attend, and append_and_attend runs the cache's append then attention
    fused_append_attend: bool
    # the class of the arrays this backend computes on (np.ndarray; Numba's device array
    # class): a cache's append fast path takes exactly these, anything else the full checks
    array_type: type

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """An uninitialised user-form buffer on the device."""

    def adopt(self, x: Any, name: str) -> Any:
        """``x`` as an array the backend can read (no copy), or a typed error."""

    def kernel_view(self, x: Any) -> Any:
        """The kernel form of an array on the device (a view)."""

    def to_device(self, x: Any) -> Any:
        """An adopted array on the device in user form (host arrays copied once)."""

    def to_kernel(self, x: Any) -> Any:
        """An adopted array in kernel form on the device (host arrays copied once)."""

    def to_host(self, x: Any, dtype: np.dtype | None = None) -> np.ndarray:
        """A host array of ``x`` (device arrays copied once), seen as ``dtype`` if given."""

    def write_kv(self, k: Any, v: Any, pos: int, k_cache: Any, v_cache: Any) -> None:
        """Write ``k``, ``v`` at positions ``[pos, pos + n)`` of the caches."""

    def write_cache(self, x: Any, pos: int, cache: Any) -> None:
        """Write one array at positions ``[pos, pos + n)`` of one cache."""

    def attention_form(self, x: Any) -> Any:
        """What the attention kernels read of a K/V array (16-bit as the kernels want);
        ``write_kv`` takes it too."""

    def attention_arrays(self, q: Any, acc: np.dtype, out: Any) -> tuple[Any, Any, Any]:
        """``(q for the kernel, array the kernel writes, array returned)``."""

    def attention_table(self, dtype: np.dtype) -> Any:
        """The 16-bit widening table the kernels take for ``dtype`` (empty otherwise)."""

    def check_attention(self, dims: _layout.Dims) -> None:
        """Raise a typed error for sizes the attention kernels cannot take."""

    def attend(self, q, k_cache, v_cache, seq_len, scale, causal, window, table, out) -> None:
        """Attention of ``q`` over positions ``[0, seq_len)``; writes ``out``."""

    def append_attend(
        self, q, k, v, pos, k_cache, v_cache, scale, causal, window, table, out
    ) -> None:
        """Write ``k``, ``v`` at ``pos``, then attend over ``pos + n`` positions."""

    def bind_append_attend(self, q, k, v, k_cache, v_cache, out) -> Any:
        """``append_attend`` for later calls with arrays of exactly these classes, shapes,
        strides and dtypes (the caller checks), with what it looks up per call looked up
        once (:class:`nbkv.DecodeStep`)."""

    def finish_attention(self, result: Any, out: Any) -> Any:
        """``out`` holding the result (cast from ``result`` where they differ)."""


def _attention_arrays(q, acc: np.dtype, out, empty):
    """(q in the accumulator dtype, the array the kernel writes, the array returned)."""
    q_dtype = np.dtype(q.dtype)
    q_kernel = q if q_dtype == acc else q.astype(acc)
    if out is None:
        out = empty(q.shape, q_dtype)
    result = out if q_dtype == acc else empty(q.shape, acc)
    return q_kernel, result, out


def _transposed(x):
    return x.transpose(0, 2, 1, 3)


def _same(x):
    return x


class CPUBackend(CPUPaged):
    """Buffers are NumPy arrays in host memory; kernels are :mod:`nbkv.kernels.cpu`.

    ``write_kv`` and ``write_cache`` are the layout's ``@njit`` kernels themselves, so the
    decode loop pays no Python wrapper for them.
    """

    name = "cpu"
    fused_append_attend = False  # append_attend: two cached kernels back to back
    array_type = np.ndarray

    # the kernel table: layout -> (write_kv, write_cache)
    _KERNELS = {
        "bhsd": (cpu_kernels.write_kv, cpu_kernels.write_cache),
        "bshd": (cpu_kernels.write_kv_bshd, cpu_kernels.write_cache_bshd),
    }

    def __init__(self, layout: str) -> None:
        self.layout = layout
        self.seq_axis = _layout.SEQ_AXIS[layout]
        self.write_kv, self.write_cache = self._KERNELS[layout]
        self._bind_paged()  # the paged kernels of this layout (nbkv.paged_backends)
        # the attention kernels read [batch, num_kv_heads, seq, head_dim] views
        self._as_bhsd = _transposed if layout == "bshd" else _same

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

    @staticmethod
    def to_device(x: np.ndarray) -> np.ndarray:
        """``x`` itself: host arrays are already on this device."""
        return x

    to_kernel = kernel_view  # host arrays are already where CPU kernels read them

    @staticmethod
    def to_host(x: Any, dtype: np.dtype | None = None) -> np.ndarray:
        """``x`` itself (it is on the host), seen as ``dtype`` if given."""
        x = np.asarray(x)
        return x if dtype is None or x.dtype == dtype else x.view(dtype)

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

    def attend(self, q, k_cache, v_cache, seq_len, scale, causal, window, table, out):
        k_cache, v_cache = self._as_bhsd(k_cache), self._as_bhsd(v_cache)
        batch, num_heads, n_q, head_dim = q.shape
        # elements of K and V read, times the query rows each serves: the work to split
        work = batch * num_heads * n_q * _span(seq_len, n_q, window) * head_dim
        parallel = work >= _config.ATTENTION_PARALLEL_MIN
        kernel = cpu_attention.attend if parallel else cpu_attention.attend_serial
        kernel(q, k_cache, v_cache, seq_len, scale, causal, window, table, out)

    def append_attend(self, q, k, v, pos, k_cache, v_cache, scale, causal, window, table, out):
        # two cached kernels back to back: on the CPU one call buys nothing more
        self.write_kv(k, v, pos, k_cache, v_cache)
        n = k.shape[self.seq_axis]
        self.attend(q, k_cache, v_cache, pos + n, scale, causal, window, table, out)

    def bind_append_attend(self, q, k, v, k_cache, v_cache, out):
        """``append_attend`` itself: on the CPU it looks nothing up that binding saves."""
        return self.append_attend

    @staticmethod
    def finish_attention(result, out):
        """Cast the kernel's result into ``out`` when they differ (16-bit queries)."""
        if result is not out:
            np.copyto(out, result, casting="unsafe")
        return out


_BACKENDS: dict[tuple[str, str], Backend] = {}
_CUDA_DEVICE: list[_CUDADevice] = []


def get_backend(device: object, layout: object = "bhsd") -> Backend:
    """The backend for ``device`` ("cpu" or "cuda") bound to ``layout``, or a typed error.

    One instance per (device, layout), made on first request.
    """
    if not isinstance(device, str) or device not in DEVICES:
        raise InvalidArgumentError(f"device must be one of {DEVICES}, got {device!r:.60}")
    layout = _layout.check_layout(layout)
    key = (device, layout)
    backend = _BACKENDS.get(key)
    if backend is None:
        if device == "cpu":
            backend = CPUBackend(layout)
        else:
            if not _CUDA_DEVICE:
                _CUDA_DEVICE.append(_CUDADevice())
            backend = CUDABackend(_CUDA_DEVICE[0], layout)
        _BACKENDS[key] = backend
    return backend


@contextmanager
def cuda_device(device: _CUDADevice) -> Iterator[None]:
    """``device="cuda"`` backed by ``device`` inside the block (for
    :func:`nbkv.cuda_offline.offline_cuda`); the CUDA backends made before are set aside,
    and restored after."""
    saved = list(_CUDA_DEVICE), {k: b for k, b in _BACKENDS.items() if k[0] == "cuda"}
    for key in saved[1]:
        del _BACKENDS[key]
    _CUDA_DEVICE[:] = [device]
    try:
        yield
    finally:
        for key in [k for k in _BACKENDS if k[0] == "cuda"]:
            del _BACKENDS[key]
        _BACKENDS.update(saved[1])
        _CUDA_DEVICE[:] = saved[0]


def to_host(x: Any, dtype: Any = None) -> np.ndarray:
    """A NumPy array of ``x``: a CUDA device array copied to the host once, a host array
    as it is (no copy). ``dtype`` views the result (a bfloat16 CUDA cache's views arrive
    as ``uint16`` bits: ``to_host(K, cache.dtype)``).

    >>> import numpy as np, nbkv
    >>> x = np.ones(3, np.float32)
    >>> nbkv.to_host(x) is x
    True
    """
    dtype = None if dtype is None else np.dtype(dtype)
    if isinstance(x, np.ndarray) or not hasattr(x, "copy_to_host"):
        return CPUBackend.to_host(x, dtype)
    return get_backend("cuda").to_host(x, dtype)
