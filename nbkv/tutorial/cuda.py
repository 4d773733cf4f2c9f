"""Helpers for ``notebooks/05_cuda_kernels.ipynb``: the flash-decoding kernel, launched by hand.

:func:`launch_attention` does what nbkv's CUDA backend does for ``nbkv.attention``, in
the open: it sizes the grid with :func:`nbkv.attention_grid`, allocates the scratch that
:func:`nbkv.launch.attention_scratch_shapes` names, launches
``nbkv.kernels.cuda_attention.attend_kernel`` and returns everything on the host,
the per-split partial results included, so that a reader can look inside the combine.
It needs a GPU or the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` before Numba is
imported).

The rest needs neither:

- :func:`function_source` and :func:`excerpt` read a kernel's code from its module at run
  time (the ``block`` device function that every attention kernel runs, say), so that the
  notebook shows the code that runs, not a copy of it;
- :func:`softmax_update`, :func:`softmax_combine` and :func:`softmax_output` are the
  kernel's online softmax and split combine in plain float64 NumPy, one block of scores at
  a time;
- :func:`gpu_results`, :func:`gpu_summary` and :func:`plot_gpu_results` load, summarise and
  plot the GPU runs of ``benchmarks/bench_cuda.py`` committed under ``benchmarks/results/``
  (``cuda-<gpu>.json``).
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from ..backends import to_host
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..launch import AttentionGrid, attention_grid, attention_scratch_shapes

__all__ = [
    "Launch",
    "launch_attention",
    "function_source",
    "excerpt",
    "Softmax",
    "softmax_start",
    "softmax_update",
    "softmax_combine",
    "softmax_output",
    "gpu_results",
    "gpu_summary",
    "plot_gpu_results",
]


class Launch(NamedTuple):
    """One hand-made launch: its grid, the output and the scratch, on the host."""

    grid: AttentionGrid
    threads: int  # per block
    out: np.ndarray  # [batch, num_heads, n_q, head_dim] float32
    part_acc: np.ndarray  # [batch, num_heads, n_q, splits, head_dim]: each split's sum
    part_stats: np.ndarray  # [batch, num_heads, n_q, splits, 2]: (running max, sum)
    counters: np.ndarray  # [tasks, chunks]: back at zero after the launch


def launch_attention(
    q: np.ndarray,
    K: np.ndarray,
    V: np.ndarray,
    *,
    causal: bool = True,
    window: int | None = None,
    splits: int | None = None,
    sm_count: int = 1,
) -> Launch:
    """Launch ``attend_kernel`` over float32 host arrays, as nbkv's backend would.

    ``q``: [batch, num_heads, n_q, head_dim]; ``K``, ``V``: [batch, num_kv_heads,
    seq_len, head_dim] ("bhsd"), every position held. ``splits`` forces the number of
    splits (None: as the backend chooses for ``sm_count`` SMs).

    Raises
    ------
    ShapeMismatchError, InvalidArgumentError
        Arrays that are not float32 4-D of agreeing sizes, a window that is not positive.
    """
    from numba import cuda

    from ..kernels import cuda_attention

    q, K, V = (np.ascontiguousarray(x) for x in (q, K, V))
    if not all(x.ndim == 4 and x.dtype == np.float32 for x in (q, K, V)):
        raise ShapeMismatchError("q, K and V must be float32 4-D arrays")
    batch, num_heads, n_q, dim = q.shape
    if K.shape != V.shape or K.shape[0] != batch or K.shape[3] != dim:
        raise ShapeMismatchError(f"K {K.shape} and V {V.shape} do not fit q {q.shape}")
    seq_len, kv_heads = K.shape[2], K.shape[1]
    if window is not None and window < 1:
        raise InvalidArgumentError(f"window must be None or a positive int, got {window}")
    win = 0 if window is None or window >= seq_len else int(window)
    span = seq_len - (max(0, seq_len - n_q - win + 1) if win else 0)
    grid = attention_grid(
        batch, num_heads, kv_heads, n_q, span, sm_count=sm_count, tile=cuda_attention.TILE,
        splits=splits,
    )  # fmt: skip
    acc_shape, stats_shape, counters_shape = attention_scratch_shapes(
        grid, batch, num_heads, n_q, dim
    )
    part_acc = cuda.device_array(acc_shape, np.float32)
    part_stats = cuda.device_array(stats_shape, np.float32)
    counters = cuda.to_device(np.zeros(counters_shape, np.int32))  # must start at zero
    out = cuda.device_array(q.shape, np.float32)
    table = cuda.to_device(np.empty(0, np.float32))  # float32 K/V: no widening table
    cuda_attention.attend_kernel[tuple(grid), cuda_attention.THREADS](
        cuda.to_device(q), cuda.to_device(K), cuda.to_device(V), seq_len,
        1.0 / math.sqrt(dim), bool(causal), win, table, part_acc, part_stats, counters, out,
    )  # fmt: skip
    return Launch(
        grid,
        cuda_attention.THREADS,
        to_host(out),
        to_host(part_acc),
        to_host(part_stats),
        to_host(counters),
    )


# -- reading a kernel's code ---------------------------------------------------------------
def function_source(module: ModuleType, name: str) -> str:
    """The source of the function ``name`` defined in ``module``, at any depth (a device
    function built inside a factory, say), read from the module's file now, dedented.

    >>> import nbkv.kernels.cuda_attention_steps as steps
    >>> function_source(steps, "block").splitlines()[1]
    'def block('

    Raises
    ------
    InvalidArgumentError
        No function, or more than one, of that name in the module.
    """
    source = inspect.getsource(module)
    found = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
    ]
    if len(found) != 1:
        raise InvalidArgumentError(
            f"{module.__name__} defines {len(found)} functions named {name!r}; expected one"
        )
    node = found[0]
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = source.splitlines()[first - 1 : node.end_lineno]
    return textwrap.dedent("\n".join(lines))


def excerpt(source: str, start: str, stop: str | None = None) -> str:
    r"""The lines of ``source`` from the first that contains ``start`` up to, not including,
    the first later one that contains ``stop`` (to the end when ``stop`` is None), dedented.

    >>> print(excerpt("a\n  b = 1\n  c = 2\nd", "b =", "d"))
    b = 1
    c = 2

    Raises
    ------
    InvalidArgumentError
        ``start`` or ``stop`` is not in ``source`` (the code changed: update the marker).
    """
    lines = source.splitlines()
    begin = next((i for i, line in enumerate(lines) if start in line), None)
    if begin is None:
        raise InvalidArgumentError(f"no line contains start={start!r}")
    end = len(lines)
    if stop is not None:
        end = next((i for i in range(begin + 1, len(lines)) if stop in lines[i]), -1)
        if end < 0:
            raise InvalidArgumentError(f"no line after {start!r} contains stop={stop!r}")
    return textwrap.dedent("\n".join(lines[begin:end])).strip("\n")


# -- the online softmax in NumPy -----------------------------------------------------------
class Softmax(NamedTuple):
    """The running state of an online softmax over some positions, per query row."""

    m: np.ndarray  # [rows]: the largest score seen (-inf: none finite yet)
    l: np.ndarray  # noqa: E741  [rows]: sum of exp(score - m)
    o: np.ndarray  # [rows, head_dim]: sum of exp(score - m) * v


def softmax_start(rows: int, head_dim: int) -> Softmax:
    """The state before any position: ``m = -inf``, ``l = 0``, ``o = 0`` (float64)."""
    return Softmax(np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, head_dim)))


def _shift(m: np.ndarray) -> np.ndarray:
    # the exponent's origin: m itself, or 0 where nothing finite was seen (so that
    # exp(-inf - -inf) = NaN never happens; the kernel does the same)
    return np.where(np.isfinite(m), m, 0.0)


def softmax_update(state: Softmax, s: np.ndarray, v: np.ndarray) -> Softmax:
    """``state`` after one more block of positions: scores ``s`` [rows, n] (``-inf`` for
    a masked position) and their values ``v`` [n, head_dim]."""
    m = np.maximum(state.m, s.max(axis=1))  # m' = max(m, max_j s_j)
    c = np.exp(state.m - _shift(m))  # e^(m - m'): rescales what was summed so far
    p = np.exp(s - _shift(m)[:, None])  # e^(s_j - m'); 0 for a masked score
    return Softmax(m, state.l * c + p.sum(axis=1), state.o * c[:, None] + p @ v)


def softmax_combine(a: Softmax, b: Softmax) -> Softmax:
    """One state for the positions of ``a`` and ``b`` together (two splits)."""
    m = np.maximum(a.m, b.m)
    ca, cb = np.exp(a.m - _shift(m)), np.exp(b.m - _shift(m))
    return Softmax(m, a.l * ca + b.l * cb, a.o * ca[:, None] + b.o * cb[:, None])


def softmax_output(state: Softmax) -> np.ndarray:
    """The attention output ``o / l`` [rows, head_dim] (NaN for a row that saw nothing)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return state.o / state.l[:, None]


