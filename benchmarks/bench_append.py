"""Benchmark: appending K/V into a preallocated cache, nbkv beside its peers.

Cases (float32, layout "bhsd"):

- decode:  single-position appends into [1, 8, 4096, 128] K and V buffers;
- prefill: 2048-position appends into [1, 8, 4096, 128];
- batch:   512-position appends into [8, 8, 1024, 128].

Methods, measured side by side in one run, in a fresh random order each round:

- nbkv API:       ``LayerKVCache.append(k, v)`` from Python (``clear()`` before it would
                  overflow);
- nbkv @njit:     ``nbkv.kernels.write_kv`` called from a user ``@njit`` loop over the
                  round's appends (per-append time = loop time / appends);
- NumPy slice:    ``K[:, :, pos:pos + n] = k`` (and V), cursor advanced by hand;
- torch index_copy_: ``K.index_copy_(2, positions, k)`` on torch tensors (as
                  transformers' StaticCache does), if torch is importable;
- np.concatenate: growth by ``K = np.concatenate([K, k], axis=2)``;
- plain copy:     ``np.copyto`` of k and v into a preallocated array of their own shape:
                  the same bytes with no cache around them, the bandwidth peer.

Positions advance as in a real decoding loop and every method writes the same positions
per round. Decode rounds are 256 appends timed as one block. Bytes counted per append:
K and V written, ``2 * numel * itemsize`` of the new data (the plain copy counts the same;
np.concatenate moves far more than it is credited with). The JIT compile time of nbkv's
kernel is reported separately and is in no timing.

Usage (from the repository root)::

    python benchmarks/bench_append.py            # full run, about half a minute
    python benchmarks/bench_append.py --quick    # smoke run
    python benchmarks/bench_append.py --json results.json
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
from numba import njit

ROOT = Path(__file__).resolve().parents[1]
try:
    import nbkv
    import nbkv.kernels
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
    import nbkv
    import nbkv.kernels
write_kv = nbkv.kernels.write_kv

try:
    import torch
except ImportError:
    torch = None

DTYPE = np.dtype(np.float32)
NOW = time.perf_counter_ns

# name, buffer shape [batch, num_kv_heads, max_seq_len, head_dim], positions per append,
# appends per timed round, rounds (full, quick), np.concatenate rounds (full, quick)
CASES = (
    ("decode", (1, 8, 4096, 128), 1, 256, (600, 20), (9, 2)),
    ("prefill", (1, 8, 4096, 128), 2048, 1, (300, 6), (300, 6)),
    ("batch", (8, 8, 1024, 128), 512, 1, (150, 6), (150, 6)),
)


@njit
def append_loop(ks, vs, pos, k_cache, v_cache):
    """Write ks[t], vs[t] (each [batch, heads, n, head_dim]) at pos + t * n, for every t."""
    n = ks.shape[3]
    for t in range(ks.shape[0]):
        write_kv(ks[t], vs[t], pos + t * n, k_cache, v_cache)


class Method:
    """One way of appending. ``run`` times a round; ``prepare`` (untimed) makes room."""

    def __init__(self, shape, ks, vs):
        self.cap, self.ks, self.vs = shape[2], ks, vs
        self.n, self.per_round = ks.shape[3], ks.shape[0]
        self.k_list, self.v_list = list(ks), list(vs)  # one contiguous array per append
        self.pos = 0  # start of the next round
        self.start = 0  # start of the last round

    def prepare(self) -> None:
        if self.pos + self.n * self.per_round > self.cap:
            self.pos = 0
            self.reset()
        self.start = self.pos

    def reset(self) -> None:
        pass

    def run(self) -> int:
        t0 = NOW()
        self.append_round()
        t1 = NOW()
        self.pos += self.n * self.per_round
        return t1 - t0

    def written(self):
        """K and V of the last round's positions, as NumPy arrays."""
        s = slice(self.start, self.start + self.n * self.per_round)
        return self.K[:, :, s], self.V[:, :, s]


