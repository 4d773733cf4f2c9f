"""Benchmark: decode attention over a K/V cache on the CPU, nbkv beside its peers.

Case: batch 1, 32 query heads over 8 KV heads (group 4), head_dim 128, float32, one query
per head (decode), ``seq_len`` = 512, 4096, 16384, 32768 positions held (capacity =
``seq_len``). Scale ``head_dim ** -0.5``; a lone decode query sees every position.

Methods, measured side by side in one run, in a fresh random order each round:

- nbkv API:        ``nbkv.attention(q, cache)`` on a ``LayerKVCache`` holding ``seq_len``
                   positions (allocates its output, as a user's call does);
- nbkv kernel:     ``nbkv.kernels.attend(q, K, V, seq_len, scale, True, 0, table, out)``
                   called directly from Python, ``out`` preallocated;
- NumPy:           the path a user would write: q reshaped into groups [1, 8, 4, 128] @
                   K^T [1, 8, 128, S] -> scores, stable softmax (subtract the max, exp,
                   divide by the sum), @ V [1, 8, S, 128]; grouped matmul, no repeat;
- torch SDPA gqa:  ``F.scaled_dot_product_attention(q, K, V, enable_gqa=True)`` with q
                   [1, 32, 1, 128] and K/V [1, 8, S, 128], if torch is importable;
- torch SDPA grp:  the same with q reshaped into groups [1, 8, 4, 128] (no enable_gqa);
                   the faster of the two torch rows (by median) is "the torch peer";
- read ceiling:    an ``@njit(parallel=True, fastmath=True)`` sum over K and V, prange
                   over heads: the same bytes read with no arithmetic to speak of;
- NumPy sum:       ``K.sum() + V.sum()``, single-threaded, for reference.

All methods read the same arrays: the cache's own buffers (torch tensors are
``torch.from_numpy`` views of them, no copy). Each thread count is left at its default
(Numba's and torch's threads, OpenBLAS's for NumPy's matmul), as a user would have it.

Cold memory: K+V is ``2 * S * 8 * 128 * 4`` bytes (4 MiB at 512, 32 MiB at 4096, 256 MiB
at 32768). Every size gets several independent caches, cycled call by call across all
methods, so that at least ``COLD_BYTES`` (4x a 32 MiB L3) are read between two reads of
one copy: every timed call reads K/V that are no longer in the CPU's caches. Bytes counted
per call: the K and V read, ``2 * S * 8 * 128 * 4``, for every method.

Timing, per method per round: one untimed call (on another copy) wakes the method's own
threads, as in a loop of its calls; then the timed call; then ``settle()`` waits until no
thread of the process still spins. Without that wait the methods disturb one another on a
small machine: OpenBLAS's threads spin about 0.1 s after each NumPy matmul, OpenMP's
(Numba's, torch's) a few ms, and the next method's threads wait for a core ("spin ms" in
the table: how long our threads stayed busy after a method's call).

Other jobs on a shared machine: a call that uses every core waits whenever another job
holds one (by milliseconds: a scheduler slice). Each timed call records how long our
threads waited for a CPU (Linux schedstat ``run_delay``); a call is "disturbed" when that
exceeds ``WAIT_SHARE`` of its duration. The figures (median, p10, p90 and all derived from
them) are over the undisturbed calls, and rounds continue until every method has enough of
them (or a cap; then every call counts, marked ``*``). The median over all calls and the
share disturbed are printed beside them.

Share of the read ceiling: "%ceil" is the read's median time over the method's; "%pair"
(which decides the 85% target) takes the same share round by round, the read's time over
the method's in the same round where neither call was disturbed, and gives its median
(:func:`paired_share`). The memory's speed on a shared machine jumps between levels that
last seconds; two calls of one round meet the same level, two medians need not. The target
lines split the paired figures by that level (rounds whose read ran within ``FAST_READ``
of its p10, and the others), and the 16-bit targets are decided round by round too: the
float32 kernel's time over the 16-bit kernel's in the same round (:func:`paired_speed`).

Correctness is checked before any timing, against ``nbkv.reference.attention`` (float64)
on the benchmark's own data, at the sizes in ``CHECK_SIZES`` (or, when ``--sizes`` runs
none of them, at the smallest size it runs; atol 1e-4); the two read
methods are checked against a float64 sum. The JIT compile time of nbkv's kernel is
reported separately and is in no timing.

Usage (from the repository root)::

    python benchmarks/bench_attention.py            # full run, about 2 minutes
    python benchmarks/bench_attention.py --quick    # smoke run: 512 and 4096 only
    python benchmarks/bench_attention.py --json results.json
    python benchmarks/bench_attention.py --sizes 32768 --no-prefill   # the target size only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _machine import machine  # noqa: E402  (this folder is on sys.path)
from numba import njit, prange

ROOT = Path(__file__).resolve().parents[1]
try:
    import nbkv
    import nbkv.dtypes
    import nbkv.kernels
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
    import nbkv
    import nbkv.dtypes
    import nbkv.kernels
attend = nbkv.kernels.attend

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = F = None

DTYPE = np.dtype(np.float32)
NOW = time.perf_counter_ns
BATCH, HEADS, KV_HEADS, HEAD_DIM = 1, 32, 8, 128
GROUP = HEADS // KV_HEADS
SCALE = 1.0 / math.sqrt(HEAD_DIM)
TABLE = nbkv.dtypes.widen_table(DTYPE)
TABLE16 = nbkv.dtypes.widen_table(np.dtype(np.float16))
# bfloat16's table, without needing ml_dtypes: bfloat16 is a float32's upper half
TABLE_BF16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
MIB = 1 << 20
# sizes checked against the float64 reference, before any timing
CHECK_SIZES = (512, 4096)
# K+V read between two reads of one copy, at the least: 4x a 32 MiB last-level cache
COLD_BYTES = 128 * MIB
ATOL = 1e-4
# seq_len: timed rounds (full, quick); a round calls every method once
SIZES = {512: (300, 30), 4096: (200, 15), 16384: (120, 0), 32768: (100, 0)}
TARGET_SEQ = 32768
# the prefill chunk: PREFILL_Q queries, the last of PREFILL_SEQ positions; rounds (full,
# quick)
PREFILL_Q, PREFILL_SEQ = 512, 4096
PREFILL_ROUNDS = (20, 3)
WARMUP_ROUNDS = 3
# settle(): poll every SETTLE_POLL_S until SETTLE_QUIET_POLLS polls in a row find no other
# thread of ours running, for at most SETTLE_CAP_S
SETTLE_POLL_S, SETTLE_QUIET_POLLS, SETTLE_CAP_S = 0.001, 2, 0.5
# a timed call is "disturbed" when our threads waited for a CPU (held by another job) for
# more than this share of its duration; the figures are from undisturbed calls when they
# number MIN_QUIET_SHARE of the rounds, and rounds go on (up to EXTRA_ROUNDS times as
# many) until they do
WAIT_SHARE = 0.05
MIN_QUIET_SHARE = 0.3
EXTRA_ROUNDS = 2
TASKS = Path("/proc/self/task")
READ = "read ceiling"  # the method every other one's share of the bandwidth is taken of


def settle() -> float:
    """Wait until no other thread of this process is running; return the seconds waited.

    Thread pools keep spinning after a call (OpenMP's, used by Numba and torch, for a few
    ms; OpenBLAS's, under NumPy's matmul, for about 0.1 s) and would take the cores the
    next method needs. A spinning thread is in state R in /proc; a parked one is not.
    """
    start = time.perf_counter()
    quiet = 0
    while quiet < SETTLE_QUIET_POLLS and time.perf_counter() - start < SETTLE_CAP_S:
        time.sleep(SETTLE_POLL_S)
        quiet = quiet + 1 if running_threads() == 0 else 0
    return time.perf_counter() - start


def running_threads() -> int:
    """Threads of this process, other than the calling one, running or runnable."""
    me = threading.get_native_id()
    n = 0
    try:
        tasks = os.listdir(TASKS)
    except OSError:
        return 0
    for tid in tasks:
        if int(tid) == me:
            continue
        try:
            stat = (TASKS / tid / "stat").read_text()
        except OSError:
            continue  # a thread that ended
        n += stat[stat.rindex(")") + 2] == "R"  # the state follows "(comm) "
    return n


def run_delay_ns() -> int:
    """ns the threads of this process have spent runnable but waiting for a CPU, in all
    (Linux schedstat; 0 where it is missing)."""
    total = 0
    try:
        tasks = os.listdir(TASKS)
    except OSError:
        return 0
    for tid in tasks:
        try:
            total += int((TASKS / tid / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended, or no schedstat
    return total


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU-seconds the whole machine has used, those used by this process), or None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    own = os.times()
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), (
        own.user + own.system
    )


def quiet_count(times, waited) -> int:
    return sum(w <= WAIT_SHARE * t for t, w in zip(times, waited, strict=True))


@njit(parallel=True, fastmath=True)
def read_kv(K, V):
    """Sum of every element of K and V, [batch, heads, seq, head_dim], C-contiguous."""
    batch, heads = K.shape[0], K.shape[1]
    part = np.zeros(batch * heads, np.float32)
    for task in prange(batch * heads):
        b = task // heads
        h = task - b * heads
        k = K[b, h].reshape(-1)
        v = V[b, h].reshape(-1)
        acc = np.float32(0.0)
        for i in range(k.size):
            acc += k[i] + v[i]
        part[task] = acc
    return part.sum()


def numpy_attention(q, K, V, scale):
    """Grouped decode attention in plain NumPy: one matmul per KV head, no repeat."""
    b, hq, n_q, d = q.shape
    qg = q.reshape(b, K.shape[1], hq // K.shape[1] * n_q, d)  # [b, kv_heads, group, d]
    s = (qg @ K.swapaxes(-1, -2)) * scale  # [b, kv_heads, group, S]
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return (w @ V).reshape(b, hq, n_q, d)


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even (as ml_dtypes does)."""
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


