"""Benchmark: the CUDA backend on a real GPU, nbkv beside a device copy and torch.

Without a usable CUDA GPU (none present, numba-cuda missing, or ``NUMBA_ENABLE_CUDASIM=1``:
the simulator times nothing real) it prints ``skipped: no CUDA device (...)``, writes a
JSON record that says so and holds no figures, and exits 0.

Three parts, each checked before it is timed:

- **append**: 1 and 8,192 positions into a ``[1, 8, 32768, 128]`` float16 cache, K and
  V. nbkv's API (``LayerKVCache(..., device="cuda").append(k, v)`` with Numba device
  arrays, and with torch tensors: Numba then synchronises on torch's stream, so that row
  is timed without the spin described below), nbkv's kernels launched directly on
  ``uint16`` views ("nbkv kernel": the row-wise ``write_rows_kernel`` with
  ``nbkv.launch.append_config``, as the backend launches it, where this nbkv has it;
  "nbkv flat kernel" or else "nbkv kernel": ``write_kv_kernel[nbkv.launch_config(numel)]``),
  a device-to-device copy of the same bytes (one
  ``cuMemcpyDtoD`` of a buffer the size of k and v together: the bandwidth peer) and
  torch slice assignment ``K[:, :, pos:pos + n] = k`` (and V). Bytes counted: read +
  written, ``2 * (k.nbytes + v.nbytes)``, for every method. Every method's written
  positions are compared bit for bit with its input after the warm-up.
- **attention**: decode (one query per head), 32 query heads over 8 KV heads, head_dim
  128, batch 1 and 16, ``seq_len`` 4,096 and 32,768, float16 and bfloat16 caches.
  ``nbkv.attention(q, cache, out=out)`` (and without ``out``, allocating), torch
  ``scaled_dot_product_attention`` with ``enable_gqa=True``, with the query reshaped into
  groups ``[batch, 8, 4, 128]``, and on K/V expanded to 32 heads with
  ``repeat_interleave`` (expanded once, outside the timing); the fastest torch form is
  "the torch peer". torch reads the cache's own buffers (``torch.as_tensor`` of the Numba
  device arrays, no copy). The bfloat16 case gives nbkv a float32 query holding the same
  (bfloat16-exact) values as torch's bfloat16 query. Before any timing: the cache holds
  exactly what was appended; nbkv's output and every torch form's against a float32
  grouped matmul + softmax (torch, on the GPU, every batch row) and nbkv's against
  ``nbkv.reference.attention`` in float64 (host, batch row 0, and a separate small case
  of awkward sizes). A wrong nbkv result stops that part loudly (and the script exits 2);
  a wrong torch form is left out of the peers with a warning. GB/s: K+V bytes of the 8
  KV heads per call, ``2 * batch * 8 * seq_len * 128 * 2``, for every method (the
  expanded form reads 4x that).
- **host path**: one decode step of one layer, batch 1, 8 KV heads, 32 query heads,
  head_dim 128, float16, 1,024 positions held (1,024 to 1,280 as the step repeats):
  ``append`` alone, ``attention`` alone, ``append`` then ``attention`` (``out=`` given),
  the fused ``nbkv.append_and_attend``, and ``step(q, k, v)`` of a ``nbkv.DecodeStep``
  (append_and_attend with its unchanging checks made once, by its first call), on the CPU
  backend and the CUDA backend side by side. The fused step is checked against the two
  calls, both against float64, and the DecodeStep's bound call against the fused step,
  bit for bit.

Timing (the GPU parts), per method: warm-up calls first (the first one, synchronised,
is reported as the JIT/first-call time, in no other figure); then each timed call runs
as: a spin kernel that keeps the GPU busy longer than the call takes on the host, a CUDA
event, the call with ``time.perf_counter_ns`` around it (no synchronisation inside),
a second event, and a wait for it. Because the GPU is still spinning when the host
enqueues the call, the events measure the device's time for the call's own work (not
the host's dispatch, which would otherwise sit between the first event and the kernel);
the host time is the Python call alone. Calls where the host took longer than the spin
(the queue ran dry, so the device figure includes host time) are counted and reported.
Then "loop": the same call back to back ``loop`` times and one synchronisation, per call,
which is what a decode loop sees (the larger of host and device time, roughly). Medians
(p10, p90 beside them). On the CPU backend every call is synchronous: host time is the
whole time.

Inputs larger than the GPU's L2 cache (60 MB on an H200): each call reads the next of
several copies of its data, so that at least ``COLD_BYTES`` are touched between two
reads of one copy. Data are made on the device by a hash kernel (values ``n / 64``,
``n`` in ``[-128, 128)``: exact in float16 and in bfloat16), the queries on the host.

Usage (from the repository root; ``benchmarks/gpu.sh`` runs it on a lent GPU)::

    python benchmarks/bench_cuda.py --json benchmarks/results/cuda-nvidia-h200.json  # ~2 min
    python benchmarks/bench_cuda.py --quick                  # smaller sizes, few calls
    python benchmarks/bench_cuda.py --parts attention        # one part (append, attention,
                                                             # host; comma-separated)
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/bench_cuda.py --dry-run   # the code paths on
        # the simulator, tiny sizes, torch on the CPU: for developing this script only;
        # its figures mean nothing and say so
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _machine import machine  # noqa: E402  (this folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
try:
    import nbkv
    import nbkv.reference
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
    import nbkv
    import nbkv.reference
try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = F = None

NOW = time.perf_counter_ns
MIB = 1 << 20
L2_BYTES = 60 * 10**6  # an H200's L2 cache
# bytes read between two reads of one copy of the inputs, at the least
COLD_BYTES = 4 * L2_BYTES
# the spin kernel before each timed call lasts this many times the call's host time,
# within these bounds (us)
SPIN_FACTOR, SPIN_MIN_US, SPIN_MAX_US = 3.0, 150.0, 20000.0
PARTS = ("append", "attention", "host")
# nbkv's result against float32 / float64: (rtol, atol) by the output's dtype
TOL = {"float16": (2**-10, 1e-3), "float32": (0.0, 1e-4)}
# a torch form against float32: (rtol, atol) by the cache's dtype (its output is that)
TORCH_TOL = {"float16": (2**-9, 2e-3), "bfloat16": (2**-6, 1e-2)}
TARGET_APPEND_SHARE = 0.85  # of the device copy's bandwidth, 8192 positions
TARGET_ATTENTION_SPEED = 0.9  # of the torch peer's speed, batch 16, 32768, float16
TARGET_HOST_US = 10.0  # host us per layer per decode step, append + attention, CUDA


@dataclass(frozen=True)
class Sizes:
    """What one run measures (full, --quick, --dry-run)."""

    append_shape: tuple  # [batch, num_kv_heads, max_seq_len, head_dim]
    append_tokens: tuple  # positions per append
    heads: int
    kv_heads: int
    head_dim: int
    attention_cases: tuple  # (batch, seq_len)
    dtypes: tuple
    small_case: tuple  # (batch, seq_len) of the float64 check of awkward sizes
    host_seq: int
    host_steps: int  # the step repeats over seq_len .. seq_len + host_steps, then crops
    calls: int  # timed calls per method (events)
    loop: int  # calls back to back per method
    warmup: int
    cold_bytes: int = COLD_BYTES  # 0: two copies (the simulator)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


FULL = Sizes(
    (1, 8, 32768, 128), (1, 8192), 32, 8, 128,
    ((1, 4096), (1, 32768), (16, 4096), (16, 32768)), ("float16", "bfloat16"), (2, 777),
    1024, 256, 200, 100, 10,
)  # fmt: skip
QUICK = Sizes(
    (1, 8, 4096, 128), (1, 1024), 32, 8, 128, ((1, 4096), (4, 4096)), ("float16",), (2, 777),
    1024, 64, 20, 10, 3,
)  # fmt: skip
DRY = Sizes(
    (1, 2, 64, 16), (1, 8), 8, 2, 16, ((2, 40),), ("float16", "bfloat16"), (2, 13),
    24, 4, 1, 1, 0, 0,
)  # fmt: skip


class WrongResult(Exception):
    """A method computed or wrote something wrong: no timing of it is worth reporting."""


# -- is there a GPU? ---------------------------------------------------------------------


def no_cuda_reason(dry_run: bool = False) -> str | None:
    """Why this process cannot time a CUDA GPU, or None when it can."""
    simulated = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    if dry_run:
        return None if simulated else "--dry-run needs NUMBA_ENABLE_CUDASIM=1"
    if simulated:
        return "the CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1); it times nothing real"
    if importlib.util.find_spec("numba_cuda") is None:
        return "numba-cuda is not installed (pip install 'nbkv[cuda]')"
    try:
        from numba import cuda

        if not cuda.is_available():
            return "numba.cuda.is_available() is False"
    except Exception as err:  # a broken driver install: say so and skip
        return f"numba.cuda failed: {type(err).__name__}: {err}"
    return None


# -- the device: data, spin, events, torch views ---------------------------------------


def _bits16_numpy(n8: np.ndarray, dtype_name: str) -> np.ndarray:
    """The 16-bit pattern of ``n8 / 64`` (float16 or bfloat16), as the fill kernel makes it."""
    vals = n8.astype(np.float32) / np.float32(64)
    if dtype_name == "float16":
        return vals.astype(np.float16).view(np.uint16)
    return (vals.view(np.uint32) >> 16).astype(np.uint16)  # exact: 8 significant bits


def _hash_numpy(i: np.ndarray, seed: int) -> np.ndarray:
    """The fill kernel's hash of the flat indices ``i`` (int64 arithmetic, as on the device)."""
    m = np.int64(0xFFFFFFFF)
    x = (i.astype(np.int64) + np.int64(seed) * np.int64(0x9E3779B1)) & m
    x ^= x >> 16
    x = (x * np.int64(0x7FEB352D)) & m
    x ^= x >> 15
    x = (x * np.int64(0x2C1B3C6D)) & m
    x ^= x >> 16
    return ((x >> 8) & np.int64(255)) - np.int64(128)


