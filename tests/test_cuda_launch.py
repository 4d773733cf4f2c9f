"""nbkv.cuda_launch: the attention launch's parameter list, prepared once, is exactly the
one numba-cuda makes on every call.

Without a GPU: Numba's device arrays are made over fake device memory (a pointer with
nothing behind it), a kernel is typed as Numba types its arguments, and Numba's own
marshalling and launch code (``_Kernel._prepare_args``, ``_Kernel.launch``) run with
``cuda.core``'s ``launch`` replaced by a recorder: a prepared launch must hand the
recorder the same stream, configuration, kernel function and parameters as Numba's
launch of the same arguments. On a real GPU (``NBKV_TEST_DEVICE=cuda``) the attention
calls themselves go through it, and are compared bit for bit with Numba's launch.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from conftest import DEVICE, SIMULATOR, host, randn, shape_of

if SIMULATOR:
    pytest.skip("numba-cuda's launch code, not the simulator's", allow_module_level=True)

nd = pytest.importorskip("numba.cuda.dispatcher")
from numba.cuda.cudadrv import devicearray  # noqa: E402

import nbkv  # noqa: E402
from nbkv import cuda_launch  # noqa: E402
from nbkv.cuda_offline import OfflineArrays, OfflineKernel, OfflineLaunch  # noqa: E402

GPU = DEVICE == "cuda" and not SIMULATOR


@pytest.fixture
def recorder(monkeypatch):
    """``cuda.core``'s launch, as Numba's dispatcher calls it, recording its arguments."""
    calls: list = []

    def launch(stream, config, kernel, *params):
        calls.append((stream, config, kernel, params))

    monkeypatch.setattr(nd, "launch", launch)
    return calls


def _same_call(a, b) -> None:
    assert a[0] is b[0] and a[2] is b[2]  # the stream and the kernel function
    assert a[1] == b[1]  # the launch configuration
    assert cuda_launch._same(list(a[3]), list(b[3]))


def _attention_args(arrays: OfflineArrays, rng: np.random.Generator, *, fused: bool, bshd: bool):
    """Arguments as ``CUDABackend._launch`` passes them: head, tail, scratch, out; sizes,
    dtypes and strides drawn at random (bfloat16 is ``uint16`` bits)."""
    batch, kv_heads = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    group, n_q = int(rng.choice([1, 2, 4, 8])), int(rng.choice([1, 1, 3, 17]))
    dim = int(rng.choice([8, 64, 128, 256]))
    heads, capacity = kv_heads * group, int(rng.integers(n_q, 70_000))
    dtype = np.dtype(rng.choice(["float16", "uint16", "float32", "float64"]))
    q_dtype = np.dtype(rng.choice(["float16", "float32", "float64"]))
    pad = int(rng.choice([0, 0, 3]))  # a strided view of the cache's buffers

    def seq(s):
        return (batch, s, kv_heads, dim) if bshd else (batch, kv_heads, s, dim)

    q = arrays((batch, heads, n_q, dim), q_dtype)
    k_cache, v_cache = arrays(seq(capacity), dtype, pad), arrays(seq(capacity), dtype, pad)
    pos = int(rng.integers(0, capacity - n_q + 1))
    if fused:
        head = (q, arrays(seq(n_q), dtype), arrays(seq(n_q), dtype), pos, k_cache, v_cache)
    else:
        head = (q, k_cache, v_cache, pos + n_q)
    scale, window = np.float32(rng.uniform(0.01, 1.0)), int(rng.choice([0, 1, 4096]))
    tail = (scale, bool(rng.integers(2)), window, arrays((0,), np.float32))
    splits, chunks = int(rng.integers(1, 67)), -(-group * n_q // 16)
    rows = min(16, group * n_q)
    scratch = (
        arrays((splits, batch * kv_heads, chunks, rows, dim), np.float32),
        arrays((splits, batch * kv_heads, chunks, rows, 2), np.float32),
        arrays((batch * kv_heads, chunks), np.int32),
    )
    return (*head, *tail, *scratch, arrays(q.shape, q_dtype))


def _renewed(arrays: OfflineArrays, args: tuple, rng: np.random.Generator) -> tuple:
    """The same kinds of arguments at new addresses, with new scalars: the next call."""
    out = []
    for a in args:
        if isinstance(a, devicearray.DeviceNDArray):
            out.append(arrays.like(a))
        elif isinstance(a, bool):
            out.append(not a)
        elif isinstance(a, np.float32):
            out.append(np.float32(rng.uniform(0.01, 1.0)))
        else:
            out.append(int(rng.integers(0, 1 << 20)))
    return tuple(out)


def _parameter_count(args: tuple) -> int:
    """Numba's flattening: an array is meminfo, parent, size, itemsize, pointer, its
    extents and its strides; a scalar is one parameter."""
    return sum(5 + 2 * a.ndim if _is_array(a) else 1 for a in args)


def _is_array(a) -> bool:
    return isinstance(a, devicearray.DeviceNDArray)


@pytest.mark.parametrize("bshd", [False, True], ids=["bhsd", "bshd"])
@pytest.mark.parametrize("fused", [False, True], ids=["attend", "append_attend"])
@pytest.mark.parametrize("seed", range(6))
def test_a_prepared_launch_passes_what_numba_passes(recorder, seed, fused, bshd):
    rng = np.random.default_rng([seed, fused, bshd])
    arrays = OfflineArrays(rng)
    args = _attention_args(arrays, rng, fused=fused, bshd=bshd)
    compiled = OfflineKernel(args)
    configured = OfflineLaunch(compiled, (int(rng.integers(1, 67)), 8, 2), (128, 1, 1))
    launch = cuda_launch.Launch(compiled, configured)
    assert launch.prepared is None
    for call in range(4):  # the first call prepares; then new addresses and scalars
        if call:
            args = _renewed(arrays, args, rng)
        launch(*args)
        configured(*args)  # Numba's launch of the same arguments
        assert launch.prepared is True
        assert len(recorder) == 2
        _same_call(*recorder)
        assert len(recorder[0][3]) == _parameter_count(args)
        pointers = [p for p in recorder[0][3] if isinstance(p, int) and p >= 1 << 38]
        assert len(pointers) == sum(a.size > 0 for a in args if _is_array(a))
        recorder.clear()


def _prepared(rng, fused=True, bshd=False):
    arrays = OfflineArrays(rng)
    args = _attention_args(arrays, rng, fused=fused, bshd=bshd)
    compiled = OfflineKernel(args)
    configured = OfflineLaunch(compiled, (3, 2, 1), (128, 1, 1))
    return arrays, args, compiled, configured


def test_an_array_of_other_strides_or_shape_goes_through_numba(recorder, rng):
    arrays, args, compiled, configured = _prepared(rng)
    prepared = cuda_launch.prepare(compiled, configured, args)
    assert isinstance(prepared, cuda_launch.PreparedLaunch)
    k_cache = args[4]
    for other in (
        arrays(k_cache.shape, k_cache.dtype, pad=1),  # other strides
        arrays(k_cache.shape[:2] + (k_cache.shape[2] + 1,) + k_cache.shape[3:], k_cache.dtype),
    ):
        changed = args[:4] + (other,) + args[5:]
        assert prepared.parameters(changed) is None
        prepared(*changed)
        configured(*changed)
        _same_call(*recorder)  # Numba's parameters for the changed arguments
        pointer = recorder[0][3][_parameter_count(args[:4]) + 4]
        assert pointer == other.device_ctypes_pointer.value
        recorder.clear()


def _declined(monkeypatch, rng, recorder, how: str):
    arrays, args, compiled, configured = _prepared(rng)
    if how == "turned off":
        monkeypatch.setattr(cuda_launch, "ENABLED", False)
    elif how == "a debug kernel":
        compiled.debug = True
    elif how == "no code library":
        del compiled._codelibrary
    elif how == "a scalar it does not convert":  # a float16 scalar: Numba's own case
        args = args[:6] + (np.float16(0.5),) + args[7:]
        compiled = OfflineKernel(args)
        configured = OfflineLaunch(compiled, (3, 2, 1), (128, 1, 1))
    elif how == "conversions that differ from Numba's":
        monkeypatch.setattr(cuda_launch, "_scalar_converter", lambda ty: ctypes.c_int32)
    elif how == "a host array":  # Numba would copy it to the device: not prepared
        args = (np.zeros(args[0].shape, args[0].dtype),) + args[1:]
    elif how == "another number of arguments":
        compiled.argument_types = compiled.argument_types[:-1]
    return args, compiled, configured


DECLINED = (
    "turned off", "a debug kernel", "no code library", "a scalar it does not convert",
    "conversions that differ from Numba's", "a host array", "another number of arguments",
)  # fmt: skip


@pytest.mark.parametrize("how", DECLINED)
def test_prepare_declines_what_it_does_not_handle_and_numba_launches_it(
    monkeypatch, recorder, rng, how
):
    args, compiled, configured = _declined(monkeypatch, rng, recorder, how)
    assert cuda_launch.prepare(compiled, configured, args) is None
    assert recorder == []  # nothing launched, nothing copied
    if how in ("a host array", "no code library", "another number of arguments", "a debug kernel"):
        return  # Numba's own launch of these needs a GPU (or fails as Numba would)
    launch = cuda_launch.Launch(compiled, configured)
    launch(*args)
    assert launch.prepared is False
    configured(*args)
    _same_call(*recorder)


def test_turning_it_off_sends_a_prepared_launch_through_numba(monkeypatch, recorder, rng):
    arrays, args, compiled, configured = _prepared(rng)
    launch = cuda_launch.Launch(compiled, configured)
    launch(*args)
    assert launch.prepared is True
    calls = []
    monkeypatch.setattr(cuda_launch, "ENABLED", False)
    numba_launch = compiled.launch

    def counted(self, *a, **k):
        calls.append(1)
        return numba_launch(*a, **k)

    monkeypatch.setattr(OfflineKernel, "launch", counted)
    launch(*args)
    assert calls == [1]  # through Numba's launch
    _same_call(*recorder)


@pytest.mark.skipif(not GPU, reason="needs a real GPU (NBKV_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_on_a_gpu_prepared_launches_give_numba_launches_bits(monkeypatch, rng, dtype, layout):
    """attention and append_and_attend, prepared, against the same calls through Numba's
    launch (turned off), bit for bit; every launch of the first kind was prepared."""
    prepared = []
    real_call = cuda_launch.PreparedLaunch.__call__

    def counted(self, *args):
        prepared.append(1)
        return real_call(self, *args)

    monkeypatch.setattr(cuda_launch.PreparedLaunch, "__call__", counted)
    kv = randn(rng, shape_of(layout, 2, 4, 300, 128), dtype)
    new = randn(rng, shape_of(layout, 2, 4, 1, 128), dtype)
    q = randn(rng, (2, 16, 1, 128), np.float32)
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(cuda_launch, "ENABLED", enabled)
        before = len(prepared)
        cache = nbkv.LayerKVCache(
            512, batch=2, num_kv_heads=4, head_dim=128, dtype=dtype, layout=layout, device="cuda"
        )
        cache.append(kv, kv)
        calls = [
            host(nbkv.attention(q, cache)),
            host(nbkv.append_and_attend(q, new, new, cache)),
            host(nbkv.attention(np.repeat(q, 3, axis=2), cache, window=100)),
        ]
        assert (len(prepared) - before > 0) == enabled
        results.append(calls)
    for a, b in zip(*results, strict=True):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


class _Dispatcher:
    """A kernel as Numba's dispatcher is, without a GPU: ``specialize`` types it for
    arguments (counted) and gives a dispatcher with one overload and a launch."""

    def __init__(self) -> None:
        self.specialised: list = []

    def specialize(self, *args):
        compiled = OfflineKernel(args)
        self.specialised.append(compiled)
        return _Special(compiled)


class _Special:
    def __init__(self, compiled: OfflineKernel) -> None:
        self.overloads = {compiled.argument_types: compiled}

    def __getitem__(self, config):
        blocks, threads = config
        return OfflineLaunch(self.overloads[next(iter(self.overloads))], blocks, threads)


def test_the_devices_launch_prepares_once_per_signature(recorder, rng):
    """``_CUDADevice.launch`` (the copy kernels' launch): one specialisation and prepared
    launch per kernel, configuration and argument signature; each call passes what
    Numba's launch of the same arguments would."""
    import threading

    from nbkv.cuda_backend import _CUDADevice

    dev = object.__new__(_CUDADevice)  # no GPU here: only what launch uses
    dev._local, dev.simulated = threading.local(), False
    kernel, arrays = _Dispatcher(), OfflineArrays(rng)
    k, cache = arrays((1, 8, 1, 128), np.float16), arrays((1, 8, 4096, 128), np.float16)
    config = (1, (16, 16))
    for pos in (0, 1, 4095):
        args = (arrays.like(k), arrays.like(k), pos, cache, arrays.like(cache))
        dev.launch(kernel, config, args)
        assert len(kernel.specialised) == 1
        kernel.specialised[0].launch(args, 1, (16, 16), recorder[0][0], 0)
        _same_call(*recorder)
        recorder.clear()
    other = arrays((2, 8, 1, 128), np.float16)  # another signature: specialised anew
    dev.launch(kernel, config, (other, other, 3, cache, cache))
    dev.launch(kernel, (2, (16, 16)), (k, k, 3, cache, cache))  # another configuration
    assert len(kernel.specialised) == 3
    assert [r[1].grid for r in recorder] == [(1, 1, 1), (2, 1, 1)]
