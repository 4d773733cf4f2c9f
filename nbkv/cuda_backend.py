"""The CUDA backend: Numba device arrays, the ``@cuda.jit`` kernels and their launches.

:class:`CUDABackend` implements :class:`nbkv.backends.Backend` for ``device="cuda"``,
bound to a layout when :func:`nbkv.backends.get_backend` makes it. What every CUDA
backend of the process shares (the driver, the compiled kernel modules, widening tables
on the device, the SM count, the attention scratch and launch plans) is one
:class:`_CUDADevice`; :class:`nbkv.cuda_plan.KernelPlan` is one attention launch
signature, typed once.
Numba's CUDA support is imported only when the first CUDA backend is made, so importing
this module needs no GPU and no numba-cuda.

Host<->device copies happen only in :meth:`CUDABackend.to_kernel` (a host input, once)
and :meth:`CUDABackend.to_host`. Get a backend through :func:`nbkv.backends.get_backend`,
which keeps one per layout and one :class:`_CUDADevice` per process.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from typing import Any

import numpy as np

from . import _config, cuda_launch
from . import layout as _layout
from ._backend_common import _host_array, _span
from .cuda_plan import KernelPlan
from .dtypes import kernel_dtype, widen_table
from .errors import (
    BackendUnavailableError,
    DeviceMismatchError,
    DTypeMismatchError,
    ShapeMismatchError,
)
from .launch import (
    append_config,
    attention_grid,
    attention_scratch_shapes,
    launch_config,
)
from .paged_backends import CUDAPaged

__all__ = ["CUDABackend"]


class _CUDADevice:
    """What every CUDA backend of this process shares: the driver, the compiled kernel
    modules, widening tables on the device, the SM count and the attention scratch."""

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

        array_type = type(cuda.device_array(1, np.uint8))  # what device_array makes
        self._parts(cuda, cuda_kernels, None, is_cuda_ndarray, array_type, None, simulated)

    @classmethod
    def from_parts(cls, cuda, kernels, attention, is_device_array, array_type, sms: int):
        """A device over these parts, asking no driver for a GPU (for
        :mod:`nbkv.cuda_offline`): ``cuda`` allocates and copies as ``numba.cuda`` does,
        ``kernels`` and ``attention`` stand for :mod:`nbkv.kernels.cuda` and
        :mod:`nbkv.kernels.cuda_attention`."""
        dev = object.__new__(cls)
        dev._parts(cuda, kernels, attention, is_device_array, array_type, sms, False)
        return dev

    def _parts(self, cuda, kernels, attention, is_device_array, array_type, sms, simulated):
        from .kernels.cuda_vec import vector_width

        self.simulated = simulated
        self.cuda = cuda
        self.is_device_array = is_device_array
        self.array_type = array_type
        self.kernels = kernels
        self.vector_width = vector_width
        self._attention = attention  # nbkv.kernels.cuda_attention, compiled on first use
        self.tables: dict[str, Any] = {}
        self._sms: int | None = sms
        # partial results and counters of the last attention launch, per thread (two
        # threads launching at once must not share counters)
        self._local = threading.local()

    def attention_kernels(self):
        if self._attention is None:
            from .kernels import cuda_attention

            self._attention = cuda_attention
        return self._attention

    def sm_count(self) -> int:
        if self._sms is None:
            device = self.cuda.get_current_device()
            self._sms = int(getattr(device, "MULTIPROCESSOR_COUNT", 1))
        return self._sms

    def scratch(self, shapes):
        """Scratch of these shapes, kept between launches; its counters are zero."""
        acc_shape, stats_shape, counters_shape = shapes
        sc = getattr(self._local, "arrays", None)
        if sc is None or sc[0].shape != acc_shape or sc[2].shape != counters_shape:
            counters = self.cuda.to_device(np.zeros(counters_shape, np.int32))
            sc = (
                self.cuda.device_array(acc_shape, np.float32),
                self.cuda.device_array(stats_shape, np.float32),
                counters,
            )
            self._local.arrays = sc
        return sc

    def drop_scratch(self) -> None:
        """Forget the scratch: a launch that failed may have left counters part-way, so
        the next launch must start from freshly zeroed ones."""
        self._local.arrays = None

    def plans(self) -> dict:
        """This thread's attention launch plans (:class:`nbkv.cuda_plan.KernelPlan`), by
        signature."""
        plans = getattr(self._local, "plans", None)
        if plans is None or len(plans) > _MAX_PLANS:  # many shapes: start afresh
            plans = self._local.plans = {}
        return plans

    def launch(self, kernel, config, args: tuple) -> None:
        """``kernel[config](*args)``; on a GPU through this thread's launch of the kernel
        specialised for these arguments' types, shapes and strides, its parameter list
        prepared once (:mod:`nbkv.cuda_launch`)."""
        specialize = getattr(kernel, "specialize", None)
        if self.simulated or specialize is None:  # nothing compiled: Numba launches it
            kernel[config](*args)
            return
        key = (kernel, config) + tuple(
            (type(a), a.shape, a.strides, a.dtype) if hasattr(a, "strides") else type(a)
            for a in args
        )
        launches = getattr(self._local, "launches", None)
        if launches is None or len(launches) > _MAX_PLANS:  # many shapes: start afresh
            launches = self._local.launches = {}
        launch = launches.get(key)
        if launch is None:
            special = specialize(*args)
            compiled = next(iter(special.overloads.values()))
            launch = launches[key] = cuda_launch.Launch(compiled, special[config])
        launch(*args)

    def empty_table(self):
        """The empty float32 array the attention kernels take as ``table`` (unread)."""
        if "none" not in self.tables:
            self.tables["none"] = self.cuda.to_device(np.empty(0, np.float32))
        return self.tables["none"]

    def dummy_scratch(self):
        """Tiny arrays of the scratch's types, to type a kernel before its grid is known."""
        if "scratch" not in self.tables:
            self.tables["scratch"] = (
                self.cuda.device_array((1,) * 5, np.float32),
                self.cuda.device_array((1,) * 5, np.float32),
                self.cuda.device_array((1, 1), np.int32),
            )
        return self.tables["scratch"]


