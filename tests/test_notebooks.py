"""Every tutorial notebook runs top to bottom, and is committed with current outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import cpu_only

pytestmark = cpu_only

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
notebook_check = pytest.importorskip("nbkv.tutorial.notebook_check")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_with_outputs_and_opens_with_what_you_learn(path):
    nb = nbformat.read(path, as_version=4)
    first = "".join(nb.cells[0].source).lower()
    assert "learn" in first, "a notebook opens with what the reader will learn"
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert outputs, "committed without outputs: readers on GitHub would see nothing"
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot saved"
    assert not any(o.get("output_type") == "error" for o in outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom_and_its_committed_outputs_are_current(path):
    committed = nbformat.read(path, as_version=4)
    env_before = dict(os.environ)
    fresh = notebook_check.execute(
        path
    )  # raises CellExecutionError, naming the cell, if any cell fails
    assert dict(os.environ) == env_before
    problems = notebook_check.stale_cells(committed, fresh)
    assert not problems, (
        f"{path.name}'s committed outputs are stale; re-run it with "
        f"`python -m nbkv.tutorial.notebook_check --save {path.relative_to(path.parents[1])}`:\n"
        + "\n".join(problems)
    )


def _notebook(*cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    for cell in nb.cells:
        cell.metadata["tags"] = []
    return nb


def test_the_staleness_check_reads_numbers_as_free_and_reports_as_fixed(tmp_path):
    path = tmp_path / "probe.ipynb"
    nb = _notebook(
        "import time; print(f'files: a.json b.json, took {time.perf_counter_ns()} ns')",
        "import sys; print('progress', file=sys.stderr); print('done')",
    )
    nbformat.write(nb, path)
    committed = notebook_check.execute(path)
    assert (
        notebook_check.stale_cells(committed, notebook_check.execute(path)) == []
    )  # only numbers moved

    listing = committed.cells[0].outputs[0]
    listing["text"] = listing["text"].replace(
        "b.json", ""
    )  # a committed output listing one file fewer
    problems = notebook_check.stale_cells(committed, notebook_check.execute(path))
    assert len(problems) == 1 and problems[0].startswith("code cell 0")

    committed.cells[0].metadata["tags"] = [
        notebook_check.VARIES_TAG
    ]  # text free, kinds still checked
    assert notebook_check.stale_cells(committed, notebook_check.execute(path)) == []
    committed.cells[1].outputs = []  # a cell that printed nothing when committed
    assert "code cell 1" in notebook_check.stale_cells(committed, notebook_check.execute(path))[0]


def test_the_staleness_check_counts_figures_and_cells():
    a = _notebook("x = 1")
    b = _notebook("x = 1")
    b.cells[0].outputs = [
        nbformat.v4.new_output("display_data", data={"image/png": "", "text/plain": "<Figure>"})
    ]
    assert "figure" in notebook_check.stale_cells(a, b)[0]
    assert notebook_check.stale_cells(a, _notebook("x = 1", "y = 2")) == [
        "1 code cells committed, 2 executed"
    ]
    assert notebook_check.normalise("took  1,234.5 ms\n(3e-07)") == "took # ms (#)"
    # a table whose column grew a digit: its rule grew a dash, and nothing else changed
    wide, narrow = "s\n----\n10.2", "s\n---\n9.8"
    assert notebook_check.normalise(wide) == notebook_check.normalise(narrow) == "s --- #"
    assert notebook_check.normalise("a - b -- c") == "a - b -- c"  # only rules
    # a ratio padded to its width lost the padding when it reached 100 (a CI run of
    # notebook 01 was called stale for it)
    padded, grown = "recompute: 9 ms ( 99.3x)", "recompute: 10 ms (100.3x)"
    assert notebook_check.normalise(padded) == notebook_check.normalise(grown)
    assert notebook_check.normalise("[ 7] {  8}") == "[#] {#}"
    assert notebook_check.normalise("(a 1)") == "(a #)"  # only right after the bracket