class NbkvAPI(Method):
    name = "nbkv API"

    def __init__(self, shape, ks, vs):
        super().__init__(shape, ks, vs)
        b, h, cap, d = shape
        self.cache = nbkv.LayerKVCache(cap, batch=b, num_kv_heads=h, head_dim=d, dtype=DTYPE)

    def reset(self):
        self.cache.clear()

    def append_round(self):
        cache = self.cache
        for k, v in zip(self.k_list, self.v_list, strict=True):
            cache.append(k, v)

    def written(self):
        K, V = self.cache.get_kv()
        s = slice(self.start, self.start + self.n * self.per_round)
        return K[:, :, s], V[:, :, s]


class NbkvNjit(Method):
    name = "nbkv @njit"

    def __init__(self, shape, ks, vs):
        super().__init__(shape, ks, vs)
        self.K, self.V = np.empty(shape, DTYPE), np.empty(shape, DTYPE)

    def append_round(self):
        append_loop(self.ks, self.vs, self.pos, self.K, self.V)


class NumpySlice(Method):
    name = "NumPy slice"

    def __init__(self, shape, ks, vs):
        super().__init__(shape, ks, vs)
        self.K, self.V = np.empty(shape, DTYPE), np.empty(shape, DTYPE)

    def append_round(self):
        K, V, n, pos = self.K, self.V, self.n, self.pos
        for k, v in zip(self.k_list, self.v_list, strict=True):
            K[:, :, pos : pos + n] = k
            V[:, :, pos : pos + n] = v
            pos += n


class TorchIndexCopy(Method):
    name = "torch index_copy_"

    def __init__(self, shape, ks, vs):
        super().__init__(shape, ks, vs)
        self.Kt, self.Vt = torch.empty(shape), torch.empty(shape)
        self.kt = [torch.from_numpy(k) for k in self.k_list]  # no copy
        self.vt = [torch.from_numpy(v) for v in self.v_list]
        # the position tensors a model passes in (cache_position), built beforehand
        self.index = [torch.arange(p, p + self.n) for p in range(0, self.cap, self.n)]

    def append_round(self):
        Kt, Vt, n, index, pos = self.Kt, self.Vt, self.n, self.index, self.pos
        for k, v in zip(self.kt, self.vt, strict=True):
            i = index[pos // n]
            Kt.index_copy_(2, i, k)
            Vt.index_copy_(2, i, v)
            pos += n

    def written(self):
        s = slice(self.start, self.start + self.n * self.per_round)
        return self.Kt[:, :, s].numpy(), self.Vt[:, :, s].numpy()


class Concatenate(Method):
    name = "np.concatenate"

    def __init__(self, shape, ks, vs, pinned: int | None = None):
        super().__init__(shape, ks, vs)
        self.pinned = pinned
        b, h, _, d = shape
        self.K0 = np.full((b, h, pinned or 0, d), 0.5, DTYPE)
        self.reset()

    def reset(self):
        self.K, self.V = self.K0.copy(), self.K0.copy()

    def prepare(self):
        if self.pinned is not None:
            # decode: every round grows from the same seq_len (see main's note), in
            # freshly allocated arrays as a decode loop would have them
            self.pos = self.pinned
            self.reset()
        super().prepare()

    def append_round(self):
        K, V = self.K, self.V
        for k, v in zip(self.k_list, self.v_list, strict=True):
            K = np.concatenate([K, k], axis=2)
            V = np.concatenate([V, v], axis=2)
        self.K, self.V = K, V


class PlainCopy(Method):
    name = "plain copy"

    def __init__(self, shape, ks, vs):
        super().__init__(shape, ks, vs)
        self.dk, self.dv = np.empty_like(ks[0]), np.empty_like(vs[0])

    def append_round(self):
        dk, dv = self.dk, self.dv
        for k, v in zip(self.k_list, self.v_list, strict=True):
            np.copyto(dk, k)
            np.copyto(dv, v)

    def written(self):
        return self.dk, self.dv


def check(methods, ks, vs) -> None:
    """Each method's last round holds exactly the new data (printed before any timing)."""
    want_k, want_v = np.concatenate(list(ks), axis=2), np.concatenate(list(vs), axis=2)
    for m in methods:
        got_k, got_v = m.written()
        if isinstance(m, PlainCopy):
            ok = np.array_equal(got_k, ks[-1]) and np.array_equal(got_v, vs[-1])
        else:
            ok = np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)
        if not ok:
            raise SystemExit(f"{m.name} wrote wrong data; no timing is worth reporting")


