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
pytestmark = pytest.mark.skipif(
    not cuda_launch.tested_numba_cuda(),
    reason=f"prepared launches are for numba-cuda {cuda_launch.TESTED_NUMBA_CUDA} only",
)


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
    for call in range(6):  # the first call prepares; then new addresses and scalars, of
        if call:  # every argument or of some (the others the very objects of the last call)
            renewed = _renewed(arrays, args, rng)
            keep = rng.random(len(args)) < (0.5 if call % 2 else 0.0)
            args = tuple(a if same else b for a, b, same in zip(args, renewed, keep, strict=True))
        launch(*args)
        configured(*args)  # Numba's launch of the same arguments
        assert launch.prepared is True
        assert len(recorder) == 2
        _same_call(*recorder)
        assert len(recorder[0][3]) == _parameter_count(args)
        pointers = [p for p in recorder[0][3] if isinstance(p, int) and p >= 1 << 38]
        assert len(pointers) == sum(a.size > 0 for a in args if _is_array(a))
        recorder.clear()


def test_copies_of_a_launch_keep_their_own_lists(recorder, rng):
    # two copies of one prepared launch, each with its own arguments (two caches' buffers),
    # called in turns with new addresses of some arguments: each passes what Numba passes
    arrays, args, compiled, configured = _prepared(rng)
    launch = cuda_launch.Launch(compiled, configured)
    assert launch.copy().prepared is None  # nothing decided yet: neither is the copy
    launch(*args)
    copies = [launch.copy(), launch.copy()]
    assert all(c.prepared is True for c in copies) and copies[0]._run is not copies[1]._run
    own = [args, _renewed(arrays, args, rng)]
    for call in range(6):
        which = call % 2
        keep = rng.random(len(args)) < 0.5  # the others new, as a step's q, k and v
        renewed = _renewed(arrays, own[which], rng)
        own[which] = tuple(
            a if same else b for a, b, same in zip(own[which], renewed, keep, strict=True)
        )
        recorder.clear()
        copies[which](*own[which])
        configured(*own[which])
        _same_call(*recorder)
    for which in (0, 1):  # the arrays copy 0 saw last, now passed to copy 1 as well
        recorder.clear()
        copies[which](*own[0])
        configured(*own[0])
        _same_call(*recorder)
    declined = cuda_launch.Launch(compiled, configured)
    declined._run = configured  # as after prepare declined: the copy launches through Numba
    assert declined.copy().prepared is False
    assert cuda_launch.own_copy(configured) is configured


def _prepared(rng, fused=True, bshd=False):
    arrays = OfflineArrays(rng)
    args = _attention_args(arrays, rng, fused=fused, bshd=bshd)
    compiled = OfflineKernel(args)
    configured = OfflineLaunch(compiled, (3, 2, 1), (128, 1, 1))
    return arrays, args, compiled, configured


def test_an_array_unlike_the_prepared_one_is_refused(recorder, rng):
    """Another dtype, strides, shape or kind of array: the kernel was compiled for the
    prepared ones, so the launch raises (Numba's specialised launch would run it wrong)."""
    arrays, args, compiled, configured = _prepared(rng)
    prepared = cuda_launch.prepare(compiled, configured, args)
    assert isinstance(prepared, cuda_launch.PreparedLaunch)
    k_cache = args[4]
    same_size = np.dtype(f"i{k_cache.dtype.itemsize}")  # same itemsize, another dtype
    longer = k_cache.shape[:2] + (k_cache.shape[2] + 1,) + k_cache.shape[3:]
    for other in (
        arrays(k_cache.shape, k_cache.dtype, pad=1),  # other strides
        arrays(longer, k_cache.dtype),
        devicearray.DeviceNDArray(
            k_cache.shape, k_cache.strides, same_size, gpu_data=arrays.like(k_cache).gpu_data
        ),
        np.zeros(k_cache.shape, k_cache.dtype),  # a host array
    ):
        with pytest.raises(TypeError, match="argument 4 of a prepared launch"):
            prepared(*args[:4], other, *args[5:])
    assert recorder == []  # nothing launched


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
    elif how == "a launch-configuration-sensitive kernel":
        compiled.launch_config_sensitive = True
    return args, compiled, configured


DECLINED = (
    "turned off", "a debug kernel", "no code library", "a scalar it does not convert",
    "conversions that differ from Numba's", "a host array", "another number of arguments",
    "a launch-configuration-sensitive kernel",
)  # fmt: skip


