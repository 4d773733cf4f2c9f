"""The demos behind ``python -m nbkv demo`` and ``python -m nbkv append-demo``.

:func:`run_model_demo` (``demo``) decodes with the built-in model
(:meth:`nbkv.models.Llama.default`) twice in one run: once with its keys and values in an
nbkv :class:`~nbkv.KVCache` (each step runs the decoder over one new position), once
without a cache (each step recomputes the whole sequence with
:meth:`~nbkv.models.Llama.forward_nocache`, quadratic in its length). Both decode greedily
and must produce the same tokens. It reports per-token latency, tokens/s and cache memory,
and plots latency against position (matplotlib, the ``demo`` extra).

Both methods run under one thread setting, one thread by default: on a small machine
Numba's OpenMP workers and OpenBLAS's threads contend for the cores, with each other and
with other processes, and a parallel region or a threaded product that waits for a
descheduled thread costs milliseconds. On a shared 2-core machine, Numba's 2 threads made
the cached steps ~32 ms instead of ~0.3 ms whenever another process was busy, and
OpenBLAS's 2 threads made recompute steps up to ~450 ms instead of ~14 ms; on an idle one,
2 BLAS threads make recompute ~25% faster.

:func:`run_append_demo` (``append-demo``), a synthetic prefill and decode loop of appends
timed against NumPy, lives in :mod:`nbkv.append_demo` and is re-exported here.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ._threads import Threads, check_threads, thread_limits
from ._units import human_bytes
from ._validate import positive_int
from .append_demo import APPEND_METHODS, run_append_demo
from .errors import InvalidArgumentError

__all__ = ["APPEND_METHODS", "DEFAULT_PROMPT", "run_append_demo", "run_model_demo"]

# -- the model demo (python -m nbkv demo) -------------------------------------------

# the start of a Python class: 88 ASCII bytes, 88 tokens of Llama.default()'s byte vocabulary
DEFAULT_PROMPT = (
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
)
MODEL_METHODS = ("cached", "recompute")
_MODEL_LABELS = {
    "cached": "nbkv KV cache",
    "recompute": "no cache (recompute)",
}
PLOT_NAME = "decode_latency.png"


class _Progress:
    """A one-line bar redrawn with ``\\r`` on a terminal, a line at each quarter otherwise.

    Writes to ``stream`` only, between timed regions; ``stream=None`` shows nothing.
    """

    def __init__(self, label: str, total: int, stream: TextIO | None) -> None:
        self.label, self.total, self.stream = label, total, stream
        self.tty = stream is not None and stream.isatty()
        self.marks = {max(1, round(total * q / 4)) for q in (1, 2, 3, 4)}
        self.shown = -1

    def update(self, done: int) -> None:
        if self.stream is None:
            return
        if self.tty:
            percent = 100 * done // self.total
            if percent == self.shown and done != self.total:
                return  # redraw only when the figure moves
            self.shown = percent
            bar = "#" * (30 * done // self.total)
            end = "\n" if done == self.total else ""
            self.stream.write(f"\r{self.label:<22} [{bar:<30}] {done}/{self.total}{end}")
        elif done in self.marks:
            self.stream.write(f"{self.label}: {done}/{self.total} tokens\n")
        self.stream.flush()


def _matplotlib_figure() -> tuple[Any, str | None]:
    """matplotlib's ``Figure`` class, or ``(None, why it cannot be had)``."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        return None, f"matplotlib is not installed ({err}); pip install 'nbkv[demo]'"
    return Figure, None


