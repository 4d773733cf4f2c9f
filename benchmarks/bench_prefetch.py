"""What a decode step's reads reach when software prefetches drive them: the float32 CPU
kernel against reads of the same bytes, in the same order, with and without the kernel's
prefetches, paired round by round with the plain read.

``bench_attention.py`` takes the kernel's share of a plain parallel read of K and V (its
"read ceiling"). The kernel cannot read that way: it does arithmetic on every row it
reads, so it asks for rows ahead (``nbkv.kernels.cpu_math.prefetch_ahead``: every line
of the row ``cpu_attention._AHEAD`` rows on, into the caches ``PREFETCH_LOCALITY``
names), and without that its reads wait on its arithmetic (see benchmarks/README.md).
This script asks what such prefetches cost a read that does no arithmetic at all.
Contenders, one call each per round (the order reversed every other round), the K/V
copies cycled so that no call finds them in the caches:

- ``read``: ``bench_attention.read_kv``, the read ceiling: per (batch row, KV head), the
  K and V rows summed side by side, on Numba's threads.
- ``blocks``: the kernel's order of reading, per KV head the K rows of a block of
  positions and then its V rows (the float32 decode step's block,
  ``cpu_attention._block_size``), summed, with no prefetch.
- ``blocks + prefetch``: the same, each row prefetching the row ``_AHEAD`` on as the
  kernel does on AVX-512 targets (the library's own ``prefetch_ahead``; on narrower ones
  the kernel prefetches float32 K 16 rows on, ``_AHEAD_32``, and reads float32 V in
  pieces of 8 positions, a line of head_dim a pass, each pass prefetching rows 16 on
  (``cpu_simd.accumulate_lines``): this contender is then not the kernel's order).
- ``blocks + page prefetch``: the same, but only one line of each 4 KiB ahead is asked
  for (a prefetch per eight rows of 512 bytes): the prefetches' number, not their
  presence.
- ``nbkv kernel``: ``nbkv.kernels.attend``, a float32 decode step (32 query heads over
  8 KV heads, head_dim 128), what the others stand beside.
- ``nbkv kernel, rows on a line``: the same over copies of the same K/V whose rows start
  on a cache-line boundary (:func:`on_line`). With glibc, numpy's large arrays, like the
  ordinary copies here, start 16 bytes past one (glibc maps them: a page, then its
  16-byte header), so that every 64-byte vector load of a row (AVX-512's) touches two
  lines; the report says where both kinds of copy start.

Each share is the read's time over the contender's in the same round, apart for the
rounds whose read ran at the memory's fast level and for the others
(``bench_attention.paired_share``: on a shared machine the bandwidth jumps between levels
that last seconds). Every sum is checked against float64 and the kernel against
``nbkv.reference.attention`` before anything is timed; JIT compile time is in no timing.

Usage: ``python benchmarks/bench_prefetch.py [--quick] [--json PATH] [--seq N]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
try:
    import nbkv  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import numba  # noqa: E402
from _machine import machine  # noqa: E402  (this folder is on sys.path)
from bench_attention import READ, paired_share, read_kv  # noqa: E402
from numba import njit, prange  # noqa: E402

from nbkv import reference  # noqa: E402
from nbkv.dtypes import widen_table  # noqa: E402
from nbkv.kernels import attend  # noqa: E402
from nbkv.kernels import cpu_attention as ca  # noqa: E402
from nbkv.kernels.cpu_math import prefetch, prefetch_ahead  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128  # bench_attention's model: group 4
GROUP = HEADS // KV_HEADS
SCALE = 1.0 / math.sqrt(DIM)
TABLE = widen_table(np.dtype(np.float32))
COLD_BYTES = 128 << 20  # read between two calls on one copy: 4x a 32 MiB L3
ROUNDS = {False: 600, True: 6}  # full, --quick
PAGE_ROWS = 4096 // (DIM * 4)  # float32 rows in 4 KiB
SUM_RTOL = 1e-5  # of the sum of magnitudes: float32 sums of 2^23 terms err ~1e-7
ATOL = 1e-4  # the kernel against float64 (outputs ~0.05)
BLOCKS, PREFETCH, PAGES = "blocks", "blocks + prefetch", "blocks + page prefetch"
KERNEL, ON_LINE = "nbkv kernel", "nbkv kernel, rows on a line"
SUMS = (READ, BLOCKS, PREFETCH, PAGES)
LINE = 64  # bytes in a cache line


@njit(fastmath=True)
def _sum_rows(x, ahead, every):
    """Sum of ``x``'s rows; ``ahead`` not 0: as row ``j`` is read, the kernel's prefetch of
    row ``j + ahead`` (every line), for the rows ``j`` that are multiples of ``every``
    (and of its first line only where ``every`` > 1)."""
    acc = np.float32(0.0)
    for j in range(x.shape[0]):
        if ahead != 0 and j % every == 0:
            if every == 1:
                prefetch_ahead(x, j, 1, ahead)
            else:
                prefetch(x, j + ahead, 0)
        for d in range(x.shape[1]):
            acc += x[j, d]
    return acc


@njit(parallel=True, fastmath=True)
def read_blocks(K, V, block, ahead, every):
    """Sum of K and V ([batch, kv_heads, seq, dim]) read as the kernel reads them: per
    (batch row, KV head), the K rows of each block of ``block`` positions, then its V
    rows; prefetching as :func:`_sum_rows` says."""
    batch, heads, seq = K.shape[0], K.shape[1], K.shape[2]
    part = np.zeros(batch * heads, np.float32)
    for task in prange(batch * heads):
        b = task // heads
        h = task - b * heads
        acc = np.float32(0.0)
        for j0 in range(0, seq, block):
            j1 = min(j0 + block, seq)
            acc += _sum_rows(K[b, h, j0:j1], ahead, every)
            acc += _sum_rows(V[b, h, j0:j1], ahead, every)
        part[task] = acc
    return part.sum()


def on_line(x: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``x`` (its values, dtype and shape) whose first element
    starts on a cache-line boundary, and so every row too where a row is a whole number
    of lines (512 bytes here)."""
    raw = np.empty(x.nbytes + LINE, np.uint8)
    start = -raw.ctypes.data % LINE
    y = raw[start : start + x.nbytes].view(x.dtype).reshape(x.shape)
    y[...] = x
    return y


