"""Continuous batching (``nbkv.serving.Engine``) against one request at a time, with the
trained default model on the CPU.

Requests are slices of held-out standard-library code (``nbkv.serving_demo.workload``),
every one added at time 0, decoded greedily; each part checks that both methods give
identical outputs before it reports a time. Three parts, ratios within one run:

1. **Throughput**: 32 requests (prompts lognormal around 48 tokens, up to 256; new tokens
   around 128, up to 256), the engine (block 16, ``max_batch_tokens`` 512, prefix caching
   on: the prompts share nothing) against ``Llama.generate`` on one request after another
   with its own contiguous cache. Target: at least 4x the tokens/s.
2. **A shared prefix**: 32 requests whose prompts start with the same 512 tokens (then
   their own, around 48), 16 new tokens each; the engine with prefix caching on against
   off. Time to first token, mean over the requests and until the last has one. Target:
   at least 3x faster with prefix caching.
3. **Memory**: the peak bytes of the blocks the engine had in use in part 1 (measured
   after every step's ``reserve``: a pool of that many blocks would have served the
   workload; the default ``num_blocks`` allocates more, 256 MiB), against 32 contiguous
   caches sized for the longest request (a batch of ``LayerKVCache`` rows).

Each contender runs ``ROUNDS`` times, alternating, after a warm-up (JIT, caches) that is
in no timing; medians are reported. BLAS and Numba threads are left at their defaults for
both. Usage: ``python benchmarks/bench_serving.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from _machine import machine  # noqa: E402  (this folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
try:
    import nbkv  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
from nbkv.models import Llama  # noqa: E402
from nbkv.serving_demo import contiguous_bytes, run_engine, run_sequential, workload  # noqa: E402

ROUNDS = {False: 3, True: 1}
REQUESTS = {False: 32, True: 8}


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.outputs, b.outputs, strict=True))


def throughput(model, quick: bool) -> dict:
    work = workload(REQUESTS[quick], seed=0, prompt_median=48, prompt_cap=256, new_median=128,
                    new_cap=256)  # fmt: skip
    tokens = sum(work.max_new_tokens)
    runs = {"engine": [], "one at a time": []}
    for _ in range(ROUNDS[quick]):
        e = run_engine(model, work)
        s = run_sequential(model, work)
        assert _same(e, s), "the engine's outputs differ from Llama.generate's"
        runs["engine"].append(e)
        runs["one at a time"].append(s)
    out = {}
    print(f"1. throughput: {len(work.prompts)} requests, {tokens} new tokens")
    for name, rs in runs.items():
        sec = float(np.median([r.seconds for r in rs]))
        out[name] = {"seconds": sec, "tokens_per_s": tokens / sec,
                     "ttft_mean_s": float(np.median([np.mean(r.ttft) for r in rs]))}  # fmt: skip
        print(f"  {name:16s} {sec:7.2f} s {tokens / sec:8.0f} tokens/s")
    out["ratio"] = out["engine"]["tokens_per_s"] / out["one at a time"]["tokens_per_s"]
    out["peak_kv_bytes"] = max(r.peak_kv_bytes for r in runs["engine"])
    out["contiguous_bytes"] = contiguous_bytes(model, work)
    out["steps"] = len(runs["engine"][0].history)
    return out


def shared_prefix(model, quick: bool) -> dict:
    work = workload(REQUESTS[quick], seed=1, prompt_median=48, prompt_cap=128, new_median=16,
                    new_cap=16, shared=512, share_every=1)  # fmt: skip
    runs = {"prefix caching on": [], "prefix caching off": []}
    for _ in range(ROUNDS[quick]):
        on = run_engine(model, work, prefix_caching=True)
        off = run_engine(model, work, prefix_caching=False)
        assert _same(on, off), "prefix caching changed the outputs"
        runs["prefix caching on"].append(on)
        runs["prefix caching off"].append(off)
    out = {}
    print(f"\n2. a shared prefix: {len(work.prompts)} requests starting with the same 512 tokens")
    for name, rs in runs.items():
        mean = float(np.median([np.mean(r.ttft) for r in rs]))
        last = float(np.median([max(r.ttft) for r in rs]))
        hit = rs[0].prefix_hit_rate
        out[name] = {"ttft_mean_s": mean, "ttft_last_s": last, "hit_rate": hit,
                     "seconds": float(np.median([r.seconds for r in rs]))}  # fmt: skip
        print(f"  {name:20s} first token: mean {mean:6.2f} s, last {last:6.2f} s; "
              f"prefix hits {hit:.0%} of prompt tokens")  # fmt: skip
    on, off = out["prefix caching on"], out["prefix caching off"]
    out["ratio_mean"] = off["ttft_mean_s"] / on["ttft_mean_s"]
    out["ratio_last"] = off["ttft_last_s"] / on["ttft_last_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests, one round")
    parser.add_argument("--json", help="write the results and machine info here")
    args = parser.parse_args()
    info = machine()
    print(f"{info['cpu']} ({info['cpu_count']} cpus), numpy {info['numpy']}, "
          f"numba {info['numba']}, nbkv {info['nbkv']}\n")  # fmt: skip
    model = Llama.default()
    t0 = time.perf_counter()
    run_engine(model, workload(4, seed=9))  # warm-up: JIT compile or cache load
    run_sequential(model, workload(2, seed=9))
    print(f"warm-up (JIT, caches): {time.perf_counter() - t0:.1f} s, in no timing\n")
    results = {"throughput": throughput(model, args.quick)}
    results["shared_prefix"] = shared_prefix(model, args.quick)
    t = results["throughput"]
    print(f"\n3. memory: peak K/V blocks in use by the engine {t['peak_kv_bytes'] / 2**20:.1f} MiB "
          f"against {t['contiguous_bytes'] / 2**20:.1f} MiB for contiguous caches sized for "
          f"the longest request ({t['contiguous_bytes'] / t['peak_kv_bytes']:.1f}x)")  # fmt: skip
    sp = results["shared_prefix"]
    print("\ntargets:")
    print(f"{'PASS' if t['ratio'] >= 4 else 'MISS'}  engine >= 4x the tokens/s of one at a "
          f"time: {t['ratio']:.2f}x")  # fmt: skip
    verdict = "PASS" if sp["ratio_mean"] >= 3 else "MISS"
    print(f"{verdict}  prefix caching >= 3x faster to first token: {sp['ratio_mean']:.2f}x "
          f"(mean), {sp['ratio_last']:.2f}x (last)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "quick": args.quick, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
