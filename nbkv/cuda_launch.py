"""CUDA kernel launches with their parameter list prepared once.

numba-cuda turns every argument into the kernel's flat parameter list on every launch: a
4-D device array becomes 13 parameters (meminfo, parent, size, itemsize, data pointer,
four extents, four strides), each through a chain of Python calls. The fused
append-and-attend kernel takes ten arrays, 128 parameters, and that marshalling alone is
about 60 us of Python per launch on a 2-core Zen 4 guest, the attention kernel's 102
parameters about 46 us, the append's 53 about 25 us (``benchmarks/bench_launch.py``):
several times everything else in a decode step.

A launch signature's arrays keep their dtypes, shapes and strides from one call to
the next (they are the plan's key), so only their data pointers and the scalars change.
:func:`prepare` builds the parameter list once, by Numba's own marshalling of a real call's
arguments, records which entries are pointers and scalars, and checks that its own
conversion of every argument gives what Numba gives. :class:`PreparedLaunch` then fills in
those entries and hands the list to the same ``cuda.core`` launch Numba would call, with
the same kernel function, configuration and stream.

This relies on numba-cuda internals (``_Kernel._prepare_args``, its code library's
``get_cufunc``, the ``launch`` and ``LaunchConfig`` its dispatcher imports from
``cuda.core``): :func:`prepare` returns None wherever they are not as expected, or an
argument is of a kind it does not handle, and the caller then launches through Numba.
``NBKV_CUDA_PREPARED_LAUNCH=0`` in the environment, or ``nbkv.cuda_launch.ENABLED = False``
at any time, turns it off.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

ENABLED = os.environ.get("NBKV_CUDA_PREPARED_LAUNCH", "1") != "0"

_POINTER = 4  # an array's data pointer: after meminfo, parent, size and itemsize


def _pointer(x) -> Any:
    """What Numba passes as a device array's data pointer (``devary.ptr`` of its shim)."""
    return x.device_ctypes_pointer.value


def _scalar_converter(ty) -> Any:
    """The conversion Numba applies to a scalar argument of type ``ty``, or None."""
    from numba.cuda import types

    if isinstance(ty, types.Integer):
        return getattr(ctypes, f"c_{ty}")
    if ty == types.float32:
        return ctypes.c_float
    if ty == types.float64:
        return ctypes.c_double
    if ty == types.boolean:
        return bool
    return None


def _same(a: list, b: list) -> bool:
    """Two parameter lists are the same: ctypes scalars compared by type and value."""
    if len(a) != len(b):
        return False
    return all(
        type(x) is type(y) and getattr(x, "value", x) == getattr(y, "value", y)
        for x, y in zip(a, b, strict=True)
    )


class PreparedLaunch:
    """One compiled kernel, one launch configuration, a parameter list made once.

    ``launch(*args)`` launches with the pointers and scalars of ``args`` filled in; every
    array of ``args`` must have the dtype, shape and strides the list was prepared with
    (an array that does not is launched through Numba instead, which is always right)."""

    def __init__(self, compiled, configured, template, slots, arrays, launch, config) -> None:
        self._library = compiled._codelibrary
        self._fallback = configured
        self._stream = configured.stream
        self._template = template
        self._slots = slots  # (argument index, parameter index, conversion)
        self._arrays = arrays  # (argument index, shape, strides)
        self._launch = launch
        self._config = config

    def parameters(self, args: tuple) -> list | None:
        """The parameter list for ``args``; None if an array's shape or strides differ."""
        for i, shape, strides in self._arrays:
            x = args[i]
            if x.shape != shape or x.strides != strides:
                return None
        params = self._template.copy()
        for i, j, convert in self._slots:
            params[j] = convert(args[i])
        return params

    def __call__(self, *args) -> None:
        params = self.parameters(args)
        if params is None:
            self._fallback(*args)
            return
        kernel = self._library.get_cufunc().kernel  # per call: the current device's
        self._launch(self._stream, self._config, kernel, *params)


def prepare(compiled, configured, args: tuple) -> PreparedLaunch | None:
    """A :class:`PreparedLaunch` of ``compiled`` (a Numba ``_Kernel``) as ``configured``
    (what ``dispatcher[grid, block]`` returns), for arguments like ``args``; None where
    this numba-cuda, the kernel or an argument is not what it handles, or where the
    prepared list for ``args`` is not exactly the one Numba makes."""
    if not ENABLED:
        return None
    try:
        from numba.cuda import dispatcher as nd
        from numba.cuda import types
        from numba.cuda.cudadrv.devicearray import DeviceNDArray

        kinds = tuple(compiled.argument_types)
        if compiled.debug or compiled.extensions or len(kinds) != len(args):
            return None
        compiled._codelibrary.get_cufunc  # noqa: B018 -- present, or no prepared launch
        slots, arrays = [], []
        start = 0
        for i, (ty, value) in enumerate(zip(kinds, args, strict=True)):
            if isinstance(ty, types.Array):
                if type(value) is not DeviceNDArray:  # a host array Numba would copy
                    return None
                slots.append((i, start + _POINTER, _pointer))
                arrays.append((i, value.shape, value.strides))
                start += 5 + 2 * ty.ndim
            else:
                convert = _scalar_converter(ty)
                if convert is None:
                    return None
                slots.append((i, start, convert))
                start += 1
        template = numba_parameters(compiled, configured, args)
        if start != len(template):
            return None
        config = _config(nd, configured, compiled.cooperative)
        prepared = PreparedLaunch(compiled, configured, template, slots, arrays, nd.launch, config)
        if not _same(prepared.parameters(args), template):
            return None
    except (AttributeError, ImportError, TypeError, ValueError):
        return None  # another numba-cuda: launch through Numba
    return prepared


def _config(nd, configured, cooperative: bool):
    """The ``cuda.core`` launch configuration Numba's launch makes for ``configured``."""
    grid, block, shared = configured.griddim, configured.blockdim, configured.sharedmem
    if nd.CUDA_CORE_GE_1_0:
        return nd.LaunchConfig(
            grid=grid, block=block, shmem_size=shared, is_cooperative=cooperative
        )
    return nd.LaunchConfig(
        grid=grid, block=block, shmem_size=shared, cooperative_launch=cooperative
    )


def numba_parameters(compiled, configured, args: tuple) -> list:
    """Numba's own parameter list for ``args`` (what its launch would pass); device
    arrays only (a host array would be copied to the device)."""
    params: list = []
    for ty, value in zip(compiled.argument_types, args, strict=True):
        compiled._prepare_args(ty, value, configured.stream, [], params)
    return params


class Launch:
    """``configured(*args)``: through a :class:`PreparedLaunch` made at the first call
    where :func:`prepare` can make one, else through Numba (``prepared`` says which)."""

    __slots__ = ("_compiled", "_configured", "_run")

    def __init__(self, compiled, configured) -> None:
        self._compiled, self._configured, self._run = compiled, configured, None

    def __call__(self, *args) -> None:
        run = self._run
        if run is None:
            run = prepare(self._compiled, self._configured, args) or self._configured
            self._run = run
        elif not ENABLED:  # turned off since: through Numba from now on
            run = self._configured
        run(*args)

    @property
    def prepared(self) -> bool | None:
        """True: prepared; False: through Numba; None: not launched yet."""
        return None if self._run is None else isinstance(self._run, PreparedLaunch)
