"""nbkv's CUDA backend and Numba's launch code without a GPU, to measure and test their
Python: :mod:`nbkv.cuda_launch`'s tests and ``benchmarks/bench_launch.py``.

- :class:`OfflineArrays`: Numba device arrays over fake device memory (a pointer with
  nothing behind it);
- :class:`OfflineKernel`: a compiled kernel with numba-cuda's own argument marshalling
  and launch methods (``_Kernel._prepare_args``, ``_Kernel.launch``), typed as Numba
  types its arguments; :class:`OfflineLaunch`: one configured launch of it;
- :func:`offline_cuda`: ``device="cuda"`` on such arrays and kernels inside a ``with``
  block, every launch recorded (kernel, configuration, parameter list) instead of run.
  All of nbkv's Python runs, and Numba's or the prepared marshalling; no kernel does, so
  nothing a cache holds or a call returns has values.

Nothing here touches a GPU: a launch ends in whatever ``numba.cuda.dispatcher.launch``
is (``cuda.core``'s, which needs a GPU, unless replaced, as :func:`offline_cuda` does).
Needs numba-cuda, and not the simulator.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import numpy as np
from numba.cuda import dispatcher as _dispatcher
from numba.cuda.cudadrv import devicearray, devices
from numba.cuda.typing.typeof import Purpose, typeof


class _Memory:
    """Device memory as a device array holds it: a pointer, nothing behind it."""

    def __init__(self, pointer: int) -> None:
        self.device_ctypes_pointer = ctypes.c_size_t(pointer)


class OfflineArrays:
    """Numba device arrays over fake memory, each at an address of its own (drawn from
    ``rng``, at or above ``2**38``)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.address = int(rng.integers(1 << 30, 1 << 38)) << 8

    def _next(self) -> _Memory:
        self.address += int(self.rng.integers(1, 1 << 12)) << 20
        return _Memory(self.address)

    def like(self, a):
        """An array of ``a``'s dtype, shape and strides, elsewhere (a size-0 one as is)."""
        if a.size == 0:
            return a
        return devicearray.DeviceNDArray(a.shape, a.strides, a.dtype, gpu_data=self._next())

    def __call__(self, shape, dtype, pad: int = 0):
        """A C-ordered array of ``shape``, or with ``pad`` more elements along every
        axis's stride (a strided view of a larger buffer)."""
        dtype = np.dtype(dtype)
        strides, step = [], dtype.itemsize
        for n in reversed(shape):
            strides.insert(0, step)
            step *= n + pad
        if 0 in shape:  # a size-0 array has a null pointer, which asks for a context
            with mock.patch.object(devices, "get_context", lambda *a: None):
                return devicearray.DeviceNDArray(tuple(shape), tuple(strides), dtype)
        return devicearray.DeviceNDArray(tuple(shape), tuple(strides), dtype, gpu_data=self._next())


class _Library:
    """A compiled kernel's code library: it gives the kernel function."""

    def __init__(self) -> None:
        self.kernel = object()

    def get_cufunc(self):
        return self


class OfflineKernel:
    """A compiled kernel as numba-cuda's ``_Kernel`` is: Numba's own marshalling and
    launch methods, typed for ``args`` as Numba types them."""

    _prepare_args = _dispatcher._Kernel._prepare_args
    launch = _dispatcher._Kernel.launch

    def __init__(self, args: tuple, debug: bool = False) -> None:
        self.argument_types = tuple(typeof(a, Purpose.argument) for a in args)
        self.extensions: list = []
        self.debug = debug
        self.cooperative = False
        self._codelibrary = _Library()  # what Numba's launch reads

    @property
    def library(self) -> _Library:
        return self._codelibrary


class OfflineLaunch:
    """What ``dispatcher[grid, block]`` is: a launch of ``kernel`` through Numba."""

    def __init__(self, kernel: OfflineKernel, grid, block) -> None:
        self.kernel = kernel
        self.griddim, self.blockdim, self.sharedmem = grid, block, 0
        self.stream = object()

    def __call__(self, *args) -> None:
        self.kernel.launch(args, self.griddim, self.blockdim, self.stream, self.sharedmem)


