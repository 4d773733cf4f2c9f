"""A prefix shared between engines through a store (``nbkv.store``): time to first token
of a second engine whose pool is empty, recomputing against loading the blocks from a
``LocalStore`` directory or a ``RedisStore`` on 127.0.0.1, with the trained default model
on the CPU.

The workload: 32 requests whose prompts start with the same 1,024 tokens of held-out
standard-library code (then their own, around 48), 16 new tokens each, all added at time
0 (``nbkv.serving_demo.workload``). A first engine serves it once with each store, which
publishes the prefix's blocks. Then, for each contender, a **fresh process** (nothing in
its pool, its kernels loaded from Numba's cache and warmed up on other text first) serves
the same requests; it reports the mean time to first token and when the last request
had one. Every process's outputs must equal the recomputing one's. Contenders alternate
over ``ROUNDS`` rounds; medians are reported. Target: a Redis hit at least 3x faster to
first token (mean) than recomputing.

Also measured in this process: the bytes of one block's record (every layer's K and V,
header and checksum) and the rate at which each store returns the prefix's records in
one ``get_many`` (GB/s of records).

``redis-server`` must be on PATH for the Redis contender (it is started on a free port
and stopped at the end); without it the Redis rows are skipped. Usage:
``python benchmarks/bench_store.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
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
from nbkv.serving import Engine  # noqa: E402
from nbkv.serving_demo import workload  # noqa: E402
from nbkv.store import BlockGeometry, LocalStore, RedisStore, get_many, namespace  # noqa: E402

ROUNDS = {False: 3, True: 1}
REQUESTS = {False: 32, True: 8}
SHARED = 1024
BLOCK = 16

_CHILD = r"""
import json, sys, time
import numpy as np
from nbkv.models import Llama
from nbkv.serving_demo import run_engine, workload
from nbkv.store import LocalStore, RedisStore
kind, where, n, shared = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = Llama.default()
run_engine(model, workload(2, seed=9), block_size=16)  # warm-up on other text: JIT, caches
store = {"recompute": None, "local": lambda: LocalStore(where, max_bytes=1 << 30),
         "redis": lambda: RedisStore(where)}[kind]
work = workload(n, seed=2, prompt_median=48, prompt_cap=128, new_median=16, new_cap=16,
                shared=shared, share_every=1)
kw = {} if store is None else {"store": store()}
r = run_engine(model, work, block_size=16, **kw)
print(json.dumps({"ttft_mean_s": float(np.mean(r.ttft)), "ttft_last_s": float(max(r.ttft)),
                  "seconds": r.seconds, "outputs": [o.tolist() for o in r.outputs]}))
"""


def start_redis() -> tuple[subprocess.Popen, str] | None:
    """A throwaway ``redis-server`` on a free port of 127.0.0.1 (no persistence), or None."""
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            RedisStore(url, timeout=0.2).contains([b"ping"])
            return proc, url
        except Exception:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")


def child(kind: str, where: str, n: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, kind, where, str(n), str(SHARED)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def publish(model, store, work) -> dict:
    engine = Engine(model, block_size=BLOCK, store=store)
    engine.generate(work.prompts, max_new_tokens=1)
    engine.flush()
    engine.close()
    return engine.stats()


def read_rate(model, store, work) -> dict:
    """One ``get_many`` of the shared prefix's records: bytes per block, GB/s."""
    engine = Engine(model, block_size=BLOCK)
    cache = engine.cache
    geo = BlockGeometry(cache.num_layers, BLOCK, cache.num_kv_heads, cache.head_dim,
                        str(cache.dtype), cache.layout)  # fmt: skip
    ns = namespace(model.identity, geo)
    from nbkv.store import store_key

    keys = [store_key(ns, k) for k in cache.prefix_keys(work.prompts[0][:SHARED])]
    times, got = [], None
    for _ in range(20):
        t0 = time.perf_counter()
        got = get_many(store, keys)
        times.append(time.perf_counter() - t0)
    assert all(g is not None for g in got), "the prefix's blocks are not in the store"
    nbytes = sum(len(g) for g in got)
    sec = float(np.median(times))
    return {"blocks": len(keys), "record_bytes": len(got[0]), "seconds": sec,
            "gb_per_s": nbytes / sec / 1e9}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests, one round")
    parser.add_argument("--json", help="write the results and machine info here")
    args = parser.parse_args()
    info = machine()
    print(f"{info['cpu']} ({info['cpu_count']} cpus), numpy {info['numpy']}, "
          f"numba {info['numba']}, nbkv {info['nbkv']}\n")  # fmt: skip
    n = REQUESTS[args.quick]
    model = Llama.default()
    work = workload(n, seed=2, prompt_median=48, prompt_cap=128, new_median=16, new_cap=16,
                    shared=SHARED, share_every=1)  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="nbkv-bench-store-")
    redis = start_redis()
    contenders = {"recompute": "-", "local": os.path.join(tmp, "kv")}
    if redis is None:
        print("redis-server is not installed: the Redis contender is skipped\n")
    else:
        contenders["redis"] = redis[1]
    try:
        stores = {"local": LocalStore(contenders["local"], max_bytes=1 << 30)}
        if redis is not None:
            stores["redis"] = RedisStore(redis[1])
        rates = {}
        for name, store in stores.items():
            s = publish(model, store, work)
            rates[name] = read_rate(model, store, work)
            print(f"published through {name}: {s['store_published_blocks']} blocks, "
                  f"{s['store_bytes_written'] / 2**20:.1f} MiB")  # fmt: skip
        runs = {name: [] for name in contenders}
        for r in range(ROUNDS[args.quick]):
            for name, where in contenders.items():
                runs[name].append(child(name, where, n))
                print(f"  round {r + 1} {name:9s} first token: mean "
                      f"{runs[name][-1]['ttft_mean_s']:.3f} s")  # fmt: skip
        want = runs["recompute"][0]["outputs"]
        for name, rs in runs.items():
            assert all(x["outputs"] == want for x in rs), f"{name} changed the outputs"
    finally:
        if redis is not None:
            redis[0].kill()
            redis[0].wait()
        shutil.rmtree(tmp, ignore_errors=True)
    results = {"requests": n, "shared_tokens": SHARED, "block_size": BLOCK, "stores": rates}
    print(f"\n{n} requests sharing a {SHARED}-token prefix, a fresh process with an empty pool:")
    base = None
    for name, rs in runs.items():
        mean = float(np.median([x["ttft_mean_s"] for x in rs]))
        last = float(np.median([x["ttft_last_s"] for x in rs]))
        base = base or mean
        results[name] = {"ttft_mean_s": mean, "ttft_last_s": last, "speedup_mean": base / mean}
        print(f"  {name:9s} first token: mean {mean:6.3f} s, last {last:6.3f} s "
              f"({base / mean:4.1f}x faster than recomputing)")  # fmt: skip
    for name, r in rates.items():
        print(f"  {name:9s} get_many of {r['blocks']} blocks ({r['record_bytes']:,} bytes each): "
              f"{r['seconds'] * 1e3:.2f} ms, {r['gb_per_s']:.2f} GB/s")  # fmt: skip
    if "redis" in results:
        ratio = results["redis"]["speedup_mean"]
        print(f"\ntargets:\n{'PASS' if ratio >= 3 else 'MISS'}  a Redis hit >= 3x faster to "
              f"first token than recomputing: {ratio:.2f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "quick": args.quick, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