def _plot_latency(
    Figure: Any,  # matplotlib.figure.Figure
    path: Path,
    positions: np.ndarray,
    ms: dict[str, np.ndarray],
    title: str,
) -> None:
    """Latency per decoded token against its position, one line per method, as a PNG.

    Uses ``matplotlib.figure.Figure`` directly (no pyplot), so no global backend or
    figure state of the caller's session is touched.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.add_subplot()
    colors = {"cached": "tab:blue", "recompute": "tab:orange"}
    for m in MODEL_METHODS:
        label = f"{_MODEL_LABELS[m]}: median {np.median(ms[m]):.2f} ms"
        ax.plot(positions, ms[m], color=colors[m], linewidth=1.2, label=label)
    ax.set_yscale("log")
    # ticks at 1-2-5 steps, labelled as plain numbers of ms
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("position of the new token (= tokens before it)")
    ax.set_ylabel("latency per token (ms, log scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left")
    fig.savefig(path, dpi=120)


def _trained() -> str:
    from .models import default_training_record

    r = default_training_record()
    return f"{r['held_out_bits_per_byte']:.2f} bits per byte on held-out code"


def run_model_demo(
    *,
    new_tokens: int = 200,
    prompt: str | None = None,
    prompt_tokens: int | None = None,
    device: str = "cpu",
    seed: int = 0,
    out_dir: str | os.PathLike | None = "nbkv-demo",
    threads: int | None = 1,
    out: Callable[[str], Any] = print,
    progress: TextIO | None | str = "stderr",
) -> dict[str, Any]:
    """Decode greedily with ``Llama.default()``, with an nbkv cache and without one.

    The prompt is run through the model once by each method (the first new token), then
    each further token is decoded: with the cache, :meth:`~nbkv.models.Llama.forward`
    over the one new position, its K/V appended to the cache; without, a full
    :meth:`~nbkv.models.Llama.forward_nocache` over every position so far, whose cost
    grows with the length. They run in turn, in one process and thread setting, after a
    warm-up that compiles (or loads) every kernel, and must produce the same tokens.

    Parameters
    ----------
    new_tokens : int >= 2
        Tokens to generate (the first from the prompt pass; the rest are decode steps,
        the ones timed per token).
    prompt : str, optional
        Prompt text, encoded as UTF-8 bytes (the model's vocabulary is bytes). Default
        :data:`DEFAULT_PROMPT` (the start of a Python class, 88 bytes).
    prompt_tokens : int, optional
        Instead of text, this many random token ids from ``default_rng(seed)``.
    device : {"cpu", "cuda"}
        Where the cache keeps K/V; the model, and the recompute path, compute on the host
        (a CUDA cache returns each layer's attention with one device-to-host copy).
    seed : int
        Seed of the random prompt ids.
    out_dir : path, optional
        Folder for the plot (created if needed); None writes no plot.
    threads : int, optional, default 1
        Numba threads (``numba.set_num_threads``) and BLAS threads (through threadpoolctl,
        if installed) for both methods, restored after; None leaves both as they are. Why
        one by default: the module's docstring (:mod:`nbkv.demo`).
    out : callable
        Receives each line of the report.
    progress : file, None or "stderr"
        Where the progress bar goes (a ``\\r`` bar on a terminal, a line at each quarter
        otherwise); None shows none.

    Returns
    -------
    dict
        ``prompt_ids`` and ``tokens`` (int64 arrays), ``positions`` (of the decode
        steps), ``ms`` (latency per decode step, an array per method: ``"cached"``,
        ``"recompute"``), ``first_token_ms``, ``median_ms``, ``p90_ms``,
        ``tokens_per_s`` (new tokens over total time) and ``total_s`` (each a dict keyed
        by method), ``ratio_total`` (recompute's total time over the cache's),
        ``max_logit_diff``, ``nbytes`` (the cache's buffers), ``seq_len``,
        ``max_seq_len``, ``warmup_s``, ``plot`` (the PNG's path, or None),
        ``plot_skipped`` (why not, or None) and ``config``.

    Raises
    ------
    KVCacheError
        A bad argument, or ``device="cuda"`` without a GPU; raised before anything runs.
    AssertionError
        If the two methods decode different tokens.

    Examples
    --------
    >>> from nbkv.demo import run_model_demo
    >>> lines = []
    >>> r = run_model_demo(new_tokens=3, prompt_tokens=4, out_dir=None,
    ...                    out=lines.append, progress=None)
    >>> r["tokens"].shape, r["seq_len"], r["nbytes"]
    ((3,), 6, 12288)
    """
    run = _ModelRun(new_tokens, prompt, prompt_tokens, device, seed, out_dir, threads, out)
    return run.run(sys.stderr if progress == "stderr" else progress)


class _ModelRun:
    """One run of :func:`run_model_demo`: the model, prompt, cache and plot path it
    checked and made, and its steps in the order the demo takes them."""

    def __init__(self, new_tokens, prompt, prompt_tokens, device, seed, out_dir, threads, out):
        from .models import Llama

        new_tokens = positive_int(new_tokens, "new_tokens")
        if new_tokens < 2:
            raise InvalidArgumentError(
                f"new_tokens must be >= 2 (the first comes from the prompt pass, the rest "
                f"are the decode steps timed per token), got {new_tokens}"
            )
        if prompt is not None and prompt_tokens is not None:
            raise InvalidArgumentError("give prompt or prompt_tokens, not both")
        if prompt_tokens is not None:
            prompt_tokens = positive_int(prompt_tokens, "prompt_tokens")
        elif prompt is None:
            prompt = DEFAULT_PROMPT
        elif not isinstance(prompt, str) or not prompt:
            raise InvalidArgumentError(f"prompt must be a non-empty str, got {prompt!r}")
        self.threads = check_threads(threads)
        self.model = model = Llama.default(device=device)  # checks device
        self.c = c = model.config
        if prompt_tokens is not None:
            ids = np.random.default_rng(seed).integers(0, c.vocab_size, prompt_tokens)
            self.about = f"{prompt_tokens} random token id{'s' * (prompt_tokens > 1)} (seed {seed})"
        else:
            ids = np.frombuffer(prompt.encode("utf-8", "surrogateescape"), np.uint8)
            preview = prompt if len(prompt) <= 72 else prompt[:69] + "..."
            self.about = f"{len(ids)} tokens, the UTF-8 bytes of {preview!r}"
        self.ids = ids.astype(np.int64)
        self.n_prompt, self.new_tokens, self.show_text = len(ids), new_tokens, prompt_tokens is None
        # the last new token is never fed back, so it needs no position
        self.cache = model.new_cache(1, self.n_prompt + new_tokens - 1)  # no GPU: raises here
        self.Figure, self.plot_skipped, self.path = None, "no output folder given", None
        if out_dir is not None:
            self.Figure, self.plot_skipped = _matplotlib_figure()
            if self.Figure is not None:
                folder = Path(out_dir)
                if folder.exists() and not folder.is_dir():
                    raise InvalidArgumentError(
                        f"out_dir {str(folder)!r} exists and is not a folder"
                    )
                self.path = folder / PLOT_NAME
        self.device, self.seed, self.out = device, seed, out
        self.sync: Callable[[], Any] = lambda: None
        if device == "cuda":
            from numba import cuda as numba_cuda

            self.sync = numba_cuda.synchronize  # stop no clock before the device is done
        steps = new_tokens - 1
        self.ns = {m: np.empty(steps, np.int64) for m in MODEL_METHODS}
        self.first_ns: dict[str, int] = {}
        self.tokens = {m: np.empty(new_tokens, np.int64) for m in MODEL_METHODS}
        self.logits = {m: np.empty((new_tokens, c.vocab_size), np.float32) for m in MODEL_METHODS}

    def run(self, stream: TextIO | None) -> dict[str, Any]:
        """The steps in order: both methods under the thread limits, then the check and
        the report; :func:`run_model_demo`'s result."""
        with thread_limits(self.threads) as running:
            self.header(running)
            warmup_s = self.warm_up()
            self.decode_cached(stream)
            self.decode_recompute(stream)
        max_diff = self.check()
        return self.report(running, warmup_s, max_diff)

    def header(self, running: Threads) -> None:
        c, out = self.c, self.out
        out(
            f"nbkv demo: Llama.default(), {c.num_hidden_layers} layers, hidden "
            f"{c.hidden_size}, {c.num_attention_heads} query / {c.num_key_value_heads} KV "
            f"heads of head_dim {c.head_dim}, byte vocabulary ({c.vocab_size}), "
            f"{self.model.num_parameters / 1e6:.1f}M parameters, trained on Python ({_trained()})"
        )
        out(
            f"  prompt: {self.about}; then {self.new_tokens} new tokens, greedy; "
            f"cache on {self.device}"
        )
        out(f"  threads (both methods): {running.about}")
        if self.device == "cuda":
            out("  the recompute path keeps no cache and runs on the host")
            if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
                out("  the CUDA simulator is on: the cache's timings say nothing of a GPU")

    def warm_up(self) -> float:
        """The first calls compile every kernel (or load it from Numba's on-disk cache)."""
        t0 = time.perf_counter_ns()
        some = np.array([[1, 2, 3]])  # any ids: the kernels compile per dtype, not per value
        warm = self.model.new_cache(1, 3)
        self.model.forward(some[:, :2], warm)
        self.model.forward(some[:, 2:], warm)
        self.model.forward_nocache(some)
        self.sync()
        warmup_s = (time.perf_counter_ns() - t0) / 1e9
        self.out(f"warm-up: {warmup_s:.2f} s (JIT compile or cache load; in no timing below)")
        return warmup_s

    def decode_cached(self, stream: TextIO | None) -> None:
        """With the cache: the prompt once, then one position per step."""
        model, cache, ns, tokens = self.model, self.cache, self.ns["cached"], self.tokens["cached"]
        bar = _Progress("decode with cache", self.new_tokens, stream)
        t0 = time.perf_counter_ns()
        logits = model.forward(self.ids[None], cache)[0, -1]
        self.sync()
        self.first_ns["cached"] = time.perf_counter_ns() - t0
        for step in range(self.new_tokens):
            if step:
                t0 = time.perf_counter_ns()
                logits = model.forward(tokens[None, step - 1 : step], cache)[0, -1]
                self.sync()
                ns[step - 1] = time.perf_counter_ns() - t0
            self.logits["cached"][step] = logits
            tokens[step] = int(logits.argmax())
            bar.update(step + 1)

    def decode_recompute(self, stream: TextIO | None) -> None:
        """Without a cache: every step runs the whole sequence so far."""
        n_prompt, ns, tokens = self.n_prompt, self.ns["recompute"], self.tokens["recompute"]
        seq = np.empty(n_prompt + self.new_tokens, np.int64)
        seq[:n_prompt] = self.ids
        bar = _Progress("recompute, no cache", self.new_tokens, stream)
        for step in range(self.new_tokens):
            n = n_prompt + step
            t0 = time.perf_counter_ns()
            logits = self.model.forward_nocache(seq[None, :n])[0, -1]
            t1 = time.perf_counter_ns()
            if step:
                ns[step - 1] = t1 - t0
            else:
                self.first_ns["recompute"] = t1 - t0
            self.logits["recompute"][step] = logits
            seq[n] = tokens[step] = int(logits.argmax())
            bar.update(step + 1)

    def check(self) -> float:
        """The same greedy tokens, step by step; the largest logit difference up to (and
        at) the first step that differs."""
        tokens, new_tokens = self.tokens, self.new_tokens
        differ = np.flatnonzero(tokens["cached"] != tokens["recompute"])
        first_diff = int(differ[0]) if len(differ) else new_tokens
        upto = min(first_diff + 1, new_tokens)
        diff = np.abs(self.logits["cached"][:upto] - self.logits["recompute"][:upto])
        max_diff = float(diff.max())
        if len(differ):
            raise AssertionError(
                f"new token {first_diff} (position {self.n_prompt + first_diff}) differs: the "
                f"cache gave {tokens['cached'][first_diff]}, recomputation "
                f"{tokens['recompute'][first_diff]} (max |logit difference| so far "
                f"{max_diff:.3g})"
            )
        return max_diff

    def report(self, running: Threads, warmup_s: float, max_diff: float) -> dict[str, Any]:
        """The closing lines and plot, and :func:`run_model_demo`'s result."""
        c, cache, out, ns, first_ns = self.c, self.cache, self.out, self.ns, self.first_ns
        n_prompt, new_tokens = self.n_prompt, self.new_tokens
        ms = {m: ns[m] / 1e6 for m in MODEL_METHODS}
        first_ms = {m: first_ns[m] / 1e6 for m in MODEL_METHODS}
        median = {m: float(np.median(ms[m])) for m in MODEL_METHODS}
        p90 = {m: float(np.percentile(ms[m], 90)) for m in MODEL_METHODS}
        total_s = {m: (first_ns[m] + int(ns[m].sum())) / 1e9 for m in MODEL_METHODS}
        per_s = {m: new_tokens / total_s[m] for m in MODEL_METHODS}
        ratio = total_s["recompute"] / total_s["cached"]
        positions = np.arange(n_prompt + 1, n_prompt + new_tokens)
        k_shape = (1, c.num_key_value_heads, cache.max_seq_len, c.head_dim)
        out(
            f"KV cache: {human_bytes(cache.nbytes)} on {self.device} ({c.num_hidden_layers} "
            f"layers x K and V of {list(k_shape)} float32; "
            f"{human_bytes(cache.nbytes / cache.max_seq_len)} per position), seq_len "
            f"{cache.seq_len}/{cache.max_seq_len}"
        )
        out("  the recompute path holds no cache: each step recomputes K/V of every position")
        out(f"{'':24}{'first token':>12}{'per new token (ms)':>22}{'tokens/s':>11}{'total':>10}")
        out(f"{'':24}{'(prompt)':>12}{'median':>12}{'p90':>10}")
        for m in MODEL_METHODS:
            out(
                f"  {_MODEL_LABELS[m]:<22}{first_ms[m]:>9.2f} ms{median[m]:>12.3f}"
                f"{p90[m]:>10.3f}{per_s[m]:>11.0f}{total_s[m]:>8.3f} s"
            )
        out(
            f"recompute takes {ratio:.3g}x the total time of decoding with the cache "
            f"({median['recompute'] / median['cached']:.3g}x the median per token)"
        )
        self._growth(ms)
        out(
            f"correctness: greedy tokens identical for all {new_tokens} new tokens; logits "
            f"agree to max |difference| {max_diff:.2g}"
        )
        text = _show_text(out, self.ids, self.tokens["cached"], self.show_text)
        self._plot(running, positions, ms)
        config = {
            "model": "Llama.default()", "prompt_len": n_prompt, "new_tokens": new_tokens,
            "device": self.device, "seed": self.seed, "threads": self.threads,
            "numba_threads": running.numba, "blas_threads": running.blas,
        }  # fmt: skip
        return {
            "config": config,
            "prompt_ids": self.ids,
            "tokens": self.tokens["cached"],
            "positions": positions,
            "ms": ms,
            "first_token_ms": first_ms,
            "median_ms": median,
            "p90_ms": p90,
            "tokens_per_s": per_s,
            "total_s": total_s,
            "ratio_total": ratio,
            "max_logit_diff": max_diff,
            "nbytes": cache.nbytes,
            "seq_len": cache.seq_len,
            "max_seq_len": cache.max_seq_len,
            "warmup_s": warmup_s,
            "plot": self.path,
            "plot_skipped": self.plot_skipped,
            "text": text,
        }

    def _growth(self, ms: dict[str, np.ndarray]) -> None:
        tenth = max(1, (self.new_tokens - 1) // 10)
        grows = {m: (np.median(ms[m][:tenth]), np.median(ms[m][-tenth:])) for m in MODEL_METHODS}
        self.out(
            f"per token, first tenth of the steps -> last: recompute {grows['recompute'][0]:.2f}"
            f" -> {grows['recompute'][1]:.2f} ms, with the cache {grows['cached'][0]:.2f} -> "
            f"{grows['cached'][1]:.2f} ms (median of each)"
        )

    def _plot(self, running: Threads, positions: np.ndarray, ms: dict[str, np.ndarray]) -> None:
        if self.path is None:
            self.out(f"plot: skipped ({self.plot_skipped})")
            return
        c = self.c
        title = (
            f"Greedy decoding, Llama.default() ({c.num_hidden_layers} layers, "
            f"{c.num_attention_heads}/{c.num_key_value_heads} heads, head_dim {c.head_dim}): "
            f"with an nbkv cache vs recomputing\nprompt {self.n_prompt} + {self.new_tokens} "
            f"new tokens, float32, cache on {self.device}, {os.cpu_count()} CPUs, threads: "
            f"Numba {running.numba}, BLAS {running.blas}"
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _plot_latency(self.Figure, self.path, positions, ms, title)
        self.out(f"plot: {self.path}")


def _show_text(out: Callable[[str], Any], prompt: np.ndarray, new: np.ndarray, show: bool) -> str:
    """Print the prompt and the decoded bytes as text (the vocabulary is bytes); return it."""
    text = bytes(np.concatenate([prompt, new]).astype(np.uint8).tolist()).decode("utf-8", "replace")
    if not show:
        return text
    cut = len(bytes(prompt.astype(np.uint8).tolist()).decode("utf-8", "replace"))
    out("text: '|' the prompt, '+' lines with what both methods decoded (identically):")
    at = 0
    for line in text.splitlines(keepends=True):
        mark = "|" if at + len(line) <= cut else "+"
        out(f"  {mark} {line.rstrip(chr(10))}")
        at += len(line)
    return text