class CUDABackend(CUDAPaged):
    """Buffers are Numba device arrays; kernels are :mod:`nbkv.kernels.cuda` and
    :mod:`nbkv.kernels.cuda_attention`, picked for the layout when the backend is made.

    Host<->device copies happen only in :meth:`to_kernel` (a host input, once) and
    :meth:`to_host`; everything else stays on the device.
    """

    name = "cuda"
    fused_append_attend = True  # one launch writes the new positions and attends

    def __init__(self, device: _CUDADevice, layout: str) -> None:
        self._dev = device
        self._cuda = device.cuda
        self.layout = layout
        self.seq_axis = _layout.SEQ_AXIS[layout]
        self._kv_heads_axis = 1 if layout == "bhsd" else 2
        k = device.kernels
        bshd = layout == "bshd"
        self._write_kv_kernel = k.write_kv_bshd_kernel if bshd else k.write_kv_kernel
        self._write_cache_kernel = k.write_cache_bshd_kernel if bshd else k.write_cache_kernel
        self._bshd = bshd
        self.array_type = device.array_type

    def empty(self, shape: tuple[int, ...], dtype: np.dtype):
        """An uninitialised device buffer; bfloat16 stored as ``uint16``."""
        return self._cuda.device_array(shape, self.stored_dtype(dtype))

    @staticmethod
    def stored_dtype(dtype: np.dtype) -> np.dtype:
        """What a device buffer of ``dtype`` holds: bfloat16 as ``uint16`` bit patterns.

        Numba has no bfloat16 device array; float16 it has, so torch and CuPy see fp16.
        """
        return dtype if dtype.kind in "fiub" else np.dtype(np.uint16)  # ints: as they are

    def adopt(self, x: Any, name: str):
        """A device array (no copy) or a host array (copied later, in :meth:`to_kernel`)."""
        if self._dev.is_device_array(x):
            return x
        if hasattr(x, "__cuda_array_interface__"):
            return self._cuda.as_cuda_array(x)
        return _host_array(x, name)

    def kernel_view(self, x):
        """The kernel form of a device array (a view, never a copy)."""
        kd = kernel_dtype(np.dtype(x.dtype))
        return x if kd == x.dtype else x.view(kd)

    def to_device(self, x):
        """User form on the device: device arrays as they are, host arrays copied once
        (bfloat16 as its ``uint16`` bits); the one explicit host->device copy of an input."""
        if isinstance(x, np.ndarray):
            host = x.view(self.stored_dtype(np.dtype(x.dtype)))
            return self._cuda.to_device(np.ascontiguousarray(host))  # contiguous for the DMA
        return x

    def to_kernel(self, x):
        """Kernel form on the device: device arrays as views, host arrays copied once."""
        return self.kernel_view(self.to_device(x))

    def to_host(self, x: Any, dtype: np.dtype | None = None) -> np.ndarray:
        """A host copy of a device array (the one explicit device->host copy), seen as
        ``dtype`` if given (bfloat16 arrives as ``uint16`` bits); host arrays as they are.

        A strided 4-D view (positions of a cache) is gathered on the device first, by
        the copy kernel, so that one contiguous transfer suffices."""
        if isinstance(x, np.ndarray):
            host = x
        else:
            if x.ndim == 4 and not x.is_c_contiguous():
                dense = self._cuda.device_array(x.shape, x.dtype)
                blocks, threads = launch_config(int(np.prod(x.shape)))
                self._dev.kernels.write_cache_kernel[blocks, threads](x, 0, dense)
                x = dense
            host = x.copy_to_host()
        return host if dtype is None or host.dtype == dtype else host.view(dtype)

    def _rows(self, arrays, pair: bool, args: tuple) -> None:
        """Launch the row-wise copy kernel for these arrays (the widest aligned vector)
        with ``args``."""
        x = arrays[0]
        dim = int(x.shape[3])
        vec = self._dev.vector_width(x.dtype.itemsize, dim, arrays)
        kernel = self._dev.kernels.write_rows_kernel(vec, self._bshd, pair)
        rows = int(x.shape[0]) * int(x.shape[1]) * int(x.shape[2])
        self._dev.launch(kernel, append_config(rows, dim, vec), args)

    def write_kv(self, k, v, pos, k_cache, v_cache) -> None:
        self._rows((k, v, k_cache, v_cache), True, (k, v, int(pos), k_cache, v_cache))

    def write_cache(self, x, pos, cache) -> None:
        self._rows((x, cache), False, (x, int(pos), cache))

    # -- attention (flash-decoding, nbkv.kernels.cuda_attention) -----------------------

    def check_attention(self, dims) -> None:
        limit = _config.ATTENTION_MAX_HEAD_DIM
        if dims.head_dim > limit:
            raise ShapeMismatchError(
                f"head_dim {dims.head_dim} is larger than the CUDA attention kernel's "
                f"{limit} (the tunable ATTENTION_MAX_HEAD_DIM)"
            )

    def attention_arrays(self, q, acc: np.dtype, out):
        """q on the device (copied once if on the host) and the output array."""
        q_dtype = np.dtype(q.dtype)
        if q_dtype.kind != "f":
            raise DTypeMismatchError(
                f"q has dtype {q_dtype}; CUDA attention takes float16, float32 or float64 "
                f"queries (a bfloat16 cache is fine: pass q as float32)"
            )
        if out is not None and isinstance(out, np.ndarray):
            raise DeviceMismatchError("out is a host array but this cache lives on cuda")
        if isinstance(q, np.ndarray):
            q = self._cuda.to_device(np.ascontiguousarray(q))  # the explicit copy
        if out is None:
            out = self._cuda.device_array(q.shape, q_dtype)
        return q, out, out

    def attention_form(self, x):
        """Storage form on the device: float16 stays float16, bfloat16 is uint16 bits."""
        x = self.to_device(x)
        dtype = np.dtype(x.dtype)
        if dtype.itemsize != 2 or dtype == np.float16 or dtype == np.uint16:
            return x  # as it is: a view of a device array costs microseconds of Python
        return x.view(np.uint16)

    def attention_table(self, dtype: np.dtype):
        """bfloat16's widening table on the device (cached); empty for other dtypes. The
        paged kernels read one entry of it, once a block, to tell bfloat16 bits (widened
        by a shift, as the contiguous kernels do, which take an empty table) from float16
        bits; nothing reads the rest."""
        key = str(dtype) if dtype.itemsize == 2 and dtype.kind != "f" else "none"
        tables = self._dev.tables
        if key not in tables:
            host = widen_table(dtype) if key != "none" else np.empty(0, np.float32)
            tables[key] = self._cuda.to_device(host)
        return tables[key]

    def _families(self, fused: bool):
        attn = self._dev.attention_kernels()
        if fused:
            return attn.append_attend_bshd_kernel if self._bshd else attn.append_attend_kernel
        return attn.attend_bshd_kernel if self._bshd else attn.attend_kernel

    def attend(self, q, k_cache, v_cache, seq_len, scale, causal, window, table, out):
        span = _span(seq_len, q.shape[2], window)
        head = (q, k_cache, v_cache, int(seq_len))
        self._launch(False, head, q, k_cache, v_cache, span, scale, causal, window, out)

    def append_attend(self, q, k, v, pos, k_cache, v_cache, scale, causal, window, table, out):
        span = _span(pos + k.shape[self.seq_axis], q.shape[2], window)
        head = (q, k, v, int(pos), k_cache, v_cache)
        self._launch(True, head, q, k_cache, v_cache, span, scale, causal, window, out)

    def bind_append_attend(self, q, k, v, k_cache, v_cache, out):
        """``append_attend`` for later calls on this thread with arrays of exactly these
        classes, shapes, strides and dtypes (the caller checks that): the launch plan
        looked up once, not per call. A call from another thread takes ``append_attend``
        (launch plans and their scratch are per thread)."""
        family = self._families(True)
        if not hasattr(family, "specialise"):  # a stand-in for the kernels (tests)
            return self.append_attend
        tail = (np.float32(1.0), True, 0, self._dev.empty_table())
        plan = self._plan_for(family, True, (q, k, v, 0, k_cache, v_cache), tail, out)
        thread, seq_axis, empty = threading.get_ident(), self.seq_axis, tail[3]
        own: dict = {}  # this binding's copies of the plan's launches (see KernelPlan.run)

        def append_attend(q, k, v, pos, k_cache, v_cache, scale, causal, window, table, out):
            if threading.get_ident() != thread:
                plain = self.append_attend
                plain(q, k, v, pos, k_cache, v_cache, scale, causal, window, table, out)
                return
            span = _span(pos + k.shape[seq_axis], q.shape[2], window)
            head = (q, k, v, int(pos), k_cache, v_cache)
            tail = (np.float32(scale), bool(causal), int(window), empty)
            plan.run(span, head, tail, out, own)

        return append_attend

    def _launch(self, fused, head, q, k_cache, v_cache, span, scale, causal, window, out):
        """Launch through this thread's cached plan for these arrays' signature (made on
        first use: the specialised kernel, typed once, and per split count a configured
        launch and its scratch); if the launch fails, forget that scratch."""
        family = self._families(fused)
        tail = (np.float32(scale), bool(causal), int(window), self._dev.empty_table())
        if not hasattr(family, "specialise"):  # a stand-in for the kernels (tests)
            self._launch_generic(family, q, k_cache, span, head + tail, out)
            return
        self._plan_for(family, fused, head, tail, out).run(span, head, tail, out)

    def _plan_for(self, family, fused: bool, head: tuple, tail: tuple, out) -> KernelPlan:
        """This thread's launch plan for these arrays' signature, made on first use."""
        q, k_cache, v_cache = head[0], head[4 if fused else 1], head[5 if fused else 2]
        plans = self._dev.plans()
        # what the kernel was typed for; the cache validated that v matches k and out q
        key = (
            family, q.shape, q.strides, q.dtype, k_cache.shape, k_cache.strides,
            k_cache.dtype, v_cache.strides, out.strides, out.dtype,
        )  # fmt: skip
        if fused:
            key += (head[1].shape, head[1].strides, head[2].strides)
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = KernelPlan(self._dev, family, head, tail, out, self._bshd)
        return plan

    def _launch_generic(self, kernel, q, k_cache, span: int, args: tuple, out) -> None:
        """Size the grid and scratch, launch, and if anything fails, forget the scratch."""
        attn = self._dev.attention_kernels()
        batch, num_heads, n_q, dim = (int(x) for x in q.shape)
        kv_heads = int(k_cache.shape[self._kv_heads_axis])
        grid = attention_grid(
            batch, num_heads, kv_heads, n_q, span, sm_count=self._dev.sm_count(),
            tile=attn.TILE, rows=attn.rows_per_block(num_heads // kv_heads, n_q),
        )  # fmt: skip
        part = self._dev.scratch(attention_scratch_shapes(grid, batch, num_heads, n_q, dim))
        try:
            kernel[tuple(grid), attn.THREADS](*args, *part, out)
        except BaseException:
            self._dev.drop_scratch()
            raise

    @staticmethod
    def finish_attention(result, out):
        return out


_MAX_PLANS = 64  # launch plans a thread keeps before it starts afresh
