"""Where a CPU decode step's time goes: the score, softmax and V passes of nbkv's attention
kernel, each timed alone, against the floor that its vector multiply-adds set.

A decode step walks the cache in blocks. Per block and KV head the kernel
(``nbkv.kernels.cpu_attention``) scores the block's K rows against the group's query rows
(``_scores``), turns the scores into weights (``_online_softmax``) and adds the weighted V
rows into the accumulators (``_accumulate_block``: ``_accumulate`` over the block, or in
pieces for 16-bit V: of 32 positions, each sweeping the next in, where vectors are
narrower than AVX-512's, of 64 otherwise). This script times each of the three alone,
on one thread, over K/V that stay in the CPU's caches (1,024 positions: 512 KiB of float32
K, half that at 16 bits), so that memory is out of the figure. It does this for float32,
float16 and bfloat16 caches, with the block size the kernel takes for each. The figure is
nanoseconds per cached position per KV head: what one thread spends on the arithmetic of
one position. The whole task (``attend_serial`` over one KV head, the same positions) is
timed beside the sum of its parts. The three are the kernel module's internals, timed
here on purpose.

The floor: the scores and the V pass each take ``rows x head_dim`` multiply-adds per
position. That is ``2 * rows * head_dim / lanes`` vector FMAs in all: 64 at group 4,
head_dim 128, 16 lanes (AVX-512). A loop of independent FMA chains measures how long one
vector FMA takes at this core's full rate. Last, an estimate of what the arithmetic of a
decode step at ``--seq`` positions costs on Numba's threads (the whole task's ns per
position x positions x KV heads / threads: it assumes the threads scale perfectly and
counts the task's fixed costs as spread over 1,024 positions), to set beside
``bench_attention.py``'s read ceiling: where it comes near the read, the step cannot hide
the one behind the other.

Everything is checked first: the three passes composed over all blocks of one KV head, and
the whole task, must give ``nbkv.reference.attention`` (float64) of the same data; each
timed loop, run once, must give the float64 scores, weights and weighted V sums.

Usage: ``python benchmarks/bench_phases.py [--quick] [--json PATH] [--seq N]``.
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
    import nbkv  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import numba  # noqa: E402
from _machine import machine  # noqa: E402  (this folder is on sys.path)
from llvmlite import ir  # noqa: E402
from numba import njit  # noqa: E402
from numba.core import cgutils, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from nbkv import reference  # noqa: E402
from nbkv.dtypes import widen_table  # noqa: E402
from nbkv.kernels import cpu_attention as ca  # noqa: E402
from nbkv.kernels.cpu_simd import tile_lanes  # noqa: E402

GROUP, DIM, POSITIONS, KV_HEADS = 4, 128, 1024, 8  # one decode step of the benchmarks' model
DTYPES = ("float32", "float16", "bfloat16")
KINDS = {"float32": -1, "float16": 0, "bfloat16": 1}  # cpu_math.kind16's codes
PHASES = ("scores", "softmax", "accumulate")
TOLERANCE = 1e-5  # the composed phases against float64 (outputs ~0.05; float32 errs ~1e-7)


def _chains() -> int:
    """Independent FMA chains: enough to cover the FMA latency on two pipes, few enough
    to stay in registers (32 vector registers with AVX-512, 16 otherwise)."""
    return 24 if tile_lanes() == 16 else 10


def _chain_start(k: int) -> float:
    """Where FMA chain ``k`` starts: distinct, so that LLVM cannot merge two chains, and
    small, so that a round's 1e-7 shows in their sum."""
    return k * 1e-3


