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
"""

from __future__ import annotations

import importlib.util
import os
import threading
from typing import Any, Protocol

import numpy as np

from . import _config
from . import layout as _layout
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
from .launch import (
    AttentionGrid,
    append_config,
    attention_grid,
    attention_scratch_shapes,
    launch_config,
    resident_blocks,
    wave_splits,
)
from .paged_backends import CPUPaged, CUDAPaged

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
        """What the attention kernels read of a K/V array (16-bit as the kernels want)."""

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

    def finish_attention(self, result: Any, out: Any) -> Any:
        """``out`` holding the result (cast from ``result`` where they differ)."""


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


def _attention_arrays(q, acc: np.dtype, out, empty):
    """(q in the accumulator dtype, the array the kernel writes, the array returned)."""
    q_dtype = np.dtype(q.dtype)
    q_kernel = q if q_dtype == acc else q.astype(acc)
    if out is None:
        out = empty(q.shape, q_dtype)
    result = out if q_dtype == acc else empty(q.shape, acc)
    return q_kernel, result, out


def _span(seq_len: int, n_q: int, window: int) -> int:
    """Positions any of the ``n_q`` last queries can see (all of them without a window)."""
    return seq_len - (max(0, seq_len - n_q - window + 1) if window else 0)


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

    @staticmethod
    def finish_attention(result, out):
        """Cast the kernel's result into ``out`` when they differ (16-bit queries)."""
        if result is not out:
            np.copyto(out, result, casting="unsafe")
        return out


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
        from .kernels.cuda_vec import vector_width

        self.cuda = cuda
        self.is_device_array = is_cuda_ndarray
        self.kernels = cuda_kernels
        self.vector_width = vector_width
        self._attention = None  # nbkv.kernels.cuda_attention, compiled on first use
        self.tables: dict[str, Any] = {}
        self._sms: int | None = None
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
        """This thread's attention launch plans (:class:`_KernelPlan`), by signature."""
        plans = getattr(self._local, "plans", None)
        if plans is None or len(plans) > _MAX_PLANS:  # many shapes: start afresh
            plans = self._local.plans = {}
        return plans

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

    def _rows(self, arrays, pair: bool):
        """The row-wise copy kernel for these arrays (the widest aligned vector) and its
        launch configuration."""
        x = arrays[0]
        dim = int(x.shape[3])
        vec = self._dev.vector_width(x.dtype.itemsize, dim, arrays)
        kernel = self._dev.kernels.write_rows_kernel(vec, self._bshd, pair)
        rows = int(x.shape[0]) * int(x.shape[1]) * int(x.shape[2])
        return kernel[append_config(rows, dim, vec)]

    def write_kv(self, k, v, pos, k_cache, v_cache) -> None:
        self._rows((k, v, k_cache, v_cache), True)(k, v, int(pos), k_cache, v_cache)

    def write_cache(self, x, pos, cache) -> None:
        self._rows((x, cache), False)(x, int(pos), cache)

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
        if np.dtype(x.dtype) == np.float16 or np.dtype(x.dtype).itemsize != 2:
            return x
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

    def _launch(self, fused, head, q, k_cache, v_cache, span, scale, causal, window, out):
        """Launch through this thread's cached plan for these arrays' signature (made on
        first use: the specialised kernel, typed once, and per split count a configured
        launch and its scratch); if the launch fails, forget that scratch."""
        family = self._families(fused)
        tail = (np.float32(scale), bool(causal), int(window), self._dev.empty_table())
        if not hasattr(family, "specialise"):  # a stand-in for the kernels (tests)
            self._launch_generic(family, q, k_cache, span, head + tail, out)
            return
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
            plan = plans[key] = _KernelPlan(self._dev, family, head, tail, out, self._bshd)
        splits = plan.splits(span)
        grid = plan.grids.get(splits)
        if grid is None:
            grid = plan.grid(splits)
        launch, scratch = grid
        try:
            launch(*head, *tail, *scratch, out)
        except BaseException:
            plan.grids.clear()  # counters may be left part-way: fresh ones next time
            raise

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


class _KernelPlan:
    """One attention launch signature on one thread: the kernel specialised for it and
    typed once (no type inference per call), the blocks one wave of it holds, and per
    split count a configured launch with its scratch (``grids``)."""

    def __init__(self, dev: _CUDADevice, family, head, tail, out, bshd: bool) -> None:
        attn = dev.attention_kernels()
        fused = family.fused
        q, k_cache, v_cache = head[0], head[4 if fused else 1], head[5 if fused else 2]
        self.spec = family.spec(q, k_cache, v_cache)
        kernel = family.specialise(self.spec)
        batch, num_heads, n_q, dim = (int(x) for x in q.shape)
        kv_heads = int(k_cache.shape[2 if bshd else 1])
        self.sizes = (batch, num_heads, n_q, dim)
        self.tasks = batch * kv_heads
        self.chunks = -(-(num_heads // kv_heads) * n_q // self.spec.rows)
        self.sms = dev.sm_count()
        self.threads, self.tile = attn.THREADS, attn.TILE
        specialize = getattr(kernel, "specialize", None)  # the simulator has none
        if specialize is not None:
            kernel = specialize(*head, *tail, *dev.dummy_scratch(), out)
        self.kernel = kernel
        self.per_sm = self._occupancy(kernel, attn)
        self._cuda = dev.cuda
        self.grids: dict[int, tuple] = {}

    def _occupancy(self, kernel, attn) -> int:
        """Resident blocks per SM: the driver's figure for the compiled kernel on a GPU,
        else from its shared memory and its launch bound's register cap."""
        try:
            compiled = next(iter(kernel.overloads.values()))
            return max(1, compiled.max_cooperative_grid_blocks(self.threads) // self.sms)
        except Exception:  # the simulator, or a driver without the query
            cap = 65_536 // (self.threads * attn.min_blocks_per_sm(self.spec))
            return resident_blocks(self.threads, registers=cap, shared=attn.shared_bytes(self.spec))

    def splits(self, span: int) -> int:
        """The split count for ``span`` visible positions (tunables read per call)."""
        per_sm = _config.ATTENTION_BLOCKS_PER_SM
        return wave_splits(
            (self.per_sm if per_sm is None else per_sm) * self.sms,
            self.tasks * self.chunks,
            span,
            self.tile,
            _config.ATTENTION_SPLITS,
        )

    def grid(self, splits: int) -> tuple:
        grid = AttentionGrid(splits, self.tasks, self.chunks)
        acc, stats, counters = attention_scratch_shapes(grid, *self.sizes)
        scratch = (
            self._cuda.device_array(acc, np.float32),
            self._cuda.device_array(stats, np.float32),
            self._cuda.to_device(np.zeros(counters, np.int32)),  # zero before a launch
        )
        launch = self.kernel[tuple(grid), self.threads]
        if launch is self.kernel:  # the simulator configures the kernel itself, in place:
            # a launch kept for one split count would run with the last one configured
            dims, threads, kernel = tuple(grid), self.threads, self.kernel

            def launch(*args):
                kernel[dims, threads](*args)

        self.grids[splits] = entry = (launch, scratch)
        return entry


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
