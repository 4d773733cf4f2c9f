"""Measurement helpers for the tutorials: medians after warm-up, bandwidth probes, JIT cost.

Everything here runs on the CPU and returns plain numbers, so that a notebook can quote
ratios from one run. Times are wall-clock (``time.perf_counter``); a bandwidth is bytes
counted explicitly, divided by a median time.

Example
-------
>>> import numpy as np
>>> from nbkv.tutorial.timing import time_call
>>> x = np.ones(1000)
>>> t = time_call(x.sum, repeats=5, warmup=1)
>>> t.repeats, t.median_s > 0
(5, True)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

__all__ = [
    "Timing",
    "time_call",
    "time_calls",
    "gb_per_s",
    "read_sum",
    "read_bandwidth",
    "copy_bandwidth",
    "peak_flops",
    "attention_flops",
    "attention_bytes",
    "roofline",
    "numpy_grouped_attention",
    "torch_grouped_attention",
    "causal_mask",
    "jit_first_call",
]

GB = 1e9  # bandwidths are in GB/s (10^9 bytes per second), as memory vendors quote them


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of repeated calls of one function.

    ``first_s`` is the first warm-up call (it includes any JIT compile or first-touch page
    faults); ``median_s``, ``p10_s`` and ``p90_s`` are over the timed calls only.
    """

    median_s: float
    p10_s: float
    p90_s: float
    first_s: float
    repeats: int

    @property
    def median_us(self) -> float:
        return self.median_s * 1e6


def time_call(
    fn: Callable[[], object],
    *,
    repeats: int = 7,
    warmup: int = 2,
    before: Callable[[], object] | None = None,
) -> Timing:
    """Call ``fn()`` ``warmup`` times untimed, then ``repeats`` times timed; medians.

    Parameters
    ----------
    fn : callable with no arguments
        The operation timed; its result is discarded.
    repeats : int
        Timed calls (at least 1).
    warmup : int
        Untimed calls first (at least 1): JIT compiles, buffers are touched, thread pools
        wake. The first of them is reported as ``first_s``.
    before : callable, optional
        Called, untimed, before every call of ``fn`` (reset a cursor, rotate buffers).

    Returns
    -------
    Timing
    """
    if repeats < 1 or warmup < 1:
        raise ValueError(f"repeats and warmup must be >= 1, got {repeats} and {warmup}")
    first = math.nan
    for i in range(warmup):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        if i == 0:
            first = time.perf_counter() - t0
    times = np.empty(repeats)
    for i in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    return Timing(
        median_s=float(np.median(times)),
        p10_s=float(np.percentile(times, 10)),
        p90_s=float(np.percentile(times, 90)),
        first_s=first,
        repeats=repeats,
    )


