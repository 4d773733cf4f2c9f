"""Paged KV cache: the memory it saves, and what paging costs attention and the write.

Four parts, each against nbkv's contiguous cache in the same run:

1. **Memory.** ``REQUESTS`` request lengths (prompt + output) drawn from a long-tailed
   distribution (lognormal, median ``MEDIAN`` positions, capped at ``MAX_LEN``; seeded),
   held at once. Contiguous: one buffer per request sized to the longest request, as a
   batch of ``LayerKVCache`` rows must be. Paged, block sizes 1 to 256: a real
   ``PagedKVCache`` (one KV head of head_dim 1, so that the pool is small) holding every
   request, its ``stats()`` read: ``bytes_reserved`` (the blocks in use) over
   ``bytes_data`` (the positions held). Target: block size 16 within 5% of the data.

2. **Decode attention** over 8 sequences of 4096 positions (32 query / 8 KV heads,
   head_dim 128, float32, one query per sequence): ``nbkv.paged_attention`` on a block-16
   pool against ``nbkv.attention`` on a ``LayerKVCache`` (batch 8, "bhsd") holding the
   same K/V. Two pools per layout: *packed* (each sequence prefilled in one step, so its
   blocks are consecutive) and *interleaved* (the eight grown together 16 positions at a
   time, as decoding sequences grow: a sequence's blocks are eight apart); and packed
   pools of block sizes ``LARGE_BLOCKS`` (64, 256: pages larger than the 32 positions
   the kernel prefetches ahead). Every method is checked against
   ``nbkv.reference.attention`` first. Rounds call every method once,
   in a fresh random order, with ``settle()`` between calls (no thread pool of one
   spinning on a core the next needs); a call during which our threads waited for a CPU
   for over 5% of its time (another job's) is left out, as in ``bench_attention.py``.
   K+V is 256 MiB per copy, 8x a 32 MiB L3: every call reads cold memory. Target: paged
   at block 16 at least 0.9x the contiguous throughput.

3. **Prefill attention**: one sequence of 4096 positions whose last 512 are new (the
   prefill chunk of ``bench_attention.py``; ``--quick``: 128 of 1024), the same heads
   and dtype: ``nbkv.paged_attention`` on packed pools ("nhd" and "hnd" at block 16,
   "nhd" at block 256) against ``nbkv.attention`` of the 512 queries on a
   ``LayerKVCache``, checked against the reference and timed as part 2. Bound by
   arithmetic, not memory (K/V 32 MiB). No target: the paged kernel's prefill should
   come near the contiguous kernel's.

4. **The write of a decode step** (8 sequences, one position each, 8 KV heads x 128):
   ``PagedKVCache.write`` (its ``write_paged`` kernel through the slot mapping) and the
   ``reserve`` that makes its step, against ``LayerKVCache.append`` of the same rows.

Usage (from the repository root)::

    python benchmarks/bench_paged.py                # full run, about 2 minutes
    python benchmarks/bench_paged.py --quick        # smoke run: 1024 positions
    python benchmarks/bench_paged.py --json results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from _machine import machine  # noqa: E402  (this folder is on sys.path)
from bench_attention import WAIT_SHARE, run_delay_ns, settle  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
try:
    import nbkv
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
    import nbkv
from nbkv import reference  # noqa: E402
from nbkv.tutorial.paging import paged_copy, request_lengths, reserved_over_data  # noqa: E402

REQUESTS, MEDIAN, SIGMA, MAX_LEN = 1000, 400, 1.0, 8192
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LARGE_BLOCKS = (64, 256)  # attention on packed pools of these block sizes too
SEQS, HEADS, KV_HEADS, DIM, BLOCK = 8, 32, 8, 128, 16
SEQ_LEN = {False: 4096, True: 1024}  # full, quick
PREFILL_NEW = {False: 512, True: 128}  # part 3's new positions (queries)
PREFILL_ROUNDS = {False: 12, True: 3}
ROUNDS = {False: 40, True: 6}
WRITE_ROUNDS = {False: 400, True: 50}
NOW = time.perf_counter_ns


def memory_part() -> dict:
    lengths = request_lengths(REQUESTS, median=MEDIAN, sigma=SIGMA, cap=MAX_LEN, seed=0)
    ratios = reserved_over_data(lengths, BLOCK_SIZES)  # real PagedKVCaches, their stats()
    out = {
        "requests": REQUESTS,
        "median": int(np.median(lengths)),
        "p99": int(np.percentile(lengths, 99)),
        "longest": int(lengths.max()),
        "contiguous_over_data": ratios.pop("contiguous"),
        "paged_over_data": ratios,
    }
    print(
        f"memory: {REQUESTS} requests, lengths median {out['median']}, p99 {out['p99']}, "
        f"longest {out['longest']} (lognormal, sigma {SIGMA})"
    )
    print(f"  {'allocation':24s} {'reserved / data':>16s} {'wasted':>8s}")
    ratio = out["contiguous_over_data"]
    print(f"  {'contiguous (longest)':24s} {ratio:16.3f} {1 - 1 / ratio:8.1%}")
    for bs, ratio in ratios.items():
        print(f"  {f'paged, block size {bs}':24s} {ratio:16.3f} {1 - 1 / ratio:8.1%}")
    return out


def timed(calls: dict, rounds: int, rng) -> dict:
    """Per method: times (ns) of the undisturbed calls and the share disturbed."""
    times = {m: [] for m in calls}
    disturbed = dict.fromkeys(calls, 0)
    for call in calls.values():  # warm-up: JIT and first touch
        call()
        call()
    for _ in range(rounds):
        for method in rng.permutation(list(calls)):
            calls[method]()  # wakes the method's threads, as in a loop of its calls
            settle()
            w0, t0 = run_delay_ns(), NOW()
            calls[method]()
            t1, w1 = NOW(), run_delay_ns()
            settle()
            if w1 - w0 > WAIT_SHARE * (t1 - t0):
                disturbed[method] += 1
            else:
                times[method].append(t1 - t0)
    for m in calls:
        if not times[m]:  # percentiles of nothing: say why instead
            raise RuntimeError(f"{m}: every call waited for a CPU (another job's); rerun")
    return {m: {"ns": times[m], "disturbed": disturbed[m] / rounds} for m in calls}


def checked_calls(q_dense, dense, q_packed, paged: dict, want, packed) -> dict:
    """The calls to time: ``nbkv.attention`` of ``q_dense`` over the contiguous cache and
    ``nbkv.paged_attention`` of ``q_packed`` over each ``(cache, step)`` of ``paged``, each
    checked first against ``want`` (float64, [tokens, heads, head_dim]; ``packed`` puts the
    contiguous output in that form). Each writes into its own ``out``."""
    got = {"contiguous attention": packed(nbkv.attention(q_dense, dense))}
    for name, (cache, step) in paged.items():
        got[name] = nbkv.paged_attention(q_packed, cache, 0, step)
    for name, out in got.items():
        err = float(np.abs(out - want).max())
        assert err < 1e-4, (name, err)
    out_dense = np.empty_like(q_dense)
    outs = {name: np.empty_like(q_packed) for name in paged}
    calls = {"contiguous attention": lambda: nbkv.attention(q_dense, dense, out=out_dense)}
    for name, (cache, step) in paged.items():
        calls[name] = lambda c=cache, s=step, o=outs[name]: nbkv.paged_attention(
            q_packed, c, 0, s, out=o
        )
    return calls


def attention_part(quick: bool, rng) -> dict:
    seq = SEQ_LEN[quick]
    K = rng.standard_normal((SEQS, KV_HEADS, seq, DIM), dtype=np.float32)
    V = rng.standard_normal((SEQS, KV_HEADS, seq, DIM), dtype=np.float32)
    q_dense = rng.standard_normal((SEQS, HEADS, 1, DIM), dtype=np.float32)
    q_packed = np.ascontiguousarray(q_dense[:, :, 0])  # [seqs, heads, dim]: one per sequence
    dense = nbkv.LayerKVCache(seq, batch=SEQS, num_kv_heads=KV_HEADS, head_dim=DIM)
    dense.append(K, V)
    paged = {
        f"paged {layout}, {'interleaved' if inter else 'packed'}": paged_copy(
            K, V, BLOCK, grow_by=BLOCK if inter else None, layout=layout
        )
        for layout in ("nhd", "hnd")
        for inter in (False, True)
    }
    for bs in LARGE_BLOCKS:  # pages larger than the prefetch distance, packed
        for layout in ("nhd", "hnd"):
            paged[f"paged {layout}, packed, block {bs}"] = paged_copy(K, V, bs, layout=layout)
    # correctness first, on the benchmark's own data
    want = reference.attention(q_dense.astype(np.float64), K, V)[:, :, 0]
    calls = checked_calls(q_dense, dense, q_packed, paged, want, lambda x: x[:, :, 0])
    result = timed(calls, ROUNDS[quick], rng)
    nbytes = 2 * K.nbytes
    print(
        f"\ndecode attention: {SEQS} sequences x {seq} positions, {HEADS}/{KV_HEADS} heads, "
        f"head_dim {DIM}, float32, K+V {nbytes / 2**20:.0f} MiB; block size {BLOCK} "
        "unless named"
    )
    report(result, "contiguous attention", nbytes)
    return {"seq_len": seq, "bytes": nbytes, "methods": result}


def report(result: dict, base_name: str, nbytes: int | None) -> None:
    """Medians, percentiles, K/V read per second (``nbytes`` per call; None: not shown)
    and throughput against ``base_name``, printed and added to ``result`` (its raw times
    dropped)."""
    base = float(np.median(result[base_name]["ns"]))
    print(
        f"  {'method':34s} {'median ms':>10s} {'p10':>8s} {'p90':>8s} {'GB/s':>6s} "
        f"{'throughput':>11s} {'disturbed':>9s}"
    )
    for name, r in result.items():
        ns = np.array(r["ns"], dtype=np.float64)
        med = float(np.median(ns))
        r.update(
            median_ms=med / 1e6,
            p10_ms=float(np.percentile(ns, 10)) / 1e6,
            p90_ms=float(np.percentile(ns, 90)) / 1e6,
            throughput_vs_contiguous=base / med,
        )
        gb_s = "-"
        if nbytes is not None:
            r["gb_s"] = nbytes / med
            gb_s = f"{r['gb_s']:.1f}"
        print(
            f"  {name:34s} {r['median_ms']:10.2f} {r['p10_ms']:8.2f} {r['p90_ms']:8.2f} "
            f"{gb_s:>6s} {r['throughput_vs_contiguous']:10.2f}x {r['disturbed']:9.0%}"
        )
        del r["ns"]


def prefill_part(quick: bool, rng) -> dict:
    seq, new = SEQ_LEN[quick], PREFILL_NEW[quick]
    K = rng.standard_normal((1, KV_HEADS, seq, DIM), dtype=np.float32)
    V = rng.standard_normal((1, KV_HEADS, seq, DIM), dtype=np.float32)
    q_dense = rng.standard_normal((1, HEADS, new, DIM), dtype=np.float32)
    q_packed = np.ascontiguousarray(q_dense[0].transpose(1, 0, 2))  # [new, heads, dim]
    dense = nbkv.LayerKVCache(seq, batch=1, num_kv_heads=KV_HEADS, head_dim=DIM)
    dense.append(K, V)
    paged = {
        f"paged {layout}, block {bs}": paged_copy(K, V, bs, layout=layout, new=new)
        for layout, bs in (("nhd", BLOCK), ("hnd", BLOCK), ("nhd", 256))
    }
    want = reference.attention(q_dense.astype(np.float64), K, V)[0].transpose(1, 0, 2)
    calls = checked_calls(q_dense, dense, q_packed, paged, want, lambda x: x[0].transpose(1, 0, 2))
    result = timed(calls, PREFILL_ROUNDS[quick], rng)
    print(
        f"\nprefill attention: 1 sequence, its last {new} of {seq} positions new, "
        f"{HEADS}/{KV_HEADS} heads, head_dim {DIM}, float32; packed pools"
    )
    report(result, "contiguous attention", None)  # bound by arithmetic: no GB/s
    return {"seq_len": seq, "new": new, "methods": result}


def write_part(quick: bool, rng) -> dict:
    rounds = WRITE_ROUNDS[quick]
    seq = SEQ_LEN[quick]
    k = rng.standard_normal((SEQS, KV_HEADS, 1, DIM), dtype=np.float32)
    v = rng.standard_normal((SEQS, KV_HEADS, 1, DIM), dtype=np.float32)
    k_rows, v_rows = np.ascontiguousarray(k[:, :, 0]), np.ascontiguousarray(v[:, :, 0])
    dense = nbkv.LayerKVCache(seq + rounds + 8, batch=SEQS, num_kv_heads=KV_HEADS, head_dim=DIM)
    blocks = SEQS * -(-(seq + rounds + 8) // BLOCK)
    paged = nbkv.PagedKVCache(blocks, BLOCK, num_kv_heads=KV_HEADS, head_dim=DIM, dtype="float32")
    sids = [paged.add() for _ in range(SEQS)]
    paged.reserve(dict.fromkeys(sids, seq - 1))
    state = {"step": paged.reserve(dict.fromkeys(sids, 1))}

    def reserve():
        state["step"] = paged.reserve(dict.fromkeys(sids, 1))

    calls = {
        "contiguous append": lambda: dense.append(k, v),
        "paged write": lambda: paged.write(0, state["step"], k_rows, v_rows),
        "paged reserve": reserve,
    }
    times = {m: [] for m in calls}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for method in rng.permutation(list(calls)):
            t0 = NOW()
            calls[method]()
            times[method].append(NOW() - t0)
    base = float(np.median(times["contiguous append"]))
    print(f"\nwrite of a decode step: {SEQS} sequences x 1 position, {KV_HEADS} x {DIM}, K and V")
    print(f"  {'method':20s} {'median us':>10s} {'vs append':>10s}")
    out = {}
    for name, ts in times.items():
        med = float(np.median(ts))
        out[name] = {"median_us": med / 1e3, "vs_append": med / base}
        print(f"  {name:20s} {med / 1e3:10.2f} {med / base:9.2f}x")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1024 positions, few rounds")
    parser.add_argument("--json", help="write the results and machine info here")
    args = parser.parse_args()
    info = machine()
    print(
        f"{info['cpu']} ({info['cpu_count']} cpus), numpy {info['numpy']}, "
        f"numba {info['numba']}, nbkv {info['nbkv']}\n"
    )
    rng = np.random.default_rng(0)
    results = {"memory": memory_part()}
    results["attention"] = attention_part(args.quick, rng)
    # its own generator: the write part's inputs stay those of the runs before it
    results["prefill"] = prefill_part(args.quick, np.random.default_rng(1))
    results["write"] = write_part(args.quick, rng)
    mem16 = results["memory"]["paged_over_data"][16]
    packed = results["attention"]["methods"]["paged nhd, packed"]["throughput_vs_contiguous"]
    inter = results["attention"]["methods"]["paged nhd, interleaved"]["throughput_vs_contiguous"]
    print("\ntargets:")
    verdict = "PASS" if mem16 <= 1.05 else "MISS"
    print(f"{verdict}  paged at block 16 within 5% of the data it holds: {mem16:.3f}")
    for name, x in (("packed", packed), ("interleaved", inter)):
        print(
            f"{'PASS' if x >= 0.9 else 'MISS'}  paged attention (nhd, {name}) >= 0.9x the "
            f"contiguous throughput: {x:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "quick": args.quick, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
