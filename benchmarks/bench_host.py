"""Host time of a decode step on the CPU: what nbkv's Python API adds around its kernels.

One layer's decode step: batch 1, 32 query / 8 KV heads, head_dim 128, one new position
appended to a ``LayerKVCache`` that holds ``held`` positions, then attention of one query
per head over ``held + 1``. The caches hold few positions (1 and 64 by default), so
the kernels' own time is small and the Python around them shows. Per dtype (float32,
float16, bfloat16; float32 queries), five contenders, each run once per round in an order
that rotates, the cache cropped back to ``held`` before each call (outside the timer):

- "DecodeStep": ``step(q, k, v)``, a :class:`nbkv.DecodeStep` of the cache made with
  ``out=out`` and bound by the check's call: append_and_attend with its unchanging checks
  made once (every timed call must take its bound path; counted);
- "append_and_attend": ``nbkv.append_and_attend(q, k, v, cache, out=out)``;
- "append + attention": ``cache.append(k, v)`` then ``nbkv.attention(q, cache, out=out)``;
- "attention": ``nbkv.attention(q, cache, out=out)`` alone, over ``held + 1`` positions;
- "kernels": what those calls run, called from Python with the cache's buffers:
  ``nbkv.kernels.write_kv`` then ``nbkv.kernels.cpu_attention.attend_serial`` (the
  calling-thread kernel that the API picks for this little work; 16-bit K/V as their
  ``uint16`` bits), Numba's dispatch included.

Before anything is timed, the outputs of the first four (DecodeStep's from its second
call, the first on its bound path) are checked bit for bit
against the kernels' and against ``nbkv.reference.attention`` in float64, and each
contender's append against the positions it wrote. Reported per contender: median, p10
and p90 microseconds per call; "over kernels" is the median minus the kernels' median:
the host time the API adds per layer per decode step. The issue's GPU target, at most
10 us of host time per layer per decode step for append plus attention, is printed
beside that figure for the fused call as a reference line, not as a CPU target (a CPU call
has no device time to hide behind).

Usage: ``python benchmarks/bench_host.py [--quick] [--json P]``.
"""

from __future__ import annotations

import argparse
import json
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

from nbkv.kernels import write_kv  # noqa: E402
from nbkv.kernels.cpu_attention import attend_serial  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128
DTYPES = ("float32", "float16", "bfloat16")
GPU_TARGET_US = 10.0  # the GPU's target (issue 14), printed beside the fused call's figure
METHODS = ("DecodeStep", "append_and_attend", "append + attention", "attention", "kernels")