# -- committed GPU benchmark results -------------------------------------------------------
def gpu_results(folder: str | Path) -> dict[str, dict]:
    """The GPU runs of ``benchmarks/bench_cuda.py`` in ``folder``: file name -> its JSON,
    for every ``cuda-*.json`` that measured something (not a run that skipped for want of
    a GPU, not a ``--dry-run`` on the simulator, and with results), in name order."""
    runs = {}
    for path in sorted(Path(folder).glob("cuda-*.json")):
        data = json.loads(path.read_text())
        if data.get("skipped") or data.get("dry_run") or not data.get("results"):
            continue
        runs[path.name] = data
    return runs


def _gpu_name(data: dict) -> str:
    return str(data.get("machine", {}).get("gpu", {}).get("name", "an unnamed GPU"))


def _attention_cases(data: dict) -> dict[str, dict]:
    return data.get("results", {}).get("attention", {}).get("cases", {})


def gpu_summary(name: str, data: dict) -> str:
    """Markdown: what the run ``name`` (one of :func:`gpu_results`) measured, in numbers
    taken from it: nbkv's decode attention against the torch peer per case, the append's
    bandwidth against the device copy, and each target, PASS, MISS or SKIP."""
    lines = [f"**{name}** ({_gpu_name(data)}{', --quick' if data.get('quick') else ''}):", ""]
    for case, r in _attention_cases(data).items():
        nb = r["methods"].get("nbkv")
        if nb is None:
            continue
        peer = r["case"].get("torch_peer")
        text = f"- attention {case}: nbkv {nb['device_us']:.1f} us, {nb['gb_per_s']:.0f} GB/s"
        if peer is not None and peer in r["methods"]:
            p = r["methods"][peer]
            text += (
                f"; {peer} {p['device_us']:.1f} us, {p['gb_per_s']:.0f} GB/s "
                f"(nbkv at {nb['speed_vs_torch_peer']:.2f}x its speed)"
            )
        lines.append(text)
    for n, r in data.get("results", {}).get("append", {}).items():
        api, copy = r["methods"].get("nbkv API"), r["methods"].get("device copy")
        if api is not None and copy is not None:
            lines.append(
                f"- append of {n} position{'s' * (n != '1')}: nbkv API {api['gb_per_s']:.0f} "
                f"GB/s, device copy {copy['gb_per_s']:.0f} GB/s "
                f"({api['gb_per_s'] / copy['gb_per_s']:.0%} of it)"
            )
    word = {True: "PASS", False: "MISS", None: "SKIP"}
    lines += [f"- {word[t['pass']]} {t['target']}: {t['figure']}" for t in data.get("targets", [])]
    return "\n".join(lines)


