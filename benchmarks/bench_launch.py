"""The Python of a CUDA kernel launch, on any machine: numba-cuda's marshalling of a
launch's arguments against nbkv's prepared parameter list (:mod:`nbkv.cuda_launch`).

numba-cuda turns every argument into the kernel's flat parameter list on every launch (a
4-D array: 13 parameters, each through a chain of Python calls); nbkv prepares the list
once per launch signature and fills in the pointers and scalars. Both run here on Numba
device arrays over fake device memory (:mod:`nbkv.cuda_offline`: a pointer with nothing
behind it; no GPU is touched, so this runs anywhere numba-cuda is installed), with the
arguments nbkv passes in one layer's decode step: 32 query / 8 KV heads, head_dim 128,
float16 cache of 4,096 positions, float32 queries. Three launches:

- "attention": the attention kernel: q, K, V, seq_len, scale, causal, window, table,
  three scratch arrays, out (8 arrays, 4 scalars: 102 parameters);
- "append_and_attend": the fused kernel, the new K/V rows and the position besides (10
  arrays, 128 parameters);
- "append": the row-copy kernel: k, v, pos, K, V (53 parameters).

Contenders, per launch: "numba" (``_Kernel._prepare_args`` over every argument, as
numba-cuda 0.30's launch does) and "prepared" (``PreparedLaunch.parameters``). Each call
gets new array objects for what a decode step makes anew (q and the new rows; the cache,
scratch and out are kept), made outside the timer, so that Numba's per-array work that it
caches on an array object is counted as a decode step pays it. Before timing, the two
lists are checked equal. Left out of both (the same for both): ``cuda.core``'s launch
(its packing of the list, the driver call) and nbkv's Python before the launch
(``bench_host.py`` on a CPU; ``bench_cuda.py``'s host part on a GPU).

Usage: ``python benchmarks/bench_launch.py [--quick] [--json P]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
try:
    import nbkv
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
    import nbkv

from _machine import machine  # noqa: E402  (this folder is on sys.path)

HEADS, KV_HEADS, DIM, CAPACITY, HELD = 32, 8, 128, 4096, 1024
LAUNCHES = ("attention", "append_and_attend", "append")
METHODS = ("numba", "prepared")


def no_launch_reason() -> str | None:
    """Why Numba's launch code cannot run here, or None."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "the CUDA simulator is on (its numba.cuda has no launch code)"
    try:
        import nbkv.cuda_offline  # noqa: F401
    except ImportError as e:
        return f"numba-cuda is not importable ({e})"
    return None


class Case:
    """One launch's kept arguments, and new ones of what a decode step makes anew."""

    def __init__(self, name: str, seed: int) -> None:
        from nbkv import cuda_launch
        from nbkv.cuda_offline import OfflineArrays, OfflineKernel, OfflineLaunch

        self.name = name
        self.arrays = arrays = OfflineArrays(np.random.default_rng(seed))
        seq = (1, KV_HEADS, CAPACITY, DIM)
        row = (1, KV_HEADS, 1, DIM)
        self.k_cache, self.v_cache = arrays(seq, np.float16), arrays(seq, np.float16)
        self.q = arrays((1, HEADS, 1, DIM), np.float32)
        self.new = arrays(row, np.float16)
        splits = 66  # as a 132-SM GPU splits 4k positions for this step
        self.kept = (
            arrays((0,), np.float32),  # the table (unread by these kernels)
            arrays((splits, KV_HEADS, 1, 4, DIM), np.float32),
            arrays((splits, KV_HEADS, 1, 4, 2), np.float32),
            arrays((KV_HEADS, 1), np.int32),
            arrays(self.q.shape, np.float32),  # out
        )
        args = self.args()
        self.kernel = OfflineKernel(args)
        self.configured = OfflineLaunch(self.kernel, (splits, KV_HEADS, 1), (128, 1, 1))
        self.prepared = cuda_launch.prepare(self.kernel, self.configured, args)
        if self.prepared is None:
            raise RuntimeError(f"{name}: nbkv.cuda_launch.prepare declined these arguments")
        self.numba_parameters = cuda_launch.numba_parameters
        self.same = cuda_launch._same

    def args(self) -> tuple:
        """The launch's arguments, with new array objects for q and the new rows."""
        new = self.arrays.like
        if self.name == "append":
            return (new(self.new), new(self.new), HELD, self.k_cache, self.v_cache)
        scale, causal, window = np.float32(DIM**-0.5), True, 0
        table, acc, stats, counters, out = self.kept
        q = new(self.q)
        if self.name == "attention":
            head = (q, self.k_cache, self.v_cache, HELD + 1)
        else:
            head = (q, new(self.new), new(self.new), HELD, self.k_cache, self.v_cache)
        return (*head, scale, causal, window, table, acc, stats, counters, out)

    def run(self, method: str, args: tuple) -> list:
        if method == "numba":
            return self.numba_parameters(self.kernel, self.configured, args)
        return self.prepared.parameters(args)

    def check(self) -> int:
        """Both methods give the same list for new arguments; its length."""
        args = self.args()
        want = self.run("numba", args)
        got = self.run("prepared", args)
        if not self.same(got, want):
            raise AssertionError(f"{self.name}: the prepared list differs from Numba's")
        return len(want)


def measure(case: Case, rounds: int, warmup: int) -> dict[str, list[int]]:
    """Nanoseconds per call of each method, alternating, new arguments for each call."""
    times: dict[str, list[int]] = {m: [] for m in METHODS}
    for r in range(warmup + rounds):
        for method in METHODS if r % 2 else METHODS[::-1]:
            args = case.args()
            t0 = time.perf_counter_ns()
            case.run(method, args)
            t1 = time.perf_counter_ns()
            if r >= warmup:
                times[method].append(t1 - t0)
    return times


def summary(times: list[int]) -> dict[str, float]:
    us = np.asarray(times) / 1e3
    return {
        "median_us": float(np.median(us)),
        "p10_us": float(np.percentile(us, 10)),
        "p90_us": float(np.percentile(us, 90)),
        "calls": len(us),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", help="write the results and machine info here")
    args = parser.parse_args(argv)
    rounds, warmup = (300, 30) if args.quick else (5000, 200)
    info = machine()
    data: dict = {"machine": info, "quick": args.quick, "rounds": rounds, "results": {}}
    reason = no_launch_reason()
    if reason:
        print(f"skipped: {reason}")
        data["skipped"] = reason
    else:
        print(f"nbkv {nbkv.__version__}: one launch's parameter list, {rounds} rounds")
        print(f"{'launch':<19} {'parameters':>10} {'numba us':>9} {'prepared us':>11} {'ratio':>6}")
        for i, name in enumerate(LAUNCHES):
            case = Case(name, seed=i)
            n = case.check()
            result = {m: summary(t) for m, t in measure(case, rounds, warmup).items()}
            result["parameters"] = n
            data["results"][name] = result
            numba, prepared = result["numba"]["median_us"], result["prepared"]["median_us"]
            print(f"{name:<19} {n:>10} {numba:>9.2f} {prepared:>11.2f} {numba / prepared:>5.1f}x")
        print("medians; p10 and p90 are in the JSON. Not counted: cuda.core's launch itself.")
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return data


if __name__ == "__main__":
    main()
