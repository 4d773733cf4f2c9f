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
gets new array objects for what a decode step makes anew (q and the new rows) and the K/V
buffers of the next of 4 layers' caches (a model's layers take turns through one launch
plan), while the scratch and out are kept, all made outside the timer, so that the work
Numba caches on an array object, and the prepared list's skipping of the arrays of the
last call, count as they would in a model's decode step. Beside them, "packing":
``cuda.core``'s packing of the prepared list (``ParamHolder``, the first part of its
launch, which both paths pay; a private class of ``cuda.core``, left out if absent).
Before timing, the two lists are checked equal. This is the marshalling alone: left out
are ``cuda.core``'s launch (timed apart: its packing; not timed: the driver call),
Numba's per-launch
``LaunchConfig`` and dispatcher call (which the prepared path does not make), the
look-up of the kernel function that both make per launch (``get_cufunc``, which asks for
the current context: faked here), and nbkv's Python before the launch (the second part).

Then the whole decode step on the CUDA backend, without a GPU
(:func:`nbkv.cuda_offline.offline_cuda`: every launch recorded instead of run, all of
nbkv's Python and the launches' marshalling run): a float16 ``LayerKVCache(device="cuda")``
holding 1,024 positions, cropped back before each call (outside the timer), q, k and v new
device arrays each call (as a model's step makes them), ``out`` kept, 4 such caches
taking turns (as a model's layers do). Steps: ``step(q, k, v)`` of the cache's
:class:`nbkv.DecodeStep` (made with ``out=out``; its checks made once, by its first call:
every later call must take its bound path, checked after the run), then
``append_and_attend(q, k, v, cache, out=out)`` (one fused launch), ``cache.append(k, v)``
then ``attention(q, cache, out=out)`` (two launches), ``attention`` alone, ``append``
alone; each with the prepared launches ("prepared") and through Numba's launch code
("numba", ``nbkv.cuda_launch.ENABLED = False``; its ``_Kernel.launch``, not the
dispatcher's ``call`` around it, so Numba's figure is if anything low). Checked first: the
launches each step records, and the same parameter lists both ways. The issue's GPU
target, at most 10 us of host time per layer per decode step for append plus attention,
is printed beside ``append_and_attend``: what is measured here leaves out ``cuda.core``'s
launch and the driver's, which only a GPU machine can time (``bench_cuda.py``).

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
LAYERS = 4  # caches taking turns, as a model's layers do: one launch plan, other buffers
LAUNCHES = ("attention", "append_and_attend", "append")
METHODS = ("numba", "prepared")
try:  # cuda.core's packing of a parameter list, the first thing its launch does
    from cuda.core._kernel_arg_handler import ParamHolder as PACK
except ImportError:
    PACK = None
STEPS = {  # the launches each step records
    "DecodeStep": ["append_and_attend"],
    "append_and_attend": ["append_and_attend"],
    "append + attention": ["append", "attention"],
    "attention": ["attention"],
    "append": ["append"],
}
PARAMETERS = {"attention": 102, "append_and_attend": 128, "append": 53}
GPU_TARGET_US = 10.0


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
        self.layers = [(arrays(seq, np.float16), arrays(seq, np.float16)) for _ in range(LAYERS)]
        self.turn = 0
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
        enabled, cuda_launch.ENABLED = cuda_launch.ENABLED, True  # whatever the environment
        try:
            self.prepared = cuda_launch.prepare(self.kernel, self.configured, args)
        finally:
            cuda_launch.ENABLED = enabled
        if self.prepared is None:
            raise RuntimeError(f"{name}: nbkv.cuda_launch.prepare declined these arguments")
        self.numba_parameters = cuda_launch.numba_parameters
        self.same = cuda_launch._same

    def args(self) -> tuple:
        """The launch's arguments: new array objects for q and the new rows, the next
        layer's K/V buffers, the same scratch and out."""
        new = self.arrays.like
        self.turn += 1
        k_cache, v_cache = self.layers[self.turn % LAYERS]
        if self.name == "append":
            return (new(self.new), new(self.new), HELD, k_cache, v_cache)
        scale, causal, window = np.float32(DIM**-0.5), True, 0
        table, acc, stats, counters, out = self.kept
        q = new(self.q)
        if self.name == "attention":
            head = (q, k_cache, v_cache, HELD + 1)
        else:
            head = (q, new(self.new), new(self.new), HELD, k_cache, v_cache)
        return (*head, scale, causal, window, table, acc, stats, counters, out)

    def run(self, method: str, args: tuple) -> list:
        if method == "numba":
            return self.numba_parameters(self.kernel, self.configured, args)
        return self.prepared.parameters(args)

    def pack(self, params: list) -> None:
        """cuda.core's packing of a parameter list, as its launch does first (both paths
        pay it); a private class of cuda.core, so this may be absent."""
        PACK(params)

    def check(self) -> int:
        """Both methods give the same list for new arguments; its length."""
        args = self.args()
        want = self.run("numba", args)
        got = self.run("prepared", args)
        if not self.same(got, want):
            raise AssertionError(f"{self.name}: the prepared list differs from Numba's")
        return len(want)


class Step:
    """One layer's decode step on the CUDA backend without a GPU (see the docstring),
    over ``LAYERS`` caches taking turns, as a model's layers do."""

    def __init__(self, launches: list, seed: int) -> None:
        from nbkv import cuda_launch
        from nbkv.cuda_offline import OfflineArrays

        self.launches, self.switch = launches, cuda_launch
        self.enabled = cuda_launch.ENABLED  # as the environment set it: restored after
        self.arrays = arrays = OfflineArrays(np.random.default_rng(seed))
        self.caches = []
        for _ in range(LAYERS):
            cache = nbkv.LayerKVCache(
                CAPACITY, batch=1, num_kv_heads=KV_HEADS, head_dim=DIM, dtype="float16",
                device="cuda",
            )  # fmt: skip
            held = arrays((1, KV_HEADS, HELD, DIM), np.float16)
            cache.append(held, held)
            self.caches.append(cache)
        self.turn = 0
        self.q = arrays((1, HEADS, 1, DIM), np.float32)
        self.k = arrays((1, KV_HEADS, 1, DIM), np.float16)
        self.out = arrays(self.q.shape, np.float32)
        # one bound step per cache, as a model keeps one per layer
        self.steps = {id(c): nbkv.DecodeStep(c, out=self.out) for c in self.caches}

    def inputs(self) -> tuple:
        """New q, k and v device arrays (no values: nothing runs)."""
        like = self.arrays.like
        return like(self.q), like(self.k), like(self.k)

    def run(self, name: str, cache, q, k, v) -> None:
        out = self.out
        if name == "DecodeStep":
            self.steps[id(cache)](q, k, v)
        elif name == "append_and_attend":
            nbkv.append_and_attend(q, k, v, cache, out=out)
        elif name == "append + attention":
            cache.append(k, v)
            nbkv.attention(q, cache, out=out)
        elif name == "attention":
            nbkv.attention(q, cache, out=out)
        else:
            cache.append(k, v)

    def call(self, name: str, method: str, inputs: tuple) -> int:
        """Nanoseconds of one step on the next cache, cropped back and the record cleared
        first."""
        self.turn += 1
        cache = self.caches[self.turn % LAYERS]
        cache.crop(HELD)
        self.launches.clear()
        self.switch.ENABLED = method == "prepared"
        t0 = time.perf_counter_ns()
        self.run(name, cache, *inputs)
        return time.perf_counter_ns() - t0

    def restore(self) -> None:
        self.switch.ENABLED = self.enabled

    def check(self) -> None:
        """Each step records its launches, with the same parameters both ways."""
        try:
            for name, kinds in STEPS.items():
                inputs, lists = self.inputs(), []
                for method in METHODS:
                    self.turn = 0  # the same cache both ways
                    self.call(name, method, inputs)
                    got = [len(params) for _, _, _, params in self.launches]
                    if got != [PARAMETERS[kind] for kind in kinds]:
                        raise AssertionError(f"{name}: launched {got} parameters, not {kinds}")
                    lists.append([list(params) for _, _, _, params in self.launches])
                if not all(self.switch._same(a, b) for a, b in zip(*lists, strict=True)):
                    raise AssertionError(f"{name}: the prepared launches differ from Numba's")
        finally:
            self.restore()


def measure_steps(step: Step, rounds: int, warmup: int) -> dict[str, dict[str, list[int]]]:
    """Nanoseconds per step, each step and method once a round, the order rotating."""
    combos = [(name, method) for name in STEPS for method in METHODS]
    times: dict = {name: {m: [] for m in METHODS} for name in STEPS}
    try:
        for r in range(warmup + rounds):
            shift = r % len(combos)
            for name, method in combos[shift:] + combos[:shift]:
                t = step.call(name, method, step.inputs())
                if r >= warmup:
                    times[name][method].append(t)
    finally:
        step.restore()
    return times


def measure(case: Case, rounds: int, warmup: int) -> dict[str, list[int]]:
    """Nanoseconds per call of each method, alternating, new arguments for each call;
    and of cuda.core's packing of the list ("packing"), where it can be imported."""
    times: dict[str, list[int]] = {m: [] for m in METHODS}
    if PACK is not None:
        times["packing"] = []
    for r in range(warmup + rounds):
        for method in METHODS if r % 2 else METHODS[::-1]:
            args = case.args()
            t0 = time.perf_counter_ns()
            params = case.run(method, args)
            t1 = time.perf_counter_ns()
            if r >= warmup:
                times[method].append(t1 - t0)
            if PACK is not None and method == "prepared":
                t0 = time.perf_counter_ns()
                case.pack(params)
                t1 = time.perf_counter_ns()
                if r >= warmup:
                    times["packing"].append(t1 - t0)
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
        from importlib.metadata import version

        data["numba_cuda"] = version("numba-cuda")
        print(
            f"nbkv {nbkv.__version__}, numba-cuda {data['numba_cuda']}: one launch's parameter "
            f"list, {rounds} rounds; K/V of {LAYERS} layers' caches in turn"
        )
        print(
            f"{'launch':<19} {'parameters':>10} {'numba us':>9} {'prepared us':>11} {'ratio':>6}"
            f" {'cuda.core packing us':>21}"
        )
        for i, name in enumerate(LAUNCHES):
            case = Case(name, seed=i)
            n = case.check()
            result = {m: summary(t) for m, t in measure(case, rounds, warmup).items()}
            result["parameters"] = n
            data["results"][name] = result
            numba, prepared = result["numba"]["median_us"], result["prepared"]["median_us"]
            pack = result["packing"]["median_us"] if "packing" in result else float("nan")
            print(
                f"{name:<19} {n:>10} {numba:>9.2f} {prepared:>11.2f} {numba / prepared:>5.1f}x"
                f" {pack:>21.2f}"
            )
        print(
            "medians; p10 and p90 are in the JSON. cuda.core packing: the first part of its "
            "launch, which both paths pay (the driver call after it is not timed here)."
        )
        from nbkv.cuda_offline import offline_cuda

        with offline_cuda() as launches:
            step = Step(launches, seed=7)
            step.check()
            steps = measure_steps(step, rounds, warmup)
            checked = sum(s.checked_calls for s in step.steps.values())
            if checked != LAYERS:  # the first call of each: every other one bound
                raise AssertionError(f"DecodeStep: {checked} calls checked, not {LAYERS}")
        data["steps"] = {n: {m: summary(t) for m, t in r.items()} for n, r in steps.items()}
        print()
        print("one layer's decode step on the CUDA backend, no GPU (launches recorded, not run)")
        print(f"{'step':<19} {'numba us':>9} {'prepared us':>11} {'ratio':>6}")
        for name, result in data["steps"].items():
            numba, prepared = result["numba"]["median_us"], result["prepared"]["median_us"]
            line = f"{name:<19} {numba:>9.2f} {prepared:>11.2f} {numba / prepared:>5.1f}x"
            if name in ("DecodeStep", "append_and_attend"):
                line += f"   (the GPU's target: {GPU_TARGET_US:.0f} us, a launch included)"
            print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return data


if __name__ == "__main__":
    main()