class Copy:
    """One cache holding ``seq_len`` positions, with every view the methods read."""

    def __init__(self, k, v):
        seq_len = k.shape[2]
        self.cache = nbkv.LayerKVCache(
            seq_len, batch=BATCH, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=DTYPE
        )
        self.cache.append(k, v)
        self.K, self.V = self.cache.get_kv()  # views of the cache's buffers
        assert self.K.flags.c_contiguous and self.K.shape[2] == seq_len
        # the same values stored in 16 bits, as kernels see them (uint16 bit patterns)
        self.K16, self.V16 = (x.astype(np.float16).view(np.uint16) for x in (k, v))
        self.Kb, self.Vb = (_to_bf16_bits(x) for x in (k, v))
        if torch is not None:
            self.Kt, self.Vt = torch.from_numpy(self.K), torch.from_numpy(self.V)


def make_methods(q, seq_len):
    """name -> (kind, call(copy) -> result). Kinds: attention, read."""
    out = np.empty_like(q)
    qg = q.reshape(BATCH, KV_HEADS, GROUP, HEAD_DIM)
    methods = {
        "nbkv API": ("attention", lambda c: nbkv.attention(q, c.cache)),
        "nbkv kernel": (
            "attention",
            lambda c: (attend(q, c.K, c.V, seq_len, SCALE, True, 0, TABLE, out), out)[1],
        ),
        "nbkv fp16 kernel": (
            "attention16",
            lambda c: (attend(q, c.K16, c.V16, seq_len, SCALE, True, 0, TABLE16, out), out)[1],
        ),
        "nbkv bf16 kernel": (
            "attention16",
            lambda c: (attend(q, c.Kb, c.Vb, seq_len, SCALE, True, 0, TABLE_BF16, out), out)[1],
        ),
        "NumPy": ("attention", lambda c: numpy_attention(q, c.K, c.V, SCALE)),
    }
    if torch is not None:
        qt, qgt = torch.from_numpy(q), torch.from_numpy(qg)
        methods["torch SDPA gqa"] = (
            "attention",
            lambda c: F.scaled_dot_product_attention(qt, c.Kt, c.Vt, enable_gqa=True),
        )
        methods["torch SDPA grp"] = (
            "attention",
            lambda c: F.scaled_dot_product_attention(qgt, c.Kt, c.Vt).reshape(q.shape),
        )
    methods[READ] = ("read", lambda c: read_kv(c.K, c.V))
    methods["NumPy sum"] = ("read", lambda c: c.K.sum() + c.V.sum())
    return methods