def host_values(shape, dtype_name: str, seed: int) -> np.ndarray:
    """The values the fill kernel writes for ``seed``, made on the host (small arrays)."""
    n8 = _hash_numpy(np.arange(int(np.prod(shape)), dtype=np.int64), seed).reshape(shape)
    return _bits16_numpy(n8, dtype_name)  # uint16 bit patterns


cuda = None  # numba.cuda, imported by _make_kernels once a GPU (or --dry-run) is known


def _make_kernels():
    """The benchmark's own kernels: a fill of 16-bit hash values and a spin.

    ``cuda`` is a module global, as in a kernel module: the simulator swaps it there."""
    global cuda
    from numba import cuda

    @cuda.jit
    def fill_kernel(out, seed, mbits, bias):
        """out (uint16, 1-D, mutated) = bits of n / 64, n a hash of (index, seed) in
        [-128, 128); float16: mbits 10, bias 9; bfloat16: mbits 7, bias 121."""
        i = np.int64(cuda.grid(1))
        stride = np.int64(cuda.gridsize(1))
        n = np.int64(out.shape[0])
        m = np.int64(0xFFFFFFFF)
        while i < n:
            x = (i + np.int64(seed) * np.int64(0x9E3779B1)) & m
            x ^= x >> 16
            x = (x * np.int64(0x7FEB352D)) & m
            x ^= x >> 15
            x = (x * np.int64(0x2C1B3C6D)) & m
            x ^= x >> 16
            n8 = ((x >> 8) & np.int64(255)) - np.int64(128)
            a = -n8 if n8 < 0 else n8
            bits = np.int64(0)
            if a:
                e = np.int64(0)  # floor(log2(a)), 0..7
                t = a
                while t > 1:
                    t >>= 1
                    e += 1
                mant = (a - (np.int64(1) << e)) << (np.int64(mbits) - e)
                bits = ((e + np.int64(bias)) << np.int64(mbits)) | mant
                if n8 < 0:
                    bits |= np.int64(0x8000)
            out[i] = np.uint16(bits)
            i += stride

    @cuda.jit
    def spin_kernel(iters, buf):
        """One thread, ``iters`` dependent multiply-adds: keeps the GPU busy. The operands
        are read from ``buf`` (float32 [x, c], mutated) so that nothing folds them away."""
        x = buf[0]
        c = buf[1]
        for _ in range(iters):
            x = x * c + c
        buf[0] = x

    return cuda, fill_kernel, spin_kernel