@intrinsic
def _fma_loop(typingctx, n):
    """``n`` rounds of :func:`_chains` independent vector FMAs (``tile_lanes()`` lanes),
    nothing else but the loop; returns a lane of their sum so that none is dropped."""
    if not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        lanes, chains = tile_lanes(), _chains()
        f32, f32v = ir.FloatType(), ir.VectorType(ir.FloatType(), tile_lanes())
        intp = context.get_value_type(types.intp)
        count = context.cast(builder, args[0], signature.args[0], types.intp)
        # multiplier from n, so that nothing folds: x = 1 - n * 1e-12 (1.0 in float32 until n
        # nears 10**5); chain k starts at k * 1e-3 and adds y = 1e-7 per round
        x0 = builder.fsub(f32(1.0), builder.fmul(builder.sitofp(count, f32), f32(1e-12)))
        one = builder.insert_element(ir.Constant(f32v, None), x0, ir.IntType(32)(0))
        x = builder.shuffle_vector(
            one,
            ir.Constant(f32v, None),
            ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes),
        )
        y = ir.Constant(f32v, [1e-7] * lanes)
        entry = builder.basic_block
        loop, done = builder.append_basic_block("fma.loop"), builder.append_basic_block("fma.done")
        builder.cbranch(builder.icmp_signed(">", count, intp(0)), loop, done)
        builder.position_at_end(loop)
        i = builder.phi(intp)
        accs = [builder.phi(f32v) for _ in range(chains)]
        fnty = ir.FunctionType(f32v, [f32v, f32v, f32v])
        fma = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fma.v{lanes}f32")
        new = [builder.call(fma, [a, x, y]) for a in accs]
        i_next = builder.add(i, intp(1))
        builder.cbranch(builder.icmp_signed("<", i_next, count), loop, done)
        i.add_incoming(intp(0), entry)
        i.add_incoming(i_next, loop)
        for k, (phi, v) in enumerate(zip(accs, new, strict=True)):
            phi.add_incoming(ir.Constant(f32v, [_chain_start(k)] * lanes), entry)
            phi.add_incoming(v, loop)
        builder.position_at_end(done)
        outs = []
        for k, v in enumerate(new):
            out = builder.phi(f32v)
            out.add_incoming(ir.Constant(f32v, [_chain_start(k)] * lanes), entry)
            out.add_incoming(v, loop)
            outs.append(out)
        total = outs[0]
        for v in outs[1:]:
            total = builder.fadd(total, v)
        return builder.extract_element(total, ir.IntType(32)(0))

    return types.float32(n), codegen


@njit
def _fma_run(n):
    return _fma_loop(n)


def fma_ns(rounds: int) -> float:
    """Nanoseconds per vector FMA at this core's full rate (best of five)."""
    _fma_run(10)
    best = min(_timed(_fma_run, rounds) for _ in range(5))
    return best / (rounds * _chains()) * 1e9


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


@njit
def _run_scores(qs, kb, s, block, kind, reps):
    for _ in range(reps):
        for j0 in range(0, kb.shape[0], block):
            ca._scores(qs, kb[j0 : j0 + block], s, 0, kind, ca._rows_ahead(kb))


@njit
def _run_softmax(s, m, denom, acc, block, positions, reps):
    """The softmax over ``positions // block`` blocks, ``reps`` times, on one buffer: after
    its first pass ``s`` holds weights (at most 1), which the later passes take as scores.
    The instructions are the same (``exp32`` has no branch); only the running maximum no
    longer grows, so the rescaling of ``acc`` is skipped, as in most blocks of a real step."""
    for _ in range(reps):
        for _j0 in range(0, positions, block):
            ca._online_softmax(s, block, m, denom, acc)


@njit
def _run_accumulate(s, vb, acc, block, kind, reps):
    for _ in range(reps):
        for j0 in range(0, vb.shape[0], block):
            ca._accumulate_block(s, vb[j0 : j0 + block], acc, kind, ca._rows_ahead(vb))


@njit
def _compose(qs, kb, vb, block, kind, out):
    """The three phases over every block, as ``_attend_task`` runs them (no mask: every
    position is seen); ``out`` gets the normalised rows."""
    rows, dim = qs.shape
    s = np.empty((rows, block), np.float32)
    m = np.full(rows, -np.inf, np.float32)
    denom = np.zeros(rows, np.float32)
    acc = np.zeros((rows, dim), np.float32)
    for j0 in range(0, kb.shape[0], block):
        j1 = min(j0 + block, kb.shape[0])
        ca._scores(qs, kb[j0:j1], s, 0, kind, ca._rows_ahead(kb))
        ca._online_softmax(s, j1 - j0, m, denom, acc)
        ca._accumulate_block(s, vb[j0:j1], acc, kind, ca._rows_ahead(vb))
    for r in range(rows):
        out[r] = acc[r] / denom[r]


