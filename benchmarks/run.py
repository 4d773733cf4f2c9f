"""Run the benchmark suite: every ``benchmarks/bench_*.py``, then the figures.

Each script runs in its own process (this interpreter, from the repository root) with
``--json <out>/<name>-<tag>.json``; its printed output is saved as ``<name>-<tag>.txt``
beside it, and ``<out>/index.json`` records the runner's command, a timestamp, and per
benchmark its command, duration and exit code. ``<tag>`` names the machine: ``cpu``, or
the GPU's name (lowercased, ``[a-z0-9-]`` only) when Numba sees a CUDA device. The
figures (``<name>-<tag>.png``, see :mod:`benchmarks.plots`) are drawn from the JSON files.

Usage (from the repository root)::

    python -m benchmarks                  # full suite into benchmarks/results/
    python -m benchmarks --quick          # smoke run (CI) into a temporary folder
    python -m benchmarks --only attention --out /tmp/att
    python -m benchmarks --plots-only     # redraw the PNGs from benchmarks/results/*.json

The exit status is non-zero if any benchmark (or figure) failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "benchmarks"
RESULTS = BENCH_DIR / "results"
INDEX = "index.json"
POLL_S = 0.2  # how often the progress bar is redrawn
HEARTBEAT_S = 30.0  # a plain "still running" line this often when not on a TTY

_DETECT_GPU = (
    "from numba import cuda\n"
    "if cuda.is_available():\n"
    "    name = cuda.get_current_device().name\n"
    "    print(name.decode() if isinstance(name, bytes) else name)\n"
)


def sanitize(name: str) -> str:
    """A device name as a file-name part: lowercased, runs of other characters as '-'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def machine_tag() -> str:
    """``cpu``, or the CUDA GPU's name as Numba reports it (e.g. ``nvidia-h200``).

    Asked in a short child process, so that this one holds no CUDA context while the
    benchmarks run; under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) it is ``cpu``.
    """
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "cpu"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _DETECT_GPU],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    lines = done.stdout.strip().splitlines()
    return sanitize(lines[-1]) if done.returncode == 0 and lines else "cpu"


def discover(bench_dir: Path) -> dict[str, Path]:
    """name -> script for every ``bench_<name>.py`` in ``bench_dir``, sorted by name."""
    return {p.stem[len("bench_") :]: p for p in sorted(Path(bench_dir).glob("bench_*.py"))}


def select(available: dict[str, Path], only: list[str] | None) -> dict[str, Path]:
    """The benchmarks ``--only`` names (``attention``, ``bench_attention`` or its file)."""
    if not only:
        return dict(available)
    chosen = {}
    for raw in only:
        name = Path(raw).stem
        name = name[len("bench_") :] if name.startswith("bench_") else name
        if name not in available:
            known = ", ".join(available) or "none"
            raise SystemExit(f"no benchmark named {raw!r} (known: {known})")
        chosen[name] = available[name]
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run nbkv's benchmarks (benchmarks/bench_*.py) and draw their figures.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="pass --quick to each script (smoke run); results go to a temporary folder "
        "unless --out is given, so the committed results are never overwritten",
    )
    parser.add_argument(
        "--only",
        metavar="NAME",
        action="append",
        help="run only this benchmark (e.g. 'append' for bench_append.py); repeatable",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        help=f"results folder (default {RESULTS.relative_to(ROOT)}/, or a temporary one "
        "with --quick)",
    )
    parser.add_argument(
        "--plots-only",
        action="store_true",
        help="run nothing: redraw the PNGs from the JSON files in the results folder",
    )
    parser.add_argument(
        "--tag", help="machine tag in the file names (default: detected, 'cpu' or the GPU)"
    )
    parser.add_argument(
        "--bench-dir",
        type=Path,
        default=BENCH_DIR,
        help="folder holding the bench_*.py scripts (default: benchmarks/)",
    )
    return parser.parse_args(argv)


def out_dir(args: argparse.Namespace) -> Path:
    """Where results go: --out, else a fresh temporary folder for --quick runs (never
    the committed results), else benchmarks/results/."""
    if args.out is not None:
        return Path(args.out)
    if args.quick and not args.plots_only:
        return Path(tempfile.mkdtemp(prefix="nbkv-bench-quick-"))
    return RESULTS


