"""Every tutorial notebook runs top to bottom, and is committed with its outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import cpu_only

pytestmark = cpu_only

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

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
def test_notebook_runs_top_to_bottom(path):
    nb = nbformat.read(path, as_version=4)
    env_before = dict(os.environ)
    client = nbclient.NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    assert dict(os.environ) == env_before
