"""The demos (``nbkv.demo``) and the command line (``python -m nbkv``)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nbkv
from nbkv import demo
from nbkv.__main__ import main
from nbkv._threads import BLAS_ENV
from nbkv.demo import APPEND_METHODS, MODEL_METHODS, run_append_demo, run_model_demo
from nbkv.models import Llama

from conftest import cpu_only

pytestmark = cpu_only

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(num_layers=2, num_kv_heads=2, head_dim=8, prompt_len=5, new_tokens=6)
TINY_MODEL = dict(new_tokens=4, prompt_tokens=3, progress=None)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _have_matplotlib() -> bool:
    return demo._matplotlib_figure()[0] is not None


def _run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, "-m", "nbkv", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )


# -- the model demo ------------------------------------------------------------------


def test_run_model_demo_decodes_the_same_tokens_both_ways_and_writes_a_png(tmp_path):
    lines: list[str] = []
    r = run_model_demo(**TINY_MODEL, out_dir=tmp_path / "plots", out=lines.append)

    assert r["tokens"].shape == (4,)
    assert r["positions"].tolist() == [4, 5, 6]  # the decode steps, after the prompt's token
    assert r["seq_len"] == r["max_seq_len"] == 3 + 4 - 1  # the last token is never fed back
    # 4 layers x (K and V) x [1, 2, 6, 32] float32
    assert r["nbytes"] == 4 * 2 * 2 * 6 * 32 * 4
    for m in MODEL_METHODS:
        assert r["ms"][m].shape == (3,) and (r["ms"][m] > 0).all()
        for key in ("first_token_ms", "median_ms", "p90_ms", "tokens_per_s", "total_s"):
            assert r[key][m] > 0, key
    assert r["ratio_total"] > 0 and r["warmup_s"] >= 0
    assert r["max_logit_diff"] < 1e-3
    text = "\n".join(lines)
    for needle in (
        "nbkv demo: Llama.default(), 4 layers",
        "prompt: 3 random token ids (seed 0); then 4 new tokens",
        "warm-up:",
        "KV cache: 12.0 KiB on cpu",
        "nbkv KV cache",
        "no cache (recompute)",
        "recompute takes",
        "correctness: greedy tokens identical for all 4 new tokens",
    ):
        assert needle in text, needle
    if _have_matplotlib():
        png = tmp_path / "plots" / demo.PLOT_NAME
        assert r["plot"] == png and r["plot_skipped"] is None
        assert png.stat().st_size > 0 and png.read_bytes()[:8] == PNG_SIGNATURE
        assert f"plot: {png}" in text
    else:
        assert r["plot"] is None and "plot: skipped (matplotlib is not installed" in text


def test_run_model_demo_tokens_are_what_generate_gives():
    r = run_model_demo(**TINY_MODEL, out_dir=None, out=lambda line: None)
    want = Llama.default().generate(r["prompt_ids"], 4, eos_token_id=None)[0, 3:]
    np.testing.assert_array_equal(r["tokens"], want)


def test_run_model_demo_encodes_the_prompt_text_as_bytes_and_shows_progress():
    lines: list[str] = []
    bar = io.StringIO()
    r = run_model_demo(new_tokens=2, prompt="Hi!", out_dir=None, out=lines.append, progress=bar)
    assert r["prompt_ids"].tolist() == [72, 105, 33]
    assert "plot: skipped (no output folder given)" in lines
    assert "decode with cache: 2/2 tokens" in bar.getvalue()  # not a terminal: plain lines
    assert "recompute, no cache: 2/2 tokens" in bar.getvalue()


def test_run_model_demo_draws_a_carriage_return_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    bar = Terminal()
    run_model_demo(**{**TINY_MODEL, "progress": bar}, out_dir=None, out=lambda line: None)
    shown = bar.getvalue()
    assert shown.startswith("\rdecode with cache") and shown.endswith("4/4\n")
    assert shown.count("\n") == 2  # one line per pass, redrawn in place


def test_run_model_demo_without_matplotlib_skips_the_plot_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(
        demo, "_matplotlib_figure", lambda: (None, "matplotlib is not installed (test)")
    )
    lines: list[str] = []
    r = run_model_demo(**TINY_MODEL, out_dir=tmp_path / "plots", out=lines.append)
    assert r["plot"] is None
    assert "plot: skipped (matplotlib is not installed (test))" in lines
    assert not (tmp_path / "plots").exists()


def test_run_model_demo_raises_when_the_two_ways_decode_different_tokens(monkeypatch):
    real = Llama.forward_nocache

    def shifted(self, ids):  # every argmax moves one token up
        return np.roll(real(self, ids), 1, axis=-1)

    monkeypatch.setattr(Llama, "forward_nocache", shifted)
    with pytest.raises(AssertionError, match="new token 0 .* differs"):
        run_model_demo(**TINY_MODEL, out_dir=None, out=lambda line: None)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(new_tokens=1), "new_tokens must be >= 2"),
        (dict(prompt="ab", prompt_tokens=2), "not both"),
        (dict(prompt="", prompt_tokens=None), "prompt must be a non-empty str"),
        (dict(prompt_tokens=0), "prompt_tokens must be a positive int"),
        (dict(threads=10_000), "threads must be in"),
        (dict(device="tpu"), "device must be one of"),
    ],
)
def test_run_model_demo_rejects_bad_arguments_before_running(bad, match, tmp_path):
    lines: list[str] = []
    options = {**TINY_MODEL, "out_dir": tmp_path / "plots", **bad}
    with pytest.raises(nbkv.InvalidArgumentError, match=match):
        run_model_demo(**options, out=lines.append)
    assert lines == [] and not (tmp_path / "plots").exists()


def test_run_model_demo_rejects_an_out_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    if not _have_matplotlib():
        pytest.skip("the folder is only needed for the plot")
    with pytest.raises(nbkv.InvalidArgumentError, match="not a folder"):
        run_model_demo(**TINY_MODEL, out_dir=tmp_path / "f", out=lambda line: None)


# -- the append demo -----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_run_append_demo_reports_figures_and_checks_correctness(layout):
    lines: list[str] = []
    result = run_append_demo(**TINY, layout=layout, out=lines.append)

    assert result["seq_len"] == 11
    assert result["prefill_seq_len"] == 5
    assert result["max_seq_len"] == 11
    # 2 layers x (K and V) x [1, 2, 11, 8] float32
    assert result["nbytes"] == result["concat_nbytes"] == 2 * 2 * 2 * 11 * 8 * 4
    assert result["concat_peak_nbytes"] > result["concat_nbytes"]
    for key in ("median_us", "p90_us", "prefill_ms"):
        assert set(result[key]) == set(APPEND_METHODS)
        assert all(t > 0 for t in result[key].values())
    assert result["ratio_vs_numpy_slice"] > 0 and result["ratio_vs_concatenate"] > 0
    assert result["compile_s"] >= 0
    text = "\n".join(lines)
    for needle in (
        "nbkv append-demo: 2 layers",
        "JIT: first append",
        "after prefill: seq_len 5/11",
        "after decode: seq_len 11/11",
        "np.concatenate growth: holds",
        "nbkv vs NumPy slice",
        "nbkv vs concatenate",
        "correctness: nbkv K/V equal the concatenated reference in all 2 layers",
    ):
        assert needle in text, needle


def test_run_append_demo_rejects_a_capacity_too_small_before_running():
    lines: list[str] = []
    with pytest.raises(nbkv.InvalidArgumentError, match="max_seq_len"):
        run_append_demo(**TINY, max_seq_len=10, out=lines.append)
    assert lines == []


# -- the command line ----------------------------------------------------------------


def test_cli_without_a_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().err


def test_cli_demo_exits_0_and_names_the_png(tmp_path):
    run = _run_cli("demo", "--new-tokens", "5", "--prompt-tokens", "4", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert "correctness: greedy tokens identical for all 5 new tokens" in run.stdout
    assert "decode with cache: 5/5 tokens" in run.stderr  # the progress, as lines off a TTY
    if _have_matplotlib():
        png = tmp_path / demo.PLOT_NAME
        assert f"plot: {png}" in run.stdout and png.stat().st_size > 0
    else:
        assert "plot: skipped" in run.stdout


def test_cli_append_demo_and_info_exit_0():
    args = "append-demo --layers 2 --kv-heads 2 --head-dim 8 --prompt 4 --new-tokens 3"
    run = _run_cli(*args.split())
    assert run.returncode == 0, run.stderr
    assert "correctness: nbkv K/V equal" in run.stdout
    info = _run_cli("info")
    assert info.returncode == 0, info.stderr
    assert "numba" in info.stdout and "float32" in info.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        ("demo --new-tokens 1 --out {tmp}", "new_tokens must be >= 2"),
        ("demo --prompt-tokens 0 --out {tmp}", "prompt_tokens"),
        ("demo --threads -1 --out {tmp}", "threads must be a positive int"),
        ("append-demo --dtype int8 --layers 1 --prompt 1 --new-tokens 1", "int8"),
    ],
)
def test_cli_bad_values_exit_2_with_an_error_line(args, needle, tmp_path, capsys):
    assert main(args.format(tmp=tmp_path / "plots").split()) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and needle in err
    assert not (tmp_path / "plots").exists()


@pytest.mark.parametrize(
    "args",
    [
        "demo --new-tokens many",
        "demo --prompt hi --prompt-tokens 3",
        "demo --layers 2",  # an append-demo flag
        "append-demo --prompt-tokens 3",
    ],
)
def test_cli_unparseable_arguments_exit_2_with_usage(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args.split())
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_bad_dtype_exits_2_from_a_subprocess_without_a_traceback():
    bad = _run_cli(
        "append-demo", "--dtype", "int8", "--layers", "1", "--prompt", "1", "--new-tokens", "1"
    )
    assert bad.returncode == 2
    assert "error:" in bad.stderr and "int8" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_run_model_demo_limits_numba_and_blas_threads_and_restores_them():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import numba

    def blas() -> list[int]:
        return [
            i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"
        ]

    before = numba.get_num_threads(), blas()
    lines: list[str] = []
    r = run_model_demo(**TINY_MODEL, out_dir=None, out=lines.append)
    assert (r["config"]["numba_threads"], r["config"]["blas_threads"]) == (1, "1")
    assert any(
        "threads (both methods): Numba 1, BLAS" in x and "1 (threadpoolctl)" in x for x in lines
    )
    assert (numba.get_num_threads(), blas()) == before


def test_run_model_demo_without_threadpoolctl_says_blas_is_not_limited(monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import raises ImportError
    for name in BLAS_ENV:
        monkeypatch.delenv(name, raising=False)
    lines: list[str] = []
    r = run_model_demo(**TINY_MODEL, out_dir=None, out=lines.append)
    assert r["config"]["blas_threads"] == "default"
    assert any("BLAS its default, not limited: threadpoolctl is not installed" in x for x in lines)