class Step:
    """One dtype's cache, inputs and the five contenders over it."""

    def __init__(self, dtype: str, held: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.held = held
        self.cache = nbkv.LayerKVCache(
            held + 8, batch=1, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=dtype
        )
        storage = self.cache.dtype
        self.k0, self.v0 = (
            rng.standard_normal((1, KV_HEADS, held, DIM)).astype(storage) for _ in range(2)
        )
        self.k, self.v = (
            rng.standard_normal((1, KV_HEADS, 1, DIM)).astype(storage) for _ in range(2)
        )
        self.cache.append(self.k0, self.v0)
        self.q = rng.standard_normal((1, HEADS, 1, DIM)).astype(np.float32)
        self.outs = {m: np.empty_like(self.q) for m in METHODS}
        self.step = nbkv.DecodeStep(self.cache, out=self.outs["DecodeStep"])
        self.scale = DIM**-0.5
        self.table = nbkv.dtypes.widen_table(storage)
        # the kernels' arguments: the cache's buffers as attention reads them (the whole
        # capacity, 16-bit as uint16 bits: nbkv.protocol.AttentionView), the new rows too
        view = self.cache.attention_view(1, None)
        self.k_buf, self.v_buf = view.k, view.v
        bits = self.k_buf.dtype
        self.k_bits, self.v_bits = self.k.view(bits), self.v.view(bits)
        if self.k_buf.shape != (1, KV_HEADS, held + 8, DIM):
            raise SystemExit(f"the buffers are not [1, 8, capacity, 128]: {self.k_buf.shape}")

    def calls(self) -> dict:
        cache, q, k, v, outs = self.cache, self.q, self.k, self.v, self.outs
        held, scale, table = self.held, self.scale, self.table
        k_buf, v_buf, k_bits, v_bits = self.k_buf, self.v_buf, self.k_bits, self.v_bits
        bound = self.step

        def decode_step():
            bound(q, k, v)

        def fused():
            nbkv.append_and_attend(q, k, v, cache, out=outs["append_and_attend"])

        def split():
            cache.append(k, v)
            nbkv.attention(q, cache, out=outs["append + attention"])

        def attention():
            nbkv.attention(q, cache, out=outs["attention"])

        def kernels():
            write_kv(k_bits, v_bits, held, k_buf, v_buf)
            attend_serial(q, k_buf, v_buf, held + 1, scale, True, 0, table, outs["kernels"])

        return {"DecodeStep": decode_step, "append_and_attend": fused,
                "append + attention": split, "attention": attention,
                "kernels": kernels}  # fmt: skip

    def reset(self, method: str) -> None:
        """Back to ``held`` positions; "attention" reads ``held + 1``, the new one written."""
        self.cache.crop(self.held)
        if method == "attention":
            self.cache.append(self.k, self.v)

    def check(self, calls: dict) -> None:
        """Every contender's output and written rows (of ``calls``, as :meth:`calls`
        makes them), before any timing."""
        for method in METHODS:
            # DecodeStep's first call is checked and binds; its second takes the bound path
            for _ in range(2 if method == "DecodeStep" else 1):
                self.reset(method)
                self.outs[method][:] = np.nan
                calls[method]()
            K, V = self.cache.get_kv()
            held = self.held if method == "kernels" else self.cache.seq_len - 1
            if held != self.held:
                raise AssertionError(f"{method}: the cache holds {held + 1} positions")
            new = (np.asarray(K)[:, :, held : held + 1], np.asarray(V)[:, :, held : held + 1])
            if method != "kernels" and not (
                np.array_equal(new[0].view(np.uint8), self.k.view(np.uint8))
                and np.array_equal(new[1].view(np.uint8), self.v.view(np.uint8))
            ):
                raise AssertionError(f"{method}: the appended position is not k, v")
        K = np.concatenate([self.k0, self.k], axis=2).astype(np.float64)
        V = np.concatenate([self.v0, self.v], axis=2).astype(np.float64)
        want = nbkv.reference.attention(self.q.astype(np.float64), K, V)
        for method in METHODS:
            got = self.outs[method]
            if not np.array_equal(got.view(np.uint32), self.outs["kernels"].view(np.uint32)):
                raise AssertionError(f"{method}: its output differs from the kernels' own")
            err = float(np.max(np.abs(got - want)))
            if not err < 1e-5:
                raise AssertionError(f"{method}: {err:.3g} away from float64 attention")
        if self.step.fast_calls == 0:
            raise AssertionError("DecodeStep: no call took the bound path")
        self.cache.crop(self.held)


def measure(step: Step, rounds: int, warmup: int) -> dict[str, list[int]]:
    """Nanoseconds per call of every contender, one call each per round, the order
    rotating round by round."""
    calls = step.calls()
    times: dict[str, list[int]] = {m: [] for m in METHODS}
    for r in range(warmup + rounds):
        shift = r % len(METHODS)
        for method in METHODS[shift:] + METHODS[:shift]:
            step.reset(method)
            call = calls[method]
            t0 = time.perf_counter_ns()
            call()
            t1 = time.perf_counter_ns()
            if r >= warmup:
                times[method].append(t1 - t0)
    step.cache.crop(step.held)
    return times


def summary(times: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    us = {method: np.asarray(ts, dtype=np.float64) / 1e3 for method, ts in times.items()}
    kernels = float(np.median(us["kernels"]))
    out = {}
    for method, ts in us.items():
        median = float(np.median(ts))
        out[method] = {
            "median_us": median,
            "p10_us": float(np.percentile(ts, 10)),
            "p90_us": float(np.percentile(ts, 90)),
            "over_kernels_us": median - kernels,
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", help="write the results and machine info here")
    parser.add_argument("--held", default="1,64", help="positions held before the step")
    args = parser.parse_args(argv)
    rounds, warmup = (300, 50) if args.quick else (5000, 500)
    helds = [int(x) for x in args.held.split(",")]
    for held in helds:
        work = HEADS * (held + 1) * DIM
        if work >= nbkv.tunables()["ATTENTION_PARALLEL_MIN"]:
            raise SystemExit(f"held={held}: the API would run the parallel kernel")
    info = machine()
    print(
        f"{info['cpu']} ({info['cpu_count']} cpus), numpy {info['numpy']}, "
        f"numba {info['numba']}, nbkv {info['nbkv']}"
    )
    print(
        f"one decode step of one layer: batch 1, {HEADS}/{KV_HEADS} heads, head_dim {DIM}, "
        f"float32 queries; {rounds} rounds after {warmup} of warm-up, contenders in "
        "rotating order; medians (p10, p90) in microseconds"
    )
    results: dict = {}
    for held in helds:
        for dtype in DTYPES:
            step = Step(dtype, held, seed=held)
            step.check(step.calls())
            fast = step.step.fast_calls
            s = summary(measure(step, rounds, warmup))
            if step.step.fast_calls - fast != rounds + warmup:
                raise AssertionError("DecodeStep: a timed call did not take its bound path")
            results[f"{dtype}, {held} held"] = s
            print(f"\n{dtype}, {held} positions held (+1 appended)")
            head = ("median", "p10", "p90")
            print(f"  {'contender':20s} {' '.join(f'{h:>8s}' for h in head)} {'over kernels':>13s}")
            for method, r in s.items():
                print(
                    f"  {method:20s} {r['median_us']:8.2f} {r['p10_us']:8.2f} "
                    f"{r['p90_us']:8.2f} {r['over_kernels_us']:13.2f}"
                )
    print(
        f"\n(over kernels: median minus the kernels' median, the host time the API adds; "
        f"the GPU's target for it is {GPU_TARGET_US:g} us per layer per decode step)"
    )
    for name, s in results.items():
        bound, fused, split = s["DecodeStep"], s["append_and_attend"], s["append + attention"]
        print(
            f"{name}: DecodeStep adds {bound['over_kernels_us']:.2f} us to its kernels, "
            f"append_and_attend {fused['over_kernels_us']:.2f} us, append + attention "
            f"{split['over_kernels_us']:.2f} us; fused / split time "
            f"{fused['median_us'] / split['median_us']:.3f}"
        )
    payload = {"machine": info, "rounds": rounds, "warmup": warmup, "results": results,
               "gpu_target_us": GPU_TARGET_US, "quick": args.quick}  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