def check(methods, q, copy) -> float:
    """Every method on ``copy`` against float64; returns the largest attention error."""
    want = nbkv.reference.attention(q, copy.K, copy.V)
    widen = {"nbkv fp16 kernel": TABLE16, "nbkv bf16 kernel": TABLE_BF16}
    pairs = {"nbkv fp16 kernel": (copy.K16, copy.V16), "nbkv bf16 kernel": (copy.Kb, copy.Vb)}
    want16 = {
        name: nbkv.reference.attention(q, widen[name][k16], widen[name][v16])
        for name, (k16, v16) in pairs.items()
    }
    total = float(copy.K.sum(dtype=np.float64) + copy.V.sum(dtype=np.float64))
    size = float(np.abs(copy.K).sum(dtype=np.float64) + np.abs(copy.V).sum(dtype=np.float64))
    worst = 0.0
    for name, (kind, call) in methods.items():
        got = call(copy)
        if kind.startswith("attention"):
            got = np.asarray(got.numpy() if torch is not None and torch.is_tensor(got) else got)
            ref = want if kind == "attention" else want16[name]
            err = float(np.max(np.abs(got.astype(np.float64) - ref)))
            ok = got.shape == want.shape and err <= ATOL
            worst = max(worst, err)
        else:  # a float32 sum of millions of terms: its rounding, relative to sum |x|
            err = abs(float(got) - total) / size
            ok = err <= 1e-5
        if not ok:
            raise SystemExit(
                f"{name} is wrong at seq_len {copy.K.shape[2]} (error {err:.3g}); "
                "no timing is worth reporting"
            )
    return worst


