"""Benchmark: saving a cache to disk and loading it back, nbkv beside NumPy.

Case (float32, layout "bhsd", every position filled): a KVCache of 16 layers of
[1, 8, 8192, 128] K and V, 1 GiB held (``--quick``: 2 layers of [1, 8, 4096, 128],
64 MiB).

Methods, measured side by side in one run, in a fresh random order each round, into a
temporary folder (``--dir`` to choose where; it is removed at the end):

- nbkv.save:         ``nbkv.save(path, cache)``: one safetensors file, CRC32 of every
                     tensor, temporary file + fsync + ``os.replace``;
- np.save:           ``np.save`` of every layer's K and V views, one ``.npy`` each, no
                     fsync (the data may still be in the page cache when it returns);
- np.save + fsync:   the same, each file flushed and fsync'ed (as nbkv.save does);
- nbkv.load:         ``nbkv.load(path)``: checks, CRC32, a ready cache;
- np.load:           ``np.load`` of every ``.npy`` file (arrays, not a cache);
- np.load + append:  ``np.load`` then ``append`` into a preallocated KVCache: what a user
                     of ``np.save`` does to get a cache back.

Files are deleted (untimed) before each save, so every save writes a new file. Loads read
files just written, so they come from the page cache: they measure nbkv's and NumPy's
own costs, not the disk. Bytes counted: the K and V data held, ``2 * layers * numel *
itemsize``. nbkv's kernels are compiled in a warm-up round, which is in no timing.

Usage (from the repository root)::

    python benchmarks/bench_persist.py            # full run, 1 GiB, about two minutes
    python benchmarks/bench_persist.py --quick    # smoke run, 64 MiB
    python benchmarks/bench_persist.py --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _machine import machine  # noqa: E402  (this folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
try:
    import nbkv
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
    import nbkv

DTYPE = np.dtype(np.float32)
NOW = time.perf_counter_ns

# layers, per-layer K (and V) shape [batch, num_kv_heads, seq, head_dim], rounds
FULL = (16, (1, 8, 8192, 128), 5)
QUICK = (2, (1, 8, 4096, 128), 3)


def make_cache(layers: int, shape, rng) -> nbkv.KVCache:
    b, h, s, d = shape
    cache = nbkv.KVCache(layers, s, batch=b, num_kv_heads=h, head_dim=d, dtype=DTYPE)
    for layer in cache:
        k = rng.standard_normal(shape, dtype=np.float32) + 0.5  # never zeros
        layer.append(k, k * -2.0)
    return cache


class Method:
    """One way of saving or loading. ``run`` times a call; ``prepare`` (untimed) resets."""

    kind = "save"

    def __init__(self, cache, folder: Path):
        self.cache, self.folder = cache, folder
        self.out = None

    def prepare(self) -> None:
        self.out = None

    def run(self) -> int:
        t0 = NOW()
        self.out = self.call()
        return NOW() - t0


def npy_paths(folder: Path, tag: str, layers: int) -> list[Path]:
    return [folder / f"{tag}-{i}-{w}.npy" for i in range(layers) for w in "kv"]


class NbkvSave(Method):
    name = "nbkv.save"

    def __init__(self, cache, folder):
        super().__init__(cache, folder)
        self.path = folder / "cache.safetensors"

    def prepare(self):
        self.path.unlink(missing_ok=True)

    def call(self):
        nbkv.save(self.path, self.cache)


class NpSave(Method):
    name = "np.save"
    tag, sync = "plain", False

    def __init__(self, cache, folder):
        super().__init__(cache, folder)
        self.paths = npy_paths(folder, self.tag, cache.num_layers)
        self.arrays = [x for layer in cache for x in layer.get_kv()]

    def prepare(self):
        for p in self.paths:
            p.unlink(missing_ok=True)

    def call(self):
        for path, arr in zip(self.paths, self.arrays, strict=True):
            with open(path, "wb") as f:
                np.save(f, arr)
                if self.sync:
                    f.flush()
                    os.fsync(f.fileno())


class NpSaveFsync(NpSave):
    name = "np.save + fsync"
    tag, sync = "synced", True


class NbkvLoad(Method):
    name = "nbkv.load"
    kind = "load"

    def __init__(self, cache, folder):
        super().__init__(cache, folder)
        self.path = folder / "loaded.safetensors"
        nbkv.save(self.path, cache)

    def call(self):
        return nbkv.load(self.path)

    def held(self):
        return [x for layer in self.out for x in layer.get_kv()]


class NpLoad(Method):
    name = "np.load"
    kind = "load"

    def __init__(self, cache, folder):
        super().__init__(cache, folder)
        self.paths = npy_paths(folder, "loaded", cache.num_layers)
        arrays = [x for layer in cache for x in layer.get_kv()]
        for path, arr in zip(self.paths, arrays, strict=True):
            np.save(path, arr)

    def call(self):
        return [np.load(p) for p in self.paths]

    def held(self):
        return self.out


class NpLoadAppend(NpLoad):
    name = "np.load + append"

    def __init__(self, cache, folder):
        super().__init__(cache, folder)
        first = cache[0]
        self.target = nbkv.KVCache(
            cache.num_layers,
            cache.max_seq_len,
            batch=first.batch,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            dtype=DTYPE,
        )

    def prepare(self):
        super().prepare()
        self.target.clear()

    def call(self):
        arrays = [np.load(p) for p in self.paths]
        for i, layer in enumerate(self.target):
            layer.append(arrays[2 * i], arrays[2 * i + 1])
        return self.target

    def held(self):
        return [x for layer in self.out for x in layer.get_kv()]


def check(methods, cache) -> None:
    """Every load gives back the cache's bits (printed before any timing)."""
    want = [x for layer in cache for x in layer.get_kv()]
    for m in methods:
        if m.kind != "load":
            continue
        m.prepare()
        m.run()
        got = m.held()
        ok = len(got) == len(want) and all(
            np.array_equal(g.view(np.uint32), w.view(np.uint32))
            for g, w in zip(got, want, strict=True)
        )
        if not ok:
            raise SystemExit(f"{m.name} gave back wrong data; no timing is worth reporting")
    back = nbkv.load(methods[0].folder / "loaded.safetensors")
    if back.seq_len != cache.seq_len or back.max_seq_len != cache.max_seq_len:
        raise SystemExit("nbkv.load gave back the wrong seq_len or capacity")