def time_calls(
    fns: dict[str, Callable[[], object]],
    *,
    repeats: int = 7,
    warmup: int = 2,
    before: dict[str, Callable[[], object] | None] | None = None,
) -> dict[str, Timing]:
    """:func:`time_call` for several methods, their calls interleaved round by round.

    Each round calls every method once, in a rotated order, so that a burst of load from
    other jobs on a shared machine falls on all methods alike instead of on whichever was
    being timed at the time. ``before`` maps a method's name to its untimed setup call.

    Returns
    -------
    dict
        name -> :class:`Timing`, in the order of ``fns``.
    """
    if repeats < 1 or warmup < 1:
        raise ValueError(f"repeats and warmup must be >= 1, got {repeats} and {warmup}")
    names = list(fns)
    before = before or {}
    first = {}
    times = {name: np.empty(repeats) for name in names}
    for r in range(warmup + repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            setup = before.get(name)
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fns[name]()
            dt = time.perf_counter() - t0
            if r == 0:
                first[name] = dt
            elif r >= warmup:
                times[name][r - warmup] = dt
    return {
        name: Timing(
            median_s=float(np.median(t)),
            p10_s=float(np.percentile(t, 10)),
            p90_s=float(np.percentile(t, 90)),
            first_s=first[name],
            repeats=repeats,
        )
        for name, t in times.items()
    }


def gb_per_s(nbytes: float, seconds: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second) of ``nbytes`` moved in ``seconds``."""
    return nbytes / seconds / GB


@njit(parallel=True, fastmath=True, cache=True)
def read_sum(x):
    """Sum of a 1-D float32 array, in parallel chunks: a read with almost no arithmetic.

    ``fastmath`` lets the additions be reordered into vector lanes, so the loop is bound
    by how fast memory delivers ``x``, not by the adds.
    """
    n = x.size
    chunks = 64  # more chunks than threads, so that threads finish together
    step = (n + chunks - 1) // chunks
    part = np.zeros(chunks, np.float32)
    for c in prange(chunks):
        # a slice with a plain 0..size loop: Numba vectorises this form, not a loop over
        # range(start, stop) (that one read 10x slower in a probe)
        y = x[c * step : min(n, (c + 1) * step)]
        acc = np.float32(0.0)
        for i in range(y.size):
            acc += y[i]
        part[c] = acc
    return part.sum()


def _seconds(t: Timing, best: bool) -> float:
    """The median call, or with ``best`` the fastest tenth (``p10_s``): a ceiling is what
    the machine can do, and on a shared machine the slower calls measure other jobs."""
    return t.p10_s if best else t.median_s


def read_bandwidth(nbytes: int = 256 << 20, *, repeats: int = 5, best: bool = False) -> float:
    """Measured read bandwidth in GB/s: :func:`read_sum` over ``nbytes`` of float32.

    Choose ``nbytes`` several times the last-level cache (the default, 256 MiB) to measure
    main memory; a small array measures the caches instead. ``best``: from the fastest
    tenth of the calls rather than the median.
    """
    x = np.ones(max(1, nbytes // 4), np.float32)
    t = time_call(lambda: read_sum(x), repeats=repeats, warmup=2)
    return gb_per_s(x.nbytes, _seconds(t, best))


def copy_bandwidth(nbytes: int = 256 << 20, *, repeats: int = 5, best: bool = False) -> float:
    """Measured copy bandwidth in GB/s: ``np.copyto`` of ``nbytes`` into another array.

    Bytes counted: ``2 * nbytes`` (each byte read once and written once), the convention
    of the STREAM "copy" figure; the CPU may move more (a written line is often read first).
    ``best``: from the fastest tenth of the calls rather than the median.
    """
    src = np.ones(max(1, nbytes // 4), np.float32)
    dst = np.zeros_like(src)  # touched, so no timed call pays for page faults
    t = time_call(lambda: np.copyto(dst, src), repeats=repeats, warmup=2)
    return gb_per_s(2 * src.nbytes, _seconds(t, best))


def peak_flops(n: int = 1024, *, repeats: int = 5, best: bool = False) -> float:
    """Measured float32 compute ceiling in GFLOP/s: a ``n x n`` matrix product through BLAS.

    A tuned matrix multiply (OpenBLAS or MKL behind NumPy's ``@``) is the fastest arithmetic
    a program on this machine can do: it keeps the vector units fed from registers and
    caches, within a few percent of the cores' peak. Counted as ``2 n^3`` FLOP (a multiply
    and an add per term). The number of threads is whatever NumPy's BLAS is allowed
    (``threadpoolctl.threadpool_limits``). ``best``: from the fastest tenth of the calls
    rather than the median.
    """
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty_like(a)
    t = time_call(lambda: np.matmul(a, b, out=out), repeats=repeats, warmup=2)
    return 2.0 * n**3 / _seconds(t, best) / GB


def _visible_pairs(n_q: int, seq_len: int, causal: bool) -> int:
    """(query, position) pairs attention computes when the queries are the last ``n_q``
    of ``seq_len`` positions: each sees the positions up to its own when ``causal``."""
    if not causal:
        return n_q * seq_len
    first = seq_len - n_q
    return n_q * (first + 1) + n_q * (n_q - 1) // 2


def attention_flops(
    n_q: int, seq_len: int, *, heads: int, head_dim: int, batch: int = 1, causal: bool = True
) -> int:
    """FLOPs of attention for ``n_q`` queries per head over ``seq_len`` cached positions.

    Each visible (query, position) pair costs ``2 * head_dim`` for its score (``q . k``) and
    ``2 * head_dim`` for its share of the output (``p * v``): ``4 * head_dim`` per pair and
    query head. The softmax's ``exp`` and sums are not counted (a few FLOP per pair, not
    per dimension). With ``causal`` the queries are the last ``n_q`` positions (a decode
    step has ``n_q = 1``; a prefill chunk appends ``n_q`` positions then attends).
    """
    return 4 * batch * heads * head_dim * _visible_pairs(n_q, seq_len, causal)


def attention_bytes(
    n_q: int,
    seq_len: int,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    itemsize: int = 4,
    batch: int = 1,
) -> int:
    """The least bytes attention must move: every cached K and V row read once, the queries
    read and the output written once. Grouped-query heads share their KV head's rows, so
    K/V are counted per KV head, not per query head."""
    kv = 2 * batch * kv_heads * seq_len * head_dim * itemsize
    q_and_out = 2 * batch * heads * n_q * head_dim * itemsize
    return kv + q_and_out


def roofline(intensity, peak_gflops: float, bandwidth_gbs: float):
    """The roofline model's attainable GFLOP/s at ``intensity`` FLOP per byte.

    A kernel that does ``I`` FLOP per byte it moves can run no faster than the memory
    delivers bytes (``bandwidth * I``) nor faster than the arithmetic units (``peak``):
    ``min(peak, bandwidth * I)``. The two roofs meet at the ridge point
    ``peak / bandwidth``; left of it a kernel is memory-bound, right of it compute-bound.
    """
    return np.minimum(peak_gflops, bandwidth_gbs * np.asarray(intensity, dtype=np.float64))


def numpy_grouped_attention(q, K, V, scale: float | None = None) -> np.ndarray:
    """Decode attention in plain NumPy, as a user would write it: the NumPy peer.

    q: [batch, num_heads, n_q, head_dim]; K, V: [batch, num_kv_heads, seq_len, head_dim].
    The query heads of a group are reshaped into rows of one matmul per KV head (no
    repeated K/V); softmax is stabilised by subtracting the row maximum. No mask: every
    query sees every position (right for a decode step, ``n_q == 1``).
    """
    b, hq, n_q, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.reshape(b, K.shape[1], hq // K.shape[1] * n_q, d)  # [b, kv_heads, group, d]
    s = (qg @ K.swapaxes(-1, -2)) * np.asarray(scale, q.dtype)  # [b, kv_heads, group, S]
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return (w @ V).reshape(b, hq, n_q, d)


def torch_grouped_attention(q, K, V, mask=None):
    """``scaled_dot_product_attention`` with the query heads grouped: the torch peer.

    q: torch tensor [batch, num_heads, n_q, head_dim]; K, V: [batch, num_kv_heads, seq_len,
    head_dim]. The group's query heads become query rows of their KV head, so K/V are not
    repeated (faster on the CPU than ``enable_gqa=True``). With ``n_q == 1`` (a decode
    step) no mask is needed; for a prefill chunk pass ``mask=causal_mask(n_q, seq_len,
    group)`` (torch's own ``is_causal`` aligns queries with the *first* positions).
    """
    import torch.nn.functional as F

    b, hq, n_q, d = q.shape
    qg = q.reshape(b, K.shape[1], hq // K.shape[1] * n_q, d)
    return F.scaled_dot_product_attention(qg, K, V, attn_mask=mask).reshape(b, hq, n_q, d)


def causal_mask(n_q: int, seq_len: int, group: int):
    """Boolean torch mask for :func:`torch_grouped_attention`: the ``n_q`` queries are the
    last positions of ``seq_len`` and each sees the positions up to its own; rows repeat for
    the ``group`` query heads of a KV head (row ``g * n_q + i`` is member ``g``'s query ``i``)."""
    import torch

    first = seq_len - n_q
    mask = torch.arange(seq_len)[None, :] <= torch.arange(first, seq_len)[:, None]
    return mask.repeat(group, 1)


_PROBE = """
import json, time
t0 = time.perf_counter()
import numpy as np
import nbkv
t1 = time.perf_counter()
q = np.ones((1, {heads}, 1, {head_dim}), np.float32)
K = np.ones((1, {kv_heads}, 16, {head_dim}), np.float32)
t2 = time.perf_counter()
nbkv.attention(q, (K, K.copy()))
t3 = time.perf_counter()
nbkv.attention(q, (K, K.copy()))
t4 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "first_call_s": t3 - t2, "second_call_s": t4 - t3}}))
"""


def jit_first_call(
    cache_dir: str | None = None, *, heads: int = 32, kv_heads: int = 8, head_dim: int = 128
) -> dict:
    """Time ``import nbkv`` and the first two ``nbkv.attention`` calls in a fresh process.

    The child process runs with ``NUMBA_CACHE_DIR=cache_dir``: an empty directory makes
    the first call compile every kernel it needs (and write them there); a directory a
    previous call filled makes it load them from disk (what ``cache=True`` buys). With
    ``cache_dir=None`` a new empty directory is used and removed afterwards.

    Returns
    -------
    dict
        ``import_s``, ``first_call_s``, ``second_call_s`` (seconds, measured in the child).
    """
    code = _PROBE.format(heads=heads, kv_heads=kv_heads, head_dim=head_dim)

    def run(where: str) -> dict:
        env = dict(os.environ, NUMBA_CACHE_DIR=where)
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    if cache_dir is not None:
        return run(cache_dir)
    with tempfile.TemporaryDirectory(prefix="nbkv-numba-cache-") as tmp:
        return run(tmp)