def bench_case(name, shape, n, per_round, rounds, concat_rounds, warmup, rng):
    b, h, cap, d = shape
    ks = (rng.standard_normal((per_round, b, h, n, d), dtype=np.float32) + 0.5).astype(DTYPE)
    vs = (rng.standard_normal(ks.shape, dtype=np.float32) + 0.5).astype(DTYPE)
    pinned = cap // 2 - n * per_round // 2 if per_round > 1 else None
    kinds = [NbkvAPI, NbkvNjit, NumpySlice, TorchIndexCopy, Concatenate, PlainCopy]
    methods = []
    for kind in kinds:
        if kind is TorchIndexCopy and torch is None:
            continue
        methods.append(
            Concatenate(shape, ks, vs, pinned) if kind is Concatenate else kind(shape, ks, vs)
        )
    # warm up: first calls, and one pass over the whole capacity so that no timed round
    # pays for first-touch page faults (np.empty buffers are mapped lazily)
    sweep = -(-cap // (n * per_round))
    for m in methods:
        for _ in range(1 if isinstance(m, Concatenate) else max(warmup, sweep)):
            m.prepare()
            m.run()
    check(methods, ks, vs)
    times = {m.name: [] for m in methods}
    stride = max(1, rounds // concat_rounds)
    for r in range(rounds):
        for j in rng.permutation(len(methods)):
            m = methods[j]
            if isinstance(m, Concatenate) and (r % stride or r // stride >= concat_rounds):
                continue
            m.prepare()
            times[m.name].append(m.run())
    nbytes = 2 * ks[0].size * DTYPE.itemsize  # K and V of one append
    res = {}
    for m in methods:
        t = np.asarray(times[m.name], dtype=np.float64) / per_round  # ns per append
        med = float(np.median(t))
        res[m.name] = {
            "us_per_append": med / 1e3,
            "us_p10": float(np.percentile(t, 10)) / 1e3,
            "us_p90": float(np.percentile(t, 90)) / 1e3,
            "gb_per_s": nbytes / med,  # bytes per ns = GB/s
            "rounds": len(t),
        }
    for r in res.values():
        r["time_vs_numpy_slice"] = r["us_per_append"] / res["NumPy slice"]["us_per_append"]
        r["time_vs_plain_copy"] = r["us_per_append"] / res["plain copy"]["us_per_append"]
    info = {
        "buffer_shape": list(shape),
        "positions_per_append": n,
        "appends_per_round": per_round,
        "bytes_per_append": nbytes,
        "concatenate_seq_len": None if pinned is None else [pinned, pinned + n * per_round],
    }
    return {"case": info, "methods": res}


def compile_times() -> dict:
    """First call of write_kv here, and a true compile in a fresh process and cache dir."""
    a = np.ones((1, 8, 4, 128), DTYPE)
    before = sum(write_kv.stats.cache_hits.values())
    t0 = NOW()
    write_kv(a[:, :, :1].copy(), a[:, :, :1].copy(), 0, a, a.copy())
    first = (NOW() - t0) / 1e9
    loaded = sum(write_kv.stats.cache_hits.values()) > before
    code = (
        "import time, numpy as np; from nbkv.kernels import write_kv; "
        "a = np.ones((1, 8, 4, 128), np.float32); t = time.perf_counter(); "
        "write_kv(a[:, :, :1].copy(), a[:, :, :1].copy(), 0, a, a.copy()); "
        "print(time.perf_counter() - t)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, NUMBA_CACHE_DIR=tmp, PYTHONPATH=str(ROOT))
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
    ks = np.ones((2, 1, 8, 1, 128), DTYPE)
    t0 = NOW()
    append_loop(ks, ks, 0, a.copy(), a.copy())
    loop = (NOW() - t0) / 1e9
    return {
        "write_kv_first_call_s": first,
        "write_kv_first_call_from_disk_cache": loaded,
        "write_kv_fresh_compile_s": float(out.stdout.split()[-1]),
        "user_njit_loop_first_call_s": loop,
    }


def report(results: dict) -> list[tuple[str, bool, str]]:
    head = (
        f"{'case':<8} {'method':<18} {'us/append':>10} {'p10':>9} {'p90':>9} {'GB/s':>7} "
        f"{'vs slice':>9} {'vs copy':>8} {'rounds':>6}"
    )
    print(head)
    print("-" * len(head))
    for case, r in results.items():
        for name, m in r["methods"].items():
            print(
                f"{case:<8} {name:<18} {m['us_per_append']:>10.2f} {m['us_p10']:>9.2f} "
                f"{m['us_p90']:>9.2f} {m['gb_per_s']:>7.2f} {m['time_vs_numpy_slice']:>8.2f}x "
                f"{m['time_vs_plain_copy']:>7.2f}x {m['rounds']:>6}"
            )
    print("(us/append: median; vs slice / vs copy: time relative to NumPy slice / plain copy,")
    print(" below 1 is faster; GB/s from K+V bytes of the new data)")
    dec, pre = results["decode"]["methods"], results["prefill"]["methods"]
    share = pre["nbkv API"]["gb_per_s"] / pre["plain copy"]["gb_per_s"]
    api, sl = dec["nbkv API"]["us_per_append"], dec["NumPy slice"]["us_per_append"]
    speedup = sl / dec["nbkv @njit"]["us_per_append"]
    return [
        ("prefill: nbkv API >= 90% of plain copy GB/s", share >= 0.9, f"{share:.1%}"),
        (
            "decode: nbkv API append no slower than NumPy slice",
            api <= sl,
            f"{api:.2f} us vs {sl:.2f} us ({api / sl:.2f}x the time)",
        ),
        ("decode: @njit path >= 5x faster than NumPy slice", speedup >= 5, f"{speedup:.1f}x"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repeats, for a smoke run")
    parser.add_argument("--json", metavar="PATH", help="write results and machine info here")
    args = parser.parse_args()
    info = machine(torch)
    print(f"{info['cpu']} ({info['cpu_count']} cpus), {info['platform']}")
    print(
        f"python {info['python']}, numpy {info['numpy']}, numba {info['numba']}, "
        f"nbkv {info['nbkv']}, torch {info['torch'] or 'not installed'}"
        + (f" ({info['torch_threads']} threads)" if torch is not None else "")
    )
    if torch is None:
        print("note: torch is not importable; the torch index_copy_ column is skipped")
    jit = compile_times()
    print(
        f"JIT: write_kv first call {jit['write_kv_first_call_s']:.3f} s "
        f"({'loaded from disk cache' if jit['write_kv_first_call_from_disk_cache'] else 'compiled'}"
        f"), fresh compile in a new process {jit['write_kv_fresh_compile_s']:.3f} s, "
        f"user @njit loop first call {jit['user_njit_loop_first_call_s']:.3f} s (in no timing)"
    )
    q = 1 if args.quick else 0
    rng = np.random.default_rng(0)
    results = {}
    for name, shape, n, per_round, rounds, concat_rounds in CASES:
        t0 = time.perf_counter()
        results[name] = bench_case(
            name, shape, n, per_round, rounds[q], concat_rounds[q], 2 - q, rng
        )
        pinned = results[name]["case"]["concatenate_seq_len"]
        extra = f"; np.concatenate grows seq_len {pinned[0]}->{pinned[1]}" if pinned else ""
        print(
            f"{name}: {shape}, {n}-position appends, {per_round} per round, checked "
            f"correct{extra} ({time.perf_counter() - t0:.1f} s)"
        )
    print()
    targets = report(results)
    print()
    for what, ok, figure in targets:
        print(f"{'PASS' if ok else 'MISS'}  {what}: {figure}")
    if args.json:
        payload = {
            "machine": info,
            "jit": jit,
            "results": results,
            "targets": [{"target": w, "pass": ok, "figure": f} for w, ok, f in targets],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
