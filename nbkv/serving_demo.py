"""``python -m nbkv serve-demo``: the continuous-batching engine against one request at a
time, on requests of real text; and the workload :mod:`benchmarks.bench_serving` uses.

Requests are slices of the Python standard library's held-out files (the trained model
never saw them, :func:`nbkv.models.train.is_held_out`), of long-tailed lengths, some
starting with a shared prefix (a common "system prompt": the head of one file), each asking
for a long-tailed number of new tokens. Both methods decode greedily, so their outputs
must be identical; the demo checks it.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TextIO

import numpy as np

from ._units import human_bytes
from .errors import InvalidArgumentError
from .serving import Engine

__all__ = ["Workload", "workload", "run_engine", "run_sequential", "run_serve_demo"]


class Workload(NamedTuple):
    """Prompts (int64 token ids) and the new tokens each asks for."""

    prompts: list[np.ndarray]
    max_new_tokens: list[int]
    shared: int  # tokens of the common prefix (0: none)


def _text(min_bytes: int) -> np.ndarray:
    """At least ``min_bytes`` of held-out standard-library source, as byte ids."""
    from .models.train import corpus_files, is_held_out

    root = sysconfig.get_paths()["stdlib"]
    chunks, size = [], 0
    for rel in (f for f in corpus_files(root) if is_held_out(f)):
        with open(os.path.join(root, rel), "rb") as f:
            chunks.append(np.frombuffer(f.read(), np.uint8))
        size += len(chunks[-1])
        if size >= min_bytes:
            break
    if size < 2:
        raise InvalidArgumentError("no held-out standard-library source found to build prompts")
    return np.concatenate(chunks).astype(np.int64)


def workload(
    n: int = 32,
    *,
    seed: int = 0,
    prompt_median: int = 96,
    prompt_cap: int = 512,
    new_median: int = 48,
    new_cap: int = 192,
    shared: int = 0,
    share_every: int = 1,
) -> Workload:
    """``n`` requests: prompt lengths and new tokens lognormal (sigma 0.8) around their
    medians, clipped to their caps; with ``shared`` > 0, every ``share_every``-th request
    starts with the same ``shared`` tokens (the rest of its prompt after them)."""
    from .tutorial.paging import request_lengths

    text = _text(4 * (prompt_cap + shared) + 65536)
    rng = np.random.default_rng(seed)
    lengths = request_lengths(n, median=prompt_median, sigma=0.8, cap=prompt_cap, seed=seed)
    new = request_lengths(n, median=new_median, sigma=0.8, cap=new_cap, seed=seed + 1)
    prefix = text[:shared]
    prompts = []
    for i, length in enumerate(lengths.tolist()):
        start = int(rng.integers(shared, len(text) - length))
        own = text[start : start + length]
        prompts.append(np.concatenate([prefix, own]) if shared and i % share_every == 0 else own)
    return Workload(prompts, [int(x) for x in new], shared)


class RunResult(NamedTuple):
    outputs: list[np.ndarray]
    seconds: float
    ttft: list[float]  # seconds from the start of the run to each request's first token
    peak_kv_bytes: int
    history: list  # StepRecords (engine only)
    prefix_hit_rate: float


def _bar(stream: TextIO | None, label: str, done: int, total: int, t0: float) -> None:
    if stream is None:
        return
    width = 30
    fill = width * done // max(total, 1)
    stream.write(
        f"\r{label:12s} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} requests "
        f"{time.perf_counter() - t0:6.1f} s"
    )
    if done == total:
        stream.write("\n")
    stream.flush()


def run_engine(
    model, work: Workload, *, progress: TextIO | None = None, label: str = "engine", **engine_kw
) -> RunResult:
    """Every request added at once, then ``step()`` until all finish."""
    engine = Engine(model, **engine_kw)
    t0 = time.perf_counter()
    rids = [
        engine.add_request(p, max_new_tokens=m)
        for p, m in zip(work.prompts, work.max_new_tokens, strict=True)
    ]
    done: dict[int, np.ndarray] = {}
    drawn = (-1, 0.0)
    while engine.has_unfinished():
        done.update(engine.step())
        now = time.perf_counter()
        if len(done) != drawn[0] and (now - drawn[1] > 0.25 or len(done) == len(rids)):
            _bar(progress, label, len(done), len(rids), t0)  # on a change, 4 times a second
            drawn = (len(done), now)
    seconds = time.perf_counter() - t0
    ttft = [engine.times(r)["first_token"] - t0 for r in rids]
    c, bs = model.config, engine.cache.block_size
    block_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4 * bs
    peak = max(h.blocks_used for h in engine.history) * block_bytes  # blocks in use
    s = engine.cache.stats()
    rate = s["prefix_hit_tokens"] / s["prefix_query_tokens"] if s["prefix_query_tokens"] else 0.0
    return RunResult([done[r] for r in rids], seconds, ttft, peak, engine.history, rate)


def run_sequential(
    model, work: Workload, *, progress: TextIO | None = None, label: str = "one at a time"
) -> RunResult:
    """``Llama.generate`` on one request after another, each with its own contiguous cache
    (sized to that request, as ``generate`` makes it)."""
    t0 = time.perf_counter()
    outs, ttft, peak = [], [], 0
    per_position = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads
    per_position *= model.config.head_dim * 4
    for i, (p, m) in enumerate(zip(work.prompts, work.max_new_tokens, strict=True)):
        first: list[float] = []

        def callback(step, ids, first=first):
            if step == 0:
                first.append(time.perf_counter() - t0)

        outs.append(model.generate(p, m, eos_token_id=None, callback=callback)[0])
        ttft.append(first[0])
        peak = max(peak, (len(p) + m - 1) * per_position)
        _bar(progress, label, i + 1, len(work.prompts), t0)
    return RunResult(outs, time.perf_counter() - t0, ttft, peak, [], 0.0)


def contiguous_bytes(model, work: Workload) -> int:
    """K/V bytes of one contiguous cache per request, each sized for the longest request
    (a batch of ``LayerKVCache`` rows)."""
    c = model.config
    longest = max(len(p) + m - 1 for p, m in zip(work.prompts, work.max_new_tokens, strict=True))
    return (
        len(work.prompts)
        * longest
        * 2
        * c.num_hidden_layers
        * c.num_key_value_heads
        * c.head_dim
        * 4
    )


def run_serve_demo(
    *,
    requests: int = 32,
    shared: int = 256,
    seed: int = 0,
    device: str = "cpu",
    out_dir: str | os.PathLike | None = "nbkv-serve-demo",
    out: Callable[[str], Any] = print,
    progress: TextIO | None | str = "stderr",
) -> dict[str, Any]:
    """Serve ``requests`` requests (every other one starting with the same ``shared``
    tokens) with the engine and one at a time; print and return the comparison, and plot
    the engine's batch and blocks over its steps (``out_dir`` None: no plot)."""
    from .models import Llama

    stream = sys.stderr if progress == "stderr" else progress
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise InvalidArgumentError(f"requests must be an int >= 1, got {requests!r:.40}")
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise InvalidArgumentError(f"shared must be an int >= 0, got {shared!r:.40}")
    model = Llama.default()
    work = workload(requests, seed=seed, shared=shared, share_every=2)
    tokens = sum(work.max_new_tokens)
    out(
        f"{requests} requests of held-out standard-library code: prompts of "
        f"{min(map(len, work.prompts))}-{max(map(len, work.prompts))} tokens (every other "
        f"one after a shared {shared}-token prefix), {tokens} new tokens in all; "
        f"model {model.num_parameters / 1e6:.1f}M parameters, greedy"
    )
    run_engine(model, workload(4, seed=seed + 7), device=device)  # warm-up: JIT, caches
    engine = run_engine(model, work, progress=stream, device=device)
    seq = run_sequential(model, work, progress=stream)
    same = all(np.array_equal(a, b) for a, b in zip(engine.outputs, seq.outputs, strict=True))
    rows = [
        ("", "engine", "one at a time"),
        ("tokens/s", f"{tokens / engine.seconds:.0f}", f"{tokens / seq.seconds:.0f}"),
        ("wall time", f"{engine.seconds:.2f} s", f"{seq.seconds:.2f} s"),
        (
            "time to first token, mean",
            f"{np.mean(engine.ttft):.2f} s",
            f"{np.mean(seq.ttft):.2f} s",
        ),
        (
            "time to first token, p90",
            f"{np.percentile(engine.ttft, 90):.2f} s",
            f"{np.percentile(seq.ttft, 90):.2f} s",
        ),  # fmt: skip
        ("peak KV bytes", human_bytes(engine.peak_kv_bytes), human_bytes(seq.peak_kv_bytes)),
        ("prefix-cache hit rate", f"{engine.prefix_hit_rate:.0%}", "-"),
    ]
    for name, a, b in rows:
        out(f"  {name:28s} {a:>12s} {b:>14s}")
    out(
        f"  {requests} contiguous caches sized for the longest request would reserve "
        f"{human_bytes(contiguous_bytes(model, work))}; outputs identical: {same}"
    )
    result = {
        "tokens_per_s": (tokens / engine.seconds, tokens / seq.seconds),
        "speedup": seq.seconds / engine.seconds,
        "ttft_mean_s": (float(np.mean(engine.ttft)), float(np.mean(seq.ttft))),
        "peak_kv_bytes": (engine.peak_kv_bytes, seq.peak_kv_bytes),
        "prefix_hit_rate": engine.prefix_hit_rate,
        "identical": same,
        "steps": len(engine.history),
    }
    if out_dir is not None:
        result["plot"] = _plot(engine.history, out_dir)
        out(f"  plot: {result['plot']}")
    return result


def _plot(history: list, out_dir: str | os.PathLike) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "serving.png")
    steps = np.arange(len(history))
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    ax0.plot(steps, [h.num_seqs for h in history], label="sequences in the batch")
    ax0.plot(steps, [h.num_decodes for h in history], label="of which decoding", alpha=0.8)
    ax0.set_ylabel("sequences")
    ax0.legend(loc="upper right")
    ax0.set_title("continuous batching: the batch and the pool over the engine's steps")
    ax1.plot(steps, [h.blocks_used for h in history], color="tab:green")
    ax1.set_ylabel("KV blocks in use")
    ax1.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
