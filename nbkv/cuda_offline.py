"""Numba's CUDA launch code without a GPU, for :mod:`nbkv.cuda_launch`'s tests and its
benchmark (``benchmarks/bench_launch.py``).

Numba device arrays over fake device memory (a pointer with nothing behind it), a
compiled kernel that has numba-cuda's own argument marshalling and launch methods
(``_Kernel._prepare_args``, ``_Kernel.launch``) and the argument types Numba's typeof
gives, and a configured launch. Nothing here touches a GPU: the launch ends in whatever
``numba.cuda.dispatcher.launch`` is (``cuda.core``'s, which needs a GPU, unless a test
replaces it). Needs numba-cuda, and not the simulator.
"""

from __future__ import annotations

import ctypes
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
        self._codelibrary = _Library()


class OfflineLaunch:
    """What ``dispatcher[grid, block]`` is: a launch of ``kernel`` through Numba."""

    def __init__(self, kernel: OfflineKernel, grid, block) -> None:
        self.kernel = kernel
        self.griddim, self.blockdim, self.sharedmem = grid, block, 0
        self.stream = object()

    def __call__(self, *args) -> None:
        self.kernel.launch(args, self.griddim, self.blockdim, self.stream, self.sharedmem)