@pytest.mark.parametrize("how", DECLINED)
def test_prepare_declines_what_it_does_not_handle_and_numba_launches_it(
    monkeypatch, recorder, rng, how
):
    args, compiled, configured = _declined(monkeypatch, rng, recorder, how)
    assert cuda_launch.prepare(compiled, configured, args) is None
    assert recorder == []  # nothing launched, nothing copied
    if how in (
        "a host array", "no code library", "another number of arguments", "a debug kernel",
        "a launch-configuration-sensitive kernel",
    ):  # fmt: skip
        return  # Numba's own launch of these needs a GPU (or fails as Numba would)
    launch = cuda_launch.Launch(compiled, configured)
    launch(*args)
    assert launch.prepared is (None if how == "turned off" else False)
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
    """A decode loop over two caches of one shape, taking turns (so that each prepared
    launch runs again with other pointers, positions and lengths): append_and_attend,
    then append and attention (a chunk of 3 queries, a window), prepared, against the
    same loop launched through Numba (turned off), bit for bit, outputs and every
    position the caches hold; every launch of the first loop was prepared."""
    counts = {"launches": 0, "prepared": 0}
    launch_call, prepared_call = cuda_launch.Launch.__call__, cuda_launch.PreparedLaunch.__call__

    def launched(self, *args):
        counts["launches"] += 1
        return launch_call(self, *args)

    def prepared(self, *args):
        counts["prepared"] += 1
        return prepared_call(self, *args)

    monkeypatch.setattr(cuda_launch.Launch, "__call__", launched)
    monkeypatch.setattr(cuda_launch.PreparedLaunch, "__call__", prepared)
    held = [randn(rng, shape_of(layout, 2, 4, 100 + 50 * i, 128), dtype) for i in range(2)]
    steps = [
        (randn(rng, (2, 16, n, 128), np.float32), randn(rng, shape_of(layout, 2, 4, n, 128), dtype))
        for n in (1,) * 8 + (3,) * 4
    ]  # fmt: skip
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(cuda_launch, "ENABLED", enabled)
        counts.update(launches=0, prepared=0)
        caches = []
        for kv in held:
            cache = nbkv.LayerKVCache(
                512, batch=2, num_kv_heads=4, head_dim=128, dtype=dtype, layout=layout,
                device="cuda",
            )  # fmt: skip
            cache.append(kv, kv)
            caches.append(cache)
        outs = []
        for i, (q, new) in enumerate(steps):
            cache = caches[i % 2]
            if q.shape[2] == 1:
                outs.append(host(nbkv.append_and_attend(q, new, 2 * new, cache)))
            else:
                cache.append(new, 2 * new)
                outs.append(host(nbkv.attention(q, cache, window=60)))
        outs += [host(x) for cache in caches for x in cache.get_kv()]
        assert counts["launches"] == 2 + len(steps) + 4  # the appends, steps, chunks
        assert counts["prepared"] == (counts["launches"] if enabled else 0)
        results.append(outs)
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
    from nbkv.cuda_backend import _CUDADevice

    dev = _CUDADevice.from_parts(None, None, None, None, None, 132)  # only launch is used
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


def test_vector_width_reads_a_device_arrays_address_as_its_interface_says(rng):
    from nbkv.kernels.cuda_vec import vector_width

    arrays = OfflineArrays(rng)
    a = arrays((2, 3, 4, 16), np.float16)
    for offset in (0, 2, 4, 8, 16):
        b = devicearray.DeviceNDArray(
            a.shape, a.strides, a.dtype, gpu_data=arrays.like(a).gpu_data.__class__(
                a.__cuda_array_interface__["data"][0] + offset
            ),
        )  # fmt: skip
        address = b.__cuda_array_interface__["data"][0]
        assert address % 16 == offset % 16
        want = next(n for n in (8, 4, 2, 1) if address % (2 * n) == 0)
        assert vector_width(2, 16, (b,)) == want


def test_cuda_core_packs_every_prepared_list(rng):
    """An oracle besides Numba: cuda.core's own packing of a launch's parameters (what its
    launch does first; no GPU needed) takes each list as prepared, for every kernel kind."""
    holder = pytest.importorskip("cuda.core._kernel_arg_handler").ParamHolder
    for fused in (False, True):
        for bshd in (False, True):
            arrays, args, compiled, configured = _prepared(rng, fused=fused, bshd=bshd)
            prepared = cuda_launch.prepare(compiled, configured, args)
            holder(prepared.parameters(_renewed(arrays, args, rng)))
    with pytest.raises(TypeError):  # it does check: a pointer left out is refused
        holder([*prepared.parameters(args)[:-1], None])