def time_methods(methods, copies, rounds, rng):
    """Time every method, rounds in a fresh random order, cycling through ``copies``.

    Returns (ns per timed call, ns our threads waited for a CPU in it, seconds they kept
    spinning after it), each a dict by name; the rounds run; the CPUs other jobs used.
    """
    names = list(methods)
    n_copies = len(copies)
    turn = 0  # cycles through the copies, call by call, across methods
    times = {name: [] for name in names}
    waited = {name: [] for name in names}  # ns our threads waited for a CPU in the call
    spin = {name: [] for name in names}  # seconds our threads stayed busy after it
    settle()
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    r = 0
    while r < WARMUP_ROUNDS + rounds or (
        r < WARMUP_ROUNDS + EXTRA_ROUNDS * rounds
        and min(quiet_count(times[n], waited[n]) for n in names) < MIN_QUIET_SHARE * rounds
    ):
        for j in rng.permutation(len(names)):
            name = names[j]
            call = methods[name][1]
            call(copies[turn % n_copies])  # untimed: wakes this method's own threads
            c = copies[(turn + 1) % n_copies]
            turn += 2
            w0 = run_delay_ns()
            t0 = NOW()
            call(c)
            t1 = NOW()
            w1 = run_delay_ns()
            after = settle()  # before the next method: no thread of ours left spinning
            if r >= WARMUP_ROUNDS:
                times[name].append(t1 - t0)
                waited[name].append(w1 - w0)
                spin[name].append(after)
        r += 1
    cpu1, wall1 = cpu_seconds(), time.perf_counter()
    other_cpus = None  # CPUs other jobs used meanwhile, on average
    if cpu0 is not None and cpu1 is not None:
        other_cpus = max(0.0, (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / (wall1 - wall0)
    return times, waited, spin, r - WARMUP_ROUNDS, other_cpus


def figures(times, waited, rounds) -> tuple[np.ndarray, np.ndarray, float, dict]:
    """One method's timed calls (ns) as figures: the calls during which none of our
    threads waited for a CPU, when there are enough of them, otherwise every call.
    Returns (all times, which were quiet, the median in ns, the figures' dict)."""
    t_all = np.asarray(times, dtype=np.float64)  # ns per call
    quiet = np.asarray(waited) <= WAIT_SHARE * t_all
    enough = quiet.sum() >= MIN_QUIET_SHARE * rounds
    t = t_all[quiet] if enough else t_all
    med = float(np.median(t))
    out = {
        "us": med / 1e3,
        "us_p10": float(np.percentile(t, 10)) / 1e3,
        "us_p90": float(np.percentile(t, 90)) / 1e3,
        "calls": len(t),
        "undisturbed_only": bool(enough),
        "calls_timed": len(t_all),
    }
    return t_all, quiet, med, out


# a round's memory was at its fast level when the read took at most this times its p10
FAST_READ = 1.25


def paired_share(times, quiet_of, name, bytes_share, rounds) -> dict:
    """``name``'s share of the read ceiling, round by round: the read's time over the
    method's time in the same round (``bytes_share`` of the read for a 16-bit cache),
    over the rounds in which neither call was disturbed. The two calls of a round run
    within a second of each other (a round at 32k takes about 0.6 s), so both meet the
    same memory bandwidth, which on a shared machine jumps between levels that last
    seconds (the read at 32k has taken 4.1 and 7.4 ms in one run); a ratio of two medians
    mixes those levels. Returns the median share in percent, its p10/p90 and the rounds
    used; no share (None) from fewer than ``MIN_QUIET_SHARE`` of ``rounds``. Apart, the
    median share in the rounds whose read ran at the memory's fast level (within
    ``FAST_READ`` of the read's p10; their count, and that bound) and in the others: a method
    bound by its arithmetic keeps a share well below 100% when the memory is fast, and
    nears it when the memory is slow."""
    t_read = np.asarray(times[READ], dtype=np.float64)
    t = np.asarray(times[name], dtype=np.float64)
    both = quiet_of[READ] & quiet_of[name]
    share = 100.0 * bytes_share * t_read / t
    *got, bound = _by_level(share, t_read, both, rounds)
    keys = ("pct_of_read_paired", "pct_paired_p10", "pct_paired_p90", "paired_rounds")
    keys += ("pct_paired_fast_memory", "fast_memory_rounds", "pct_paired_slow_memory")
    return {
        **dict(zip(keys, got, strict=True)),
        "fast_read_max_us": None if bound is None else bound / 1e3,  # times are in ns
    }


def paired_speed(times, quiet_of, name, ref, rounds) -> dict:
    """``name``'s speed over ``ref``'s (``ref``'s time over ``name``'s), round by round,
    as :func:`paired_share` takes the read's: the median over the rounds in which none of
    the three calls was disturbed, and apart at each level of the memory."""
    both = quiet_of[READ] & quiet_of[name] & quiet_of[ref]
    t_read = np.asarray(times[READ], dtype=np.float64)
    speed = np.asarray(times[ref], dtype=np.float64) / np.asarray(times[name], np.float64)
    med, _, _, n, fast, n_fast, slow, _ = _by_level(speed, t_read, both, rounds)
    return {
        "speed_vs_kernel_paired": med,  # ``ref`` is the float32 kernel here
        "speed_paired_rounds": n,
        "speed_paired_fast_memory": fast,
        "speed_fast_memory_rounds": n_fast,
        "speed_paired_slow_memory": slow,
    }


def _by_level(x, t_read, used, rounds) -> tuple:
    """Median, p10, p90 and count of ``x`` over the rounds ``used``; its median over those
    whose read ran at the memory's fast level (at most ``FAST_READ`` times the read's p10
    over those rounds), their count, its median over the others, and that bound on the
    read's time. None for each figure from fewer than ``MIN_QUIET_SHARE`` of ``rounds``
    (or no round at a level). If less than a tenth of the rounds met fast memory, the
    "fast" level is the fastest tenth of a slow run: the bound, recorded, says which."""
    n = int(used.sum())
    if n < max(1, MIN_QUIET_SHARE * rounds):  # too few to say
        return None, None, None, n, None, 0, None, None
    x, t_read = x[used], t_read[used]
    bound = FAST_READ * float(np.percentile(t_read, 10))
    fast = t_read <= bound
    slow = float(np.median(x[~fast])) if (~fast).any() else None
    p10, p90 = np.percentile(x, [10, 90])
    med, med_fast = float(np.median(x)), float(np.median(x[fast]))
    return med, float(p10), float(p90), n, med_fast, int(fast.sum()), slow, bound


def bench_size(seq_len, rounds, rng, check_it=None):
    t_start = time.perf_counter()
    shape = (BATCH, KV_HEADS, seq_len, HEAD_DIM)
    nbytes = 2 * seq_len * KV_HEADS * HEAD_DIM * DTYPE.itemsize  # K and V read per call
    # timed calls alternate with untimed ones: ``COLD_BYTES`` or more are read between
    # two reads of one copy
    n_copies = max(2, -(-COLD_BYTES // nbytes) + 1)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    q = rng.standard_normal((BATCH, HEADS, 1, HEAD_DIM), dtype=np.float32)
    copies = [Copy(k, v) for _ in range(n_copies)]
    del k, v
    methods = make_methods(q, seq_len)
    names = list(methods)
    if check_it is None:
        check_it = seq_len in CHECK_SIZES
    worst = check(methods, q, copies[0]) if check_it else None
    times, waited, spin, r, other_cpus = time_methods(methods, copies, rounds, rng)
    res = {}
    quiet_of = {}
    for name in names:
        t_all, quiet_of[name], med, res[name] = figures(times[name], waited[name], rounds)
        quiet = quiet_of[name]
        res[name].update(
            # bytes per ns = GB/s; 16-bit caches hold half the bytes
            gb_per_s=(nbytes // 2 if methods[name][0] == "attention16" else nbytes) / med,
        )
        res[name].update(
            {
                "disturbed_share": float(1.0 - quiet.mean()),
                "us_all_calls": float(np.median(t_all)) / 1e3,
                "us_all_p90": float(np.percentile(t_all, 90)) / 1e3,
                "threads_busy_after_ms": float(np.median(spin[name])) * 1e3,
            }
        )
    ceiling = res[READ]["us"]
    peer = None
    if torch is not None:
        peer = min(("torch SDPA gqa", "torch SDPA grp"), key=lambda n: res[n]["us"])
    for name, m in res.items():
        # a 16-bit cache is half the bytes: its ceiling is taken as half the read's time
        half = methods[name][0] == "attention16"
        m["pct_of_read_ceiling"] = 100.0 * ceiling * (0.5 if half else 1.0) / m["us"]
        m.update(paired_share(times, quiet_of, name, 0.5 if half else 1.0, rounds))
        if half:  # against the float32 kernel, round by round
            m.update(paired_speed(times, quiet_of, name, "nbkv kernel", rounds))
        m["time_vs_numpy"] = m["us"] / res["NumPy"]["us"]
        m["time_vs_torch_peer"] = None if peer is None else m["us"] / res[peer]["us"]
    info = {
        "seq_len": seq_len,
        "kv_shape": list(shape),
        "q_shape": list(q.shape),
        "bytes_per_call": nbytes,
        "copies_cycled": n_copies,
        "cycled_mib": n_copies * nbytes / MIB,
        "checked_max_abs_err": worst,
        "torch_peer": peer,
        "rounds": r,
        "other_jobs_cpus": other_cpus,
        "wall_s": time.perf_counter() - t_start,
    }
    return {"case": info, "methods": res}


def bench_prefill(rounds, rng, n_q=PREFILL_Q, seq_len=PREFILL_SEQ):
    """A prefill chunk: the last ``n_q`` of ``seq_len`` positions attend causally (each
    query up to its own position), nbkv's kernel against torch SDPA given the same mask
    as a boolean matrix (torch's ``is_causal`` aligns queries to the first positions, not
    the last). Compute-bound: the figure is GFLOP/s of the visible scores' 4 FLOP per
    query, position and dimension (Q K^T and weights x V), masked work not counted."""
    shape = (BATCH, KV_HEADS, seq_len, HEAD_DIM)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    q = rng.standard_normal((BATCH, HEADS, n_q, HEAD_DIM), dtype=np.float32)
    copies = [(k, v), (k.copy(), v.copy())]
    out = np.empty_like(q)
    methods = {
        "nbkv kernel": (
            "attention",
            lambda c: (attend(q, c[0], c[1], seq_len, SCALE, True, 0, TABLE, out), out)[1],
        )
    }
    if torch is not None:
        first = seq_len - n_q
        mask = torch.arange(seq_len)[None, :] <= torch.arange(first, seq_len)[:, None]
        qt = torch.from_numpy(q)
        qg = torch.from_numpy(q.reshape(BATCH, KV_HEADS, GROUP * n_q, HEAD_DIM))
        mask_g = mask.repeat(GROUP, 1)  # grouped rows: member g's query i is row g*n_q + i
        tc = [tuple(torch.from_numpy(x) for x in c) for c in copies]
        sdpa = F.scaled_dot_product_attention
        methods["torch SDPA gqa"] = (
            "attention",
            lambda c: sdpa(qt, *tc[c[0] is not copies[0][0]], attn_mask=mask, enable_gqa=True),
        )
        methods["torch SDPA grp"] = (
            "attention",
            lambda c: sdpa(qg, *tc[c[0] is not copies[0][0]], attn_mask=mask_g).reshape(q.shape),
        )
    want = nbkv.reference.attention(q, k, v)
    worst = 0.0
    for name, (_, call) in methods.items():
        got = call(copies[0])
        got = np.asarray(got.numpy() if torch is not None and torch.is_tensor(got) else got)
        err = float(np.max(np.abs(got.astype(np.float64) - want)))
        if err > ATOL:
            raise SystemExit(f"{name} is wrong on the prefill chunk (error {err:.3g})")
        worst = max(worst, err)
    times, waited, _spin, r, other_cpus = time_methods(methods, copies, rounds, rng)
    visible = sum(first_pos + 1 for first_pos in range(seq_len - n_q, seq_len))  # causal
    flop = 4 * BATCH * HEADS * visible * HEAD_DIM
    res = {}
    for name in methods:
        _t_all, _quiet, med, res[name] = figures(times[name], waited[name], rounds)
        res[name]["gflop_per_s"] = flop / med
    peer = None
    if torch is not None:
        peer = min(("torch SDPA gqa", "torch SDPA grp"), key=lambda n: res[n]["us"])
        for m in res.values():
            m["time_vs_torch_peer"] = m["us"] / res[peer]["us"]
    info = {
        "n_q": n_q,
        "seq_len": seq_len,
        "q_shape": list(q.shape),
        "kv_shape": list(shape),
        "flop_per_call": flop,
        "checked_max_abs_err": worst,
        "torch_peer": peer,
        "rounds": r,
        "other_jobs_cpus": other_cpus,
    }
    return {"case": info, "methods": res}


def report_prefill(pre: dict) -> None:
    c = pre["case"]
    print(
        f"prefill: q {c['q_shape']} over K/V {c['kv_shape']} float32, causal; checked (max "
        f"|err| {c['checked_max_abs_err']:.1e} vs float64); {c['rounds']} rounds; torch peer: "
        f"{c['torch_peer']}"
    )
    for name, m in pre["methods"].items():
        vt = m.get("time_vs_torch_peer")
        print(
            f"  {name:<15} {m['us'] / 1e3:>8.1f} ms  p10 {m['us_p10'] / 1e3:>7.1f}  p90 "
            f"{m['us_p90'] / 1e3:>7.1f}  {m['gflop_per_s']:>6.1f} GFLOP/s"
            + (f"  {vt:.2f}x torch's time" if vt is not None else "")
            + f"  calls {m['calls']}/{m['calls_timed']}{'' if m['undisturbed_only'] else '*'}"
        )
    print()


def compile_times() -> dict:
    """First call of attend here, and a true compile in a fresh process and cache dir."""
    q = np.ones((BATCH, HEADS, 1, HEAD_DIM), DTYPE)
    K = np.ones((BATCH, KV_HEADS, 16, HEAD_DIM), DTYPE)
    out = np.empty_like(q)
    before = sum(attend.stats.cache_hits.values())
    t0 = NOW()
    attend(q, K, K.copy(), 16, SCALE, True, 0, TABLE, out)
    first = (NOW() - t0) / 1e9
    loaded = sum(attend.stats.cache_hits.values()) > before
    code = (
        "import time, numpy as np; from nbkv.kernels import attend; "
        "from nbkv.dtypes import widen_table; t = widen_table(np.dtype(np.float32)); "
        "q = np.ones((1, 32, 1, 128), np.float32); K = np.ones((1, 8, 16, 128), np.float32); "
        "o = np.empty_like(q); s = time.perf_counter(); "
        "attend(q, K, K.copy(), 16, 0.1, True, 0, t, o); print(time.perf_counter() - s)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, NUMBA_CACHE_DIR=tmp, PYTHONPATH=str(ROOT))
        fresh = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
    t0 = NOW()
    read_kv(K, K)
    floor = (NOW() - t0) / 1e9
    return {
        "attend_first_call_s": first,
        "attend_first_call_from_disk_cache": loaded,
        "attend_fresh_compile_s": float(fresh.stdout.split()[-1]),
        "read_ceiling_first_call_s": floor,
    }


def report(results: dict) -> None:
    head = (
        f"{'seq_len':>7} {'method':<15} {'us':>9} {'p10':>9} {'p90':>9} {'GB/s':>6} "
        f"{'%ceil':>6} {'%pair':>6} {'vs torch':>9} {'vs NumPy':>9} {'us (all)':>9} {'dist':>5} "
        f"{'spin ms':>7} {'calls':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in results.values():
        for name, m in r["methods"].items():
            vt = m["time_vs_torch_peer"]
            vt = f"{vt:>8.2f}x" if vt is not None else f"{'-':>9}"
            calls = f"{m['calls']}/{m['calls_timed']}{'' if m['undisturbed_only'] else '*'}"
            pair = m["pct_of_read_paired"]
            pair = f"{pair:>5.1f}%" if pair is not None else f"{'-':>6}"
            print(
                f"{r['case']['seq_len']:>7} {name:<15} {m['us']:>9.1f} {m['us_p10']:>9.1f} "
                f"{m['us_p90']:>9.1f} {m['gb_per_s']:>6.2f} {m['pct_of_read_ceiling']:>5.1f}% "
                f"{pair} {vt} {m['time_vs_numpy']:>8.2f}x {m['us_all_calls']:>9.1f} "
                f"{100 * m['disturbed_share']:>4.0f}% {m['threads_busy_after_ms']:>7.1f} "
                f"{calls:>8}"
            )
        print()
    for line in (
        "us: median of the undisturbed calls, p10/p90 around it. GB/s: K+V bytes read",
        "(2*S*8*128*4) per median time. %ceil: share of the read ceiling's GB/s (its median",
        "time over this median time). %pair: the same share round by round (the read's time",
        "over this method's in the same round, both undisturbed), its median: robust to the",
        "memory bandwidth changing during the run. vs torch / vs NumPy: median time relative",
        "to the torch peer (the faster torch SDPA row) / the NumPy path, below 1 is faster.",
        "us (all): median of every timed call. dist: share of calls",
        "disturbed (our threads waited for a CPU > 5% of the call). spin ms: how long our",
        "threads kept a core busy after the call. calls: undisturbed/timed; * every call",
        "counted (too few undisturbed).",
    ):
        print(f"  {line}")


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1f}%"


def _phases(m: dict) -> str:
    """The paired share split by the memory's level (see :func:`paired_share`)."""
    bound = m["fast_read_max_us"]
    return (
        f"memory fast in {m['fast_memory_rounds']} rounds"
        + ("" if bound is None else f" (read <= {bound / 1e3:.2f} ms)")
        + f": {_pct(m['pct_paired_fast_memory'])}, in the others: "
        + _pct(m["pct_paired_slow_memory"])
    )


def _phase_speeds(m16: dict) -> str:
    """A 16-bit kernel's paired speed over the float32 kernel's at each level of the
    memory (see :func:`paired_speed`)."""
    fast, slow = m16["speed_paired_fast_memory"], m16["speed_paired_slow_memory"]
    return (
        f"memory fast in {m16['speed_fast_memory_rounds']} rounds: "
        + ("-" if fast is None else f"{fast:.2f}x")
        + (", in the others: " + ("-" if slow is None else f"{slow:.2f}x"))
    )


def targets(results: dict, seq_len: int, pre: dict | None) -> list[tuple[str, bool | None, str]]:
    """Issue 14's goals at ``seq_len`` (decode) and for the prefill chunk, if run."""
    m = results[seq_len]["methods"]
    api, ker = m["nbkv API"], m["nbkv kernel"]
    # decided round by round (see paired_share); the ratio of the medians beside it
    share, kshare = api["pct_of_read_paired"], ker["pct_of_read_paired"]
    out = [
        (
            f"seq_len {seq_len}: nbkv API >= 85% of the read ceiling (paired by round)",
            None if share is None else share >= 85,
            f"too few rounds with both calls undisturbed ({api['paired_rounds']})"
            if share is None
            else f"{share:.1f}% over {api['paired_rounds']} rounds (p10 "
            f"{api['pct_paired_p10']:.1f}%, p90 {api['pct_paired_p90']:.1f}%; kernel "
            + ("-" if kshare is None else f"{kshare:.1f}%")
            + f"; ratio of medians {api['pct_of_read_ceiling']:.1f}%; {_phases(api)})",
        )
    ]
    peer = results[seq_len]["case"]["torch_peer"]
    what = f"seq_len {seq_len}: nbkv API >= 1.5x the speed of the torch peer"
    if peer is None:
        out.append((what, None, "torch not importable"))
    else:
        speed = m[peer]["us"] / api["us"]
        out.append(
            (
                what,
                speed >= 1.5,
                f"{speed:.2f}x ({peer}; kernel {m[peer]['us'] / ker['us']:.2f}x)",
            )
        )
    for name in ("nbkv fp16 kernel", "nbkv bf16 kernel"):
        # decided round by round, as the read ceiling's share; the ratio of medians beside
        m16 = m[name]
        speed = m16["speed_vs_kernel_paired"]
        out.append(
            (
                f"seq_len {seq_len}: {name} >= 1.6x the speed of the float32 kernel (paired)",
                None if speed is None else speed >= 1.6,
                f"too few rounds with the three calls undisturbed ({m16['speed_paired_rounds']})"
                if speed is None
                else f"{speed:.2f}x over {m16['speed_paired_rounds']} rounds ("
                + _phase_speeds(m16)
                + f"; ratio of medians {ker['us'] / m16['us']:.2f}x: {m16['us']:.0f} us "
                f"against {ker['us']:.0f} us)",
            )
        )
    if pre is not None:
        c = pre["case"]
        what = (
            f"prefill {c['n_q']} queries over {c['seq_len']} positions: nbkv kernel >= 1.0x "
            "torch's speed"
        )
        if pre["case"]["torch_peer"] is None:
            out.append((what, None, "torch not importable"))
        else:
            p = pre["methods"]
            speed = p[pre["case"]["torch_peer"]]["us"] / p["nbkv kernel"]["us"]
            out.append((what, speed >= 1.0, f"{speed:.2f}x ({pre['case']['torch_peer']})"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="few repeats, seq_len 512 and 4096 only"
    )
    parser.add_argument("--json", metavar="PATH", help="write results and machine info here")
    parser.add_argument(
        "--sizes",
        metavar="N,N",
        help=f"only these seq_len, comma-separated, of {', '.join(map(str, SIZES))}",
    )
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill chunk")
    args = parser.parse_args()
    sizes = SIZES
    if args.sizes:
        try:
            sizes = {int(n): SIZES[int(n)] for n in args.sizes.split(",")}
        except (ValueError, KeyError):
            parser.error(f"--sizes takes some of {', '.join(map(str, SIZES))}; got {args.sizes!r}")
    if not any(rounds[1 if args.quick else 0] for rounds in sizes.values()):
        parser.error("--quick runs only seq_len 512 and 4096: give one of them in --sizes")
    info = machine(torch)
    print(
        f"{info['cpu']} ({info['cpu_id']}; {info['cpu_count']} cpus, L3 {info['l3_cache']}), "
        f"{info['platform']}"
    )
    print(
        f"python {info['python']}, numpy {info['numpy']} ({info['numpy_blas']}), numba "
        f"{info['numba']} ({info['numba_threads']} threads), nbkv {info['nbkv']}, torch "
        f"{info['torch'] or 'not installed'}"
        + (f" ({info['torch_threads']} threads)" if torch is not None else "")
        + (f"; env {info['thread_env']}" if info["thread_env"] else "")
    )
    if info["isa_env"]:
        print(f"targets: {info['isa_env']}; torch's CPU kernels: {info['torch_cpu_capability']}")
    if info["git"]:
        changed = ", ".join(x.split()[-1] for x in info["git"]["nbkv_changed"]) or "none"
        print(
            f"nbkv at commit {info['git']['commit'][:12]}; changed since, in nbkv/: {changed} "
            f"(cpu_attention.py sha256 {info['git']['cpu_attention_py_sha256'][:12]})"
        )
    if torch is None:
        print("note: torch is not importable; the torch SDPA rows and the torch target are skipped")
    jit = compile_times()
    import numba

    info["numba_threading_layer"] = numba.threading_layer()
    print(
        f"JIT: attend first call {jit['attend_first_call_s']:.3f} s "
        f"({'loaded from disk cache' if jit['attend_first_call_from_disk_cache'] else 'compiled'}"
        f"), fresh compile in a new process {jit['attend_fresh_compile_s']:.3f} s, read "
        f"ceiling first call {jit['read_ceiling_first_call_s']:.3f} s (in no timing); "
        f"Numba threading layer {info['numba_threading_layer']}"
    )
    print(
        f"decode: q [{BATCH}, {HEADS}, 1, {HEAD_DIM}], K/V [{BATCH}, {KV_HEADS}, S, {HEAD_DIM}] "
        f"float32, {WARMUP_ROUNDS} warm-up rounds, methods in a fresh random order each round"
    )
    q = 1 if args.quick else 0
    rng = np.random.default_rng(0)
    results = {}
    run = [n for n, rounds in sizes.items() if rounds[q]]
    # correctness before any timing: at CHECK_SIZES, or the smallest size run if none is
    check_at = set(CHECK_SIZES) & set(run) or {min(run)}
    for seq_len in run:
        r = bench_size(seq_len, sizes[seq_len][q], rng, seq_len in check_at)
        results[seq_len] = r
        c = r["case"]
        cold = (
            f"{c['copies_cycled']} caches cycled ({c['cycled_mib']:.0f} MiB), each timed call "
            "reads K/V not in cache"
        )
        checked = (
            f"checked (max |err| {c['checked_max_abs_err']:.1e} vs float64, atol {ATOL:g})"
            if c["checked_max_abs_err"] is not None
            else "not checked at this size"
        )
        print(
            f"seq_len {seq_len}: K+V {c['bytes_per_call'] / MIB:.0f} MiB; {cold}; {checked}; "
            f"torch peer: {c['torch_peer']}; {c['rounds']} rounds ({c['wall_s']:.1f} s)"
            + (
                f"; other jobs used {c['other_jobs_cpus']:.2f} of {os.cpu_count()} CPUs meanwhile"
                if c["other_jobs_cpus"] is not None
                else ""
            )
        )
    pre = None
    if not args.no_prefill:
        pre = bench_prefill(PREFILL_ROUNDS[q], rng, *((64, 512) if args.quick else ()))
    print()
    report(results)
    if pre is not None:
        report_prefill(pre)
    busy = [
        f"{name} at {seq_len}"
        for seq_len, r in results.items()
        for name, m in r["methods"].items()
        if not m["undisturbed_only"]
    ]
    if busy:
        print(
            "WARNING: the machine was busy; too few undisturbed calls, so every call counts, "
            f"for: {', '.join(busy)}. Those figures measure the other jobs; rerun when quiet."
        )
    print()
    at = TARGET_SEQ if TARGET_SEQ in results else max(results)
    if at != TARGET_SEQ:
        print(f"targets are set at seq_len {TARGET_SEQ} (not run here); shown at {at} for info:")
    goals = targets(results, at, pre)
    for what, ok, figure in goals:
        print(f"{'SKIP' if ok is None else 'PASS' if ok else 'MISS'}  {what}: {figure}")
    if args.json:
        payload = {
            "machine": info,
            "jit": jit,
            "results": {str(k): v for k, v in results.items()},
            "prefill": pre,
            "targets": [{"target": w, "pass": ok, "figure": f} for w, ok, f in goals],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