def _bars(ax: Any, labels: list[str], series: dict[str, list]) -> None:
    width = 0.8 / max(1, len(series))
    for i, (method, values) in enumerate(series.items()):
        xs = [k + (i - (len(series) - 1) / 2) * width for k in range(len(labels))]
        ys = [np.nan if y is None else y for y in values]
        ax.bar(xs, ys, width, label=method)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)


def _series(cases: dict[str, dict], key: str) -> dict[str, list]:
    methods = list(dict.fromkeys(m for r in cases.values() for m in r["methods"]))
    return {m: [r["methods"].get(m, {}).get(key) for r in cases.values()] for m in methods}


def plot_gpu_results(name: str, data: dict) -> Any:
    """A figure of one run (one of :func:`gpu_results`): decode attention GB/s of K+V read
    per case and method, and, where the run has them, the append's GB/s per method and
    the host microseconds of one decode step per backend. Needs matplotlib."""
    import matplotlib.pyplot as plt

    results = data.get("results", {})
    cases = _attention_cases(data)
    appends = results.get("append", {})
    host = results.get("host", {})
    panels = [p for p, have in (("attention", cases), ("append", appends), ("host", host)) if have]
    if not panels:
        raise InvalidArgumentError(f"{name} holds no attention, append or host results")
    widths = {"attention": 2.2, "append": 1.0, "host": 1.0}
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4 * len(panels) + 1, 4), dpi=100, squeeze=False,
        width_ratios=[widths[p] for p in panels],
    )  # fmt: skip
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "attention":
            _bars(ax, [c.replace(" ", "\n") for c in cases], _series(cases, "gb_per_s"))
            ax.set_xlabel("cache dtype, batch, seq_len")
            ax.set_ylabel("GB/s of K+V read per median device time")
            ax.set_title("Decode attention (higher is faster)", fontsize=9)
            ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend
        elif panel == "append":
            _bars(ax, [f"{n} pos." for n in appends], _series(appends, "gb_per_s"))
            ax.set_yscale("log")
            ax.set_xlabel("positions per append")
            ax.set_ylabel("GB/s read + written per median device time")
            ax.set_title("Append, K and V", fontsize=9)
        else:
            calls = list(dict.fromkeys(c for r in host.values() for c in r["methods"]))
            per_backend = {
                b: [r["methods"].get(c, {}).get("host_us") for c in calls] for b, r in host.items()
            }
            labels = [c.replace(" + ", "\n+ ").replace("_and_", "_and_\n") for c in calls]
            _bars(ax, labels, per_backend)
            ax.set_yscale("log")
            ax.set_xlabel("call")
            ax.set_ylabel("host us per call (median)")
            ax.set_title("One decode step of one layer, host time", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{name}: {_gpu_name(data)}", fontsize=10)
    fig.tight_layout()
    return fig