def line_offset(x: np.ndarray) -> int:
    """Bytes from the cache line's start to ``x``'s first element."""
    return x.ctypes.data % LINE


def offsets(pairs) -> list[int]:
    """The distinct :func:`line_offset` of every K and V in ``pairs``, sorted."""
    return sorted({line_offset(x) for pair in pairs for x in pair})


def contenders(q, out, block):
    """name -> f(K, V), every one run on Numba's threads (``ON_LINE`` is the kernel, to
    be given the copies :func:`on_line` makes)."""

    def kernel(k, v):  # a decode step over every position of the copy
        attend(q, k, v, k.shape[2], SCALE, False, 0, TABLE, out)
        return out

    return {
        READ: read_kv,
        BLOCKS: lambda k, v: read_blocks(k, v, block, 0, 1),
        PREFETCH: lambda k, v: read_blocks(k, v, block, ca._AHEAD, 1),
        PAGES: lambda k, v: read_blocks(k, v, block, ca._AHEAD, PAGE_ROWS),
        KERNEL: kernel,
        ON_LINE: kernel,
    }


def check(methods, q, k, v, twins) -> dict:
    """Every sum against float64, the kernel against ``nbkv.reference`` (``ON_LINE`` over
    ``twins``, the same values on line boundaries); max errors."""
    want = float(k.sum(dtype=np.float64) + v.sum(dtype=np.float64))
    scale = float(np.abs(k).sum(dtype=np.float64) + np.abs(v).sum(dtype=np.float64))
    errors = {}
    for name in SUMS:
        got = float(methods[name](k, v))
        errors[name] = abs(got - want) / scale
        assert errors[name] <= SUM_RTOL, f"{name}: sum {got} against {want} in float64"
    assert all(line_offset(x) == 0 and x.strides[-2] % LINE == 0 for x in twins), (
        "the twins' rows do not start on a line"
    )
    assert all(np.array_equal(t, x) for t, x in zip(twins, (k, v), strict=True)), (
        "the twins do not hold the copy's values"
    )
    ref = reference.attention(q.astype(np.float64), k, v, scale=SCALE)
    for name, kv in ((KERNEL, (k, v)), (ON_LINE, twins)):
        errors[name] = float(np.abs(methods[name](*kv) - ref).max())
        assert errors[name] <= ATOL, f"{name}: {errors[name]:.2e} off float64"
    return errors


def measure(methods, copies, twins, rounds) -> dict:
    """Per contender, its time (ns) in each round; every call on its own copy in turn
    (``ON_LINE`` on the copy's twin)."""
    names = list(methods)
    times = {n: [] for n in names}
    c = 0
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            c = (c + 1) % len(copies)
            kv = twins[c] if name == ON_LINE else copies[c]
            t0 = time.perf_counter_ns()
            methods[name](*kv)
            times[name].append(time.perf_counter_ns() - t0)
    return times