def _show(path: Path) -> str:
    """``path`` relative to the repository root when inside it, else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


class Progress:
    """A one-line bar redrawn with '\\r' on a TTY; plain lines (start, every
    ``HEARTBEAT_S`` while running, end) otherwise."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.width = total, width
        self.last_beat = 0.0

    def start(self, i: int, name: str) -> None:
        self.last_beat = 0.0
        if not self.tty:
            self._line(f"[{i + 1}/{self.total}] {name}: started")

    def update(self, i: int, name: str, elapsed: float, expected: float | None) -> None:
        if self.tty:
            part = min(elapsed / expected, 0.99) if expected else 0.0
            filled = round(self.width * (i + part) / self.total)
            bar = "#" * filled + "-" * (self.width - filled)
            eta = f" of ~{expected:.0f} s" if expected else ""
            self.stream.write(
                f"\r[{bar}] {i + 1}/{self.total} {name}: {elapsed:6.1f} s{eta}  \x1b[K"
            )
            self.stream.flush()
        elif elapsed - self.last_beat >= HEARTBEAT_S:
            self.last_beat = elapsed
            self._line(f"[{i + 1}/{self.total}] {name}: running, {elapsed:.0f} s")

    def done(self, i: int, name: str, elapsed: float, status: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
        self._line(f"[{i + 1}/{self.total}] {name}: {status} in {elapsed:.1f} s")

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()


def _load_index(path: Path) -> dict:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _json_problem(path: Path) -> str | None:
    """Why the JSON a script wrote is not a usable record (None when it is)."""
    try:
        data = json.loads(path.read_text())
    except OSError:
        return "wrote no JSON"
    except ValueError as err:
        return f"wrote unreadable JSON ({err})"
    machine = data.get("machine") if isinstance(data, dict) else None
    if not isinstance(machine, dict):
        return "JSON has no 'machine' record"
    missing = [k for k in ("command", "python", "numpy", "numba") if k not in machine]
    return f"JSON 'machine' lacks {', '.join(missing)}" if missing else None


def run_one(
    name: str,
    script: Path,
    out: Path,
    tag: str,
    quick: bool,
    progress: Progress,
    i: int,
    expected: float | None,
) -> dict:
    """Run one script, its stdout into ``<name>-<tag>.txt``; its index entry."""
    json_path, txt_path = out / f"{name}-{tag}.json", out / f"{name}-{tag}.txt"
    json_path.unlink(missing_ok=True)  # a stale file must not pass for this run's
    # paths as from the repository root (the child's cwd), as the scripts' usage shows them
    flags = [*(["--quick"] if quick else []), "--json", _show(json_path)]
    cmd = [sys.executable, _show(script), *flags]
    started = datetime.now(timezone.utc)
    progress.start(i, name)
    t0 = time.perf_counter()
    with open(txt_path, "w") as stdout, tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, text=True
        )
        try:
            while proc.poll() is None:
                progress.update(i, name, time.perf_counter() - t0, expected)
                time.sleep(POLL_S)
        except BaseException:  # Ctrl-C: leave no benchmark running behind us
            proc.terminate()
            proc.wait()
            raise
        elapsed = time.perf_counter() - t0
        stderr.seek(0)
        err = stderr.read()
    code = proc.returncode
    problem = _json_problem(json_path)
    entry = {
        "name": name,
        "script": _show(script),
        "command": cmd,
        "started": started.isoformat(timespec="seconds"),
        "duration_s": round(elapsed, 3),
        "exit_code": code,
        "ok": code == 0 and problem is None,
        "json": json_path.name if problem is None else None,
        "stdout": txt_path.name,
    }
    if problem is not None:
        entry["problem"] = problem
    skipped = _skipped(json_path) if problem is None else None
    if skipped is not None:  # nothing measured here (bench_cuda.py without a GPU): no
        # result files are left to pass for measurements
        entry.update(skipped=skipped, json=None, stdout=None)
        json_path.unlink(missing_ok=True)
        txt_path.unlink(missing_ok=True)
    if err.strip():
        entry["stderr_tail"] = err[-4000:]
    if entry["ok"]:
        status = "ok" if skipped is None else f"skipped ({skipped})"
    elif code:
        status = f"FAILED (exit {code})" + (f"; {problem}" if problem else "")
    else:
        status = f"FAILED ({problem})"
    progress.done(i, name, elapsed, status)
    if not entry["ok"]:
        tail = (err.strip() or txt_path.read_text().strip()).splitlines()[-15:]
        for line in tail:
            progress._line(f"    {line}")
    elif skipped is None:  # the targets each script states, PASS / MISS / SKIP
        for line in txt_path.read_text().splitlines():
            if line.startswith(("PASS ", "MISS ", "SKIP ")):
                progress._line(f"    {line}")
    return entry


