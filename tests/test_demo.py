"""The demo (``nbkv.demo.run_demo``) and the command line (``python -m nbkv``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import nbkv
from nbkv.__main__ import main
from nbkv.demo import METHODS, run_demo

from conftest import cpu_only

pytestmark = cpu_only

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(num_layers=2, num_kv_heads=2, head_dim=8, prompt_len=5, new_tokens=6)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, "-m", "nbkv", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_run_demo_reports_figures_and_checks_correctness(layout):
    lines: list[str] = []
    result = run_demo(**TINY, layout=layout, out=lines.append)

    assert result["seq_len"] == 11
    assert result["prefill_seq_len"] == 5
    assert result["max_seq_len"] == 11
    # 2 layers x (K and V) x [1, 2, 11, 8] float32
    assert result["nbytes"] == result["concat_nbytes"] == 2 * 2 * 2 * 11 * 8 * 4
    assert result["concat_peak_nbytes"] > result["concat_nbytes"]
    for key in ("median_us", "p90_us", "prefill_ms"):
        assert set(result[key]) == set(METHODS)
        assert all(t > 0 for t in result[key].values())
    assert result["ratio_vs_numpy_slice"] > 0 and result["ratio_vs_concatenate"] > 0
    assert result["compile_s"] >= 0
    text = "\n".join(lines)
    for needle in (
        "nbkv demo: 2 layers",
        "JIT: first append",
        "after prefill: seq_len 5/11",
        "after decode: seq_len 11/11",
        "np.concatenate growth: holds",
        "nbkv vs NumPy slice",
        "nbkv vs concatenate",
        "correctness: nbkv K/V equal the concatenated reference in all 2 layers",
    ):
        assert needle in text, needle


def test_run_demo_rejects_a_capacity_too_small_before_running():
    lines: list[str] = []
    with pytest.raises(nbkv.InvalidArgumentError, match="max_seq_len"):
        run_demo(**TINY, max_seq_len=10, out=lines.append)
    assert lines == []


def test_cli_without_a_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().err


def test_cli_demo_and_info_exit_0():
    args = "demo --layers 2 --kv-heads 2 --head-dim 8 --prompt 4 --new-tokens 3"
    demo = _run_cli(*args.split())
    assert demo.returncode == 0, demo.stderr
    assert "correctness: nbkv K/V equal" in demo.stdout
    info = _run_cli("info")
    assert info.returncode == 0, info.stderr
    assert "numba" in info.stdout and "float32" in info.stdout


def test_cli_bad_dtype_exits_2_with_an_error_line():
    bad = _run_cli("demo", "--dtype", "int8", "--layers", "1", "--prompt", "1", "--new-tokens", "1")
    assert bad.returncode == 2
    assert "error:" in bad.stderr and "int8" in bad.stderr
    assert "Traceback" not in bad.stderr
