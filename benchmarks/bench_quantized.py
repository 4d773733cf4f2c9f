"""Quantized KV cache (KIVI): decode attention over the codes, the append that quantizes,
and the memory, against nbkv's float16 cache on the CPU.

Four parts, measured in one run:

1. **Memory** at ``[1, 8, 32768, 128]``: ``nbytes`` of a ``QuantizedKVCache`` (float16
   window and 16-bit scales, group 64, residual 128) of 8-, 4- and 2-bit codes, against a
   float16 ``LayerKVCache`` of the same capacity (and float32). Each figure is also
   recomputed from the storage's formula (:func:`quantized_nbytes`) and the two must agree.
   Targets: 8-bit at most 0.56x the float16 bytes, 4-bit at most 0.30x.

2. **Decode attention** (one query per head, batch 1, 32 query heads over 8 KV heads,
   head_dim 128, float32 query): ``nbkv.attention(q, cache, out=out)`` over a
   ``QuantizedKVCache`` of 8-bit and of 4-bit codes (dtype float16, group 64, residual
   128: the codes are dequantized block by block inside the kernel) against the same call
   over a float16 ``LayerKVCache`` holding the same positions, and a float32 one for
   reference. The headline size is 32768 positions; the sweep (1024 to 32768) shows where
   the codes start to pay for their dequantization as the context grows. Every contender
   is checked against ``nbkv.reference.attention`` (float64) over exactly what it holds
   (for the codes: :func:`nbkv.reference.quantized_kv`) before any timing (atol 1e-4);
   the quantization's own effect on the output (against float32 attention over the
   unrounded K/V) is printed beside it. Rounds call every contender once, in a fresh
   random order, each timed call preceded by an untimed one (which wakes the thread pool,
   as in a loop of decode steps) and followed by ``settle()`` (no thread of ours left
   spinning on a core the next contender needs). Each contender cycles through copies of
   its cache so that at least ``COLD_BYTES`` of its own are read between two reads of one
   copy: every timed call reads memory that is not in the CPU's caches, as a decode step
   through many layers does. A call during which our threads waited for a CPU for over
   ``WAIT_SHARE`` of its time (another job's) is left out, as in ``bench_attention.py``.
   Bytes read per call are counted from the storage (codes, scales, zero points, window).
   Targets at 32768: 8-bit at least 1.3x and 4-bit at least 1.5x faster than float16.

3. **The append** (quantize on write) into caches of capacity 32768 holding 4096
   positions: 1-position appends (a decode step; every 64th one quantizes a group of 64
   positions as it leaves the window, so the median, the mean and the appends that
   quantize are reported apart), then 512-position chunks, each against
   ``LayerKVCache.append`` (float16) of the same rows, in a fresh random order per step.

4. **JIT**: the first call of each kernel in this process (it may load from Numba's disk
   cache), and, in a full run, a compile in a fresh process with an empty cache
   directory. No timing above includes either.

Usage (from the repository root)::

    python benchmarks/bench_quantized.py                # full run, 2 to 3 minutes
    python benchmarks/bench_quantized.py --quick        # smoke run: 1024 and 4096 only
    python benchmarks/bench_quantized.py --json benchmarks/results/quantized-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _machine import machine  # noqa: E402  (this folder is on sys.path)
from bench_attention import (  # noqa: E402
    COLD_BYTES,
    EXTRA_ROUNDS,
    MIN_QUIET_SHARE,
    WAIT_SHARE,
    cpu_seconds,
    run_delay_ns,
    settle,
)

ROOT = Path(__file__).resolve().parents[1]
try:
    import nbkv
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
    import nbkv
from nbkv import reference  # noqa: E402

NOW = time.perf_counter_ns
MIB = 1 << 20
BATCH, HEADS, KV_HEADS, DIM = 1, 32, 8, 128
GROUP_SIZE, RESIDUAL = 64, 128
TARGET_SEQ = 32768
# seq_len: timed rounds (full, quick); a round calls every contender once
SIZES = {
    1024: (60, 8),
    2048: (60, 0),
    4096: (50, 6),
    8192: (40, 0),
    16384: (30, 0),
    32768: (40, 0),
}
CHECK_SIZES = (1024, 4096, 32768)  # checked against the float64 reference first
ATOL = 1e-4
WARMUP_ROUNDS = 2
SPEEDUP_TARGETS = {"8-bit": 1.3, "4-bit": 1.5}  # times faster than float16, at TARGET_SEQ
MEMORY_TARGETS = {8: 0.56, 4: 0.30}  # nbytes relative to float16, at most
# the append part: caches of capacity TARGET_SEQ holding PREFILL positions, then
# DECODE_APPENDS 1-position appends, then CHUNK_APPENDS chunks of CHUNK positions
PREFILL, CHUNK = 4096, 512
DECODE_APPENDS = {False: 1024, True: 128}
CHUNK_APPENDS = {False: 40, True: 4}


def quantized_nbytes(seq: int, heads: int, dim: int, bits: int, dtype_bytes: int = 2) -> int:
    """What ``QuantizedKVCache(seq, batch=1, num_kv_heads=heads, head_dim=dim, bits=bits,
    group_size=GROUP_SIZE, residual=RESIDUAL).nbytes`` allocates, from the storage's
    layout (:mod:`nbkv.kernels.cpu_quant`): codes for whole groups, a 16-bit scale and
    zero point per K channel per group and per V position per channel group, and a window
    of ``residual + group_size - 1`` rows in the cache's dtype, for K and for V."""
    g, gv = GROUP_SIZE, min(GROUP_SIZE, dim)
    coded = (seq // g) * g
    row = -(-dim // (8 // bits))  # bytes of one position's packed codes
    k = coded * row + 2 * 2 * (seq // g) * dim
    v = coded * row + 2 * 2 * coded * (dim // gv)
    window = max(1, min(seq, RESIDUAL + g - 1)) * dim * dtype_bytes
    return heads * (k + v + 2 * window)


def bytes_read(cache) -> int:
    """K/V bytes one decode attention call reads: every position held, as stored."""
    seq = cache.seq_len
    if isinstance(cache, nbkv.QuantizedKVCache):
        q, g, gv = cache.q_len, cache.group_size, min(cache.group_size, cache.head_dim)
        per = 0
        for b in cache.bits:
            per += q * -(-cache.head_dim // (8 // b))  # codes
        per += 2 * 2 * (q // g) * cache.head_dim  # K scales and zero points
        per += 2 * 2 * q * (cache.head_dim // gv)  # V scales and zero points
        per += 2 * (seq - q) * cache.head_dim * cache.dtype.itemsize  # the window
        return cache.batch * cache.num_kv_heads * per
    return 2 * cache.batch * cache.num_kv_heads * seq * cache.head_dim * cache.dtype.itemsize


def new_cache(kind: str, capacity: int):
    """An empty cache of one contender: "float32", "float16", "8-bit", "4-bit"."""
    sizes = dict(batch=BATCH, num_kv_heads=KV_HEADS, head_dim=DIM)
    if kind in ("float32", "float16"):
        return nbkv.LayerKVCache(capacity, dtype=kind, **sizes)
    return nbkv.QuantizedKVCache(
        capacity,
        dtype="float16",
        bits=int(kind.split("-")[0]),
        group_size=GROUP_SIZE,
        residual=RESIDUAL,
        **sizes,
    )


CONTENDERS = ("float32", "float16", "8-bit", "4-bit")


# -- 1. memory -----------------------------------------------------------------------


def memory_part() -> dict:
    seq = TARGET_SEQ
    sizes = dict(batch=BATCH, num_kv_heads=KV_HEADS, head_dim=DIM)
    f16 = nbkv.LayerKVCache(seq, dtype="float16", **sizes).nbytes
    f32 = nbkv.LayerKVCache(seq, dtype="float32", **sizes).nbytes
    out = {"shape": [BATCH, KV_HEADS, seq, DIM], "float16_nbytes": f16, "float32_nbytes": f32}
    rows = {}
    for bits in (8, 4, 2):
        cache = nbkv.QuantizedKVCache(
            seq, dtype="float16", bits=bits, group_size=GROUP_SIZE, residual=RESIDUAL, **sizes
        )
        formula = quantized_nbytes(seq, KV_HEADS, DIM, bits)
        if cache.nbytes != formula:
            raise SystemExit(f"{bits}-bit nbytes {cache.nbytes} != the formula's {formula}")
        rows[f"{bits}-bit"] = {
            "nbytes": cache.nbytes,
            "vs_float16": cache.nbytes / f16,
            "bits_per_value": 8 * cache.nbytes / (2 * KV_HEADS * seq * DIM),
        }
    out["quantized"] = rows
    print(
        f"memory: [{BATCH}, {KV_HEADS}, {seq}, {DIM}] K and V, capacity {seq}; group "
        f"{GROUP_SIZE}, residual {RESIDUAL} (window {RESIDUAL + GROUP_SIZE - 1} rows in float16)"
    )
    print(f"  {'cache':10s} {'nbytes':>13s} {'MiB':>8s} {'vs float16':>11s} {'bits/value':>11s}")
    print(f"  {'float32':10s} {f32:13,d} {f32 / MIB:8.2f} {f32 / f16:10.3f}x {32:11.2f}")
    print(f"  {'float16':10s} {f16:13,d} {f16 / MIB:8.2f} {1:10.3f}x {16:11.2f}")
    for name, r in rows.items():
        print(
            f"  {name:10s} {r['nbytes']:13,d} {r['nbytes'] / MIB:8.2f} {r['vs_float16']:10.3f}x "
            f"{r['bits_per_value']:11.2f}"
        )
    print("  (nbytes: every buffer allocated; equal to the storage formula for every row)")
    return out


# -- 2. decode attention -------------------------------------------------------------


def filled_caches(seq: int, rng) -> tuple[dict, dict]:
    """name -> one cache holding ``seq`` random positions; and the data they hold."""
    shape = (BATCH, KV_HEADS, seq, DIM)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    caches = {}
    for kind in CONTENDERS:
        cache = new_cache(kind, seq)
        cache.append(*((k, v) if kind == "float32" else (k16, v16)))
        caches[kind] = cache
    return caches, {"k": k, "v": v, "k16": k16, "v16": v16}


def check(caches: dict, data: dict, q: np.ndarray) -> dict:
    """Each contender against float64 attention over what it holds; and the output's
    distance from float32 attention over the unrounded K/V (the storage's own effect)."""
    exact = reference.attention(q, data["k"], data["v"])
    k16, v16 = data["k16"].astype(np.float32), data["v16"].astype(np.float32)
    out = {}
    for name, cache in caches.items():
        if name == "float32":
            held = data["k"], data["v"]
        elif name == "float16":
            held = k16, v16
        else:
            held = reference.quantized_kv(
                k16, v16, cache.q_len, bits=cache.bits, group_size=cache.group_size
            )
        want = reference.attention(q, *held)
        got = nbkv.attention(q, cache).astype(np.float64)
        err = float(np.abs(got - want).max())
        if not err <= ATOL:
            raise SystemExit(
                f"{name} attention is wrong at seq_len {cache.seq_len} (max |err| {err:.3g} "
                "against the float64 reference); no timing is worth reporting"
            )
        drift = float(np.abs(got - exact).max())
        out[name] = {"max_abs_err": err, "vs_unrounded_max_abs": drift}
    out["output_max_abs"] = float(np.abs(exact).max())
    return out


def time_rounds(methods: dict, rounds: int, rng) -> tuple[dict, int]:
    """methods: name -> (copies, call(copy)). Per name, the ns and CPU-wait ns of each
    timed call; rounds continue (up to EXTRA_ROUNDS times) until every name has enough
    undisturbed calls."""
    names = list(methods)
    times = {n: [] for n in names}
    waited = {n: [] for n in names}
    turn = dict.fromkeys(names, 0)

    def quiet(n):
        return sum(w <= WAIT_SHARE * t for t, w in zip(times[n], waited[n], strict=True))

    settle()
    r = 0
    while r < WARMUP_ROUNDS + rounds or (
        r < WARMUP_ROUNDS + EXTRA_ROUNDS * rounds
        and min(quiet(n) for n in names) < MIN_QUIET_SHARE * rounds
    ):
        for j in rng.permutation(len(names)):
            name = names[j]
            copies, call = methods[name]
            call(copies[turn[name] % len(copies)])  # untimed: wakes the thread pool
            c = copies[(turn[name] + 1) % len(copies)]
            turn[name] += 2
            w0, t0 = run_delay_ns(), NOW()
            call(c)
            t1, w1 = NOW(), run_delay_ns()
            settle()
            if r >= WARMUP_ROUNDS:
                times[name].append(t1 - t0)
                waited[name].append(w1 - w0)
        r += 1
    return {n: (times[n], waited[n]) for n in names}, r - WARMUP_ROUNDS


def summary(times, waited, rounds: int, nbytes: int | None = None) -> dict:
    """Median, p10, p90 (us) of the undisturbed calls (of all when too few)."""
    t_all = np.asarray(times, dtype=np.float64)
    quiet = np.asarray(waited) <= WAIT_SHARE * t_all
    enough = quiet.sum() >= MIN_QUIET_SHARE * rounds
    t = t_all[quiet] if enough else t_all
    med = float(np.median(t))
    out = {
        "us": med / 1e3,
        "us_p10": float(np.percentile(t, 10)) / 1e3,
        "us_p90": float(np.percentile(t, 90)) / 1e3,
        "calls": len(t),
        "calls_timed": len(t_all),
        "undisturbed_only": bool(enough),
        "disturbed_share": float(1.0 - quiet.mean()),
        "us_all_calls": float(np.median(t_all)) / 1e3,
    }
    if nbytes is not None:
        out["bytes_read"] = nbytes
        out["gb_per_s"] = nbytes / med  # bytes per ns = GB/s
    return out


def attention_size(seq: int, rounds: int, rng) -> dict:
    t_start = time.perf_counter()
    caches, data = filled_caches(seq, rng)
    q = rng.standard_normal((BATCH, HEADS, 1, DIM), dtype=np.float32)
    checked = check(caches, data, q) if seq in CHECK_SIZES else None
    del data
    out = np.empty_like(q)
    methods, case = {}, {"seq_len": seq, "copies": {}, "checked": checked}
    for name, cache in caches.items():
        nbytes = bytes_read(cache)
        n = max(2, -(-COLD_BYTES // nbytes) + 1)
        copies = [cache] + [cache.copy() for _ in range(n - 1)]
        case["copies"][name] = n
        methods[name] = (copies, lambda c: nbkv.attention(q, c, out=out))
    del caches
    samples, done = time_rounds(methods, rounds, rng)
    res = {}
    for name, (copies, _) in methods.items():
        res[name] = summary(*samples[name], rounds, bytes_read(copies[0]))
        res[name]["q_len"] = getattr(copies[0], "q_len", 0)
    base = res["float16"]["us"]
    for m in res.values():
        m["time_vs_float16"] = m["us"] / base
        m["speedup_vs_float16"] = base / m["us"]
    case.update(rounds=done, wall_s=time.perf_counter() - t_start)
    return {"case": case, "methods": res}


def print_attention(results: dict) -> None:
    print(
        f"\ndecode attention: q [{BATCH}, {HEADS}, 1, {DIM}] float32 over K/V "
        f"[{BATCH}, {KV_HEADS}, S, {DIM}]; quantized: float16 window, group {GROUP_SIZE}, "
        f"residual {RESIDUAL}; each contender's copies cycled so that >= "
        f"{COLD_BYTES // MIB} MiB of its own are read between two reads of one"
    )
    head = (
        f"  {'seq_len':>7} {'cache':8s} {'us':>9s} {'p10':>9s} {'p90':>9s} {'MiB read':>9s} "
        f"{'GB/s':>6s} {'vs fp16':>8s} {'speedup':>8s} {'dist':>5s} {'calls':>7s}"
    )
    print(head)
    print("  " + "-" * (len(head) - 2))
    for r in results.values():
        seq = r["case"]["seq_len"]
        for name, m in r["methods"].items():
            calls = f"{m['calls']}/{m['calls_timed']}{'' if m['undisturbed_only'] else '*'}"
            print(
                f"  {seq:>7} {name:8s} {m['us']:9.1f} {m['us_p10']:9.1f} {m['us_p90']:9.1f} "
                f"{m['bytes_read'] / MIB:9.2f} {m['gb_per_s']:6.2f} "
                f"{m['time_vs_float16']:7.2f}x {m['speedup_vs_float16']:7.2f}x "
                f"{100 * m['disturbed_share']:4.0f}% {calls:>7s}"
            )
        c = r["case"]
        note = f"{c['rounds']} rounds, {c['wall_s']:.0f} s"
        if c["checked"]:
            errs = ", ".join(f"{n} {c['checked'][n]['max_abs_err']:.1e}" for n in r["methods"])
            drift = ", ".join(
                f"{n} {c['checked'][n]['vs_unrounded_max_abs']:.1e}" for n in r["methods"]
            )
            note += (
                f"; max |err| vs float64 over what each holds: {errs}; vs float32 over the "
                f"unrounded K/V (outputs up to {c['checked']['output_max_abs']:.2f}): {drift}"
            )
        print(f"  {'':7} ({note})")
    for line in (
        "us: median of the undisturbed calls; p10/p90 around it. MiB read: K/V bytes as",
        "stored (codes, scales, zero points, window). GB/s: those bytes per median time.",
        "vs fp16: time relative to the float16 cache; speedup: float16's time over this one's.",
        "dist: calls disturbed (our threads waited for a CPU > 5% of the call). calls:",
        "undisturbed/timed; * every call counted (too few undisturbed).",
    ):
        print(f"  {line}")


# -- 3. the append -------------------------------------------------------------------


def append_part(quick: bool, rng) -> dict:
    names = ("float16", "8-bit", "4-bit")
    n_dec, n_chunk = DECODE_APPENDS[quick], CHUNK_APPENDS[quick]
    caches = {n: new_cache(n, TARGET_SEQ) for n in names}
    shape = (BATCH, KV_HEADS, PREFILL, DIM)
    k0 = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    v0 = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    for c in caches.values():
        c.append(k0, v0)
    del k0, v0

    def rows(n):
        x = rng.standard_normal((BATCH, KV_HEADS, n, DIM), dtype=np.float32)
        return x.astype(np.float16)

    # decode: 1-position appends, all contenders per step in a fresh random order
    steps = [(rows(1), rows(1)) for _ in range(n_dec)]
    for c in caches.values():  # one untimed append each: first touch of the window
        c.append(*steps[0])
    times = {n: [] for n in names}
    waited = {n: [] for n in names}
    quantized = {n: [] for n in names}  # did this append quantize a group?
    settle()
    for k, v in steps:
        for j in rng.permutation(len(names)):
            name = names[j]
            c = caches[name]
            q0 = getattr(c, "q_len", 0)
            w0, t0 = run_delay_ns(), NOW()
            c.append(k, v)
            t1, w1 = NOW(), run_delay_ns()
            times[name].append(t1 - t0)
            waited[name].append(w1 - w0)
            quantized[name].append(getattr(c, "q_len", 0) != q0)
    decode = {}
    for name in names:
        t = np.asarray(times[name], dtype=np.float64)
        quiet = np.asarray(waited[name]) <= WAIT_SHARE * t
        qz = np.asarray(quantized[name])
        s = summary(times[name], waited[name], n_dec)
        s["us_mean"] = float(t[quiet].mean() if quiet.any() else t.mean()) / 1e3
        s["appends_quantizing"] = int(qz.sum())
        s["us_median_quantizing"] = float(np.median(t[qz])) / 1e3 if qz.any() else None
        s["us_median_window_only"] = float(np.median(t[~qz])) / 1e3
        decode[name] = s
    for s in decode.values():
        s["median_vs_float16"] = s["us"] / decode["float16"]["us"]
        s["mean_vs_float16"] = s["us_mean"] / decode["float16"]["us_mean"]

    # chunks of CHUNK positions
    chunks = [(rows(CHUNK), rows(CHUNK)) for _ in range(4)]
    times = {n: [] for n in names}
    waited = {n: [] for n in names}
    for i in range(n_chunk):
        k, v = chunks[i % len(chunks)]
        settle()
        for j in rng.permutation(len(names)):
            name = names[j]
            w0, t0 = run_delay_ns(), NOW()
            caches[name].append(k, v)
            t1, w1 = NOW(), run_delay_ns()
            times[name].append(t1 - t0)
            waited[name].append(w1 - w0)
    chunk = {name: summary(times[name], waited[name], n_chunk) for name in names}
    for s in chunk.values():
        s["ns_per_position"] = s["us"] * 1e3 / CHUNK
        s["time_vs_float16"] = s["us"] / chunk["float16"]["us"]
    held = {n: c.seq_len for n, c in caches.items()}
    assert len(set(held.values())) == 1, held

    print(
        f"\nappend: caches [{BATCH}, {KV_HEADS}, {TARGET_SEQ}, {DIM}] float16 (quantized: group "
        f"{GROUP_SIZE}, residual {RESIDUAL}) holding {PREFILL} positions; K and V, float16 rows"
    )
    print(f"  decode, {n_dec} appends of 1 position each:")
    print(
        f"  {'cache':8s} {'median us':>10s} {'p10':>7s} {'p90':>7s} {'mean us':>8s} "
        f"{'quantizing':>10s} {'us each':>8s} {'median vs fp16':>15s} {'mean vs fp16':>13s}"
    )
    for name, s in decode.items():
        each = s["us_median_quantizing"]
        print(
            f"  {name:8s} {s['us']:10.2f} {s['us_p10']:7.2f} {s['us_p90']:7.2f} "
            f"{s['us_mean']:8.2f} {s['appends_quantizing']:10d} "
            f"{'-' if each is None else f'{each:.1f}':>8s} {s['median_vs_float16']:14.2f}x "
            f"{s['mean_vs_float16']:12.2f}x"
        )
    print(
        "  (quantizing: appends that quantized a group of 64 leaving the window, and their\n"
        "  median; mean: per append over all, so the groups' cost amortized per token)"
    )
    print(f"  chunks of {CHUNK} positions, {n_chunk} appends:")
    print(
        f"  {'cache':8s} {'median us':>10s} {'p10':>9s} {'p90':>9s} {'ns/pos':>7s} {'vs fp16':>8s}"
    )
    for name, s in chunk.items():
        print(
            f"  {name:8s} {s['us']:10.1f} {s['us_p10']:9.1f} {s['us_p90']:9.1f} "
            f"{s['ns_per_position']:7.1f} {s['time_vs_float16']:7.2f}x"
        )
    return {
        "capacity": TARGET_SEQ,
        "prefill": PREFILL,
        "decode": decode,
        "chunk_positions": CHUNK,
        "chunk": chunk,
    }


# -- 4. JIT --------------------------------------------------------------------------

# 1024 positions: enough work for the parallel kernel (nbkv.tunables ATTENTION_PARALLEL_MIN)
JIT_SEQ = 1024
_FRESH = f"""
import time, numpy as np, nbkv
c = nbkv.QuantizedKVCache({JIT_SEQ}, batch=1, num_kv_heads=8, head_dim=128, dtype="float16",
                          bits=4, group_size=64, residual=128)
x = np.ones((1, 8, {JIT_SEQ}, 128), np.float16)
q = np.ones((1, 32, 1, 128), np.float32)
t0 = time.perf_counter(); c.append(x, x); t1 = time.perf_counter()
nbkv.attention(q, c); t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def jit_part(fresh: bool) -> dict:
    """First calls here (small caches: the time is the compile, or the load from Numba's
    disk cache), and a compile in a fresh process with an empty cache directory."""
    from nbkv.kernels import cpu_quant

    kernels = (cpu_quant.quant_append, cpu_quant.attend_quant)

    def hits():
        return sum(sum(k.stats.cache_hits.values()) for k in kernels)

    def misses():
        return sum(sum(k.stats.cache_misses.values()) for k in kernels)

    h0, m0 = hits(), misses()
    out = {}
    x = np.ones((BATCH, KV_HEADS, JIT_SEQ, DIM), np.float16)
    q = np.ones((BATCH, HEADS, 1, DIM), np.float32)
    for kind in ("float16", "8-bit", "4-bit"):
        c = new_cache(kind, JIT_SEQ)
        t0 = time.perf_counter()
        c.append(x, x)
        t1 = time.perf_counter()
        nbkv.attention(q, c)
        t2 = time.perf_counter()
        out[kind] = {"first_append_s": t1 - t0, "first_attention_s": t2 - t1}
    out["quant_kernels_loaded_from_disk_cache"] = hits() - h0
    out["quant_kernels_compiled"] = misses() - m0
    out["attend_quant_signatures"] = len(cpu_quant.attend_quant.signatures)
    out["fresh_compile_s"] = None
    if fresh:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, NUMBA_CACHE_DIR=tmp, PYTHONPATH=str(ROOT))
            done = subprocess.run(
                [sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, check=True
            )
        a, b = (float(s) for s in done.stdout.split()[-2:])
        out["fresh_compile_s"] = {"quantized_append": a, "quantized_attention": b}
    print(f"JIT (in no timing): first calls in this process, caches of {JIT_SEQ} positions")
    for kind in ("float16", "8-bit", "4-bit"):
        r = out[kind]
        print(
            f"  {kind:8s} append {r['first_append_s']:.3f} s, attention "
            f"{r['first_attention_s']:.3f} s"
        )
    print(
        f"  quantized kernels (quant_append, attend_quant): "
        f"{out['quant_kernels_loaded_from_disk_cache']} loaded from Numba's disk cache, "
        f"{out['quant_kernels_compiled']} compiled; attend_quant specialisations after the "
        f"8-bit and 4-bit calls: {out['attend_quant_signatures']} (bits are run-time ints)"
    )
    if fresh:
        f = out["fresh_compile_s"]
        print(
            f"  fresh process, empty cache dir: quantized append {f['quantized_append']:.1f} s, "
            f"attention {f['quantized_attention']:.1f} s (compile included)"
        )
    else:
        print("  (the fresh-process compile is measured in a full run only)")
    return out


# -- the run -------------------------------------------------------------------------


def targets(results: dict) -> list[tuple[str, bool | None, str]]:
    goals = []
    mem = results["memory"]["quantized"]
    for bits, most in MEMORY_TARGETS.items():
        r = mem[f"{bits}-bit"]["vs_float16"]
        goals.append((f"{bits}-bit nbytes at 32k <= {most}x float16", r <= most, f"{r:.3f}x"))
    att = results["attention"].get(str(TARGET_SEQ))
    for name, least in SPEEDUP_TARGETS.items():
        what = f"{name} decode attention at {TARGET_SEQ} >= {least}x faster than float16"
        if att is None:
            goals.append((what, None, "not run (--quick)"))
            continue
        m = att["methods"][name]
        goals.append((what, m["speedup_vs_float16"] >= least, f"{m['speedup_vs_float16']:.2f}x"))
    return goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq_len 1024 and 4096, few rounds")
    parser.add_argument("--json", help="write the results and machine info here")
    args = parser.parse_args()
    info = machine()
    import numba

    print(
        f"{info['cpu']} ({info['cpu_count']} cpus, L3 {info['l3_cache']}), {info['platform']}\n"
        f"python {info['python']}, numpy {info['numpy']}, numba {info['numba']} "
        f"({info['numba_threads']} threads), nbkv {info['nbkv']}"
    )
    if info["git"]:
        changed = ", ".join(x.split()[-1] for x in info["git"]["nbkv_changed"]) or "none"
        print(f"nbkv at commit {info['git']['commit'][:12]}; changed since, in nbkv/: {changed}")
    print()
    results = {"jit": jit_part(fresh=not args.quick)}
    info["numba_threading_layer"] = numba.threading_layer()
    print()
    results["memory"] = memory_part()
    rng = np.random.default_rng(0)
    col = 1 if args.quick else 0
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    att = {}
    for seq, rounds in SIZES.items():
        if rounds[col]:
            att[str(seq)] = attention_size(seq, rounds[col], rng)
    results["attention"] = att
    cpu1 = cpu_seconds()
    if cpu0 is not None and cpu1 is not None:
        other = max(0.0, (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / (time.perf_counter() - t0)
        results["other_jobs_cpus_during_attention"] = other
    print_attention(att)
    if "other_jobs_cpus_during_attention" in results:
        print(
            f"  other jobs used {results['other_jobs_cpus_during_attention']:.2f} of "
            f"{os.cpu_count()} CPUs on average meanwhile"
        )
    results["append"] = append_part(args.quick, rng)
    goals = targets(results)
    results["targets"] = [{"target": w, "pass": ok, "figure": f} for w, ok, f in goals]
    print("\ntargets:")
    for what, ok, figure in goals:
        print(f"{'SKIP' if ok is None else 'PASS' if ok else 'MISS'}  {what}: {figure}")
    crossover = [
        int(s)
        for s, r in att.items()
        if r["methods"]["8-bit"]["speedup_vs_float16"] >= 1
        or r["methods"]["4-bit"]["speedup_vs_float16"] >= 1
    ]
    results["quantized_faster_than_float16_at"] = crossover
    print(
        "quantized faster than float16 at seq_len: "
        + (", ".join(map(str, crossover)) if crossover else "none measured")
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"machine": info, "quick": args.quick, "results": results}
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