class Device:
    """What the benchmark asks of the GPU; under ``--dry-run`` the simulator and CPU torch."""

    def __init__(self, dry_run: bool) -> None:
        self.cuda, self.fill_kernel, self.spin_kernel = _make_kernels()
        self.dry = dry_run
        self.spin_buf = self.cuda.to_device(np.array([1.0, 0.5], np.float32))
        self.e0, self.e1 = self.event(), self.event()
        self.ns_per_iter = None
        self.torch_device = "cpu" if dry_run else "cuda"
        self.first_calls: dict[str, float] = {}

    def event(self):
        try:
            return self.cuda.event(timing=True)
        except TypeError:  # the simulator's Event takes no arguments
            return self.cuda.event()

    def sync(self) -> None:
        self.cuda.synchronize()
        if torch is not None and not self.dry:
            torch.cuda.synchronize()

    def empty(self, shape, dtype):
        return self.cuda.device_array(tuple(shape), np.dtype(dtype))

    def random(self, shape, dtype_name: str, seed: int):
        """A device array of ``shape`` holding the hash values of ``seed``: float16, or
        bfloat16 as uint16 bit patterns (what a bfloat16 cache takes and gives)."""
        storage = np.float16 if dtype_name == "float16" else np.uint16
        x = self.empty(shape, storage)
        flat = x.view(np.uint16).reshape(int(np.prod(shape)))
        mbits, bias = (10, 9) if dtype_name == "float16" else (7, 121)
        threads = 256
        blocks = max(1, min(-(-flat.shape[0] // threads), 132 * 32))
        self.fill_kernel[blocks, threads](flat, seed, mbits, bias)
        return x

    def check_fill(self) -> None:
        """The fill kernel writes what :func:`host_values` says, for both dtypes."""
        for dtype_name in ("float16", "bfloat16"):
            got = self.random((3, 1000), dtype_name, 5).copy_to_host().view(np.uint16)
            if not np.array_equal(got, host_values((3, 1000), dtype_name, 5)):
                raise WrongResult(f"the benchmark's fill kernel is wrong for {dtype_name}")

    def spin(self, iters: int) -> None:
        self.spin_kernel[1, 1](iters, self.spin_buf)

    def spin_iters(self, us: float) -> int:
        """Iterations of the spin kernel that take about ``us`` microseconds."""
        if self.dry:
            return 1
        if self.ns_per_iter is None:
            probe = 200_000
            self.spin(probe)  # compiles it
            self.sync()
            got = []
            for _ in range(3):
                self.e0.record()
                self.spin(probe)
                self.e1.record()
                self.e1.synchronize()
                got.append(self.e0.elapsed_time(self.e1) * 1e6 / probe)
            self.ns_per_iter = max(float(np.median(got)), 1e-3)
        return max(1, int(us * 1e3 / self.ns_per_iter))

    def host(self, x) -> np.ndarray:
        """A host copy of a device array (or of a torch tensor), uint16 bits for 16-bit."""
        if torch is not None and torch.is_tensor(x):
            x = x.detach()
            if x.dtype in (torch.float16, torch.bfloat16):
                x = x.view(torch.int16)
            return x.cpu().numpy()
        return x.copy_to_host()

    def torch_view(self, x, dtype_name: str):
        """A torch tensor of the device array ``x`` (no copy on a GPU), seen as
        ``dtype_name``; under --dry-run a CPU copy."""
        tdtype = getattr(torch, dtype_name)
        if self.dry:
            t = torch.from_numpy(x.copy_to_host())
            return t.view(torch.int16).view(tdtype) if t.element_size() == 2 else t
        if np.dtype(x.dtype).itemsize == 2:
            t = torch.as_tensor(x.view(np.int16), device="cuda")
            return t.view(tdtype)
        return torch.as_tensor(x, device="cuda")

    def to_torch(self, host16: np.ndarray, dtype_name: str):
        """A torch tensor on the device from host 16-bit bit patterns (or a float array)."""
        t = torch.from_numpy(np.ascontiguousarray(host16))
        if t.element_size() == 2:
            t = t.view(torch.int16).view(getattr(torch, dtype_name))
        return t.to(self.torch_device)

    def flush(self) -> None:
        """Give freed device memory back (Numba defers frees; torch caches blocks)."""
        gc.collect()
        try:
            self.cuda.current_context().deallocations.clear()
        except Exception:  # the simulator, or another Numba: nothing to flush
            pass
        if torch is not None and not self.dry:
            torch.cuda.empty_cache()


def _stats(xs) -> dict:
    a = np.asarray(xs, dtype=np.float64)
    return {
        "median": float(np.median(a)),
        "p10": float(np.percentile(a, 10)),
        "p90": float(np.percentile(a, 90)),
    }


class Timer:
    """Times one method on the GPU: device (events) and host time per call, and a loop."""

    def __init__(self, dev: Device, sizes: Sizes) -> None:
        self.dev, self.sizes = dev, sizes

    def run(self, name: str, prepare, spin: bool = True) -> dict:
        """``prepare(i)`` readies call ``i`` (untimed) and returns it, a zero-arg callable.

        ``spin=False``: no spin kernel before the call (for a call that synchronises, which
        would wait for it); its device time then includes the host's dispatch."""
        dev, s = self.dev, self.sizes
        t0 = NOW()
        prepare(0)()
        dev.sync()
        first = (NOW() - t0) / 1e9
        dev.first_calls[name] = first
        for i in range(1, s.warmup + 3):
            prepare(i)()
        dev.sync()
        host_probe = []
        for i in range(3):
            call = prepare(i)
            t0 = NOW()
            call()
            host_probe.append((NOW() - t0) / 1e3)
            dev.sync()
        spin_us = min(max(SPIN_FACTOR * max(host_probe), SPIN_MIN_US), SPIN_MAX_US)
        iters = dev.spin_iters(spin_us) if spin else 0
        spin_us = spin_us if spin else 0.0
        device_us, host_us = [], []
        for i in range(s.calls):
            call = prepare(i)
            if iters:
                dev.spin(iters)
            dev.e0.record()
            t0 = NOW()
            call()
            t1 = NOW()
            dev.e1.record()
            dev.e1.synchronize()
            device_us.append(dev.e0.elapsed_time(dev.e1) * 1e3)
            host_us.append((t1 - t0) / 1e3)
        dry = sum(h > 0.9 * spin_us for h in host_us) if spin else None
        dev.sync()
        t0 = NOW()
        for i in range(s.loop):
            prepare(i)()
        dev.sync()
        loop_us = (NOW() - t0) / 1e3 / s.loop
        d, h = _stats(device_us), _stats(host_us)
        return {
            "device_us": d["median"],
            "device_us_p10": d["p10"],
            "device_us_p90": d["p90"],
            "host_us": h["median"],
            "host_us_p10": h["p10"],
            "host_us_p90": h["p90"],
            "loop_us": loop_us,
            "calls": s.calls,
            "loop_calls": s.loop,
            "spin_us": spin_us,
            "queue_ran_dry": dry,
            "first_call_s": first,
        }

    def run_host(self, name: str, prepare) -> dict:
        """The same for a synchronous (CPU backend) call: host time is all there is."""
        s = self.sizes
        t0 = NOW()
        prepare(0)()
        first = (NOW() - t0) / 1e9
        self.dev.first_calls[name] = first
        for i in range(1, s.warmup + 3):
            prepare(i)()
        host_us = []
        for i in range(max(s.calls, 3 * s.loop)):
            call = prepare(i)
            t0 = NOW()
            call()
            host_us.append((NOW() - t0) / 1e3)
        h = _stats(host_us)
        return {
            "device_us": None,
            "host_us": h["median"],
            "host_us_p10": h["p10"],
            "host_us_p90": h["p90"],
            "loop_us": h["median"],
            "calls": len(host_us),
            "first_call_s": first,
        }


def copies_for(nbytes: int, sizes: Sizes, most: int = 64) -> int:
    """Copies of an input of ``nbytes`` to cycle so that each call reads cold data."""
    if nbytes >= 8 * L2_BYTES or sizes.cold_bytes == 0:
        return 1 if sizes.cold_bytes else 2
    return min(1 + math.ceil(sizes.cold_bytes / nbytes), most)


def _close(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> tuple[bool, float]:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want)
    ok = got.shape == want.shape and bool(np.all(err <= atol + rtol * np.abs(want)))
    return ok, float(err.max()) if err.size else 0.0


# -- part 1: appends ---------------------------------------------------------------------


def direct_launches(shape) -> dict:
    """name -> ``launch(k, v, pos, k_cache, v_cache)`` for nbkv's CUDA append kernels
    called directly, on ``uint16`` views, configured as the backend configures them: the
    row-wise kernel (``write_rows_kernel`` with ``nbkv.launch.append_config``) where this
    nbkv has it, and the flat ``write_kv_kernel`` with ``nbkv.launch_config``."""
    from nbkv.kernels import cuda as ck

    b, h, n, d = shape
    out = {}
    rows_kernel = getattr(ck, "write_rows_kernel", None)
    append_config = getattr(nbkv.launch, "append_config", None)
    if rows_kernel is not None and append_config is not None:
        try:
            from nbkv.kernels.cuda_vec import vector_width

            vec = vector_width(2, d)  # fresh buffers: aligned, strides whole rows
            out["nbkv kernel"] = rows_kernel(vec, False, True)[append_config(b * h * n, d, vec)]
        except Exception as err:  # another nbkv: time the flat kernel alone
            print(f"note: the row-wise append kernel is not launchable here ({err})")
    flat = ck.write_kv_kernel[nbkv.launch_config(b * h * n * d)]
    out["nbkv flat kernel" if out else "nbkv kernel"] = flat
    return out


def bench_append(dev: Device, sizes: Sizes, timer: Timer) -> dict:
    b, h, cap, d = sizes.append_shape
    cache = nbkv.LayerKVCache(
        cap, batch=b, num_kv_heads=h, head_dim=d, dtype="float16", device="cuda"
    )
    Kk, Vk = dev.empty((b, h, cap, d), np.uint16), dev.empty((b, h, cap, d), np.uint16)
    Kt = Vt = None
    if torch is not None:
        Kt = torch.empty((b, h, cap, d), dtype=torch.float16, device=dev.torch_device)
        Vt = torch.empty_like(Kt)
    results = {}
    for n in sizes.append_tokens:
        shape = (b, h, n, d)
        kv_bytes = 2 * int(np.prod(shape)) * 2  # k and v, float16
        sets = copies_for(2 * kv_bytes, sizes)
        ks = [dev.random(shape, "float16", 1000 + 2 * i) for i in range(sets)]
        vs = [dev.random(shape, "float16", 1001 + 2 * i) for i in range(sets)]
        srcs = [dev.random((kv_bytes // 2,), "float16", 3000 + i) for i in range(sets)]
        dsts = [dev.empty((kv_bytes // 2,), np.float16) for _ in range(sets)]
        slots = cap // n
        launches = direct_launches(shape)
        k16 = [x.view(np.uint16) for x in ks]
        v16 = [x.view(np.uint16) for x in vs]
        methods = {}

        def api(i, ks=ks, vs=vs, n=n, sets=sets):
            if cache.seq_len + n > cap:
                cache.clear()
            k, v = ks[i % sets], vs[i % sets]
            return lambda: cache.append(k, v)

        def api_region(i, n=n):
            K, V = cache.get_kv()
            p = cache.seq_len - n
            return dev.host(K[:, :, p : p + n]), dev.host(V[:, :, p : p + n])

        methods["nbkv API"] = (api, api_region)

        def kernel_region(i, n=n, slots=slots):
            p = (i % slots) * n
            return dev.host(Kk[:, :, p : p + n]), dev.host(Vk[:, :, p : p + n])

        for name, launch in launches.items():

            def kernel(i, n=n, sets=sets, slots=slots, launch=launch, k16=k16, v16=v16):
                k, v, p = k16[i % sets], v16[i % sets], (i % slots) * n
                return lambda: launch(k, v, p, Kk, Vk)

            methods[name] = (kernel, kernel_region)

        def dcopy(i, sets=sets, srcs=srcs, dsts=dsts):
            src, dst = srcs[i % sets], dsts[i % sets]
            return lambda: dst.copy_to_device(src)

        def dcopy_region(i, sets=sets, dsts=dsts):
            return dev.host(dsts[i % sets]), None

        methods["device copy"] = (dcopy, dcopy_region)

        if torch is not None:
            kts = [dev.torch_view(x, "float16") for x in ks]
            vts = [dev.torch_view(x, "float16") for x in vs]

            def api_torch(i, kts=kts, vts=vts, n=n, sets=sets):
                if cache.seq_len + n > cap:
                    cache.clear()
                k, v = kts[i % sets], vts[i % sets]
                return lambda: cache.append(k, v)

            if not dev.dry:  # the simulator's Numba cannot take a (CPU) torch tensor
                methods["nbkv API (torch tensors)"] = (api_torch, api_region)

            def tslice(i, kts=kts, vts=vts, n=n, sets=sets, slots=slots):
                k, v, p = kts[i % sets], vts[i % sets], (i % slots) * n

                def call():
                    Kt[:, :, p : p + n] = k
                    Vt[:, :, p : p + n] = v

                return call

            def tslice_region(i, n=n, slots=slots):
                p = (i % slots) * n
                return dev.host(Kt[:, :, p : p + n]), dev.host(Vt[:, :, p : p + n])

            methods["torch slice"] = (tslice, tslice_region)

        # each method's written positions against its input, before any timing
        checked = {}
        for name, (prepare, region) in methods.items():
            i = 5 % sets + sets  # a call whose source is not set 0
            try:
                t0 = NOW()
                prepare(i)()
                dev.sync()
                dev.first_calls[f"append {n}: {name}: first call (check)"] = (NOW() - t0) / 1e9
            except Exception as err:  # a direct launch this nbkv no longer takes
                if name.startswith("nbkv API"):
                    raise
                print(f"WARNING: append of {n}: {name} failed ({type(err).__name__}: {err})")
                continue
            got_k, got_v = region(i)
            if name == "device copy":
                ok = np.array_equal(got_k.view(np.uint16), dev.host(srcs[i % sets]).view(np.uint16))
            else:
                want_k, want_v = dev.host(ks[i % sets]), dev.host(vs[i % sets])
                ok = np.array_equal(got_k.view(np.uint16), want_k.view(np.uint16)) and (
                    np.array_equal(got_v.view(np.uint16), want_v.view(np.uint16))
                )
            if not ok:
                if name.startswith("nbkv API"):
                    raise WrongResult(f"append of {n}: {name} wrote wrong data")
                print(f"WARNING: append of {n}: {name} wrote wrong data; left out")
                continue
            checked[name] = prepare
        cache.clear()
        res = {}
        for name, prepare in checked.items():
            # numba synchronises on the stream of a torch tensor it is given
            # (CUDA_ARRAY_INTERFACE_SYNC): no spin, or the call would wait for it
            spin = name != "nbkv API (torch tensors)"
            m = timer.run(f"append {n}: {name}", prepare, spin=spin)
            m["gb_per_s"] = 2 * kv_bytes / (max(m["device_us"], 1e-3) * 1e3)  # bytes/ns
            m["loop_gb_per_s"] = 2 * kv_bytes / (m["loop_us"] * 1e3)
            res[name] = m
        peer = res.get("device copy")
        for m in res.values():
            m["bandwidth_vs_device_copy"] = (
                m["gb_per_s"] / peer["gb_per_s"] if peer is not None else None
            )
        results[str(n)] = {
            "case": {
                "cache_shape": [b, h, cap, d],
                "dtype": "float16",
                "positions_per_append": n,
                "bytes_per_call": 2 * kv_bytes,
                "input_copies_cycled": sets,
                "checked": sorted(checked),
            },
            "methods": res,
        }
        del ks, vs, srcs, dsts, k16, v16, methods, checked
        dev.flush()
    return results


# -- part 2: decode attention ------------------------------------------------------------


def _reference32(qt, Kt, Vt, group: int):
    """Decode attention in float32 with torch, the obvious way (grouped, no repeat)."""
    b, hq, _, d = qt.shape
    hk = Kt.shape[1]
    out = torch.empty((b, hq, 1, d), dtype=torch.float32, device=qt.device)
    for r in range(b):  # one batch row at a time: the float32 copies stay small
        q = qt[r].float().reshape(hk, group, d)
        k, v = Kt[r].float(), Vt[r].float()
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d)  # [hk, group, seq]
        w = torch.softmax(s, dim=-1)
        out[r] = (w @ v).reshape(hq, 1, d)
    return out


def _float64_check(cache, q_host: np.ndarray, out_host: np.ndarray) -> tuple[bool, float]:
    """nbkv's output for batch row 0 against nbkv.reference.attention in float64."""
    K, V = cache.get_kv()
    K, V = cache.to_host(K[:1]), cache.to_host(V[:1])
    want = nbkv.reference.attention(q_host[:1], K, V)
    return _close(out_host[:1], want, *TOL[str(out_host.dtype)])


def small_check(dev: Device, sizes: Sizes, dtype_name: str) -> dict:
    """nbkv.attention on awkward sizes against float64, host data copied once."""
    batch, seq = sizes.small_case
    rng = np.random.default_rng(7)
    shape = (batch, sizes.kv_heads, seq, sizes.head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    q = rng.standard_normal((batch, sizes.heads, 1, sizes.head_dim)).astype(np.float32)
    if dtype_name == "float16":
        k, v, q = k.astype(np.float16), v.astype(np.float16), q.astype(np.float16)
    else:
        import ml_dtypes

        k, v = k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)
    cache = nbkv.LayerKVCache(
        seq + 3, batch=batch, num_kv_heads=sizes.kv_heads, head_dim=sizes.head_dim,
        dtype=dtype_name, device="cuda",
    )  # fmt: skip
    cache.append(k, v)
    t0 = NOW()
    got = nbkv.to_host(nbkv.attention(q, cache))  # the first attention of this dtype: JIT
    dev.first_calls[f"attention {dtype_name}: first call (small case, host q)"] = (NOW() - t0) / 1e9
    ok, err = _close(got, nbkv.reference.attention(q, k, v), *TOL[str(got.dtype)])
    if not ok:
        raise WrongResult(
            f"attention, {dtype_name}, batch {batch}, seq_len {seq} (host data): max |err| "
            f"{err:.3g} against float64"
        )
    return {"batch": batch, "seq_len": seq, "max_abs_err_vs_float64": err}


def bench_attention_case(dev, sizes, timer, dtype_name, batch, seq) -> dict:
    hk, hq, d, group = sizes.kv_heads, sizes.heads, sizes.head_dim, sizes.group
    shape = (batch, hk, seq, d)
    kv_bytes = 2 * int(np.prod(shape)) * 2
    n_copies = copies_for(kv_bytes, sizes)
    copies = []
    for c in range(n_copies):
        cache = nbkv.LayerKVCache(
            seq, batch=batch, num_kv_heads=hk, head_dim=d, dtype=dtype_name, device="cuda"
        )
        k = dev.random(shape, dtype_name, 10 * c + 1)
        v = dev.random(shape, dtype_name, 10 * c + 2)
        cache.append(k, v)
        K, V = cache.get_kv()
        if c == 0:  # the cache holds what was appended (torch and the checks read it)
            if torch is not None and not dev.dry:
                same = torch.equal(dev.torch_view(K, "int16"), dev.torch_view(k, "int16"))
                same = same and torch.equal(dev.torch_view(V, "int16"), dev.torch_view(v, "int16"))
            else:
                same = np.array_equal(dev.host(K).view(np.uint16), dev.host(k).view(np.uint16))
                same = same and np.array_equal(
                    dev.host(V).view(np.uint16), dev.host(v).view(np.uint16)
                )
            if not same:
                raise WrongResult(f"append of {seq} positions ({dtype_name}) wrote wrong data")
        del k, v
        entry = {"cache": cache}
        if torch is not None:
            entry["K"], entry["V"] = dev.torch_view(K, dtype_name), dev.torch_view(V, dtype_name)
            entry["Kx"] = entry["K"].repeat_interleave(group, dim=1)
            entry["Vx"] = entry["V"].repeat_interleave(group, dim=1)
        copies.append(entry)
    q_bits = host_values((batch, hq, 1, d), dtype_name, 99)
    if dtype_name == "float16":
        q_host = q_bits.view(np.float16)
    else:  # nbkv takes a float32 query over a bfloat16 cache; the values are bf16-exact
        q_host = (q_bits.astype(np.uint32) << 16).view(np.float32)
    q_dev = dev.cuda.to_device(q_host)
    out = dev.empty(q_host.shape, q_host.dtype)

    def nbkv_out(i):
        cache = copies[i % n_copies]["cache"]
        return lambda: nbkv.attention(q_dev, cache, out=out)

    def nbkv_alloc(i):
        cache = copies[i % n_copies]["cache"]
        return lambda: nbkv.attention(q_dev, cache)

    methods = {"nbkv": nbkv_out, "nbkv (allocating)": nbkv_alloc}
    check = {"float64_row0": None, "vs_float32": {}}
    # nbkv against float64 on batch row 0 of the real data, before any timing
    got = dev.host(nbkv.attention(q_dev, copies[0]["cache"], out=out))
    got = got.view(np.float16) if q_host.dtype == np.float16 else got
    ok, err = _float64_check(copies[0]["cache"], q_host, got)
    if not ok:
        raise WrongResult(
            f"attention, {dtype_name}, batch {batch}, seq_len {seq}: max |err| {err:.3g} "
            "against float64 (batch row 0)"
        )
    check["float64_row0"] = err
    if torch is not None:
        qt = dev.to_torch(q_bits, dtype_name)
        qg = qt.reshape(batch, hk, group, d)
        c0 = copies[0]
        ref = _reference32(qt, c0["K"], c0["V"], group)
        got_t = torch.from_numpy(np.asarray(got, np.float32)).to(ref.device)
        rtol, atol = TOL[str(got.dtype)]
        ok, err = _close(got_t.cpu().numpy(), ref.cpu().numpy(), rtol, atol)
        check["vs_float32"]["nbkv"] = err
        if not ok:
            raise WrongResult(
                f"attention, {dtype_name}, batch {batch}, seq_len {seq}: max |err| {err:.3g} "
                "against float32"
            )
        sdpa = F.scaled_dot_product_attention

        def gqa(i):
            c = copies[i % n_copies]
            return lambda: sdpa(qt, c["K"], c["V"], enable_gqa=True)

        def grouped(i):
            c = copies[i % n_copies]
            return lambda: sdpa(qg, c["K"], c["V"])

        def expanded(i):
            c = copies[i % n_copies]
            return lambda: sdpa(qt, c["Kx"], c["Vx"])

        forms = {
            "torch SDPA gqa": gqa,
            "torch SDPA grouped": grouped,
            "torch SDPA expanded": expanded,
        }
        for name, prepare in forms.items():
            try:
                o = prepare(0)().reshape(batch, hq, 1, d).float()
            except Exception as e:  # a form this torch cannot run: say so, leave it out
                print(f"WARNING: {name} failed ({type(e).__name__}: {e}); left out")
                continue
            ok, err = _close(o.cpu().numpy(), ref.cpu().numpy(), *TORCH_TOL[dtype_name])
            check["vs_float32"][name] = err
            if not ok:
                print(f"WARNING: {name} is off by {err:.3g} against float32; left out")
                continue
            methods[name] = prepare
        del ref, got_t
    res = {}
    for name, prepare in methods.items():
        m = timer.run(f"attention {dtype_name} b{batch} s{seq}: {name}", prepare)
        m["gb_per_s"] = kv_bytes / (max(m["device_us"], 1e-3) * 1e3)
        res[name] = m
    torch_names = [n for n in res if n.startswith("torch")]
    peer = min(torch_names, key=lambda n: res[n]["device_us"]) if torch_names else None
    for m in res.values():
        m["speed_vs_torch_peer"] = (
            res[peer]["device_us"] / m["device_us"] if peer is not None else None
        )
        m["loop_speed_vs_torch_peer"] = (
            res[peer]["loop_us"] / m["loop_us"] if peer is not None else None
        )
    info = {
        "batch": batch,
        "seq_len": seq,
        "dtype": dtype_name,
        "q_dtype_nbkv": str(q_host.dtype),
        "heads": hq,
        "kv_heads": hk,
        "head_dim": d,
        "bytes_per_call": kv_bytes,
        "copies_cycled": n_copies,
        "torch_peer": peer,
        "max_abs_err": check,
    }
    return {"case": info, "methods": res}


def bench_attention(dev: Device, sizes: Sizes, timer: Timer) -> dict:
    results, small = {}, {}
    for dtype_name in sizes.dtypes:
        if dtype_name == "bfloat16" and importlib.util.find_spec("ml_dtypes") is None:
            print("note: ml_dtypes is not importable; the bfloat16 cases are skipped")
            continue
        small[dtype_name] = small_check(dev, sizes, dtype_name)
        for batch, seq in sizes.attention_cases:
            t0 = time.perf_counter()
            r = bench_attention_case(dev, sizes, timer, dtype_name, batch, seq)
            results[f"{dtype_name} b{batch} s{seq}"] = r
            dev.flush()  # this case's caches and tensors are gone
            c = r["case"]
            errs = ", ".join(f"{k} {v:.1e}" for k, v in c["max_abs_err"]["vs_float32"].items())
            print(
                f"attention {dtype_name}, batch {batch}, seq_len {seq}: K+V "
                f"{c['bytes_per_call'] / MIB:.0f} MiB, {c['copies_cycled']} copies cycled; "
                f"max |err| against float64 (batch row 0) {c['max_abs_err']['float64_row0']:.1e}"
                f", against float32: {errs or '-'}; torch peer {c['torch_peer']} "
                f"({time.perf_counter() - t0:.1f} s)"
            )
    return {"cases": results, "small_checks": small}


# -- part 3: the host path of a decode step ----------------------------------------------


def bench_host(dev: Device, sizes: Sizes, timer: Timer) -> dict:
    hk, hq, d = sizes.kv_heads, sizes.heads, sizes.head_dim
    seq, steps = sizes.host_seq, sizes.host_steps
    rng = np.random.default_rng(3)
    tokens = 16
    k0 = rng.standard_normal((1, hk, seq, d)).astype(np.float16)
    v0 = rng.standard_normal((1, hk, seq, d)).astype(np.float16)
    ks = rng.standard_normal((tokens, 1, hk, 1, d)).astype(np.float16)
    vs = rng.standard_normal((tokens, 1, hk, 1, d)).astype(np.float16)
    q = rng.standard_normal((1, hq, 1, d)).astype(np.float16)
    results = {}
    for device in ("cpu", "cuda"):
        cache = nbkv.LayerKVCache(
            seq + steps, batch=1, num_kv_heads=hk, head_dim=d, dtype="float16", device=device
        )
        cache.append(k0, v0)
        if device == "cuda":
            put = dev.cuda.to_device
            kk, vv, qq = [put(x) for x in ks], [put(x) for x in vs], put(q)
            out, out2 = dev.empty(q.shape, np.float16), dev.empty(q.shape, np.float16)
        else:
            kk, vv, qq = list(ks), list(vs), q
            out, out2 = np.empty_like(q), np.empty_like(q)

        # the fused step against the two calls on the same state, and both against float64
        cache.append(kk[0], vv[0])
        plain = nbkv.to_host(nbkv.attention(qq, cache, out=out)).copy()
        cache.crop(seq)
        fused = nbkv.to_host(nbkv.append_and_attend(qq, kk[0], vv[0], cache, out=out2))
        K, V = cache.get_kv()
        want = nbkv.reference.attention(q, cache.to_host(K), cache.to_host(V))
        for what, got in (("append + attention", plain), ("append_and_attend", fused)):
            ok, err = _close(got, want, *TOL["float16"])
            if not ok:
                raise WrongResult(f"host path on {device}: {what} off by {err:.3g} (float64)")
        bound = nbkv.DecodeStep(cache, out=out)
        for _ in range(2):  # checked (and bound), then the bound path
            cache.crop(seq)
            got = nbkv.to_host(bound(qq, kk[0], vv[0]))
            if not np.array_equal(got.view(np.uint16), fused.view(np.uint16)):
                raise WrongResult(f"host path on {device}: DecodeStep differs from the fused")
        if bound.fast_calls != 1:
            raise WrongResult(f"host path on {device}: DecodeStep did not bind ({bound})")
        cache.crop(seq)

        def room(cache=cache):
            if cache.seq_len >= seq + steps:
                cache.crop(seq)

        def append(i, cache=cache, kk=kk, vv=vv):
            room()
            k, v = kk[i % tokens], vv[i % tokens]
            return lambda: cache.append(k, v)

        def attend(i, cache=cache, qq=qq, out=out):
            return lambda: nbkv.attention(qq, cache, out=out)

        def step(i, cache=cache, kk=kk, vv=vv, qq=qq, out=out):
            room()
            k, v = kk[i % tokens], vv[i % tokens]

            def call():
                cache.append(k, v)
                nbkv.attention(qq, cache, out=out)

            return call

        def fused_step(i, cache=cache, kk=kk, vv=vv, qq=qq, out=out):
            room()
            k, v = kk[i % tokens], vv[i % tokens]
            return lambda: nbkv.append_and_attend(qq, k, v, cache, out=out)

        def bound_step(i, kk=kk, vv=vv, qq=qq, bound=bound):
            room()
            k, v = kk[i % tokens], vv[i % tokens]
            return lambda: bound(qq, k, v)

        res = {}
        for name, prepare in (
            ("append", append),
            ("attention", attend),
            ("append + attention", step),
            ("append_and_attend", fused_step),
            ("DecodeStep", bound_step),
        ):
            run = timer.run if device == "cuda" else timer.run_host
            res[name] = run(f"host path {device}: {name}", prepare)
            cache.crop(seq)
        if bound.checked_calls != 1:  # its check's first call; every timed one bound
            raise WrongResult(f"host path on {device}: DecodeStep calls were checked ({bound})")
        results[device] = {
            "case": {
                "batch": 1,
                "heads": hq,
                "kv_heads": hk,
                "head_dim": d,
                "dtype": "float16",
                "seq_len": [seq, seq + steps],
                "checked_max_abs_err_vs_float64": float(np.max(np.abs(plain - want))),
            },
            "methods": res,
        }
        del cache
        dev.flush()
    return results


# -- report ------------------------------------------------------------------------------


def _f(x, spec=".1f", none="-") -> str:
    return none if x is None else format(x, spec)


def report(results: dict) -> None:
    if "append" in results and "error" not in results["append"]:
        print("append (float16 cache [1, 8, 32768, 128] in a full run; K and V)")
        head = (
            f"{'positions':>9} {'method':<25} {'dev us':>8} {'p10':>7} {'p90':>7} "
            f"{'host us':>8} {'loop us':>8} {'GB/s':>7} {'vs copy':>8} {'dry':>4}"
        )
        print(head)
        print("-" * len(head))
        for n, r in results["append"].items():
            for name, m in r["methods"].items():
                print(
                    f"{n:>9} {name:<25} {m['device_us']:>8.2f} {m['device_us_p10']:>7.2f} "
                    f"{m['device_us_p90']:>7.2f} {m['host_us']:>8.2f} {m['loop_us']:>8.2f} "
                    f"{m['gb_per_s']:>7.1f} {_f(m['bandwidth_vs_device_copy'], '.2f'):>7}x "
                    f"{_f(m['queue_ran_dry'], 'd'):>4}"
                )
        print()
    if "attention" in results and "error" not in results["attention"]:
        print("decode attention (32 query heads over 8 KV heads, head_dim 128 in a full run)")
        head = (
            f"{'case':<22} {'method':<20} {'dev us':>8} {'p10':>8} {'p90':>8} {'host us':>8} "
            f"{'loop us':>8} {'GB/s':>7} {'speed':>7} {'loop sp':>7} {'dry':>4}"
        )
        print(head)
        print("-" * len(head))
        for case, r in results["attention"]["cases"].items():
            for name, m in r["methods"].items():
                print(
                    f"{case:<22} {name:<20} {m['device_us']:>8.1f} {m['device_us_p10']:>8.1f} "
                    f"{m['device_us_p90']:>8.1f} {m['host_us']:>8.1f} {m['loop_us']:>8.1f} "
                    f"{m['gb_per_s']:>7.0f} {_f(m['speed_vs_torch_peer'], '.2f'):>6}x "
                    f"{_f(m['loop_speed_vs_torch_peer'], '.2f'):>6}x "
                    f"{_f(m['queue_ran_dry'], 'd'):>4}"
                )
            print()
    if "host" in results and "error" not in results["host"]:
        print("host path of one decode step, one layer (batch 1, float16, ~1024 positions)")
        head = (
            f"{'backend':<8} {'call':<20} {'host us':>8} {'p10':>8} {'p90':>8} {'dev us':>8} "
            f"{'loop us':>8}"
        )
        print(head)
        print("-" * len(head))
        for device, r in results["host"].items():
            for name, m in r["methods"].items():
                print(
                    f"{device:<8} {name:<20} {m['host_us']:>8.1f} {m['host_us_p10']:>8.1f} "
                    f"{m['host_us_p90']:>8.1f} {_f(m['device_us']):>8} {m['loop_us']:>8.1f}"
                )
        print()
    for line in (
        "dev us: median device time per call (CUDA events, the queue kept busy by a spin",
        "kernel so that host dispatch is not counted); p10/p90 around it. host us: median",
        "Python time of the call, no synchronisation. loop us: per call, calls back to back",
        "then one synchronisation. GB/s: bytes (append: read + written; attention: K+V of",
        "the 8 KV heads) per median device time. vs copy: bandwidth relative to the device",
        "copy of the same bytes. speed / loop sp: the torch peer's time over this time",
        "(above 1 is faster). dry: calls whose host time outlasted the spin (device time",
        "includes host time). CPU backend: host time is the whole time.",
    ):
        print(f"  {line}")


def targets(results: dict, sizes: Sizes) -> list[tuple[str, bool | None, str]]:
    out = []
    n = str(max(sizes.append_tokens))
    what = f"append {n} positions: nbkv API >= {TARGET_APPEND_SHARE}x the device copy's bandwidth"
    app = results.get("append", {})
    if n in app and "nbkv API" in app[n]["methods"] and "device copy" in app[n]["methods"]:
        m = app[n]["methods"]
        share = m["nbkv API"]["bandwidth_vs_device_copy"]
        ker = m.get("nbkv kernel", {}).get("bandwidth_vs_device_copy")
        out.append(
            (
                what,
                share >= TARGET_APPEND_SHARE,
                f"{share:.2f}x ({m['nbkv API']['gb_per_s']:.0f} vs "
                f"{m['device copy']['gb_per_s']:.0f} GB/s; kernel {_f(ker, '.2f')}x)",
            )
        )
    else:
        out.append((what, None, "not measured"))
    batch, seq = max(sizes.attention_cases)
    what = (
        f"decode attention, batch {batch}, seq_len {seq}, float16: nbkv >= "
        f"{TARGET_ATTENTION_SPEED}x the speed of the faster torch SDPA form"
    )
    case = results.get("attention", {}).get("cases", {}).get(f"float16 b{batch} s{seq}")
    if case is not None and case["case"]["torch_peer"] is not None:
        m = case["methods"]["nbkv"]
        peer = case["case"]["torch_peer"]
        out.append(
            (
                what,
                m["speed_vs_torch_peer"] >= TARGET_ATTENTION_SPEED,
                f"{m['speed_vs_torch_peer']:.2f}x ({m['device_us']:.1f} us vs "
                f"{case['methods'][peer]['device_us']:.1f} us, {peer}; "
                f"{m['gb_per_s']:.0f} GB/s)",
            )
        )
    else:
        out.append((what, None, "not measured (or torch not importable)"))
    host = results.get("host", {}).get("cuda", {}).get("methods", {})
    for name in ("append + attention", "append_and_attend", "DecodeStep"):
        what = f"host path on CUDA, {name}: <= {TARGET_HOST_US:g} us host time per layer per step"
        if name in host:
            us = host[name]["host_us"]
            cpu = results["host"].get("cpu", {}).get("methods", {}).get(name, {}).get("host_us")
            out.append((what, us <= TARGET_HOST_US, f"{us:.1f} us (CPU backend: {_f(cpu)} us)"))
        else:
            out.append((what, None, "not measured"))
    return out


# -- main --------------------------------------------------------------------------------


def gpu_info(dev: Device) -> dict:
    cuda = dev.cuda
    info: dict = {"simulator": dev.dry}
    try:
        d = cuda.get_current_device()
        name = d.name.decode() if isinstance(d.name, bytes) else d.name
        info.update(name=str(name), compute_capability=list(getattr(d, "compute_capability", ())))
        info["sm_count"] = int(getattr(d, "MULTIPROCESSOR_COUNT", 0)) or None
        free, total = cuda.current_context().get_memory_info()
        info["memory_gib"] = round(total / 2**30, 1)
    except Exception as err:  # only for the record
        info["error"] = f"{type(err).__name__}: {err}"
    try:
        from numba.cuda.cudadrv.driver import driver

        info["driver_version"] = list(driver.get_version())
    except Exception:
        pass
    for dist in ("numba-cuda", "cupy", "cupy-cuda12x", "cupy-cuda13x", "ml_dtypes"):
        try:
            from importlib.metadata import version

            info[dist] = version(dist)
        except Exception:
            pass
    if torch is not None:
        info["torch_cuda"] = torch.version.cuda
    try:  # a launch of fewer blocks than Numba likes warns (a cost per launch, on the host)
        from numba.core import config

        info["numba_cuda_low_occupancy_warnings"] = bool(config.CUDA_LOW_OCCUPANCY_WARNINGS)
    except Exception:
        pass
    info["kernel_sources_sha256"] = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        for p in sorted((ROOT / "nbkv" / "kernels").glob("cuda*.py"))
    }
    return info


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few calls")
    parser.add_argument("--json", metavar="PATH", help="write results and machine info here")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="under NUMBA_ENABLE_CUDASIM=1: run every code path at tiny sizes on the "
        "simulator (torch on the CPU); the figures mean nothing",
    )
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {PARTS}")
    info = machine(torch)
    reason = no_cuda_reason(args.dry_run)
    if reason is not None:
        print(f"skipped: no CUDA device ({reason}); nothing was measured")
        print("SKIP  every CUDA target: no CUDA device")
        write_json(
            args.json,
            {"machine": info, "skipped": reason, "quick": args.quick, "results": {}, "targets": []},
        )
        return 0
    sizes = DRY if args.dry_run else QUICK if args.quick else FULL
    dev = Device(args.dry_run)
    info["gpu"] = gpu_info(dev)
    try:
        dev.check_fill()
    except WrongResult as err:
        print(f"WRONG: {err}; nothing is measured")
        write_json(args.json, {"machine": info, "errors": {"fill": str(err)}, "results": {}})
        return 2
    g = info["gpu"]
    if args.dry_run:
        print("DRY RUN under the CUDA simulator, tiny sizes: every figure below is meaningless")
    print(
        f"{g.get('name')} (cc {g.get('compute_capability')}, {g.get('sm_count')} SMs, "
        f"{g.get('memory_gib')} GiB), driver {g.get('driver_version')}; host {info['cpu']} "
        f"({info['cpu_count']} cpus)"
    )
    print(
        f"python {info['python']}, numpy {info['numpy']}, numba {info['numba']}, numba-cuda "
        f"{g.get('numba-cuda')}, nbkv {info['nbkv']}, torch {info['torch'] or 'not installed'}"
        f" (CUDA {g.get('torch_cuda')})"
    )
    if info["git"]:
        changed = ", ".join(x.split()[-1] for x in info["git"]["nbkv_changed"]) or "none"
        print(f"nbkv at commit {info['git']['commit'][:12]}; changed since, in nbkv/: {changed}")
    if torch is None:
        print("note: torch is not importable; the torch peers and the attention target are skipped")
    timer = Timer(dev, sizes)
    results, errors = {}, {}
    wrong = False
    benches = {"append": bench_append, "attention": bench_attention, "host": bench_host}
    for part in parts:
        t0 = time.perf_counter()
        try:
            results[part] = benches[part](dev, sizes, timer)
            print(f"{part}: done in {time.perf_counter() - t0:.1f} s")
        except WrongResult as err:
            wrong = True
            errors[part] = f"WRONG: {err}"
            print(f"WRONG RESULT in part {part}: {err}; no timing of it is reported")
        except Exception as err:  # report it, go on with the other parts, fail at the end
            errors[part] = "".join(traceback.format_exception(err))[-4000:]
            print(f"FAILED part {part}: {type(err).__name__}: {err}")
            traceback.print_exc()
        dev.flush()
    print()
    report(results)
    print()
    goals = targets(results, sizes)
    if args.dry_run:
        goals = [(w, None, f"dry run, meaningless ({f})") for w, _, f in goals]
    for what, ok, figure in goals:
        print(f"{'SKIP' if ok is None else 'PASS' if ok else 'MISS'}  {what}: {figure}")
    slow = {k: v for k, v in dev.first_calls.items() if v >= 0.1}
    print(
        "JIT: first calls of 0.1 s or more (synchronised, in no timing; all in the JSON): "
        + ("; ".join(f"{k} {v:.2f} s" for k, v in slow.items()) or "none")
    )
    write_json(
        args.json,
        {
            "machine": info,
            "dry_run": args.dry_run,
            "quick": args.quick,
            "sizes": sizes.__dict__,
            "jit_first_call_s": dev.first_calls,
            "results": results,
            "errors": errors,
            "targets": [{"target": w, "pass": ok, "figure": f} for w, ok, f in goals],
        },
    )
    if errors:
        print(f"FAILED: {', '.join(errors)}")
    return 2 if wrong else 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