def _data(dtype: str, rng):
    """Queries (scale folded in), K and V as the kernel reads them, their float32 values,
    and the widening table."""
    qs = (rng.standard_normal((GROUP, DIM)) * DIM**-0.5).astype(np.float32)
    k = rng.standard_normal((POSITIONS, DIM)).astype(np.float32)
    v = rng.standard_normal((POSITIONS, DIM)).astype(np.float32)
    if dtype == "float32":
        return qs, k, v, k, v, np.zeros(0, np.float32)
    np_dtype = nbkv_dtype(dtype)
    k16, v16 = k.astype(np_dtype), v.astype(np_dtype)
    table = widen_table(np.dtype(np_dtype))
    return (
        qs,
        k16.view(np.uint16),
        v16.view(np.uint16),
        k16.astype(np.float32),
        v16.astype(np.float32),
        table,
    )


def nbkv_dtype(name: str):
    """The NumPy dtype of a 16-bit cache (bfloat16 by ml_dtypes, as nbkv stores it)."""
    if name == "float16":
        return np.float16
    import ml_dtypes

    return ml_dtypes.bfloat16


def check(dtype: str, rng) -> float:
    """The largest error of the composed phases against float64 attention; raises past
    :data:`TOLERANCE`."""
    qs, kb, vb, kf, vf, table = _data(dtype, rng)
    kind = KINDS[dtype]
    block = ca._block_size(GROUP, DIM * kb.itemsize)
    got = np.empty((GROUP, DIM), np.float32)
    _compose(qs, kb, vb, block, kind, got)
    want = reference.attention(
        qs[None, :, None, :], kf[None, None], vf[None, None], scale=1.0, causal=False
    )[0, :, 0, :]
    err = float(np.max(np.abs(got - want)))
    if not err <= TOLERANCE:
        raise AssertionError(f"{dtype}: the composed phases are {err:.2e} off float64")
    # and the whole task agrees with them
    whole = _whole(qs, kb, vb, table)
    err_whole = float(np.max(np.abs(whole - want)))
    if not err_whole <= TOLERANCE:
        raise AssertionError(f"{dtype}: attend_serial is {err_whole:.2e} off float64")
    return max(err, err_whole)


def _whole(qs, kb, vb, table, reps: int = 0):
    """``attend_serial`` over one KV head, its group's queries as ``qs`` (scale 1). With
    ``reps``, returns the best seconds of five runs of ``reps`` calls instead."""
    q = qs[None, :, None, :].copy()
    kc, vc = kb[None, None], vb[None, None]
    out = np.empty_like(q)
    if not reps:
        ca.attend_serial(q, kc, vc, POSITIONS, 1.0, False, 0, table, out)
        return out[0, :, 0, :]
    run = _repeat_whole
    run(q, kc, vc, table, out, 1)
    return min(_timed(run, q, kc, vc, table, out, reps) for _ in range(5))


@njit
def _repeat_whole(q, kc, vc, table, out, reps):
    for _ in range(reps):
        ca.attend_serial(q, kc, vc, kc.shape[2], 1.0, False, 0, table, out)


def _close(phase: str, dtype: str, got, want) -> None:
    """Raise unless ``got`` matches the float64 ``want`` to float32 rounding."""
    err = float(np.max(np.abs(got - want) / (1.0 + np.abs(want))))
    if not err <= TOLERANCE:
        raise AssertionError(f"{dtype}: the timed {phase} pass is {err:.2e} off float64")