def summarise(times, rounds, nbytes) -> dict:
    """Median, p10, GB/s and the paired shares of the read (all rounds count: this
    script runs nothing else beside its contenders)."""
    quiet = {n: np.ones(rounds, dtype=bool) for n in times}
    res = {}
    for name, t in times.items():
        t = np.asarray(t, dtype=np.float64)
        med, p10 = float(np.median(t)), float(np.percentile(t, 10))
        res[name] = {
            "ms": med / 1e6,
            "ms_p10": p10 / 1e6,
            "gb_per_s": nbytes / med,
            **paired_share(times, quiet, name, 1.0, rounds),
        }
    return res


def report(res) -> None:
    w = max(len(name) for name in res)
    head = f"{'contender':<{w}} {'ms':>7} {'p10':>7} {'GB/s':>6} "
    head += f"{'%pair':>6} {'fast':>6} {'others':>6}"
    print(head + "\n" + "-" * len(head))

    def pct(x):
        return f"{x:>5.1f}%" if x is not None else f"{'-':>6}"

    for name, m in res.items():
        print(
            f"{name:<{w}} {m['ms']:>7.2f} {m['ms_p10']:>7.2f} {m['gb_per_s']:>6.1f} "
            f"{pct(m['pct_of_read_paired'])} {pct(m['pct_paired_fast_memory'])} "
            f"{pct(m['pct_paired_slow_memory'])}"
        )
    fast = res[READ]
    print(
        f"\n%pair: the read's time over the contender's in the same round (median of "
        f"{fast['paired_rounds']} rounds); fast: the {fast['fast_memory_rounds']} rounds "
        f"whose read took at most {fast['fast_read_max_us'] / 1e3:.2f} ms (1.25x its "
        "p10), others: the rest"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small cache, few rounds")
    parser.add_argument("--json", help="write the results and machine info here")
    parser.add_argument("--seq", type=int, default=None, help="positions (32768; quick 4096)")
    args = parser.parse_args()
    seq = args.seq or (4096 if args.quick else 32768)
    rounds = ROUNDS[args.quick]
    rng = np.random.default_rng(0)
    info = machine()
    shape = (1, KV_HEADS, seq, DIM)
    nbytes = 2 * int(np.prod(shape)) * 4
    n_copies = max(2, -(-COLD_BYTES // nbytes) + 1)
    q = rng.standard_normal((1, HEADS, 1, DIM), dtype=np.float32)
    out = np.empty_like(q)
    block = int(ca._block_size(GROUP, DIM * 4))
    copies = [
        (rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32))
        for _ in range(n_copies)
    ]
    twins = [(on_line(k), on_line(v)) for k, v in copies]
    methods = contenders(q, out, block)
    t0 = time.perf_counter()
    errors = check(methods, q, *copies[0], twins[0])  # also compiles every contender
    jit_s = time.perf_counter() - t0
    print(
        f"{info['cpu']} ({info['cpu_count']} cpus, {numba.get_num_threads()} Numba threads), "
        f"numpy {info['numpy']}, numba {info['numba']}, nbkv {info['nbkv']}"
    )
    print(
        f"K+V [1, {KV_HEADS}, {seq}, {DIM}] float32, {nbytes / 2**20:.0f} MiB a call, "
        f"{n_copies} copies cycled; blocks of {block} positions, prefetch {ca._AHEAD} rows "
        f"ahead; rows {'/'.join(map(str, offsets(copies)))} bytes into a cache line "
        f"({ON_LINE}: {'/'.join(map(str, offsets(twins)))}); {rounds} rounds; checked "
        f"(compile and check {jit_s:.1f} s): "
        + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
        + "\n"
    )
    times = measure(methods, copies, twins, rounds)
    res = summarise(times, rounds, nbytes)
    report(res)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": info,
                    "quick": args.quick,
                    "config": {
                        "kv_shape": list(shape),
                        "heads": HEADS,
                        "bytes_per_call": nbytes,
                        "copies_cycled": n_copies,
                        "block": block,
                        "prefetch_rows_ahead": ca._AHEAD,
                        "page_rows": PAGE_ROWS,
                        "copies_offset_in_line": offsets(copies),
                        "twins_offset_in_line": offsets(twins),
                        "rounds": rounds,
                        "threads": numba.get_num_threads(),
                    },
                    "max_error": errors,
                    "results": res,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