@pytest.mark.parametrize(
    "scalars", [(np.bool_(True), 7), (False, np.int32(7)), (True, np.int64(1 << 40))]
)
def test_numpy_scalars_are_passed_as_numba_passes_them(recorder, rng, scalars):
    arrays, args, compiled, configured = _prepared(rng)
    causal, window = scalars
    args = (*args[:7], causal, window, *args[9:])
    compiled = OfflineKernel(args)
    configured = OfflineLaunch(compiled, (3, 2, 1), (128, 1, 1))
    prepared = cuda_launch.prepare(compiled, configured, args)
    assert prepared is not None
    prepared(*args)
    configured(*args)
    _same_call(*recorder)


def test_the_kernel_function_is_looked_up_at_every_launch(recorder, rng, monkeypatch):
    """Numba's launch asks the code library for the current device's function each time
    (a process may switch devices); so does a prepared launch."""
    arrays, args, compiled, configured = _prepared(rng)
    library = compiled.library
    functions = []

    def get_cufunc():
        functions.append(object())
        library.kernel = functions[-1]
        return library

    monkeypatch.setattr(library, "get_cufunc", get_cufunc)
    launch = cuda_launch.Launch(compiled, configured)
    for _ in range(3):
        launch(*args)
    assert [call[2] for call in recorder] == functions and len(functions) == 3


def test_a_launch_with_callbacks_goes_through_numba(recorder, rng):
    """Numba's pre_launch_callbacks run before its launch: a configured launch that has
    some is not prepared, and one given some after it was goes through Numba."""
    arrays, args, compiled, configured = _prepared(rng)
    ran = []

    def callback(kernel, config):
        ran.append(kernel)

    class WithCallbacks(OfflineLaunch):
        def __call__(self, *a):
            for cb in self.pre_launch_callbacks:
                cb(self.kernel, self)
            super().__call__(*a)

    configured = WithCallbacks(compiled, (3, 2, 1), (128, 1, 1))
    configured.pre_launch_callbacks = [callback]
    assert cuda_launch.prepare(compiled, configured, args) is None
    configured.pre_launch_callbacks = []
    prepared = cuda_launch.prepare(compiled, configured, args)
    assert prepared is not None
    configured.pre_launch_callbacks.append(callback)
    prepared(*args)
    assert ran == [compiled] and len(recorder) == 1


def test_another_numba_cuda_launches_through_numba(monkeypatch, recorder, rng):
    arrays, args, compiled, configured = _prepared(rng)
    monkeypatch.setattr(cuda_launch, "tested_numba_cuda", lambda: False)
    assert cuda_launch.prepare(compiled, configured, args) is None


def test_turned_off_then_on_a_launch_is_prepared_again(monkeypatch, recorder, rng):
    arrays, args, compiled, configured = _prepared(rng)
    launch = cuda_launch.Launch(compiled, configured)
    monkeypatch.setattr(cuda_launch, "ENABLED", False)
    launch(*args)
    assert launch.prepared is None  # through Numba, and nothing decided
    monkeypatch.setattr(cuda_launch, "ENABLED", True)
    launch(*args)
    assert launch.prepared is True
    configured(*args)
    _same_call(*recorder[1:])


def test_a_prepared_launch_keeps_no_array_alive(recorder, rng):
    """It remembers the arrays of the last call only weakly: a cache's buffers go when the
    cache lets them go (and an array at a reused address is checked afresh)."""
    import gc
    import weakref

    arrays, args, compiled, configured = _prepared(rng)
    launch = cuda_launch.Launch(compiled, configured)
    launch(*args)
    launch(*args)  # the same objects: nothing checked or read again
    _, _, _, first = recorder[0]
    assert cuda_launch._same(list(recorder[1][3]), list(first))
    gone = [weakref.ref(a) for a in args if isinstance(a, devicearray.DeviceNDArray)]
    args = _renewed(arrays, args, rng)
    gc.collect()
    assert all(r() is None or r().size == 0 for r in gone)  # the size-0 table is shared
    launch(*args)
    configured(*args)
    _same_call(*recorder[2:])