def _skipped(json_path: Path) -> str | None:
    """The reason a benchmark's JSON gives for having measured nothing, or None."""
    try:
        why = json.loads(json_path.read_text()).get("skipped")
    except (OSError, ValueError, AttributeError):
        return None
    return str(why) if why else None


def draw_plots(out: Path, names: list[str] | None, stream: TextIO) -> tuple[list[str], bool]:
    """Draw ``<name>-<tag>.png`` beside every ``<name>-<tag>.json`` in ``out`` that has a
    figure (only for ``names`` when given); the PNGs written, and whether all worked."""
    try:
        from benchmarks import plots
    except ImportError:  # run as a file, not as part of the package
        sys.path.insert(0, str(ROOT))
        from benchmarks import plots
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        stream.write(f"no figures: matplotlib is not installed ({err})\n")
        return [], False
    written, ok = [], True
    for name, plot in plots.PLOTTERS.items():
        if names is not None and name not in names:
            continue
        for path in sorted(out.glob(f"{name}-*.json")):
            png = path.with_suffix(".png")
            if _skipped(path) is not None:
                continue  # nothing was measured: no figure
            try:
                plots.save(plot(json.loads(path.read_text())), png)
            except Exception as err:  # report it, draw the others, fail at the end
                stream.write(f"figure {png.name} FAILED: {type(err).__name__}: {err}\n")
                ok = False
                continue
            written.append(png.name)
            stream.write(f"wrote {_show(png)}\n")
    return written, ok


def main(argv: list[str] | None = None, stream: TextIO | None = None) -> int:
    stream = stream if stream is not None else sys.stdout
    args = parse_args(argv)
    selected = select(discover(args.bench_dir), args.only)
    out = out_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    if args.plots_only:
        names = list(selected) if args.only else None
        written, ok = draw_plots(out, names, stream)
        if not written:
            stream.write(f"no figure drawn: no matching JSON files in {_show(out)}\n")
        return 0 if ok and written else 1
    if not selected:
        stream.write(f"no bench_*.py in {_show(args.bench_dir)}\n")
        return 1
    tag = sanitize(args.tag) if args.tag else machine_tag()
    index_path = out / INDEX
    previous = _load_index(index_path)
    # expected durations for the bar: the last run of the same kind into this folder
    before = previous.get("benchmarks", {}) if previous.get("quick") == args.quick else {}
    started = datetime.now(timezone.utc)
    stream.write(
        f"{len(selected)} benchmark(s) ({', '.join(selected)}), "
        f"{'quick' if args.quick else 'full'} run, machine tag {tag!r}, results in "
        f"{_show(out)}\n"
    )
    progress = Progress(len(selected), stream)
    entries = {}
    for i, (name, script) in enumerate(selected.items()):
        last = before.get(f"{name}-{tag}", {})
        expected = last.get("duration_s") if last.get("ok") else None
        entries[f"{name}-{tag}"] = run_one(
            name, script, out, tag, args.quick, progress, i, expected
        )
    pngs, plots_ok = draw_plots(out, [e["name"] for e in entries.values() if e["ok"]], stream)
    failed = [e["name"] for e in entries.values() if not e["ok"]]
    code = 1 if failed or not plots_ok else 0
    # entries of benchmarks not run this time (--only) stay, each with its own command
    kept = previous.get("benchmarks", {}) if previous.get("quick") == args.quick else {}
    command = [sys.executable, "-m", "benchmarks", *(sys.argv[1:] if argv is None else argv)]
    for entry in entries.values():
        entry["suite_command"] = command
    index = {
        "command": command,
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "tag": tag,
        "host": {"platform": platform.platform(), "python": platform.python_version()},
        "ran": list(entries),
        "exit_code": code,
        "failed": failed,
        "plots": pngs,
        "benchmarks": {**{k: v for k, v in kept.items() if k not in entries}, **entries},
    }
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    stream.write(f"wrote {_show(index_path)}\n")
    if failed:
        stream.write(f"FAILED: {', '.join(failed)}\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
