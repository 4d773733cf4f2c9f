"""The synthetic append demo behind ``python -m nbkv append-demo`` (re-exported by
:mod:`nbkv.demo`).

:func:`run_append_demo` is a prefill and decode loop over a model-shaped cache with no
model: three ways of keeping K/V are timed in the same run. nbkv's ``KVCache`` and NumPy
slice assignment into preallocated arrays with a hand-kept cursor take turns at every
decode step (in a fresh random order, so that machine noise hits both alike); growth by
``np.concatenate`` (what naive code does; done with :func:`nbkv.reference.append`, which is
exactly that) decodes the same tokens in a pass of its own, since its copies of the whole
cache would flush the CPU caches between the other two. At the end nbkv's buffers are
checked bit for bit against the concatenated reference.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import reference
from ._units import human_bytes
from ._validate import positive_int
from .backends import to_host
from .errors import InvalidArgumentError
from .kernels import cpu as cpu_kernels
from .kvcache import KVCache
from .layout import buffer_shape, seq_index

__all__ = ["APPEND_METHODS", "run_append_demo"]

APPEND_METHODS = ("nbkv", "numpy_slice", "concatenate")
_LABELS = {
    "nbkv": "nbkv KVCache",
    "numpy_slice": "NumPy slice (manual cursor)",
    "concatenate": "np.concatenate growth",
}


def _randn(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    # shifted normal data: never zeros, which would hide unwritten memory
    return (rng.standard_normal(shape, dtype=np.float32) + 0.5).astype(dtype)


def _ratio_line(name: str, a: float, b: float) -> str:
    if a <= b:
        return f"  nbkv vs {name}: {a / b:.2f}x the time ({b / a:.1f}x faster)"
    return f"  nbkv vs {name}: {a / b:.2f}x the time (nbkv slower by {(a / b - 1) * 100:.0f}%)"


def run_append_demo(
    *,
    num_layers: int = 8,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    batch: int = 1,
    prompt_len: int = 512,
    new_tokens: int = 256,
    max_seq_len: int | None = None,
    dtype: Any = "float32",
    device: str = "cpu",
    layout: str = "bhsd",
    seed: int = 0,
    out: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Prefill then decode into a ``KVCache``, timing nbkv against two NumPy ways.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim, batch : int
        The model's shape; every layer gets K and V of
        ``[batch, num_kv_heads, max_seq_len, head_dim]`` (in ``layout``).
    prompt_len : int
        Positions appended to every layer at once (the prefill).
    new_tokens : int
        Decode steps; each appends one position to every layer.
    max_seq_len : int, optional
        Capacity; default ``prompt_len + new_tokens``.
    dtype, device, layout
        As for :class:`nbkv.LayerKVCache`. On ``device="cuda"`` the NumPy ways stay on
        the host and nbkv copies each host array to the device per append.
    seed : int
        Seed of ``numpy.random.default_rng`` for the K/V data.
    out : callable
        Receives each line of the report.

    Returns
    -------
    dict
        ``seq_len``, ``prefill_seq_len``, ``max_seq_len``, ``nbytes`` (nbkv's buffers),
        ``concat_nbytes`` and ``concat_peak_nbytes`` (what concatenation holds at the end
        and needs at its peak), ``compile_s``, ``prefill_ms``, ``median_us`` and
        ``p90_us`` (per decode token, all layers; each a dict keyed by method:
        ``"nbkv"``, ``"numpy_slice"``, ``"concatenate"``), ``ratio_vs_numpy_slice`` and
        ``ratio_vs_concatenate`` (nbkv's median time over the other's; below 1 means
        nbkv is faster) and ``config``.

    Raises
    ------
    KVCacheError
        A size, dtype, device or layout nbkv does not accept.
    AssertionError
        If nbkv's K/V differ from the concatenated reference in any layer.

    Examples
    --------
    >>> from nbkv.demo import run_append_demo
    >>> lines = []
    >>> r = run_append_demo(num_layers=2, num_kv_heads=2, head_dim=8, prompt_len=3,
    ...                     new_tokens=2, out=lines.append)
    >>> r["seq_len"], r["nbytes"]
    (5, 1280)
    """
    run = _AppendRun(
        num_layers, num_kv_heads, head_dim, batch, prompt_len, new_tokens, max_seq_len,
        dtype, device, layout, seed, out,
    )  # fmt: skip
    compile_s, how = run.warm_up()
    out(f"JIT: first append {compile_s:.3f} s ({how}; in no timing below)")
    prefill_ms = run.prefill()
    times = run.decode()
    run.check()
    return run.report(compile_s, prefill_ms, times)