def measure(dtype: str, reps: int, rng) -> dict:
    """ns per position per KV head for each phase and the whole task, best of five."""
    qs, kb, vb, kf, vf, table = _data(dtype, rng)
    kind = KINDS[dtype]
    block = ca._block_size(GROUP, DIM * kb.itemsize)
    assert POSITIONS % block == 0, (POSITIONS, block)  # the wrappers walk whole blocks
    s = np.empty((GROUP, block), np.float32)
    m = np.full(GROUP, -np.inf, np.float32)
    denom = np.zeros(GROUP, np.float32)
    acc = np.zeros((GROUP, DIM), np.float32)
    # each timed wrapper run once and checked: the scores of the last block, its weights
    # from a fresh state, and the V pass of those weights over every block
    q64 = qs.astype(np.float64)
    _run_scores(qs, kb, s, block, kind, 1)
    scores = q64 @ kf[POSITIONS - block :].T.astype(np.float64)
    _close("scores", dtype, s, scores)
    _run_softmax(s, m, denom, acc, block, block, 1)
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    _close("softmax", dtype, s, weights)
    _close("softmax", dtype, denom, weights.sum(axis=1))
    _run_accumulate(s, vb, acc, block, kind, 1)
    v_sum = vf.astype(np.float64).reshape(-1, block, DIM).sum(axis=0)  # every block, same s
    _close("accumulate", dtype, acc, s.astype(np.float64) @ v_sum)
    runs = {
        "scores": (_run_scores, (qs, kb, s, block, kind, reps)),
        "softmax": (_run_softmax, (s, m, denom, acc, block, POSITIONS, reps)),
        "accumulate": (_run_accumulate, (s, vb, acc, block, kind, reps)),
    }
    per = reps * POSITIONS
    out = {"block": block}
    for name, (fn, args) in runs.items():
        out[f"{name}_ns"] = min(_timed(fn, *args) for _ in range(5)) / per * 1e9
    out["phases_ns"] = sum(out[f"{p}_ns"] for p in PHASES)
    out["whole_ns"] = _whole(qs, kb, vb, table, reps) / per * 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (a smoke run)")
    parser.add_argument("--json", help="write the results and machine info here")
    parser.add_argument("--seq", type=int, default=32768, help="positions of the step priced")
    args = parser.parse_args()
    reps = 4 if args.quick else 400
    rng = np.random.default_rng(0)
    info = machine()
    lanes = tile_lanes()
    threads = numba.get_num_threads()
    print(
        f"{info['cpu']} ({info['cpu_count']} cpus), numpy {info['numpy']}, "
        f"numba {info['numba']}, nbkv {info['nbkv']}; {lanes}-lane vectors, one thread"
    )
    errors = {d: check(d, rng) for d in DTYPES}
    print("checked against float64: " + ", ".join(f"{d} {e:.1e}" for d, e in errors.items()))
    fma = fma_ns(2_000_000 if not args.quick else 200_000)
    fmas = 2 * GROUP * DIM / lanes  # vector FMAs per position: scores and V pass
    floor = fmas * fma
    print(
        f"vector FMA at full rate: {fma:.3f} ns ({1 / fma:.2f} per ns); "
        f"{fmas:.0f} per position (group {GROUP}, head_dim {DIM}): floor {floor:.2f} ns"
    )
    print(
        f"\nns per position per KV head, K/V in cache ({POSITIONS} positions), one thread;"
        f" the step: {args.seq} positions x {KV_HEADS} KV heads on {threads} threads"
    )
    head = f"{'cache':<9} {'block':>5} " + " ".join(f"{p:>10}" for p in PHASES)
    print(head + f" {'sum':>7} {'whole':>7} {'floor/whole':>11} {'step ms':>8}")
    results = {}
    for dtype in DTYPES:
        r = measure(dtype, reps, rng)
        r["floor_share"] = floor / r["whole_ns"]
        r["step_ms"] = r["whole_ns"] * args.seq * KV_HEADS / threads / 1e6
        results[dtype] = r
        print(
            f"{dtype:<9} {r['block']:>5} "
            + " ".join(f"{r[f'{p}_ns']:>10.2f}" for p in PHASES)
            + f" {r['phases_ns']:>7.2f} {r['whole_ns']:>7.2f} {r['floor_share']:>11.0%}"
            + f" {r['step_ms']:>8.2f}"
        )
    print(
        "\nfloor/whole: the share of the task's time its vector FMAs need at full rate;"
        " step ms: an estimate of one decode step's arithmetic, memory aside"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": info,
                    "quick": args.quick,
                    "config": {
                        "group": GROUP,
                        "head_dim": DIM,
                        "positions_in_cache": POSITIONS,
                        "kv_heads": KV_HEADS,
                        "seq_priced": args.seq,
                        "lanes": lanes,
                        "threads": threads,
                        "reps": reps,
                    },
                    "fma_ns": fma,
                    "fmas_per_position": fmas,
                    "floor_ns": floor,
                    "max_error": errors,
                    "results": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
