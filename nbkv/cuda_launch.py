"""CUDA kernel launches with their parameter list prepared once.

numba-cuda turns every argument into the kernel's flat parameter list on every launch: a
4-D device array becomes 13 parameters (meminfo, parent, size, itemsize, data pointer,
four extents, four strides), each through a chain of Python calls. The fused
append-and-attend kernel takes ten arrays, 128 parameters, and that marshalling alone is
about 60 us of Python per launch on a 2-core Zen 4 guest, the attention kernel's 102
parameters about 46 us, the append's 53 about 25 us (``benchmarks/bench_launch.py``):
several times everything else in a decode step.

The arrays of one launch signature keep their dtypes, shapes and strides from one call
to the next (nbkv keys its launches by them, or validates them against those that are
keys, as ``v`` against ``k``), so only their data pointers and the scalars change.
:func:`prepare` builds the parameter list once, by Numba's own marshalling of a real
call's arguments, records which entries are pointers and scalars, and checks that its own
fill-in of those arguments gives exactly Numba's list. :class:`PreparedLaunch` then fills
in those entries (refusing, with ``TypeError``, an array unlike the one it was prepared
with) and hands the list to the same ``cuda.core`` launch Numba would call, with the same
kernel function (looked up per call, as Numba does), configuration and stream. What
Numba's launch does besides, for a specialised kernel, is nothing these launches need:
no writeback (device arrays only), no debug exception check (debug kernels are not
prepared), no retyping; its pre-launch callbacks, if any are added, send the launch
through Numba.

This relies on numba-cuda internals (``_Kernel._prepare_args``, its code library's
``get_cufunc``, the ``launch`` and ``LaunchConfig`` its dispatcher imports from
``cuda.core``): :func:`prepare` returns None wherever they are not as expected, an
argument is of a kind it does not handle, or numba-cuda is not a version
:data:`TESTED_NUMBA_CUDA` names, and the caller then launches through Numba.
``NBKV_CUDA_PREPARED_LAUNCH=0`` in the environment, or ``nbkv.cuda_launch.ENABLED = False``
at any time, turns it off.
"""

from __future__ import annotations

import copy
import ctypes
import os
import weakref
from functools import lru_cache
from typing import Any

ENABLED = os.environ.get("NBKV_CUDA_PREPARED_LAUNCH", "1") != "0"

_POINTER = 4  # an array's data pointer: after meminfo, parent, size and itemsize
# numba-cuda versions whose launch code (_Kernel.launch, _prepare_args, the dispatcher's
# call) this was checked against; any other launches through Numba
TESTED_NUMBA_CUDA = ("0.30.",)


