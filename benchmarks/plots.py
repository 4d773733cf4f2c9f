"""The benchmark figures, drawn from the JSON files the ``bench_*.py`` scripts write.

Each function takes the loaded JSON (``json.load`` of ``results/<name>-<tag>.json``) and
returns a ``matplotlib.figure.Figure`` (made without pyplot, so no backend or global
figure state is touched), or draws into an ``ax`` it is given::

    import json
    from benchmarks import plots

    data = json.load(open("benchmarks/results/attention-cpu.json"))
    fig = plots.plot_attention(data)  # displays in a notebook; or:
    plots.save(fig, "attention-cpu.png")

``python -m benchmarks --plots-only`` redraws every figure in ``benchmarks/results/``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

# methods of bench_attention.py that read K and V without attending: references, not peers
READ_METHODS = ("read ceiling", "NumPy sum")


def _new_axes(ax: Any, size: tuple[float, float]) -> tuple[Any, Any]:
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


def machine_line(data: dict) -> str:
    """One line naming the machine and the versions a benchmark JSON records."""
    m = data.get("machine", {})
    parts = [f"{m.get('cpu', '?')} ({m.get('cpu_count', '?')} cpus)"]
    for lib in ("python", "numpy", "numba", "torch"):
        if m.get(lib):
            parts.append(f"{lib} {m[lib]}")
    return ", ".join(parts)


def _methods(results: dict) -> list[str]:
    """Every method named in any case, in the order the script ran them."""
    names: list[str] = []
    for r in results.values():
        names += [n for n in r["methods"] if n not in names]
    return names


def plot_append(data: dict, ax: Any = None) -> Any:
    """bench_append.py: per case, one bar per method of its time relative to NumPy slice.

    Log scale (np.concatenate is hundreds of times slower at decode); whiskers span the
    method's p10 to p90 relative to NumPy slice's median; below the line at 1 is faster.
    """
    fig, ax = _new_axes(ax, (10, 5.5))
    results = data["results"]
    cases, methods = list(results), _methods(results)
    width = 0.8 / len(methods)
    colors = [f"C{i}" for i in range(10)]
    for i, name in enumerate(methods):
        xs, ys, lo, hi = [], [], [], []
        for j, case in enumerate(cases):
            m = results[case]["methods"].get(name)
            if m is None:
                continue
            ratio = m["time_vs_numpy_slice"]
            xs.append(j + (i - (len(methods) - 1) / 2) * width)
            ys.append(ratio)
            lo.append(ratio - ratio * m["us_p10"] / m["us_per_append"])
            hi.append(ratio * m["us_p90"] / m["us_per_append"] - ratio)
        bars = ax.bar(
            xs,
            ys,
            width,
            yerr=[lo, hi],
            label=name,
            color=colors[i % len(colors)],
            error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "0.3"},
        )
        ax.bar_label(
            bars,
            labels=[f"{y:.2f}" if y < 10 else f"{y:.0f}" for y in ys],
            fontsize=7,
            padding=2,
        )
    ax.axhline(1.0, color="0.2", linewidth=0.8, linestyle="--")
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)))
    labels = []
    for case in cases:
        c = results[case]["case"]
        n = c["positions_per_append"]
        shape = ", ".join(str(s) for s in c["buffer_shape"])
        what = "1 position" if n == 1 else f"{n} positions"
        labels.append(f"{case}: {what} per append\ninto [{shape}]")
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("time relative to NumPy slice (log; below 1 is faster)")
    ax.set_title(
        "Appending K/V: median time per append, relative to NumPy slice assignment\n"
        + machine_line(data),
        fontsize=10,
    )
    ax.legend(fontsize=8, ncols=3, loc="upper right")
    ax.grid(axis="y", which="both", alpha=0.25)
    ax.margins(y=0.12)
    return fig


def plot_attention(data: dict, ax: Any = None) -> Any:
    """bench_attention.py: GB/s of K+V read against seq_len, one line per method.

    The read ceiling (a parallel ``@njit`` sum over the same bytes) is drawn dashed; the
    nbkv API points are labelled with their share of it.
    """
    fig, ax = _new_axes(ax, (10.5, 5.5))
    results = data["results"]
    seqs = sorted(results, key=int)
    methods = _methods(results)
    peers = [n for n in methods if n not in READ_METHODS]
    for i, name in enumerate(peers):
        pts = [(int(s), results[s]["methods"][name]) for s in seqs if name in results[s]["methods"]]
        nbkv = name.startswith("nbkv")
        ax.plot(
            [s for s, _ in pts],
            [m["gb_per_s"] for _, m in pts],
            marker="o",
            linewidth=2.2 if nbkv else 1.3,
            markersize=5 if nbkv else 4,
            color=f"C{i % 10}",
            # a 16-bit cache's GB/s are of its own bytes, half a float32 cache's
            label=name + (" (GB/s of half the bytes)" if "16 kernel" in name else ""),
        )
        if name == "nbkv API":
            for s, m in pts:
                # the share paired round by round where the run measured it
                share = m.get("pct_of_read_paired") or m["pct_of_read_ceiling"]
                ax.annotate(
                    f"{share:.0f}%",
                    (s, m["gb_per_s"]),
                    textcoords="offset points",
                    xytext=(0, -9),
                    ha="center",
                    va="top",
                    fontsize=8,
                    color=f"C{i % 10}",
                )
    styles = {"read ceiling": ("k", "--", 2.0), "NumPy sum": ("0.5", ":", 1.3)}
    for name in (n for n in READ_METHODS if n in methods):
        color, style, width = styles[name]
        pts = [(int(s), results[s]["methods"][name]) for s in seqs if name in results[s]["methods"]]
        label = "read ceiling (parallel @njit sum of K+V)" if name == "read ceiling" else name
        ax.plot(
            [s for s, _ in pts],
            [m["gb_per_s"] for _, m in pts],
            linestyle=style,
            color=color,
            linewidth=width,
            marker=".",
            label=label,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(s) for s in seqs])
    ax.set_xticklabels(seqs)
    ax.set_xlabel("seq_len (positions held; K+V = 2 * seq_len * 8 * 128 * 4 bytes)")
    ax.set_ylabel("GB/s of K+V read (per median call)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        "Decode attention, 32 query heads over 8 KV heads, head_dim 128, float32\n"
        "(nbkv API labelled with its share of the read ceiling, paired by round where"
        " measured; higher is faster)\n" + machine_line(data),
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.25)
    return fig


def plot_quantized(data: dict, ax: Any = None) -> Any:
    """bench_quantized.py: decode attention time against seq_len (float32, float16, 8-bit
    and 4-bit caches), whiskers p10 to p90; with no ``ax``, a second panel of each
    cache's speedup over float16, the targets dashed (below 1 the codes are slower)."""
    results = data["results"]["attention"]
    seqs = sorted(results, key=int)
    names = list(results[seqs[0]]["methods"])
    if ax is None:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(12, 5), layout="constrained")
        ax, ax2 = fig.subplots(1, 2)
    else:
        fig, ax2 = ax.figure, None
    xs = [int(s) for s in seqs]
    for i, name in enumerate(names):
        ms = [results[s]["methods"][name] for s in seqs]
        ys = [m["us"] / 1e3 for m in ms]
        err = [
            [(m["us"] - m["us_p10"]) / 1e3 for m in ms],
            [(m["us_p90"] - m["us"]) / 1e3 for m in ms],
        ]
        style = dict(marker="o", color=f"C{i}", capsize=2, label=name)
        ax.errorbar(xs, ys, yerr=err, linestyle=":" if name == "float32" else "-", **style)
        if ax2 is not None and name != "float16":
            ax2.plot(xs, [m["speedup_vs_float16"] for m in ms], marker="o", color=f"C{i}",
                     linestyle=":" if name == "float32" else "-", label=name)  # fmt: skip
    for a in (ax, ax2):
        if a is None:
            continue
        a.set_xscale("log", base=2)
        a.set_xticks(xs)
        a.set_xticklabels([f"{x // 1024}k" for x in xs])
        a.set_xlabel("seq_len (positions held)")
        a.grid(alpha=0.25, which="both")
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode attention call (median; whiskers p10-p90)")
    ax.set_title(
        "Decode attention, 32 query / 8 KV heads, head_dim 128, batch 1\n"
        "quantized: float16 window, group 64, residual 128\n" + machine_line(data),
        fontsize=9,
    )
    ax.legend(fontsize=8)
    if ax2 is not None:
        ax2.axhline(1.0, color="0.2", linewidth=0.8)
        for (name, goal), c in zip((("8-bit", 1.3), ("4-bit", 1.5)), ("C2", "C3"), strict=True):
            ax2.axhline(
                goal, color=c, linewidth=0.8, linestyle="--", label=f"{name} target {goal}x"
            )
        ax2.set_ylabel("speedup over the float16 cache (float16 time / this time)")
        ax2.set_ylim(bottom=0)
        ax2.set_title("Above 1: faster than float16 (dashed: the targets at 32k)", fontsize=9)
        ax2.legend(fontsize=8)
    return fig


