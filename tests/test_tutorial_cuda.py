"""nbkv.tutorial.cuda: the hand-made flash-decoding launch of notebook 05 (a GPU or the
simulator), against the float64 reference and the backend's own launch; and, on any
backend, the kernel-source excerpts, the NumPy online softmax and the GPU-results loader
and plot the notebook shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import nbkv
from nbkv import reference

from conftest import DEVICE, host, randn

needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="launches a CUDA kernel")


@needs_cuda
@pytest.mark.parametrize("window, n_q, splits", [(None, 1, 3), (40, 5, 2), (None, 2, None)])
def test_the_hand_made_launch_is_the_backends(rng, window, n_q, splits):
    from nbkv.tutorial.cuda import launch_attention

    K = randn(rng, (1, 2, 100, 8), "float32")
    V = randn(rng, (1, 2, 100, 8), "float32")
    q = randn(rng, (1, 4, n_q, 8), "float32")
    run = launch_attention(q, K, V, window=window, splits=splits)
    np.testing.assert_allclose(run.out, reference.attention(q, K, V, window=window), atol=3e-5)
    assert (run.counters == 0).all()  # the last block of each task reset its counter
    assert run.part_stats.shape[3] == run.grid.splits
    cache = nbkv.LayerKVCache(
        100, batch=1, num_kv_heads=2, head_dim=8, dtype="float32", device=DEVICE
    )
    cache.append(K, V)
    with nbkv.override_tunables(ATTENTION_SPLITS=run.grid.splits):
        np.testing.assert_array_equal(host(nbkv.attention(q, cache, window=window)), run.out)


@needs_cuda
def test_zero_keys_make_each_splits_sum_its_number_of_positions(rng):
    from nbkv.tutorial.cuda import launch_attention

    zeros = np.zeros((2, 2, 100, 8), np.float32)
    run = launch_attention(randn(rng, (2, 4, 1, 8), "float32"), zeros, zeros, splits=3)
    assert run.part_stats[..., 1].astype(int)[0, 0, 0].tolist() == [34, 34, 32]


@needs_cuda
def test_bad_arrays_are_typed_errors(rng):
    from nbkv.tutorial.cuda import launch_attention

    K = randn(rng, (1, 2, 10, 8), "float32")
    with pytest.raises(nbkv.ShapeMismatchError):
        launch_attention(randn(rng, (1, 4, 1, 8), "float64"), K, K)
    with pytest.raises(nbkv.ShapeMismatchError):
        launch_attention(randn(rng, (1, 4, 1, 6), "float32"), K, K)
    with pytest.raises(nbkv.InvalidArgumentError, match="window"):
        launch_attention(randn(rng, (1, 4, 1, 8), "float32"), K, K, window=0)


# -- the kernel's code, read from its module ------------------------------------------------
NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "05_cuda_kernels.ipynb"


def _notebook_steps() -> list[str]:
    """The device functions notebook 05 prints, in its order."""
    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return re.findall(r'function_source\(cuda_attention_steps, "(\w+)"\)', code)


def test_function_source_finds_the_nested_steps_the_notebook_prints():
    from nbkv.kernels import cuda_attention_steps as steps
    from nbkv.tutorial.cuda import excerpt, function_source

    names = _notebook_steps()
    assert names[0] == "block" and len(names) == 7, names
    src = function_source(steps, "block")
    assert src.startswith("@cuda.jit(device=True, inline=True)\ndef block(")
    assert src.rstrip().endswith("counters[task, chunk] = 0  # ready for the next launch")
    body = excerpt(src, "t = cuda.threadIdx.x")
    assert body.startswith("t = cuda.threadIdx.x") and not body.startswith(" ")  # dedented
    for name in names[1:]:
        assert f"{name}(" in body, name  # block calls it
        text = function_source(steps, name)
        assert text.startswith(f"@cuda.jit(device=True, inline=True)\ndef {name}("), name


def test_function_source_and_excerpt_raise_for_a_missing_or_ambiguous_name():
    from nbkv.kernels import cuda_attention_steps, cuda_vec
    from nbkv.tutorial.cuda import excerpt, function_source

    with pytest.raises(nbkv.InvalidArgumentError, match="0 functions named 'nope'"):
        function_source(cuda_attention_steps, "nope")
    with pytest.raises(nbkv.InvalidArgumentError, match="2 functions named 'reduce'"):
        function_source(cuda_vec, "reduce")  # one per reducer flavour
    with pytest.raises(nbkv.InvalidArgumentError, match="start"):
        excerpt("a\nb", "c")
    with pytest.raises(nbkv.InvalidArgumentError, match="stop"):
        excerpt("a\nb", "b", "a")  # stop only before start


# -- the online softmax in NumPy --------------------------------------------------------------
def _blockwise(q, K, V, lo, hi, block, window):
    """Online softmax over positions [lo, hi) of one KV head, ``block`` at a time."""
    from nbkv.tutorial.cuda import softmax_start, softmax_update

    seq_len, dim = K.shape
    state = softmax_start(len(q), dim)
    for j0 in range(lo, hi, block):
        j = np.arange(j0, min(j0 + block, hi))
        s = q @ K[j].T / np.sqrt(dim)
        if window is not None:
            s[:, j <= seq_len - 1 - window] = -np.inf  # the query sits at seq_len - 1
        state = softmax_update(state, s, V[j])
    return state


@pytest.mark.parametrize("window, block", [(None, 16), (40, 16), (40, 7), (3, 1), (None, 200)])
def test_online_softmax_block_by_block_and_split_equals_the_reference(rng, window, block):
    from nbkv.tutorial.cuda import softmax_combine, softmax_output

    q = rng.standard_normal((1, 4, 1, 12))
    K, V = rng.standard_normal((2, 1, 1, 100, 12))
    ref = reference.attention(q, K, V, window=window)[0, :, 0]
    whole = _blockwise(q[0, :, 0], K[0, 0], V[0, 0], 0, 100, block, window)
    np.testing.assert_allclose(softmax_output(whole), ref, rtol=0, atol=1e-12)
    parts = [_blockwise(q[0, :, 0], K[0, 0], V[0, 0], a, b, block, window)
             for a, b in [(0, 50), (50, 75), (75, 100)]]  # fmt: skip
    combined = softmax_combine(softmax_combine(parts[0], parts[1]), parts[2])
    np.testing.assert_allclose(softmax_output(combined), ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(combined.l, whole.l, rtol=1e-12)
    if window is not None and window <= 50:  # split 0 saw only masked positions
        assert np.isneginf(parts[0].m).all() and (parts[0].l == 0).all()


def test_a_row_that_sees_nothing_gives_nan_without_a_warning():
    from nbkv.tutorial.cuda import softmax_output, softmax_start, softmax_update

    state = softmax_update(softmax_start(2, 3), np.full((2, 4), -np.inf), np.ones((4, 3)))
    assert np.isneginf(state.m).all() and (state.l == 0).all() and (state.o == 0).all()
    with np.errstate(all="raise"):
        assert np.isnan(softmax_output(state)).all()


# -- committed GPU results ----------------------------------------------------------------------
def _method(device_us, gb_per_s, **more):
    return {"device_us": device_us, "host_us": 20.0, "loop_us": device_us + 1.0,
            "gb_per_s": gb_per_s, **more}  # fmt: skip


def _bench_cuda_json(parts=("append", "attention", "host")):
    """A small record in the structure ``benchmarks/bench_cuda.py --json`` writes."""
    results = {}
    if "append" in parts:
        results["append"] = {
            n: {"case": {"cache_shape": [1, 8, 32768, 128], "dtype": "float16",
                         "positions_per_append": int(n), "bytes_per_call": 8192 * int(n)},
                "methods": {"nbkv API": _method(9.0, 1.0 * int(n)),
                            "nbkv kernel": _method(4.0, 2.0 * int(n)),
                            "device copy": _method(3.0, 4.0 * int(n))}}
            for n in ("1", "8192")
        }  # fmt: skip
    if "attention" in parts:
        cases = {}
        for dtype in ("float16", "bfloat16"):
            for batch, seq in ((1, 4096), (16, 32768)):
                cases[f"{dtype} b{batch} s{seq}"] = {
                    "case": {"batch": batch, "seq_len": seq, "dtype": dtype, "heads": 32,
                             "kv_heads": 8, "head_dim": 128, "torch_peer": "torch SDPA gqa"},
                    "methods": {"nbkv": _method(50.0, 3000.0, speed_vs_torch_peer=1.25),
                                "nbkv (allocating)": _method(55.0, 2800.0),
                                "torch SDPA gqa": _method(62.5, 2400.0),
                                "torch SDPA expanded": _method(200.0, 750.0)},
                }  # fmt: skip
        results["attention"] = {"cases": cases, "small_checks": {}}
    if "host" in parts:
        results["host"] = {
            dev: {"case": {"batch": 1}, "methods": {
                name: {"device_us": None, "host_us": us} for name, us in
                (("append", 3.0), ("attention", 6.0), ("append + attention", 9.0),
                 ("append_and_attend", 5.0))}}
            for dev in ("cpu", "cuda")
        }  # fmt: skip
    return {
        "machine": {"cpu": "x", "cpu_count": 16, "gpu": {"name": "NVIDIA H200", "sm_count": 132}},
        "dry_run": False,
        "quick": False,
        "results": results,
        "errors": {},
        "targets": [
            {
                "target": "attention b16 s32768 float16 >= 0.9x torch",
                "pass": True,
                "figure": "1.25x",
            },
            {"target": "host us per layer <= 10", "pass": None, "figure": "not measured"},
        ],
    }


def test_gpu_results_loads_only_runs_that_measured_something(tmp_path):
    from nbkv.tutorial.cuda import gpu_results

    assert gpu_results(tmp_path) == {}
    (tmp_path / "cuda-nvidia-h200.json").write_text(json.dumps(_bench_cuda_json()))
    skipped = {"machine": {}, "skipped": "no CUDA device", "results": {}, "targets": []}
    (tmp_path / "cuda-cpu.json").write_text(json.dumps(skipped))
    dry = dict(_bench_cuda_json(), dry_run=True)
    (tmp_path / "cuda-simulator.json").write_text(json.dumps(dry))
    (tmp_path / "attention-cpu.json").write_text(json.dumps(_bench_cuda_json()))
    runs = gpu_results(tmp_path)
    assert list(runs) == ["cuda-nvidia-h200.json"]
    assert runs["cuda-nvidia-h200.json"]["machine"]["gpu"]["name"] == "NVIDIA H200"


def test_gpu_summary_states_the_runs_own_numbers():
    from nbkv.tutorial.cuda import gpu_summary

    text = gpu_summary("cuda-nvidia-h200.json", _bench_cuda_json())
    assert text.startswith("**cuda-nvidia-h200.json** (NVIDIA H200):")
    assert (
        "- attention float16 b16 s32768: nbkv 50.0 us, 3000 GB/s; torch SDPA gqa 62.5 us, "
        "2400 GB/s (nbkv at 1.25x its speed)"
    ) in text
    assert (
        "- append of 8192 positions: nbkv API 8192 GB/s, device copy 32768 GB/s (25% of it)" in text
    )
    assert "- PASS attention b16 s32768 float16 >= 0.9x torch: 1.25x" in text
    assert "- SKIP host us per layer <= 10: not measured" in text


@pytest.mark.parametrize(
    "parts, panels",
    [(("append", "attention", "host"), 3), (("attention",), 1), (("append", "host"), 2)],
)
def test_plot_gpu_results_draws_a_labelled_panel_per_part(parts, panels):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nbkv.tutorial.cuda import plot_gpu_results

    fig = plot_gpu_results("cuda-nvidia-h200.json", _bench_cuda_json(parts))
    try:
        assert len(fig.axes) == panels
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
            assert ax.get_legend() is not None and ax.patches  # bars, one colour per method
        assert "NVIDIA H200" in fig.get_suptitle()
    finally:
        plt.close(fig)


def test_plot_gpu_results_refuses_a_run_without_results():
    from nbkv.tutorial.cuda import plot_gpu_results

    with pytest.raises(nbkv.InvalidArgumentError, match="holds no"):
        plot_gpu_results("cuda-x.json", _bench_cuda_json(()))