class _Dispatcher:
    """A kernel as a Numba dispatcher is: ``specialize`` types it for arguments and gives
    a dispatcher with one overload, which ``[grid, block]`` configures."""

    def specialize(self, *args) -> _Dispatcher:
        special = _Dispatcher()
        special.overloads = {"offline": OfflineKernel(args)}
        return special

    def __getitem__(self, config) -> OfflineLaunch:
        grid, block = config
        overloads = getattr(self, "overloads", None)
        if overloads is None:  # a launch without specialising first: typed per call
            return _Untyped(grid, block)
        return OfflineLaunch(overloads["offline"], grid, block)


class _Untyped:
    def __init__(self, grid, block) -> None:
        self.grid, self.block = grid, block

    def __call__(self, *args) -> None:
        OfflineLaunch(OfflineKernel(args), self.grid, self.block)(*args)


class _Kernels:
    """A kernel module (``nbkv.kernels.cuda``, ``nbkv.kernels.cuda_attention``) with every
    kernel, kernel family and kernel factory it has standing for offline kernels."""

    def __init__(self, module) -> None:
        self._module = module
        self._made: dict = {}

    def __getattr__(self, name: str):
        value = getattr(self._module, name)
        family = getattr(self._module, "KernelFamily", None)
        if family is not None and isinstance(value, family):
            return self._made.setdefault(name, _Family(value))
        if name.endswith("_kernel"):
            if callable(value) and not hasattr(value, "py_func"):  # a factory
                return lambda *key: self._made.setdefault((name, key), _Dispatcher())
            return self._made.setdefault(name, _Dispatcher())
        return value


class _Family:
    """A kernel family (``nbkv.kernels.cuda_attention.KernelFamily``): its specialisations
    offline kernels."""

    def __init__(self, family) -> None:
        self.fused, self.spec = family.fused, family.spec
        self._made: dict = {}

    def specialise(self, spec) -> _Dispatcher:
        return self._made.setdefault(spec, _Dispatcher())


class _Cuda:
    """The part of ``numba.cuda`` the CUDA backend allocates and copies with."""

    def __init__(self, arrays: OfflineArrays) -> None:
        self._arrays = arrays

    def device_array(self, shape, dtype):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return self._arrays(shape, dtype)

    def to_device(self, host):
        return self._arrays(np.shape(host), np.asarray(host).dtype)  # values not copied


def _device(rng: np.random.Generator, sms: int):
    """A :class:`nbkv.cuda_backend._CUDADevice` over offline arrays and kernels."""
    from .cuda_backend import _CUDADevice
    from .kernels import cuda as cuda_kernels
    from .kernels import cuda_attention

    return _CUDADevice.from_parts(
        _Cuda(OfflineArrays(rng)),
        _Kernels(cuda_kernels),
        _Kernels(cuda_attention),
        lambda x: isinstance(x, devicearray.DeviceNDArray),
        devicearray.DeviceNDArray,
        sms,
    )


@contextmanager
def offline_cuda(sms: int = 132, seed: int = 0) -> Iterator[list]:
    """``device="cuda"`` without a GPU inside the block (``sms`` multiprocessors): caches
    and calls run all of nbkv's Python and the launches' marshalling, and each launch is
    appended to the list this yields as ``(stream, config, kernel, parameters)`` instead
    of running. Backends made before are set aside, and restored after, as is Numba's
    launch function.

    Process-wide, for a process of its own (a benchmark, a test): inside the block, every
    launch of the process is recorded, a real GPU cache's too; a cache made inside must
    not be used after it, nor one made before inside it."""
    from . import backends

    launches: list = []

    def record(stream, config, kernel, *params) -> None:
        launches.append((stream, config, kernel, params))

    with backends.cuda_device(_device(np.random.default_rng(seed), sms)):
        with mock.patch.object(_dispatcher, "launch", record):
            yield launches
