"""Decode attention at larger groups, and a few queries at once, on the CPU.

``bench_attention.py`` times the decode step of a group of 4 (32 query / 8 KV heads).
Models go further: Mistral Large has 12 query heads per KV head, Llama-3-405B 16, and a
speculative decoder checks 4-8 draft tokens at once, 16-32 query rows per KV head at
group 4. This script times those shapes: one sequence of ``SEQ_LEN`` positions, head_dim
128, float32 K/V, for each (query heads, KV heads, queries) of ``SHAPES``:

- ``nbkv.attention`` over a ``LayerKVCache`` holding the positions;
- ``nbkv.paged_attention`` over a ``PagedKVCache`` ("nhd", block 16) holding the same;
- torch's SDPA with the queries grouped per KV head (``[1, kv_heads, rows, 128]``, no
  repeated K/V: the faster torch form in ``bench_attention.py``), with a causal mask
  when there are several queries;
- the read ceiling: a parallel sum of the same K/V bytes (``bench_attention.read_kv``).

Each nbkv output is checked against ``nbkv.reference`` (float64) first. Rounds call every
contender once in a fresh random order with the thread pools settled between calls; calls
during which our threads waited for a CPU over 5% of their time are left out
(``bench_paged.timed``). Copies enough to read ``COLD_BYTES`` between two reads of one
are cycled, so that every call reads K/V from memory.

Usage (from the repository root)::

    python benchmarks/bench_groups.py                # full run, about 1.5 minutes
    python benchmarks/bench_groups.py --quick        # smoke run: 1024 positions
    python benchmarks/bench_groups.py --json results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from _machine import machine  # noqa: E402  (this folder is on sys.path)
from bench_attention import COLD_BYTES, read_kv  # noqa: E402
from bench_paged import timed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
try:
    import nbkv
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))
    import nbkv
from nbkv import reference  # noqa: E402
from nbkv.tutorial.paging import paged_copy  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = F = None

DIM, BLOCK = 128, 16
# (query heads, KV heads, queries): decode steps at groups 4 to 32, then 2, 4 and 8
# queries at group 4 (a speculative decoder's check of its draft)
SHAPES = ((32, 8, 1), (32, 4, 1), (48, 4, 1), (64, 4, 1), (64, 2, 1),
          (32, 8, 2), (32, 8, 4), (32, 8, 8))  # fmt: skip
SEQ_LEN = {False: 16384, True: 1024}  # full, quick
ROUNDS = {False: 30, True: 3}
ATOL = 1e-4


class Copy:
    """One sequence's K/V, in a contiguous cache and a paged one, and torch's views."""

    def __init__(self, K, V, n_q):
        self.dense = nbkv.LayerKVCache(K.shape[2], batch=1, num_kv_heads=K.shape[1],
                                       head_dim=DIM)  # fmt: skip
        self.dense.append(K, V)
        self.K, self.V = self.dense.get_kv()
        self.paged, self.step = paged_copy(K, V, BLOCK, new=n_q)
        self.Kt = self.Vt = None
        if torch is not None:
            self.Kt, self.Vt = torch.from_numpy(self.K), torch.from_numpy(self.V)


def torch_grouped(q, kv_heads, mask):
    """torch's SDPA of ``q`` ``[1, heads, n_q, dim]`` with each KV head's queries as one
    block of rows (row ``g * n_q + i``: query ``i`` of the group's head ``g``); ``mask``:
    :func:`causal_rows`, made once, shared by every KV head (None for one query)."""
    _, heads, n_q, dim = q.shape
    qg = torch.from_numpy(q.reshape(1, kv_heads, heads // kv_heads * n_q, dim))
    m = None if mask is None else torch.from_numpy(mask)

    def call(c):
        return F.scaled_dot_product_attention(qg, c.Kt, c.Vt, attn_mask=m)

    return call


def causal_rows(group, n_q, seq_len):
    """The additive float32 mask of :func:`torch_grouped`'s rows, ``[group * n_q,
    seq_len]``: 0 where query ``i`` (row ``g * n_q + i``) sees a position (up to
    ``seq_len - n_q + i``), -inf elsewhere; torch adds it as it is, converting nothing per
    call."""
    i = np.tile(np.arange(n_q), group)[:, None]
    visible = np.arange(seq_len)[None, :] <= seq_len - n_q + i
    return np.where(visible, np.float32(0), np.float32(-np.inf)).astype(np.float32)


def shape_part(heads, kv_heads, n_q, seq_len, rounds, rng) -> dict:
    group = heads // kv_heads
    nbytes = 2 * kv_heads * seq_len * DIM * 4
    n_copies = max(2, -(-COLD_BYTES // nbytes) + 1)
    copies = []
    for _ in range(n_copies):
        K, V = (rng.standard_normal((1, kv_heads, seq_len, DIM), dtype=np.float32)
                for _ in "kv")  # fmt: skip
        copies.append(Copy(K, V, n_q))
    q = rng.standard_normal((1, heads, n_q, DIM), dtype=np.float32)
    q_packed = np.ascontiguousarray(q[0].transpose(1, 0, 2))  # [n_q, heads, dim]
    turn = {"i": 0}

    def cycled(fn):
        def call():
            turn["i"] += 1
            return fn(copies[turn["i"] % n_copies])

        return call

    methods = {
        "nbkv contiguous": lambda c: nbkv.attention(q, c.dense),
        "nbkv paged": lambda c: nbkv.paged_attention(q_packed, c.paged, 0, c.step),
    }
    c0 = copies[0]
    want = reference.attention(q.astype(np.float64), c0.K, c0.V)
    err = max(
        np.abs(methods["nbkv contiguous"](c0) - want).max(),
        np.abs(methods["nbkv paged"](c0).transpose(1, 0, 2)[None] - want).max(),
    )
    if torch is not None:
        mask = None if n_q == 1 else causal_rows(group, n_q, seq_len)
        methods["torch SDPA grp"] = torch_grouped(q, kv_heads, mask)
        got = methods["torch SDPA grp"](c0).numpy().reshape(q.shape)
        err = max(err, np.abs(got - want).max())
    if not err < ATOL:
        raise AssertionError(f"{heads}/{kv_heads} heads, {n_q} queries: max |err| {err:.2e}")
    methods["read ceiling"] = lambda c: read_kv(c.K, c.V)
    result = timed({m: cycled(f) for m, f in methods.items()}, rounds, rng)
    med = {m: float(np.median(r["ns"])) / 1e3 for m, r in result.items()}
    peer = med.get("torch SDPA grp")
    row = {
        "heads": heads, "kv_heads": kv_heads, "queries": n_q, "group": group,
        "rows": group * n_q, "bytes": nbytes, "max_err": float(err),
        "median_us": med,
        "disturbed": {m: r["disturbed"] for m, r in result.items()},
        "vs_torch": {m: peer / med[m] for m in med} if peer else None,
        "share_of_read": {m: med["read ceiling"] / med[m] for m in med},
    }  # fmt: skip
    return row


def report(rows) -> None:
    print(
        f"\n{'heads':>7s} {'q':>2s} {'rows':>4s} {'contender':16s} {'median us':>10s} "
        f"{'vs torch':>8s} {'%read':>6s} {'disturbed':>9s}"
    )
    for r in rows:
        for m, us in r["median_us"].items():
            vs = f"{r['vs_torch'][m]:7.2f}x" if r["vs_torch"] else "       -"
            print(
                f"{r['heads']:>3d}/{r['kv_heads']:<3d} {r['queries']:2d} {r['rows']:4d} "
                f"{m:16s} {us:10.0f} {vs} {100 * r['share_of_read'][m]:5.0f}% "
                f"{100 * r['disturbed'][m]:8.0f}%"
            )
        print()
    print(
        "  median us: of the undisturbed calls. vs torch: torch's median time over this\n"
        "  one's (above 1 is faster). %read: the read ceiling's time over this one's."
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1024 positions, few rounds")
    parser.add_argument("--json", help="write the results and machine info here")
    args = parser.parse_args(argv)
    info = machine(torch)
    seq_len = SEQ_LEN[args.quick]
    print(
        f"{info['cpu']} ({info['cpu_count']} cpus), numpy {info['numpy']}, "
        f"numba {info['numba']}, nbkv {info['nbkv']}, torch {info.get('torch', '-')}\n"
        f"one sequence of {seq_len} positions, head_dim {DIM}, float32 K/V and queries; "
        f"paged: 'nhd', block {BLOCK}; medians over {ROUNDS[args.quick]} rounds"
    )
    rng = np.random.default_rng(0)
    rows = []
    for heads, kv_heads, n_q in SHAPES:
        t0 = time.perf_counter()
        rows.append(shape_part(heads, kv_heads, n_q, seq_len, ROUNDS[args.quick], rng))
        print(f"  {heads}/{kv_heads} heads, {n_q} queries: {time.perf_counter() - t0:.0f} s",
              flush=True)  # fmt: skip
    report(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "quick": args.quick, "results": rows}, f, indent=1)
    return {"machine": info, "results": rows}


if __name__ == "__main__":
    main()
