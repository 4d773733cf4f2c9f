"""Beam reorder: nbkv's in-place ``reorder`` against NumPy fancy-index assignment.

Cache ``[8, 8, 4096, 128]`` float32 (K and V, every position held; 256 MiB together).
Two reorders, each measured for both methods in the same run, in alternating order:

- beams: ``[0, 0, 1, 1, 2, 2, 3, 3]`` (rows repeat; no cycle, no scratch row);
- reverse: ``[7, 6, ..., 0]`` (four swaps: cycles, each broken by nbkv's scratch row).

Reported per method: median time after warm-up, GB/s from the bytes moved (rows whose
content changes, read and written, K and V), and the peak extra host memory the call
needs (tracemalloc): NumPy's ``K[:] = K[idx]`` builds a full temporary copy first, nbkv
at most one batch row. Usage: ``python benchmarks/bench_reorder.py [--quick] [--json P]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
try:
    import nbkv
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
    import nbkv

from _machine import machine  # noqa: E402  (this folder is on sys.path)

CASES = {"beams": [0, 0, 1, 1, 2, 2, 3, 3], "reverse": [7, 6, 5, 4, 3, 2, 1, 0]}


def peak_extra(call) -> int:
    """Bytes of host memory allocated at the peak of ``call`` beyond what it returns."""
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="[8, 8, 512, 128], few repeats")
    parser.add_argument("--json", help="write the results and machine info here")
    args = parser.parse_args()
    seq = 512 if args.quick else 4096
    repeats = 5 if args.quick else 15
    shape = (8, 8, seq, 128)
    rng = np.random.default_rng(0)
    K = rng.standard_normal(shape, dtype=np.float32)
    V = rng.standard_normal(shape, dtype=np.float32)
    cache = nbkv.LayerKVCache(seq, batch=8, num_kv_heads=8, head_dim=128, dtype="float32")
    cache.append(K, V)
    Kn, Vn = K.copy(), V.copy()
    info = machine()
    row_bytes = 2 * int(np.prod(shape[1:])) * 4  # K and V of one batch row
    print(
        f"{info['cpu']} ({info['cpu_count']} cpus), numpy {info['numpy']}, "
        f"numba {info['numba']}, nbkv {info['nbkv']}"
    )
    print(f"cache {shape} float32, K+V {2 * K.nbytes / 2**20:.0f} MiB, every position held")
    results = {}
    for name, idx in CASES.items():
        # correctness first: both methods, from the same start, against a fancy index
        cache.clear()
        cache.append(K, V)
        Kn[:], Vn[:] = K, V
        want_k = K[idx]
        cache.reorder(idx)
        Kn[:] = Kn[idx]
        Vn[:] = Vn[idx]
        got_k = cache.get_kv()[0]
        assert np.array_equal(got_k, want_k) and np.array_equal(Kn, want_k), name
        moved = sum(1 for i, j in enumerate(idx) if i != j) * row_bytes * 2  # read + write
        times = {"nbkv reorder": [], "NumPy K[:] = K[idx]": []}

        def nbkv_call(idx=idx):
            cache.reorder(idx)

        def numpy_call(idx=idx):
            Kn[:] = Kn[idx]
            Vn[:] = Vn[idx]

        calls = {"nbkv reorder": nbkv_call, "NumPy K[:] = K[idx]": numpy_call}
        for call in calls.values():
            call()  # warm-up
        for r in range(repeats):
            order = list(calls) if r % 2 == 0 else list(calls)[::-1]
            for method in order:
                t0 = time.perf_counter_ns()
                calls[method]()
                times[method].append(time.perf_counter_ns() - t0)
        peaks = {m: peak_extra(c) for m, c in calls.items()}
        results[name] = {}
        print(f"\n{name} {idx}: {moved / 2**20:.0f} MiB moved (rows that change, read + written)")
        print(f"  {'method':22s} {'ms':>9s} {'GB/s':>7s} {'vs NumPy':>9s} {'peak extra':>11s}")
        base = float(np.median(times["NumPy K[:] = K[idx]"]))
        for method, ts in times.items():
            med = float(np.median(ts))
            gbs = moved / med if med else float("nan")
            results[name][method] = {
                "median_ms": med / 1e6,
                "p10_ms": float(np.percentile(ts, 10)) / 1e6,
                "p90_ms": float(np.percentile(ts, 90)) / 1e6,
                "gb_per_s": gbs,
                "vs_numpy": med / base,
                "peak_extra_bytes": peaks[method],
            }
            print(
                f"  {method:22s} {med / 1e6:9.2f} {gbs:7.2f} {med / base:8.2f}x "
                f"{peaks[method] / 2**20:9.1f} MiB"
            )
    print(
        "\n(median of",
        repeats,
        "calls after a warm-up; vs NumPy: time ratio, below 1 is "
        "faster; peak extra: tracemalloc peak beyond the arrays already held)",
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"machine": info, "shape": shape, "repeats": repeats, "results": results}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
