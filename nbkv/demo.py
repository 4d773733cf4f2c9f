"""A synthetic prefill and decode loop over a model-shaped :class:`nbkv.KVCache`.

Three ways of keeping K/V are timed in the same run: nbkv's ``KVCache`` and NumPy slice
assignment into preallocated arrays with a hand-kept cursor take turns at every decode
step (in a fresh random order, so that machine noise hits both alike); growth by
``np.concatenate`` (what naive code does; done with :func:`nbkv.reference.append`, which
is exactly that) decodes the same tokens in a pass of its own, since its copies of the
whole cache would flush the CPU caches between the other two. At the end nbkv's buffers are
checked bit for bit against the concatenated reference.

Run it as ``python -m nbkv demo`` or call :func:`run_demo`.
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
from .cache import KVCache
from .errors import InvalidArgumentError
from .kernels import cpu as cpu_kernels
from .layout import buffer_shape, seq_index

__all__ = ["run_demo"]

METHODS = ("nbkv", "numpy_slice", "concatenate")
_LABELS = {
    "nbkv": "nbkv KVCache",
    "numpy_slice": "NumPy slice (manual cursor)",
    "concatenate": "np.concatenate growth",
}


def _randn(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    # shifted normal data: never zeros, which would hide unwritten memory
    return (rng.standard_normal(shape, dtype=np.float32) + 0.5).astype(dtype)


def _host(x: Any, dtype: np.dtype) -> np.ndarray:
    """A host copy of a cache view in its logical dtype (bfloat16 arrives as uint16)."""
    if hasattr(x, "copy_to_host"):
        x = x.copy_to_host()
    x = np.asarray(x)
    return x if x.dtype == dtype else x.view(dtype)


def _ratio_line(name: str, a: float, b: float) -> str:
    if a <= b:
        return f"  nbkv vs {name}: {a / b:.2f}x the time ({b / a:.1f}x faster)"
    return f"  nbkv vs {name}: {a / b:.2f}x the time (nbkv slower by {(a / b - 1) * 100:.0f}%)"


def run_demo(
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
    >>> from nbkv.demo import run_demo
    >>> lines = []
    >>> r = run_demo(num_layers=2, num_kv_heads=2, head_dim=8, prompt_len=3,
    ...              new_tokens=2, out=lines.append)
    >>> r["seq_len"], r["nbytes"]
    (5, 1280)
    """
    prompt_len = positive_int(prompt_len, "prompt_len")
    new_tokens = positive_int(new_tokens, "new_tokens")
    total = prompt_len + new_tokens
    max_seq_len = total if max_seq_len is None else positive_int(max_seq_len, "max_seq_len")
    if max_seq_len < total:
        raise InvalidArgumentError(
            f"max_seq_len must hold prompt_len + new_tokens = {total} positions, got {max_seq_len}"
        )
    # the cache validates every other argument before anything is allocated
    cache = KVCache(
        num_layers,
        max_seq_len,
        batch=batch,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        layout=layout,
    )
    dt = cache.dtype
    L = num_layers
    rng = np.random.default_rng(seed)
    cuda = device == "cuda"
    sync: Callable[[], Any] = lambda: None  # noqa: E731
    if cuda:
        from numba import cuda as numba_cuda

        sync = numba_cuda.synchronize  # stop no clock before the device is done

    out(
        f"nbkv demo: {L} layers x {num_kv_heads} kv heads x head_dim {head_dim}, "
        f"batch {batch}, {dt}, layout {layout}, device {device}"
    )
    out(f"  prompt {prompt_len} + {new_tokens} new tokens, max_seq_len {max_seq_len}, seed {seed}")
    if cuda:
        out("  nbkv caches live on the GPU: each append copies its host arrays to the device;")
        out("  the NumPy ways stay on the host")

    # the first append compiles the kernel (or loads it from Numba's on-disk cache)
    warm = KVCache(
        1,
        4,
        batch=batch,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dt,
        device=device,
        layout=layout,
    )
    one = _randn(rng, buffer_shape(layout, batch, num_kv_heads, 1, head_dim), dt)
    kernel = (
        None if cuda else (cpu_kernels.write_kv_bshd if layout == "bshd" else cpu_kernels.write_kv)
    )
    seen = None if cuda else (len(kernel.overloads), sum(kernel.stats.cache_hits.values()))
    t0 = time.perf_counter_ns()
    warm[0].append(one, one)
    sync()
    compile_s = (time.perf_counter_ns() - t0) / 1e9
    how = "compile or cache load"
    if seen is not None:
        if len(kernel.overloads) == seen[0]:
            how = "already compiled in this process"
        elif sum(kernel.stats.cache_hits.values()) > seen[1]:
            how = "loaded from Numba's on-disk cache"
        else:
            how = "compiled"
    for _ in range(3):  # warm the fast path and the NumPy ways too, off the clock
        warm[0].append(one, one)
        reference.append(one, one, one, one, layout)
    sync()
    out(f"JIT: first append {compile_s:.3f} s ({how}; in no timing below)")

    # prefill: prompt_len positions into every layer, by each method
    kp = _randn(rng, (L,) + buffer_shape(layout, batch, num_kv_heads, prompt_len, head_dim), dt)
    vp = _randn(rng, kp.shape, dt)
    shape = buffer_shape(layout, batch, num_kv_heads, max_seq_len, head_dim)
    Ks = [np.empty(shape, dt) for _ in range(L)]
    Vs = [np.empty(shape, dt) for _ in range(L)]
    Kc = [None] * L
    Vc = [None] * L
    prefill_ms = {}
    t0 = time.perf_counter_ns()
    for i in range(L):
        cache[i].append(kp[i], vp[i])
    sync()
    prefill_ms["nbkv"] = (time.perf_counter_ns() - t0) / 1e6
    t0 = time.perf_counter_ns()
    idx = seq_index(layout, 0, prompt_len)
    for i in range(L):
        Ks[i][idx] = kp[i]
        Vs[i][idx] = vp[i]
    prefill_ms["numpy_slice"] = (time.perf_counter_ns() - t0) / 1e6
    empty_k, empty_v = reference.empty_kv(batch, num_kv_heads, head_dim, dt, layout)
    t0 = time.perf_counter_ns()
    for i in range(L):
        Kc[i], Vc[i] = reference.append(empty_k, empty_v, kp[i], vp[i], layout)
    prefill_ms["concatenate"] = (time.perf_counter_ns() - t0) / 1e6
    del kp, vp
    prefill_seq_len = cache.seq_len
    out(
        f"after prefill: seq_len {prefill_seq_len}/{max_seq_len}, "
        f"nbkv cache {human_bytes(cache.nbytes)} (preallocated for {max_seq_len} positions)"
    )
    out(
        f"prefill ({prompt_len} positions x {L} layers): "
        + " | ".join(f"{m} {prefill_ms[m]:.2f} ms" for m in METHODS)
    )

    # decode: one position per layer per step. nbkv and NumPy slice take turns, in a fresh
    # random order each step, so that noise favours neither. np.concatenate runs in a pass
    # of its own over the same tokens: its copies of the whole cache would flush the CPU
    # caches between the other two and make their timings measure that instead.
    orders = np.random.default_rng(seed).permuted(np.tile([0, 1], (new_tokens, 1)), axis=1)
    times = {m: np.empty(new_tokens, np.int64) for m in METHODS}
    token_shape = (2, L) + buffer_shape(layout, batch, num_kv_heads, 1, head_dim)

    def token(step: int) -> np.ndarray:  # the same new K/V for a step in both passes
        return _randn(np.random.default_rng((seed, step)), token_shape, dt)

    tty = out is print and sys.stdout.isatty()
    total = 2 * new_tokens
    marks = {max(1, round(total * q / 4)) for q in (1, 2, 3, 4)}

    def progress(done: int) -> None:
        if tty and (done % max(1, total // 50) == 0 or done == total):
            bar = "#" * (30 * done // total)
            sys.stdout.write(f"\rdecode [{bar:<30}] {done}/{total} passes x steps")
            sys.stdout.flush()
            if done == total:
                sys.stdout.write("\n")
        elif not tty and done in marks:
            out(f"decode: {100 * done // total}% of the two passes")

    for step in range(new_tokens):
        kv = token(step)
        ks, vs = kv[0], kv[1]
        pos = prompt_len + step
        for j in orders[step]:
            if METHODS[j] == "nbkv":
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
            times[METHODS[j]][step] = t1 - t0
        progress(step + 1)
    for step in range(new_tokens):
        kv = token(step)
        ks, vs = kv[0], kv[1]
        t0 = time.perf_counter_ns()
        for i in range(L):
            Kc[i], Vc[i] = reference.append(Kc[i], Vc[i], ks[i], vs[i], layout)
        times["concatenate"][step] = time.perf_counter_ns() - t0
        progress(new_tokens + step + 1)
    pos = prompt_len + new_tokens

    # correctness: every layer bit-exact against the concatenated reference
    for i in range(L):
        K, V = cache[i].get_kv()
        if not (np.array_equal(_host(K, dt), Kc[i]) and np.array_equal(_host(V, dt), Vc[i])):
            raise AssertionError(f"layer {i}: nbkv K/V differ from the concatenated reference")
        # a slip in the hand-kept cursor would show here
        held = seq_index(layout, 0, pos)
        if not (np.array_equal(Ks[i][held], Kc[i]) and np.array_equal(Vs[i][held], Vc[i])):
            raise AssertionError(f"layer {i}: the NumPy slice arrays differ from the reference")

    concat_nbytes = sum(k.nbytes + v.nbytes for k, v in zip(Kc, Vc, strict=True))
    # the last np.concatenate keeps one layer's old K and V alive beside the new ones
    concat_peak = concat_nbytes + (Kc[-1].nbytes + Vc[-1].nbytes) // pos * (pos - 1)
    median = {m: float(np.median(times[m])) / 1e3 for m in METHODS}
    p90 = {m: float(np.percentile(times[m], 90)) / 1e3 for m in METHODS}
    out(
        f"after decode: seq_len {cache.seq_len}/{max_seq_len}, nbkv cache "
        f"{human_bytes(cache.nbytes)} (unchanged; the NumPy slice arrays hold the same)"
    )
    out(
        f"np.concatenate growth: holds {human_bytes(concat_nbytes)} at the end, needs "
        f"{human_bytes(concat_peak)} at its peak (old + new arrays alive during a concatenate)"
    )
    out(f"decode append per token, all {L} layers (us): median      p90")
    for m in METHODS:
        out(f"  {_LABELS[m]:<30} {median[m]:>12.1f} {p90[m]:>8.1f}")
    ratio_slice = median["nbkv"] / median["numpy_slice"]
    ratio_concat = median["nbkv"] / median["concatenate"]
    out(_ratio_line("NumPy slice", median["nbkv"], median["numpy_slice"]))
    out(_ratio_line("concatenate", median["nbkv"], median["concatenate"]))
    out(f"correctness: nbkv K/V equal the concatenated reference in all {L} layers (bit-exact)")
    return {
        "config": {
            "num_layers": L,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "batch": batch,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "dtype": str(dt),
            "device": device,
            "layout": layout,
            "seed": seed,
        },
        "seq_len": cache.seq_len,
        "prefill_seq_len": prefill_seq_len,
        "max_seq_len": max_seq_len,
        "nbytes": cache.nbytes,
        "concat_nbytes": concat_nbytes,
        "concat_peak_nbytes": concat_peak,
        "compile_s": compile_s,
        "prefill_ms": prefill_ms,
        "median_us": median,
        "p90_us": p90,
        "ratio_vs_numpy_slice": ratio_slice,
        "ratio_vs_concatenate": ratio_concat,
    }