def test_the_launch_function_is_read_at_every_launch(monkeypatch, rng):
    """cuda.core's launch as numba-cuda's dispatcher has it at the time of each launch."""
    arrays, args, compiled, configured = _prepared(rng)
    first, second = [], []
    monkeypatch.setattr(nd, "launch", lambda *a: first.append(a))
    prepared = cuda_launch.prepare(compiled, configured, args)
    prepared(*args)
    monkeypatch.setattr(nd, "launch", lambda *a: second.append(a))
    prepared(*args)
    assert len(first) == len(second) == 1


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_decode_steps_bound_launches_are_append_and_attends_launches(rng, dtype, layout):
    """Offline (fake device memory, launches recorded): ``nbkv.DecodeStep`` launches the
    same kernel with the same parameters as ``append_and_attend`` through Numba's own
    marshalling on the same cache and position, step after step over two caches taking
    turns (each bound step with its own copy of the prepared list), every step's launch
    prepared."""
    from nbkv.cuda_offline import offline_cuda

    with offline_cuda(seed=int(rng.integers(1 << 30))) as launches:
        arrays = OfflineArrays(rng)
        caches, steps, outs = [], [], []
        q = arrays((2, 16, 1, 128), np.float32)
        for held in (5, 9):
            cache = nbkv.LayerKVCache(
                64, batch=2, num_kv_heads=4, head_dim=128, dtype=dtype, layout=layout,
                device="cuda",
            )  # fmt: skip
            kv = arrays(shape_of(layout, 2, 4, held, 128), np.dtype(dtype))
            cache.append(kv, kv)
            caches.append(cache)
            outs.append(arrays.like(q))
            steps.append(nbkv.DecodeStep(cache, window=7, out=outs[-1]))
        k = arrays(shape_of(layout, 2, 4, 1, 128), np.dtype(dtype))
        prepared, pointer = cuda_launch.PreparedLaunch.__call__, cuda_launch._pointer
        counted, filled = [], []

        def count(self, *args):
            counted.append(1)
            return prepared(self, *args)

        def fill(x):
            filled.append(x)
            return pointer(x)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cuda_launch.PreparedLaunch, "__call__", count)
            mp.setattr(cuda_launch, "_pointer", fill)
            for i in range(8):
                cache, step = caches[i % 2], steps[i % 2]
                args = (arrays.like(q), arrays.like(k), arrays.like(k))
                held = cache.seq_len
                launches.clear()
                filled.clear()
                step(*args)
                got = launches[:]
                if i >= 4:  # its own list: only q, k and v filled in, not its cache's K/V
                    assert [id(x) for x in filled] == [id(x) for x in args]
                assert cache.seq_len == held + 1
                cache.crop(held)
                launches.clear()
                mp.setattr(cuda_launch, "ENABLED", False)  # through Numba's marshalling
                nbkv.append_and_attend(*args, cache, window=7, out=outs[i % 2])
                mp.setattr(cuda_launch, "ENABLED", True)
                assert cache.seq_len == held + 1 and len(launches) == len(got) == 1
                _same_call(got[0], launches[0])
        assert [s.fast_calls for s in steps] == [3, 3]
        assert len(counted) == 8  # every step's launch prepared, none of Numba's

        # a launch that fails: nothing held, the plan's scratch made afresh, and the
        # step's next launch, through a new copy of the new grid's launch, is Numba's
        def fail(self, *args):
            raise RuntimeError("injected: the launch failed")

        held, args = caches[0].seq_len, (arrays.like(q), arrays.like(k), arrays.like(k))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cuda_launch.PreparedLaunch, "__call__", fail)
            with pytest.raises(RuntimeError, match="injected"):
                steps[0](*args)
        assert caches[0].seq_len == held and steps[0].fast_calls == 3
        launches.clear()
        filled.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cuda_launch, "_pointer", fill)
            steps[0](*args)
        got = launches[:]
        # a new copy, prepared afresh, fills in every array: q, k, v, the cache's K and V,
        # the (empty) table, the three new scratch arrays and out (the old copy would have
        # filled in q, k, v and the new scratch only; the old scratch, q, k and v only)
        assert len(filled) == 10 and [id(x) for x in filled[:3]] == [id(x) for x in args]
        caches[0].crop(held)
        launches.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cuda_launch, "ENABLED", False)
            nbkv.append_and_attend(*args, caches[0], window=7, out=outs[0])
        _same_call(got[0], launches[0])
        assert steps[0].checked_calls == 1 and steps[0].fast_calls == 4
