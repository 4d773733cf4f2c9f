"""Probe: the CPU kernels with ``cpu_attention._FEW_ROWS`` as it is against another value,
paired in one process.

``_FEW_ROWS`` decides which query rows per KV head take the decode tiles (at most that
many) and which ``cpu_prefill``'s matrix products (more, where they apply: AVX2 and
narrower). Numba freezes a module's globals when it compiles, so this probe copies
``cpu_attention.py`` and ``cpu_paged.py`` into ``nbkv/kernels/`` under other names with
the other value (removed again at the end), imports both versions and times them call for
call in random order, each call on one of three copies of K/V (read cold: 64 MiB each at
32/8 heads). Every output is checked against the current version's first (float32
tolerance). Not a benchmark of the suite (``python -m benchmarks`` runs ``bench_*.py``
only): it compares two versions of the code, which the suite never has at once.

Usage (from the repository root; about 8 minutes, two compiles included)::

    python benchmarks/probe_few_rows.py            # against 8, the value before 2026-12-07
    python benchmarks/probe_few_rows.py --other 64
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
try:
    import nbkv  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
from nbkv.dtypes import widen_table  # noqa: E402
from nbkv.kernels import cpu_attention, cpu_paged  # noqa: E402

KERNELS = ROOT / "nbkv" / "kernels"
DIM, SEQ, ROUNDS = 128, 8192, 16
SCALE = 1 / math.sqrt(DIM)
# (query heads, KV heads, queries) of the contiguous kernel, one sequence of SEQ positions
SHAPES = ((48, 4, 1), (32, 8, 3), (64, 4, 1), (32, 32, 16), (32, 8, 4), (64, 4, 2),
          (32, 8, 8), (32, 8, 12), (64, 4, 4), (32, 8, 16), (32, 8, 24))  # fmt: skip
# (query heads, KV heads) of the paged kernel's decode step: 8 sequences of 2,048 positions
PAGED = ((64, 4), (48, 4), (32, 2), (32, 8))
PAGED_SEQS, PAGED_LEN, BLOCK = 8, 2048, 16


def other_versions(value: int):
    """``(cpu_attention, cpu_paged)`` compiled with ``_FEW_ROWS = value``."""
    att = (KERNELS / "cpu_attention.py").read_text()
    att = att.replace(f"_FEW_ROWS = {cpu_attention._FEW_ROWS}\n", f"_FEW_ROWS = {value}\n")
    paged = (KERNELS / "cpu_paged.py").read_text()
    paged = paged.replace(
        "from .cpu_attention import _FEW_ROWS,", "from ._probe_attention import _FEW_ROWS,"
    )
    for name, text in (("_probe_attention", att), ("_probe_paged", paged)):
        (KERNELS / f"{name}.py").write_text(text)
    a = importlib.import_module("nbkv.kernels._probe_attention")
    p = importlib.import_module("nbkv.kernels._probe_paged")
    assert a._FEW_ROWS == value and p._FEW_ROWS == value
    return a, p


def paired(calls: dict, rounds: int, rng) -> dict:
    """Median ns of each call, timed in a fresh random order each round."""
    times = {n: [] for n in calls}
    for r in range(rounds):
        for i, n in enumerate(rng.permutation(list(calls))):
            t = time.perf_counter_ns()
            calls[n](r + i)
            times[n].append(time.perf_counter_ns() - t)
    return {n: statistics.median(t) for n, t in times.items()}


def contiguous(old, dtype: str, rng) -> None:
    table = widen_table(np.dtype(dtype))
    for heads, kv_heads, n_q in SHAPES:
        copies = []
        for _ in range(3):
            K, V = (rng.standard_normal((1, kv_heads, SEQ, DIM), dtype=np.float32)
                    for _ in "kv")  # fmt: skip
            if dtype == "float16":
                K, V = (x.astype(np.float16).view(np.uint16) for x in (K, V))
            copies.append((K, V))
        q = rng.standard_normal((1, heads, n_q, DIM), dtype=np.float32)
        outs = {"now": np.empty_like(q), "other": np.empty_like(q)}
        fns = {"now": cpu_attention.attend, "other": old.attend}

        def call(name, i, q=q, copies=copies, outs=outs, fns=fns):
            K, V = copies[i % 3]
            fns[name](q, K, V, SEQ, SCALE, True, 0, table, outs[name])

        call("now", 0)
        call("other", 0)
        np.testing.assert_allclose(outs["other"], outs["now"], atol=2e-5, rtol=0)
        med = paired({n: (lambda i, n=n: call(n, i)) for n in fns}, ROUNDS, rng)
        rows = heads // kv_heads * n_q
        print(
            f"contiguous {dtype:8s} {heads:2d}/{kv_heads:<2d} heads, {n_q:2d} queries, "
            f"{rows:3d} rows: other {med['other'] / 1e6:6.2f} ms, now {med['now'] / 1e6:6.2f}"
            f" ms: {med['other'] / med['now']:.2f}x",
            flush=True,
        )


def paged_decode(old_paged, rng) -> None:
    i32 = np.int32
    pages = PAGED_LEN // BLOCK
    for heads, kv_heads in PAGED:
        pools = [rng.standard_normal((PAGED_SEQS * pages, BLOCK, kv_heads, DIM))
                 .astype(np.float32) for _ in "kv"]  # fmt: skip
        table = rng.permutation(PAGED_SEQS * pages).astype(i32)
        q = rng.standard_normal((PAGED_SEQS, heads, DIM)).astype(np.float32)
        args = (np.arange(PAGED_SEQS + 1, dtype=i32), (np.arange(PAGED_SEQS + 1) * pages)
                .astype(i32), table, np.full(PAGED_SEQS, PAGED_LEN, i32), DIM**-0.5, 0)  # fmt: skip
        outs = {"now": np.empty_like(q), "other": np.empty_like(q)}
        fns = {"now": cpu_paged.paged_attend, "other": old_paged.paged_attend}

        def call(name, i, q=q, pools=pools, args=args, outs=outs, fns=fns):
            fns[name](q, *pools, *args, outs[name], None, 1)

        call("now", 0)
        call("other", 0)
        np.testing.assert_allclose(outs["other"], outs["now"], atol=2e-5, rtol=0)
        med = paired({n: (lambda i, n=n: call(n, i)) for n in fns}, 2 * ROUNDS, rng)
        print(
            f"paged nhd  float32  {heads:2d}/{kv_heads:<2d} heads, group {heads // kv_heads:2d}"
            f": other {med['other'] / 1e6:6.2f} ms, now {med['now'] / 1e6:6.2f} ms: "
            f"{med['other'] / med['now']:.2f}x",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", type=int, default=8, help="the other _FEW_ROWS (8)")
    args = parser.parse_args(argv)
    print(
        f"_FEW_ROWS now {cpu_attention._FEW_ROWS}, other {args.other}; ratios: the other's "
        "median time over the current one's (above 1: the current is faster)"
    )
    try:
        old, old_paged = other_versions(args.other)
        rng = np.random.default_rng(0)
        for dtype in ("float32", "float16"):
            contiguous(old, dtype, rng)
        paged_decode(old_paged, rng)
    finally:
        for name in ("_probe_attention", "_probe_paged"):
            (KERNELS / f"{name}.py").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