@lru_cache(maxsize=1)
def tested_numba_cuda() -> bool:
    """Whether the installed numba-cuda is one :data:`TESTED_NUMBA_CUDA` names."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("numba-cuda").startswith(TESTED_NUMBA_CUDA)
    except PackageNotFoundError:
        return False


def _dead() -> None:
    """A weak reference to nothing: no array was passed here yet."""
    return None


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
        return _as_is  # Numba passes a boolean as it is (bool or np.bool_)
    return None


def _as_is(x):
    return x


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

    ``launch(*args)`` launches with the pointers and scalars of ``args`` filled in. Every
    array of ``args`` must be a Numba device array of the dtype, shape and strides the
    list was prepared with: anything else raises ``TypeError`` (the kernel was compiled
    for those; Numba's launch of a specialised kernel would not retype it either, and a
    C-ordered kernel given other strides reads the wrong elements). The callers key their
    launches by all of these, so it does not happen in nbkv. A callback added to the
    configured launch since (Numba's ``pre_launch_callbacks``) sends the launch through
    Numba, which runs it."""

    def __init__(self, compiled, configured, template, slots, arrays, dispatcher, config) -> None:
        self._library = compiled.library
        self._configured = configured
        self._stream = configured.stream
        self._params = template.copy()  # the last list: only what changes is filled in
        pointers = {i: j for i, j, convert in slots if convert is _pointer}
        # (argument index, parameter index, type, dtype, shape, strides) per array
        self._arrays = [(i, pointers[i], *rest) for i, *rest in arrays]
        # the array last passed in each place, weakly (a launch must not keep a cache's
        # buffers alive after the cache lets them go)
        self._seen: list = [_dead] * len(arrays)
        self._scalars = [slot for slot in slots if slot[2] is not _pointer]
        self._dispatcher = dispatcher  # numba.cuda.dispatcher: its launch, read per call
        self._config = config

    def parameters(self, args: tuple) -> list:
        """The parameter list for ``args`` (``TypeError`` for an array unlike the one it
        was prepared with), valid until the next call. An array that is the one passed
        in its place last time (and still alive) is neither checked nor read again."""
        params, seen = self._params, self._seen
        for n, (i, j, kind, dtype, shape, strides) in enumerate(self._arrays):
            x = args[i]
            if seen[n]() is x:  # the cache's buffers, scratch, often out: as they were
                continue
            if (
                x.shape != shape
                or x.strides != strides
                or type(x) is not kind
                or (x.dtype is not dtype and x.dtype != dtype)  # identity: the usual case
            ):
                raise TypeError(
                    f"argument {i} of a prepared launch must be a {kind.__name__} of dtype "
                    f"{dtype}, shape {shape} and strides {strides}, got {type(x).__name__} "
                    f"{getattr(x, 'dtype', '')} {getattr(x, 'shape', '')} "
                    f"{getattr(x, 'strides', '')}"
                )
            params[j] = _pointer(x)
            seen[n] = weakref.ref(x)
        for i, j, convert in self._scalars:
            params[j] = convert(args[i])
        return params

    def copy(self) -> PreparedLaunch:
        """The same launch with its own parameter list, starting as this one's. Launches
        of one signature over several caches (a model's layers) refill each cache's
        buffers when the caches take turns on one list; with a copy per cache, only
        what changes between that cache's own calls is filled in."""
        new = copy.copy(self)
        new._params, new._seen = self._params.copy(), self._seen.copy()
        return new

    def __call__(self, *args) -> None:
        params = self.parameters(args)
        if getattr(self._configured, "pre_launch_callbacks", None):
            self._configured(*args)  # Numba runs the callbacks, then launches
            return
        kernel = self._library.get_cufunc().kernel  # per call: the current device's
        self._dispatcher.launch(self._stream, self._config, kernel, *params)


def prepare(compiled, configured, args: tuple) -> PreparedLaunch | None:
    """A :class:`PreparedLaunch` of ``compiled`` (a Numba ``_Kernel``) as ``configured``
    (what ``dispatcher[grid, block]`` returns), for arguments like ``args``; None where
    this numba-cuda, the kernel or an argument is not what it handles, or where the
    prepared list for ``args`` is not exactly the one Numba makes."""
    if not ENABLED or not tested_numba_cuda():
        return None
    try:
        from numba.cuda import dispatcher as nd
        from numba.cuda import types
        from numba.cuda.cudadrv.devicearray import DeviceNDArray

        kinds = tuple(compiled.argument_types)
        if compiled.debug or compiled.extensions or len(kinds) != len(args):
            return None
        if getattr(compiled, "launch_config_sensitive", False):
            return None  # Numba may redispatch it per launch configuration
        compiled.library.get_cufunc  # noqa: B018 -- present, or no prepared launch
        slots, arrays = [], []
        start = 0
        for i, (ty, value) in enumerate(zip(kinds, args, strict=True)):
            if isinstance(ty, types.Array):
                if type(value) is not DeviceNDArray:  # a host array Numba would copy
                    return None
                slots.append((i, start + _POINTER, _pointer))
                arrays.append((i, DeviceNDArray, value.dtype, value.shape, value.strides))
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
        prepared = PreparedLaunch(compiled, configured, template, slots, arrays, nd, config)
        if not _same(prepared.parameters(args), template):
            return None
        if getattr(configured, "pre_launch_callbacks", None):
            return None  # Numba runs them
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
        if not ENABLED:  # turned off (for now): through Numba
            run = self._configured
        elif run is None:
            run = prepare(self._compiled, self._configured, args) or self._configured
            self._run = run
        run(*args)

    def copy(self) -> Launch:
        """The same launch with its own prepared parameter list (a copy of this one's, if
        it has one; :meth:`PreparedLaunch.copy`)."""
        new = Launch(self._compiled, self._configured)
        run = self._run
        new._run = run.copy() if isinstance(run, PreparedLaunch) else run
        return new

    @property
    def prepared(self) -> bool | None:
        """True: prepared; False: through Numba; None: not launched yet."""
        return None if self._run is None else isinstance(self._run, PreparedLaunch)


def own_copy(launch):
    """``launch.copy()`` for a :class:`Launch`; any other launch (Numba's configured
    kernel, the simulator's) as it is: it keeps no parameter list."""
    return launch.copy() if isinstance(launch, Launch) else launch
