"""python -m nbkv serve-demo and nbkv.serving_demo (the workload the benchmark uses)."""

from __future__ import annotations

import io

import numpy as np
import pytest

import nbkv
from nbkv.__main__ import main
from nbkv.serving_demo import run_serve_demo, workload

from conftest import cpu_only

pytestmark = cpu_only


def test_the_workload_is_held_out_code_with_a_shared_prefix():
    w = workload(6, seed=3, shared=20, share_every=2, prompt_median=30, prompt_cap=50)
    assert len(w.prompts) == len(w.max_new_tokens) == 6 and w.shared == 20
    for i, p in enumerate(w.prompts):
        assert p.dtype == np.int64 and p.min() >= 0 and p.max() < 256
        assert np.array_equal(p[:20], w.prompts[0][:20]) == (i % 2 == 0)
    again = workload(6, seed=3, shared=20, share_every=2, prompt_median=30, prompt_cap=50)
    assert all(np.array_equal(a, b) for a, b in zip(w.prompts, again.prompts, strict=True))


def test_serve_demo_gives_identical_outputs_reports_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    lines, bar = [], io.StringIO()
    r = run_serve_demo(requests=4, shared=32, out_dir=tmp_path, out=lines.append, progress=bar)
    assert r["identical"] and r["steps"] > 0 and r["prefix_hit_rate"] >= 0
    assert (tmp_path / "serving.png").stat().st_size > 5000
    text = "\n".join(lines)
    assert (
        "tokens/s" in text and "time to first token" in text and "outputs identical: True" in text
    )
    assert "4/4 requests" in bar.getvalue()


def test_the_cli_runs_serve_demo_and_reports_bad_arguments(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["serve-demo", "--requests", "2", "--shared", "0", "--out", str(tmp_path)]) == 0
    assert "outputs identical: True" in capsys.readouterr().out
    assert main(["serve-demo", "--requests", "0"]) == 2
    assert "requests must be" in capsys.readouterr().err
    with pytest.raises(nbkv.InvalidArgumentError):
        run_serve_demo(requests=2, shared=-1, out_dir=None)