def _bars(ax: Any, groups: list[str], series: dict[str, list]) -> None:
    """Grouped bars: one group per label in ``groups``, one bar per series (None: none)."""
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        pts = [(j, v) for j, v in enumerate(values) if v is not None]
        xs = [j + (i - (len(series) - 1) / 2) * width for j, _ in pts]
        ax.bar(xs, [v for _, v in pts], width, label=name, color=f"C{i % 10}")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.25)


def _series(results: dict, key: str) -> dict[str, list]:
    """method -> its ``key`` in each case of ``results`` (None where it did not run)."""
    return {
        n: [r["methods"].get(n, {}).get(key) for r in results.values()] for n in _methods(results)
    }


def plot_cuda(data: dict, ax: Any = None) -> Any:
    """bench_cuda.py: decode attention GB/s of K+V read per case and method (device time,
    CUDA events); with no ``ax``, two more panels: append GB/s (read + written, log scale)
    and host microseconds of a decode step per backend. A run that was skipped (no GPU)
    draws a figure that says so and nothing else."""
    results = data.get("results") or {}
    if data.get("skipped") or not results:
        fig, ax = _new_axes(ax, (6, 2))
        why = data.get("skipped") or "no results"
        ax.text(0.5, 0.5, f"CUDA benchmark skipped: {why}\nnothing was measured",
                ha="center", va="center", fontsize=9, wrap=True)  # fmt: skip
        ax.set_axis_off()
        return fig
    if ax is None:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(16, 5), layout="constrained")
        ax, ax_app, ax_host = fig.subplots(1, 3, width_ratios=[2.2, 1, 1])
    else:
        fig, ax_app, ax_host = ax.figure, None, None
    cases = results.get("attention", {}).get("cases", {})
    _bars(ax, [c.replace(" ", "\n") for c in cases], _series(cases, "gb_per_s"))
    ax.set_ylabel("GB/s of K+V read (8 KV heads) per median device time")
    ax.set_title(
        "Decode attention on the GPU, 32 query / 8 KV heads, head_dim 128 (higher is faster)\n"
        f"{data.get('machine', {}).get('gpu', {}).get('name', '?')}; " + machine_line(data),
        fontsize=9,
    )
    ax.legend(fontsize=7)
    appends = results.get("append", {})
    if ax_app is not None and appends:
        labels = [f"{n} position{'s' * (n != '1')}" for n in appends]
        _bars(ax_app, labels, _series(appends, "gb_per_s"))
        ax_app.set_yscale("log")
        ax_app.set_ylabel("GB/s (read + written) per median device time")
        shape = next(iter(appends.values()))["case"]["cache_shape"]
        ax_app.set_title(f"Append into {shape} float16, K and V", fontsize=9)
        ax_app.legend(fontsize=7)
    host = results.get("host", {})
    if ax_host is not None and host:
        calls = _methods(host)
        per_backend = {
            b: [r["methods"].get(c, {}).get("host_us") for c in calls] for b, r in host.items()
        }
        _bars(ax_host, [c.replace(" + ", "\n+ ") for c in calls], per_backend)
        ax_host.axhline(10.0, color="0.2", linewidth=0.8, linestyle="--", label="target (CUDA)")
        ax_host.set_yscale("log")
        ax_host.set_ylabel("host us per call (median)")
        ax_host.set_title("One decode step of one layer, 1,024 positions", fontsize=9)
        ax_host.legend(fontsize=7)
    return fig


# benchmark name (bench_<name>.py) -> the function drawing its figure
PLOTTERS: dict[str, Callable[..., Any]] = {
    "append": plot_append,
    "attention": plot_attention,
    "quantized": plot_quantized,
    "cuda": plot_cuda,
}


def save(fig: Any, path: str | Path, dpi: int = 120) -> Path:
    """Write ``fig`` as a PNG at ``path`` (folders made as needed); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def draw(name: str, data: dict, path: str | Path) -> Path:
    """Draw benchmark ``name``'s figure from its loaded JSON into the PNG ``path``."""
    return save(PLOTTERS[name](data), path)