class _AppendRun:
    """One run of :func:`run_append_demo`: its cache, the NumPy ways' arrays, and the
    steps (warm-up, prefill, decode, check, report) in the order the demo takes them."""

    def __init__(
        self, num_layers, num_kv_heads, head_dim, batch, prompt_len, new_tokens, max_seq_len,
        dtype, device, layout, seed, out,
    ) -> None:  # fmt: skip
        self.prompt_len = prompt_len = positive_int(prompt_len, "prompt_len")
        self.new_tokens = new_tokens = positive_int(new_tokens, "new_tokens")
        total = prompt_len + new_tokens
        max_seq_len = total if max_seq_len is None else positive_int(max_seq_len, "max_seq_len")
        if max_seq_len < total:
            raise InvalidArgumentError(
                f"max_seq_len must hold prompt_len + new_tokens = {total} positions, "
                f"got {max_seq_len}"
            )
        # the cache validates every other argument before anything is allocated
        self.cache = KVCache(
            num_layers, max_seq_len, batch=batch, num_kv_heads=num_kv_heads,
            head_dim=head_dim, dtype=dtype, device=device, layout=layout,
        )  # fmt: skip
        self.max_seq_len, self.dt, self.L = max_seq_len, self.cache.dtype, num_layers
        self.batch, self.num_kv_heads, self.head_dim = batch, num_kv_heads, head_dim
        self.device, self.layout, self.seed, self.out = device, layout, seed, out
        self.rng = np.random.default_rng(seed)
        self.cuda = device == "cuda"
        self.sync: Callable[[], Any] = lambda: None
        if self.cuda:
            from numba import cuda as numba_cuda

            self.sync = numba_cuda.synchronize  # stop no clock before the device is done
        out(
            f"nbkv append-demo: {num_layers} layers x {num_kv_heads} kv heads x head_dim "
            f"{head_dim}, batch {batch}, {self.dt}, layout {layout}, device {device}"
        )
        out(
            f"  prompt {prompt_len} + {new_tokens} new tokens, max_seq_len {max_seq_len}, "
            f"seed {seed}"
        )
        if self.cuda:
            out("  nbkv caches live on the GPU: each append copies its host arrays to the device;")
            out("  the NumPy ways stay on the host")

    def _shape(self, positions: int) -> tuple[int, ...]:
        return buffer_shape(self.layout, self.batch, self.num_kv_heads, positions, self.head_dim)

    def warm_up(self) -> tuple[float, str]:
        """The first append's seconds (it compiles the kernel, or loads it from Numba's
        on-disk cache) and which of these it did; then the fast paths warmed, off the
        clock."""
        warm = KVCache(
            1, 4, batch=self.batch, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            dtype=self.dt, device=self.device, layout=self.layout,
        )  # fmt: skip
        one = _randn(self.rng, self._shape(1), self.dt)
        kernel = None
        if not self.cuda:
            kernel = cpu_kernels.write_kv_bshd if self.layout == "bshd" else cpu_kernels.write_kv
        seen = None if kernel is None else (len(kernel.overloads), _hits(kernel))
        t0 = time.perf_counter_ns()
        warm[0].append(one, one)
        self.sync()
        compile_s = (time.perf_counter_ns() - t0) / 1e9
        how = "compile or cache load"
        if seen is not None:
            if len(kernel.overloads) == seen[0]:
                how = "already compiled in this process"
            elif _hits(kernel) > seen[1]:
                how = "loaded from Numba's on-disk cache"
            else:
                how = "compiled"
        for _ in range(3):  # warm the fast path and the NumPy ways too, off the clock
            warm[0].append(one, one)
            reference.append(one, one, one, one, self.layout)
        self.sync()
        return compile_s, how

    def prefill(self) -> dict[str, float]:
        """``prompt_len`` positions into every layer by each method; milliseconds each."""
        L, dt, layout, cache = self.L, self.dt, self.layout, self.cache
        kp = _randn(self.rng, (L,) + self._shape(self.prompt_len), dt)
        vp = _randn(self.rng, kp.shape, dt)
        Ks = self.Ks = [np.empty(self._shape(self.max_seq_len), dt) for _ in range(L)]
        Vs = self.Vs = [np.empty(self._shape(self.max_seq_len), dt) for _ in range(L)]
        Kc, Vc = self.Kc, self.Vc = [None] * L, [None] * L
        prefill_ms = {}
        sync = self.sync
        t0 = time.perf_counter_ns()
        for i in range(L):
            cache[i].append(kp[i], vp[i])
        sync()
        prefill_ms["nbkv"] = (time.perf_counter_ns() - t0) / 1e6
        t0 = time.perf_counter_ns()
        idx = seq_index(layout, 0, self.prompt_len)
        for i in range(L):
            Ks[i][idx] = kp[i]
            Vs[i][idx] = vp[i]
        prefill_ms["numpy_slice"] = (time.perf_counter_ns() - t0) / 1e6
        empty_k, empty_v = reference.empty_kv(
            self.batch, self.num_kv_heads, self.head_dim, dt, layout
        )
        t0 = time.perf_counter_ns()
        for i in range(L):
            Kc[i], Vc[i] = reference.append(empty_k, empty_v, kp[i], vp[i], layout)
        prefill_ms["concatenate"] = (time.perf_counter_ns() - t0) / 1e6
        self.prefill_seq_len = cache.seq_len
        self.out(
            f"after prefill: seq_len {self.prefill_seq_len}/{self.max_seq_len}, nbkv cache "
            f"{human_bytes(cache.nbytes)} (preallocated for {self.max_seq_len} positions)"
        )
        self.out(
            f"prefill ({self.prompt_len} positions x {L} layers): "
            + " | ".join(f"{m} {prefill_ms[m]:.2f} ms" for m in APPEND_METHODS)
        )
        return prefill_ms

    def _token(self, step: int) -> np.ndarray:  # the same new K/V for a step in both passes
        shape = (2, self.L) + self._shape(1)
        return _randn(np.random.default_rng((self.seed, step)), shape, self.dt)

    def decode(self) -> dict[str, np.ndarray]:
        """One position per layer per step; nanoseconds per step and method. nbkv and
        NumPy slice take turns, in a fresh random order each step, so that noise favours
        neither. np.concatenate runs in a pass of its own over the same tokens: its
        copies of the whole cache would flush the CPU caches between the other two and
        make their timings measure that instead."""
        new_tokens, L, layout = self.new_tokens, self.L, self.layout
        # locals in the timed loops, as the one-function demo had: no attribute reads
        cache, sync, Ks, Vs, Kc, Vc = self.cache, self.sync, self.Ks, self.Vs, self.Kc, self.Vc
        orders = np.random.default_rng(self.seed).permuted(np.tile([0, 1], (new_tokens, 1)), axis=1)
        times = {m: np.empty(new_tokens, np.int64) for m in APPEND_METHODS}
        progress = _DecodeProgress(2 * new_tokens, self.out)
        for step in range(new_tokens):
            ks, vs = self._token(step)
            pos = self.prompt_len + step
            for j in orders[step]:
                if APPEND_METHODS[j] == "nbkv":
                    t0 = time.perf_counter_ns()
                    for i in range(L):
                        cache[i].append(ks[i], vs[i])
                    sync()
                    t1 = time.perf_counter_ns()
                else:
                    t0 = time.perf_counter_ns()
                    idx = seq_index(layout, pos, pos + 1)
                    for i in range(L):
                        Ks[i][idx] = ks[i]
                        Vs[i][idx] = vs[i]
                    t1 = time.perf_counter_ns()
                times[APPEND_METHODS[j]][step] = t1 - t0
            progress.update(step + 1)
        for step in range(new_tokens):
            ks, vs = self._token(step)
            t0 = time.perf_counter_ns()
            for i in range(L):
                Kc[i], Vc[i] = reference.append(Kc[i], Vc[i], ks[i], vs[i], layout)
            times["concatenate"][step] = time.perf_counter_ns() - t0
            progress.update(new_tokens + step + 1)
        return times

    def check(self) -> None:
        """Every layer bit-exact against the concatenated reference, in nbkv's cache and
        in the NumPy slice arrays (where a slip of the hand-kept cursor would show)."""
        held = seq_index(self.layout, 0, self.prompt_len + self.new_tokens)
        for i in range(self.L):
            K, V = self.cache[i].get_kv()
            Kc, Vc = self.Kc[i], self.Vc[i]
            if not (
                np.array_equal(to_host(K, self.dt), Kc) and np.array_equal(to_host(V, self.dt), Vc)
            ):
                raise AssertionError(f"layer {i}: nbkv K/V differ from the concatenated reference")
            if not (np.array_equal(self.Ks[i][held], Kc) and np.array_equal(self.Vs[i][held], Vc)):
                raise AssertionError(f"layer {i}: the NumPy slice arrays differ from the reference")

    def report(self, compile_s: float, prefill_ms: dict, times: dict) -> dict[str, Any]:
        """The closing lines, and :func:`run_append_demo`'s result."""
        out, L, cache, pos = self.out, self.L, self.cache, self.prompt_len + self.new_tokens
        concat_nbytes = sum(k.nbytes + v.nbytes for k, v in zip(self.Kc, self.Vc, strict=True))
        # the last np.concatenate keeps one layer's old K and V alive beside the new ones
        concat_peak = concat_nbytes + (self.Kc[-1].nbytes + self.Vc[-1].nbytes) // pos * (pos - 1)
        median = {m: float(np.median(times[m])) / 1e3 for m in APPEND_METHODS}
        p90 = {m: float(np.percentile(times[m], 90)) / 1e3 for m in APPEND_METHODS}
        out(
            f"after decode: seq_len {cache.seq_len}/{self.max_seq_len}, nbkv cache "
            f"{human_bytes(cache.nbytes)} (unchanged; the NumPy slice arrays hold the same)"
        )
        out(
            f"np.concatenate growth: holds {human_bytes(concat_nbytes)} at the end, needs "
            f"{human_bytes(concat_peak)} at its peak (old + new arrays alive during a concatenate)"
        )
        out(f"decode append per token, all {L} layers (us): median      p90")
        for m in APPEND_METHODS:
            out(f"  {_LABELS[m]:<30} {median[m]:>12.1f} {p90[m]:>8.1f}")
        out(_ratio_line("NumPy slice", median["nbkv"], median["numpy_slice"]))
        out(_ratio_line("concatenate", median["nbkv"], median["concatenate"]))
        out(f"correctness: nbkv K/V equal the concatenated reference in all {L} layers (bit-exact)")
        config = {
            "num_layers": L, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "batch": self.batch, "prompt_len": self.prompt_len, "new_tokens": self.new_tokens,
            "dtype": str(self.dt), "device": self.device, "layout": self.layout,
            "seed": self.seed,
        }  # fmt: skip
        return {
            "config": config,
            "seq_len": cache.seq_len,
            "prefill_seq_len": self.prefill_seq_len,
            "max_seq_len": self.max_seq_len,
            "nbytes": cache.nbytes,
            "concat_nbytes": concat_nbytes,
            "concat_peak_nbytes": concat_peak,
            "compile_s": compile_s,
            "prefill_ms": prefill_ms,
            "median_us": median,
            "p90_us": p90,
            "ratio_vs_numpy_slice": median["nbkv"] / median["numpy_slice"],
            "ratio_vs_concatenate": median["nbkv"] / median["concatenate"],
        }


def _hits(kernel) -> int:
    """Loads of a Numba dispatcher from its on-disk cache, so far."""
    return sum(kernel.stats.cache_hits.values())


class _DecodeProgress:
    """The decode's progress: a bar redrawn with ``\\r`` when ``out`` is ``print`` to a
    terminal, otherwise a line through ``out`` at each quarter of the two passes."""

    def __init__(self, total: int, out: Callable[[str], Any]) -> None:
        self.total, self.out = total, out
        self.tty = out is print and sys.stdout.isatty()
        self.marks = {max(1, round(total * q / 4)) for q in (1, 2, 3, 4)}

    def update(self, done: int) -> None:
        total = self.total
        if self.tty and (done % max(1, total // 50) == 0 or done == total):
            bar = "#" * (30 * done // total)
            sys.stdout.write(f"\rdecode [{bar:<30}] {done}/{total} passes x steps")
            sys.stdout.flush()
            if done == total:
                sys.stdout.write("\n")
        elif not self.tty and done in self.marks:
            self.out(f"decode: {100 * done // total}% of the two passes")