def bench(layers: int, shape, rounds: int, folder: Path, rng) -> dict:
    t0 = time.perf_counter()
    cache = make_cache(layers, shape, rng)
    nbytes = sum(x.nbytes for layer in cache for x in layer.get_kv())
    kinds = [NbkvSave, NpSave, NpSaveFsync, NbkvLoad, NpLoad, NpLoadAppend]
    methods = [kind(cache, folder) for kind in kinds]
    # warm up: first calls (kernel compilation, page cache) in no timing
    for m in methods:
        m.prepare()
        m.run()
    check(methods, cache)
    print(
        f"{layers} layers of {shape} {DTYPE} K and V, {nbytes / 2**30:.3f} GiB held; "
        f"checked bit-exact ({time.perf_counter() - t0:.1f} s to set up)"
    )
    times = {m.name: [] for m in methods}
    for _ in range(rounds):
        for j in rng.permutation(len(methods)):
            m = methods[j]
            m.prepare()
            times[m.name].append(m.run())
            m.out = None  # free a loaded cache before the next method runs
    res = {}
    for m in methods:
        t = np.asarray(times[m.name], dtype=np.float64) / 1e9
        med = float(np.median(t))
        res[m.name] = {
            "kind": m.kind,
            "s": med,
            "s_min": float(t.min()),
            "s_max": float(t.max()),
            "gb_per_s": nbytes / med / 1e9,
            "rounds": len(t),
        }
    for r in res.values():
        peer = res["np.save" if r["kind"] == "save" else "np.load"]["s"]
        r["time_vs_numpy"] = r["s"] / peer
    return {
        "case": {"layers": layers, "shape": list(shape), "dtype": str(DTYPE), "bytes": nbytes},
        "methods": res,
        "file_bytes": os.path.getsize(folder / "loaded.safetensors"),
    }


def report(result: dict) -> None:
    head = (
        f"{'method':<18} {'s (median)':>10} {'min':>8} {'max':>8} {'GB/s':>7} "
        f"{'vs NumPy':>9} {'rounds':>6}"
    )
    print(head)
    print("-" * len(head))
    for name, m in result["methods"].items():
        print(
            f"{name:<18} {m['s']:>10.3f} {m['s_min']:>8.3f} {m['s_max']:>8.3f} "
            f"{m['gb_per_s']:>7.2f} {m['time_vs_numpy']:>8.2f}x {m['rounds']:>6}"
        )
    print("(s: median seconds per call; GB/s from the K+V bytes held; vs NumPy: time relative")
    print(" to np.save (saves) or np.load (loads), below 1 is faster; loads from page cache)")
    print(f"file: {result['file_bytes']} bytes for {result['case']['bytes']} bytes of data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, few repeats")
    parser.add_argument("--json", metavar="PATH", help="write results and machine info here")
    parser.add_argument("--dir", metavar="PATH", help="where the temporary folder goes")
    args = parser.parse_args()
    info = machine()
    print(f"{info['cpu']} ({info['cpu_count']} cpus), {info['platform']}")
    print(
        f"python {info['python']}, numpy {info['numpy']}, numba {info['numba']}, "
        f"nbkv {info['nbkv']}"
    )
    layers, shape, rounds = QUICK if args.quick else FULL
    folder = Path(tempfile.mkdtemp(prefix="nbkv-bench-persist-", dir=args.dir))
    usage = shutil.disk_usage(folder)
    print(f"temporary folder {folder} ({usage.free / 2**30:.0f} GiB free)")
    try:
        result = bench(layers, shape, rounds, folder, np.random.default_rng(0))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print()
    report(result)
    if args.json:
        payload = {"machine": info, "results": result}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
