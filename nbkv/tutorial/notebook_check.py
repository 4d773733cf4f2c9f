"""Run a notebook top to bottom and tell whether its committed outputs are stale.

A notebook is committed with its outputs so that readers on GitHub see them. Those outputs go
stale when the code or the library changes and nobody re-runs the notebook: a cell that now
prints four result files still shows two, a plot that is no longer drawn is still there. This
module re-executes a notebook and compares what each code cell *reports* with what was
committed:

- the kinds of output, in order (printed text, a figure, a rich display, an error);
- the number of figures;
- the printed and displayed text, with every number and every run of spaces normalised
  (``"17.3 ms"`` and ``"9.1 ms"`` read the same), so that timings and other measured values may
  move between runs while the files, rows, labels and sentences a cell reports may not.

What goes to stderr (warnings, progress bars) is not compared. A cell whose text depends on
more than numbers (say, which of two methods was faster on this run) carries the cell tag
``nbkv:varies``; for it only the kinds and figures are compared.

Usage, from the repository root::

    python -m nbkv.tutorial.notebook_check notebooks/03_memory_and_latency.ipynb         # check
    python -m nbkv.tutorial.notebook_check --save notebooks/03_memory_and_latency.ipynb  # save

It needs the ``notebooks`` extra (``nbclient``, ``nbformat``, ``ipykernel``).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

VARIES_TAG = "nbkv:varies"
_NUMBER = re.compile(r"[-+]?(?:\d[\d,_]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_SPACE = re.compile(r"\s+")
_RULE = re.compile(r"-{3,}")  # a table's rule, as long as its widest cell
_PADDED = re.compile(r"([(\[{])\s+#")  # a number padded to its field's width after a bracket


def normalise(text: str) -> str:
    """``text`` with every table rule (three dashes or more) cut to three, every number
    replaced by ``#``, every run of whitespace by one space, and none between an opening
    bracket and a number: a column's width follows its numbers (a time of 10.2 s where the
    committed run took 9.8 s), so its rule does, and a number padded to a width
    (``f"({ratio:5.1f}x)"``) loses its padding when it grows (``( 99.3x)``, ``(100.3x)``)."""
    text = _SPACE.sub(" ", _NUMBER.sub("#", _RULE.sub("---", text)))
    return _PADDED.sub(r"\1#", text).strip()


@dataclass(frozen=True)
class CellReport:
    """What one code cell reports: kinds of output, figure count, normalised text."""

    kinds: tuple[str, ...]
    figures: int
    text: str | None  # None for a cell tagged nbkv:varies


def _kind(output) -> str | None:
    kind = output.get("output_type")
    if kind == "stream":
        return None if output.get("name") == "stderr" else "stdout"
    if kind in ("display_data", "execute_result"):
        data = output.get("data", {})
        if "image/png" in data or "image/svg+xml" in data:
            return "figure"
        if "text/markdown" in data:
            return "markdown"
        return "display"
    return kind  # "error"


def _text(output) -> str:
    if output.get("output_type") == "stream":
        return "" if output.get("name") == "stderr" else output.get("text", "")
    data = output.get("data", {})
    if "image/png" in data or "image/svg+xml" in data:
        return ""
    return data.get("text/markdown", data.get("text/plain", ""))


def report(nb) -> list[CellReport]:
    """One :class:`CellReport` per code cell of ``nb`` (an ``nbformat`` notebook)."""
    reports = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = cell.get("outputs", [])
        kinds = []
        for output in outputs:
            kind = _kind(output)
            if kind is not None and not (kinds and kinds[-1] == kind == "stdout"):
                kinds.append(kind)  # consecutive stdout chunks are one stream
        varies = VARIES_TAG in cell.get("metadata", {}).get("tags", [])
        text = None if varies else normalise("".join(_text(o) for o in outputs))
        reports.append(CellReport(tuple(kinds), sum(k == "figure" for k in kinds), text))
    return reports


def stale_cells(committed, fresh) -> list[str]:
    """Human-readable differences between a committed notebook and a fresh execution of it."""
    old, new = report(committed), report(fresh)
    if len(old) != len(new):
        return [f"{len(old)} code cells committed, {len(new)} executed"]
    problems = []
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        if a.kinds != b.kinds:
            problems.append(
                f"code cell {i}: committed outputs {list(a.kinds)}, now {list(b.kinds)}"
            )
        elif a.text is not None and a.text != b.text:
            problems.append(
                f"code cell {i}: committed text\n    {a.text[:400]}\n  now\n    {b.text[:400]}"
            )
    return problems


def execute(path: str | Path, *, timeout: int = 900):
    """A fresh execution of the notebook at ``path`` (its own directory as working directory)."""
    import nbclient
    import nbformat

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    return nb


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(
        prog="python -m nbkv.tutorial.notebook_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument(
        "--save", action="store_true", help="write the fresh outputs into the notebook"
    )
    args = parser.parse_args(argv)
    failed = 0
    for path in args.paths:
        committed = nbformat.read(path, as_version=4)
        fresh = execute(path)
        problems = stale_cells(committed, fresh)
        if args.save:
            nbformat.write(fresh, path)
            print(f"{path}: executed and saved ({len(problems)} cells had changed)")
        elif problems:
            failed += 1
            print(f"{path}: STALE\n  " + "\n  ".join(problems))
        else:
            print(f"{path}: committed outputs are current")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
