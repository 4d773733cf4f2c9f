"""The benchmark suite runner (``python -m benchmarks``) and its figures.

No real benchmark runs here: the figures are drawn from the committed JSON files, and the
runner runs tiny fake ``bench_*.py`` scripts written into ``tmp_path``.
"""

from __future__ import annotations

import importlib
import io
import json
import shutil
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import nbkv

from conftest import cpu_only

pytestmark = cpu_only

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

if str(ROOT) not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks import run  # noqa: E402

pytest.importorskip("matplotlib")

from benchmarks import plots  # noqa: E402

FAKE = """\
import argparse, json, sys
parser = argparse.ArgumentParser()
parser.add_argument("--quick", action="store_true")
parser.add_argument("--json")
args = parser.parse_args()
print("fake benchmark, quick" if args.quick else "fake benchmark, full")
print("PASS  fake target: 1.0x")
machine = {"command": " ".join([sys.executable, *sys.argv]), "python": "3", "numpy": "2",
           "numba": "0"}
with open(args.json, "w") as f:
    json.dump({"machine": machine, "results": {}, "quick": args.quick}, f)
"""

BROKEN = """\
import sys
print("about to fail")
print("something went wrong", file=sys.stderr)
sys.exit(3)
"""

NO_JSON = "print('forgot the JSON')\n"


def _bench_dir(tmp_path: Path, **scripts: str) -> Path:
    folder = tmp_path / "bench"
    folder.mkdir()
    for name, text in scripts.items():
        (folder / f"bench_{name}.py").write_text(textwrap.dedent(text))
    (folder / "helper.py").write_text("raise SystemExit('not a benchmark')\n")
    return folder


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}-cpu.json").read_text())


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 5000


# figures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["append", "attention"])
def test_plot_from_committed_json(tmp_path, name):
    data = _load(name)
    fig = plots.PLOTTERS[name](data)
    ax = fig.axes[0]
    methods = list(next(iter(data["results"].values()))["methods"])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    for method in methods:  # every method of the run is drawn and named
        assert any(label.startswith(method) for label in labels), method
    path = plots.save(fig, tmp_path / "sub" / f"{name}.png")
    assert _is_png(path)


def test_plot_append_bars_are_ratios_to_numpy_slice():
    data = _load("append")
    ax = plots.plot_append(data).axes[0]
    assert ax.get_yscale() == "log"
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    want = sorted(
        round(m["time_vs_numpy_slice"], 6)
        for r in data["results"].values()
        for m in r["methods"].values()
    )
    assert heights == want


def test_plot_attention_lines_are_gb_per_s():
    data = _load("attention")
    ax = plots.plot_attention(data).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    seqs = sorted(data["results"], key=int)
    api = lines["nbkv API"]
    assert list(api.get_xdata()) == [int(s) for s in seqs]
    assert list(api.get_ydata()) == [
        data["results"][s]["methods"]["nbkv API"]["gb_per_s"] for s in seqs
    ]
    ceiling = next(line for label, line in lines.items() if label.startswith("read ceiling"))
    assert ceiling.get_linestyle() == "--"


def test_plots_draw_into_a_given_axes(tmp_path):
    from matplotlib.figure import Figure

    fig = Figure()
    a, b = fig.subplots(1, 2)
    assert plots.plot_append(_load("append"), ax=a) is fig
    assert plots.plot_attention(_load("attention"), ax=b) is fig
    assert _is_png(plots.save(fig, tmp_path / "both.png"))


def test_plots_only_redraws_from_json(tmp_path):
    for name in ("append", "attention"):
        shutil.copy(RESULTS / f"{name}-cpu.json", tmp_path / f"{name}-cpu.json")
    out = io.StringIO()
    assert run.main(["--plots-only", "--out", str(tmp_path)], stream=out) == 0
    assert _is_png(tmp_path / "append-cpu.png") and _is_png(tmp_path / "attention-cpu.png")
    assert not (tmp_path / "index.json").exists()  # nothing ran
    (tmp_path / "append-cpu.png").unlink()
    assert run.main(["--plots-only", "--only", "attention", "--out", str(tmp_path)], out) == 0
    assert not (tmp_path / "append-cpu.png").exists()


def test_plots_only_fails_without_json(tmp_path):
    assert run.main(["--plots-only", "--out", str(tmp_path)], stream=io.StringIO()) == 1


# the runner ------------------------------------------------------------------------------


def test_sanitize_device_names():
    assert run.sanitize("NVIDIA H200") == "nvidia-h200"
    assert run.sanitize("  NVIDIA GeForce RTX 4090 (24GB) ") == "nvidia-geforce-rtx-4090-24gb"
    assert run.sanitize(b"Tesla T4".decode()) == "tesla-t4"
    assert run.sanitize("***") == "unknown"


def test_machine_tag_is_cpu_under_the_simulator(monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    assert run.machine_tag() == "cpu"


def test_parse_args_and_output_folder(tmp_path):
    args = run.parse_args([])
    assert not args.quick and args.only is None and not args.plots_only
    assert run.out_dir(args) == run.RESULTS
    assert args.bench_dir == run.BENCH_DIR
    quick = run.out_dir(run.parse_args(["--quick"]))  # never the committed results
    assert quick != run.RESULTS and quick.is_dir() and not any(quick.iterdir())
    quick.rmdir()
    args = run.parse_args(["--quick", "--out", str(tmp_path), "--only", "a", "--only", "b"])
    assert run.out_dir(args) == tmp_path and args.only == ["a", "b"]
    assert run.out_dir(run.parse_args(["--plots-only"])) == run.RESULTS


def test_discover_and_select(tmp_path):
    folder = _bench_dir(tmp_path, zeta=FAKE, alpha=FAKE)
    found = run.discover(folder)
    assert list(found) == ["alpha", "zeta"]  # sorted; helper.py is not a benchmark
    assert list(run.select(found, None)) == ["alpha", "zeta"]
    for spelling in ("zeta", "bench_zeta", "bench_zeta.py"):
        assert list(run.select(found, [spelling])) == ["zeta"]
    with pytest.raises(SystemExit, match="no benchmark named 'gamma'"):
        run.select(found, ["gamma"])


def test_suite_runs_scripts_and_writes_index(tmp_path):
    folder = _bench_dir(tmp_path, fake=FAKE, other=FAKE)
    out = tmp_path / "results"
    argv = ["--bench-dir", str(folder), "--out", str(out), "--tag", "Test Box", "--quick"]
    log = io.StringIO()
    assert run.main(argv, stream=log) == 0
    for name in ("fake", "other"):
        data = json.loads((out / f"{name}-test-box.json").read_text())
        assert data["quick"] is True and "--quick" in data["machine"]["command"]
        txt = (out / f"{name}-test-box.txt").read_text()
        assert txt.startswith("fake benchmark, quick")
    index = json.loads((out / "index.json").read_text())
    assert index["command"][1:] == ["-m", "benchmarks", *argv]
    assert index["quick"] is True and index["tag"] == "test-box"
    assert index["exit_code"] == 0 and index["failed"] == []
    assert index["ran"] == ["fake-test-box", "other-test-box"]
    assert "T" in index["started"] and index["finished"] >= index["started"]
    entry = index["benchmarks"]["fake-test-box"]
    assert entry["exit_code"] == 0 and entry["ok"] and entry["duration_s"] > 0
    assert entry["json"] == "fake-test-box.json" and entry["stdout"] == "fake-test-box.txt"
    assert entry["command"][0] == sys.executable and "--quick" in entry["command"]
    # plain progress lines (not a TTY) and the scripts' targets
    text = log.getvalue()
    assert "[1/2] fake: started" in text and "[2/2] other: ok in" in text
    assert "PASS  fake target" in text and "\r" not in text

    # --only reruns one; the other's entry stays in the index
    assert run.main([*argv, "--only", "other"], stream=io.StringIO()) == 0
    index = json.loads((out / "index.json").read_text())
    assert index["ran"] == ["other-test-box"]
    assert set(index["benchmarks"]) == {"fake-test-box", "other-test-box"}


def test_suite_reports_failures(tmp_path):
    folder = _bench_dir(tmp_path, good=FAKE, broken=BROKEN, nojson=NO_JSON)
    out = tmp_path / "results"
    log = io.StringIO()
    code = run.main(["--bench-dir", str(folder), "--out", str(out), "--tag", "t"], stream=log)
    assert code != 0
    index = json.loads((out / "index.json").read_text())
    assert index["exit_code"] == code and sorted(index["failed"]) == ["broken", "nojson"]
    broken, nojson = index["benchmarks"]["broken-t"], index["benchmarks"]["nojson-t"]
    assert broken["exit_code"] == 3 and not broken["ok"]
    assert "something went wrong" in broken["stderr_tail"]
    assert (out / "broken-t.txt").read_text() == "about to fail\n"
    assert nojson["exit_code"] == 0 and not nojson["ok"] and nojson["problem"] == "wrote no JSON"
    assert index["benchmarks"]["good-t"]["ok"]
    text = log.getvalue()
    assert "broken: FAILED (exit 3)" in text and "something went wrong" in text
    assert "nojson: FAILED (wrote no JSON)" in text


def test_progress_bar_on_a_tty():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    bar = run.Progress(2, stream, width=10)
    bar.start(0, "append")
    bar.update(0, "append", 5.0, 10.0)
    bar.done(0, "append", 10.0, "ok")
    bar.update(1, "attention", 1.0, None)
    text = stream.getvalue()
    assert "\r[########--] 1/2 append:" not in text  # half of the first of two: a quarter
    assert "\r[##--------] 1/2 append:    5.0 s of ~10 s" in text
    assert "[1/2] append: ok in 10.0 s\n" in text
    assert "\r[#####-----] 2/2 attention:" in text


def test_python_dash_m_benchmarks_help():
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    for option in ("--quick", "--only", "--out", "--plots-only", "--bench-dir"):
        assert option in done.stdout


# bench_cuda.py and gpu.sh (no GPU here: they must skip, or run on the simulator) -------

BENCH_CUDA = ROOT / "benchmarks" / "bench_cuda.py"
GPU_SH = ROOT / "benchmarks" / "gpu.sh"


def _bench_cuda(args: list[str], simulator: bool, timeout: float = 300):
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return subprocess.run(
        [sys.executable, str(BENCH_CUDA), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("simulator", [True, False], ids=["simulator", "no-gpu"])
def test_bench_cuda_skips_cleanly_without_a_gpu(tmp_path, simulator):
    if not simulator and run.machine_tag() != "cpu":
        pytest.skip("a CUDA GPU is present: the plain run would time it")
    out = tmp_path / "cuda.json"
    done = _bench_cuda(["--quick", "--json", str(out)], simulator)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("skipped: no CUDA device (")
    assert ("simulator" in done.stdout) is simulator
    data = json.loads(out.read_text())
    assert data["skipped"] and data["results"] == {} and data["targets"] == []
    assert run._json_problem(out) is None  # a record the suite runner takes
    fig = plots.PLOTTERS["cuda"](data)  # a figure that says so, and nothing else
    assert "skipped" in fig.axes[0].texts[0].get_text()


def test_suite_runs_bench_cuda_as_skipped_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")  # for the child: never a real GPU
    log = io.StringIO()
    argv = ["--only", "cuda", "--quick", "--out", str(tmp_path), "--tag", "t"]
    assert run.main(argv, stream=log) == 0, log.getvalue()
    entry = json.loads((tmp_path / "index.json").read_text())["benchmarks"]["cuda-t"]
    assert entry["ok"] and entry["skipped"]  # the reason bench_cuda.py gave
    # nothing measured: no result files or figure left to pass for measurements
    assert entry["json"] is None and not list(tmp_path.glob("cuda-t.*"))
    assert "skipped (" in log.getvalue()


def test_bench_cuda_dry_run_on_the_simulator_checks_and_reports_every_part(tmp_path):
    # every code path of the GPU run at tiny sizes on the simulator (torch on the CPU):
    # what a lent GPU would meet first, short of its speed
    import importlib.util

    out = tmp_path / "cuda.json"
    done = _bench_cuda(["--dry-run", "--json", str(out)], simulator=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "DRY RUN" in done.stdout and "WRONG" not in done.stdout
    data = json.loads(out.read_text())
    assert data["dry_run"] and data["errors"] == {}
    results = data["results"]
    assert set(results) == {"append", "attention", "host"}
    for case in results["append"].values():
        assert {"nbkv API", "nbkv kernel", "device copy"} <= set(case["methods"])
    for case in results["attention"]["cases"].values():
        names = set(case["methods"])
        assert {"nbkv", "nbkv (allocating)"} <= names
        if importlib.util.find_spec("torch") is not None:
            assert case["case"]["torch_peer"] in names
    assert set(results["host"]) == {"cpu", "cuda"}
    assert all(t["pass"] is None for t in data["targets"])  # a dry run claims nothing
    assert _is_png(plots.save(plots.plot_cuda(data), tmp_path / "cuda.png"))


def test_gpu_sh_parses_and_keeps_to_its_budget(tmp_path):
    import os
    import subprocess

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    subprocess.run([bash, "-n", str(GPU_SH)], check=True)
    env = dict(os.environ, OUT=str(tmp_path), NBKV_GPU_BUDGET_S="10")
    done = subprocess.run(
        [bash, str(GPU_SH), "bench", "tests", "nonsense"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1  # nothing ran: too little budget, and an unknown stage
    summary = (tmp_path / "summary.txt").read_text()
    assert "bench: SKIPPED" in summary and "tests: SKIPPED" in summary
    assert "unknown stage 'nonsense'" in summary


def _bench_script(name):
    """The module of ``benchmarks/bench_<name>.py`` (the scripts import ``_machine`` and
    each other from their folder, which goes on ``sys.path``)."""
    folder = str(ROOT / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(f"bench_{name}")


def _bench_attention():
    return _bench_script("attention")


def test_paired_share_compares_each_round_with_its_own_read():
    # the memory bandwidth halves midway: the read takes 4 then 8 units, the method 5
    # then 9. Round by round the method reads at 80% then 89% of the read's speed; the
    # ratio of the two medians over the quiet rounds (6 / 7) would mix the phases
    import numpy as np

    ba = _bench_attention()
    times = {ba.READ: [4.0, 4.0, 4.0, 8.0, 8.0, 8.0, 1.0], "m": [5.0, 5.0, 5.0, 9.0, 9.0, 9.0, 9.0]}
    quiet = {ba.READ: np.ones(7, bool), "m": np.array([1, 1, 1, 1, 1, 1, 0], bool)}
    got = ba.paired_share(times, quiet, "m", 1.0, rounds=7)
    # the last round is left out: the method's call there was disturbed
    assert got["paired_rounds"] == 6
    assert got["pct_of_read_paired"] == pytest.approx(100 * (0.8 + 8 / 9) / 2)
    assert got["pct_paired_p10"] == pytest.approx(80.0)
    assert got["pct_paired_p90"] == pytest.approx(800 / 9)
    # apart: the rounds whose read ran at the memory's fast level (4 units) and the others
    assert got["fast_memory_rounds"] == 3
    assert got["pct_paired_fast_memory"] == pytest.approx(80.0)
    assert got["pct_paired_slow_memory"] == pytest.approx(800 / 9)
    assert got["fast_read_max_us"] == pytest.approx(1.25 * 4.0 / 1e3)  # times in ns
    assert "memory fast in 3 rounds (read <= 0.00 ms): 80.0%, in the others: 88.9%" in (
        ba._phases(got)
    )
    # a 16-bit kernel taking 4 units in every round, against the float32 one: 1.25x while
    # the memory is fast, 2.25x while it is slow; the disturbed last round left out
    times["f16"] = [4.0] * 7
    quiet["f16"] = np.ones(7, bool)
    speed = ba.paired_speed(times, quiet, "f16", "m", rounds=7)
    assert speed["speed_paired_rounds"] == 6
    assert speed["speed_vs_kernel_paired"] == pytest.approx(1.75)
    assert speed["speed_paired_fast_memory"] == pytest.approx(1.25)
    assert speed["speed_paired_slow_memory"] == pytest.approx(2.25)
    assert speed["speed_fast_memory_rounds"] == 3
    assert ba._phase_speeds(speed) == "memory fast in 3 rounds: 1.25x, in the others: 2.25x"
    # a 16-bit cache reads half the bytes: its share is of half the read's time
    half = ba.paired_share(times, quiet, "m", 0.5, rounds=7)
    assert half["pct_of_read_paired"] == pytest.approx(got["pct_of_read_paired"] / 2)
    # too few rounds with both calls undisturbed (fewer than MIN_QUIET_SHARE of them): none
    few = np.zeros(7, bool)
    few[:2] = True
    assert 2 < ba.MIN_QUIET_SHARE * 7
    none = ba.paired_share(times, {ba.READ: quiet[ba.READ], "m": few}, "m", 1.0, rounds=7)
    assert none["pct_of_read_paired"] is None and none["paired_rounds"] == 2


def test_bench_attention_main_runs_two_sizes_and_checks_the_smallest(tmp_path, monkeypatch):
    # a whole run of main() in little: two sizes (a loop over sizes once reused the name
    # of its set of sizes to check for a line of text, and broke at the second size),
    # two rounds each, no prefill, no compile in a fresh process
    import json

    ba = _bench_attention()
    monkeypatch.setattr(ba, "SIZES", {512: (0, 2), 4096: (0, 2)})
    monkeypatch.setattr(ba, "CHECK_SIZES", (4096,))
    monkeypatch.setattr(ba, "WARMUP_ROUNDS", 1)
    monkeypatch.setattr(ba, "COLD_BYTES", 8 * ba.MIB)
    jit = {
        "attend_first_call_s": 0.0,
        "attend_first_call_from_disk_cache": True,
        "attend_fresh_compile_s": 0.0,
        "read_ceiling_first_call_s": 0.0,
    }
    monkeypatch.setattr(ba, "compile_times", lambda: jit)
    out = tmp_path / "a.json"
    monkeypatch.setattr(
        sys, "argv", ["bench_attention", "--quick", "--no-prefill", "--json", str(out)]
    )
    ba.main()
    results = json.loads(out.read_text())["results"]
    assert sorted(results, key=int) == ["512", "4096"]
    assert results["512"]["case"]["checked_max_abs_err"] is None  # 4096 is the one checked
    assert results["4096"]["case"]["checked_max_abs_err"] < ba.ATOL


def test_bench_groups_main_checks_and_times_every_contender(tmp_path, monkeypatch):
    # a whole run in little: a decode step past 8 rows and a few queries at once, each
    # contender checked against float64 before it is timed, and a wrong one caught
    bg = _bench_script("groups")
    # no call set aside as disturbed by another job (a busy CI machine): none to time
    monkeypatch.setattr(_bench_script("paged"), "WAIT_SHARE", float("inf"))
    monkeypatch.setattr(bg, "SHAPES", ((16, 1, 1), (8, 2, 3)))
    monkeypatch.setattr(bg, "SEQ_LEN", {True: 100, False: 100})
    monkeypatch.setattr(bg, "COLD_BYTES", 1 << 20)
    out = tmp_path / "g.json"
    got = bg.main(["--quick", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["group"], r["rows"]) for r in rows] == [(16, 16), (4, 12)]
    for r in rows:
        assert r["max_err"] < bg.ATOL
        assert {"nbkv contiguous", "nbkv paged", "read ceiling"} <= set(r["median_us"])
        assert all(t > 0 for t in r["median_us"].values())
    assert got["results"] == rows
    # the mask torch gets: query i of a group's head sees up to position seq_len - n_q + i
    mask = bg.causal_rows(4, 3, 10)
    assert mask.shape == (12, 10) and mask.dtype == np.float32
    assert (mask == 0).sum(axis=1).tolist() == [8, 9, 10] * 4
    assert set(np.unique(mask).tolist()) == {0.0, -np.inf}
    real = nbkv.attention
    monkeypatch.setattr(nbkv, "attention", lambda q, c: real(q, c) + 1e-3)
    with pytest.raises(AssertionError, match="max .err"):
        bg.shape_part(16, 1, 1, 100, 1, np.random.default_rng(0))


def _bench_phases():
    return _bench_script("phases")


def test_bench_phases_main_checks_and_reports_every_phase(tmp_path, monkeypatch):
    bp = _bench_phases()
    out = tmp_path / "p.json"
    monkeypatch.setattr(sys, "argv", ["bench_phases", "--quick", "--json", str(out)])
    bp.main()
    data = json.loads(out.read_text())
    lanes = data["config"]["lanes"]
    assert data["fmas_per_position"] == 2 * bp.GROUP * bp.DIM / lanes
    assert data["floor_ns"] == pytest.approx(data["fma_ns"] * data["fmas_per_position"])
    assert set(data["results"]) == set(bp.DTYPES)
    for dtype, r in data["results"].items():
        assert data["max_error"][dtype] <= bp.TOLERANCE
        itemsize = 4 if dtype == "float32" else 2
        assert r["block"] == bp.ca._block_size(bp.GROUP, bp.DIM * itemsize)
        assert all(r[f"{p}_ns"] > 0 for p in bp.PHASES) and r["whole_ns"] > 0
        assert r["phases_ns"] == pytest.approx(sum(r[f"{p}_ns"] for p in bp.PHASES))
    assert {r["block"] for r in data["results"].values()} == {bp.ca._LONG_BLOCK}


def test_bench_phases_check_fails_when_the_phases_disagree_with_float64(monkeypatch):
    bp = _bench_phases()
    real = bp.reference.attention

    class Off:
        @staticmethod
        def attention(*args, **kwargs):
            return real(*args, **kwargs) + 10 * bp.TOLERANCE

    monkeypatch.setattr(bp, "reference", Off)
    with pytest.raises(AssertionError, match="composed phases are .* off float64"):
        bp.check("float16", np.random.default_rng(1))


def test_bench_phases_check_fails_when_the_whole_task_disagrees(monkeypatch):
    bp = _bench_phases()
    real = bp._whole
    monkeypatch.setattr(bp, "_whole", lambda *a, **k: real(*a, **k) + 10 * bp.TOLERANCE)
    with pytest.raises(AssertionError, match="attend_serial is .* off float64"):
        bp.check("float32", np.random.default_rng(2))


def test_bench_phases_checks_each_timed_pass(monkeypatch):
    # a timed loop that computes something else is caught before it is timed
    bp = _bench_phases()
    real = bp._run_scores

    def scores_of_the_first_block(qs, kb, s, block, kind, reps):
        real(qs, kb[:block], s, block, kind, reps)  # the last block is the one expected

    monkeypatch.setattr(bp, "_run_scores", scores_of_the_first_block)
    with pytest.raises(AssertionError, match="timed scores pass"):
        bp.measure("float32", 1, np.random.default_rng(3))


def test_bench_phases_fma_loop_runs_every_chain_n_rounds():
    # the timed loop must do what it is timed for: chain k starts at k * 1e-3 and each
    # round adds 1e-7 (the multiplier is 1.0 in float32 for these n), so the sum counts them
    bp = _bench_phases()
    results = {}
    for n in (0, 1, 5, 1000):
        accs = [np.float32(bp._chain_start(k)) for k in range(bp._chains())]
        for _ in range(n):
            accs = [np.float32(a + np.float32(1e-7)) for a in accs]
        want = accs[0]
        for a in accs[1:]:
            want = np.float32(want + a)
        results[n] = bp._fma_run(n)
        assert results[n] == want, n
    assert results[0] < results[1] < results[5] < results[1000]


def _bench_prefetch():
    return _bench_script("prefetch")


def test_bench_prefetch_main_checks_and_reports_every_contender(tmp_path, monkeypatch):
    bp = _bench_prefetch()
    out = tmp_path / "pf.json"
    monkeypatch.setattr(sys, "argv", ["bench_prefetch", "--quick", "--json", str(out)])
    bp.main()
    data = json.loads(out.read_text())
    assert list(data["results"]) == [*bp.SUMS, bp.KERNEL, bp.ON_LINE]
    assert data["config"]["block"] == bp.ca._block_size(bp.GROUP, bp.DIM * 4)
    assert max(data["max_error"][n] for n in (bp.KERNEL, bp.ON_LINE)) <= bp.ATOL
    assert data["config"]["twins_offset_in_line"] == [0]
    # numpy's arrays start at least 16-byte aligned (malloc's promise on x86-64)
    assert all(x % 16 == 0 for x in data["config"]["copies_offset_in_line"])
    assert all(data["max_error"][n] <= bp.SUM_RTOL for n in bp.SUMS)
    for name, r in data["results"].items():
        assert r["ms"] > 0 and r["paired_rounds"] == data["config"]["rounds"], name
    assert data["results"][bp.READ]["pct_of_read_paired"] == pytest.approx(100.0)


@pytest.mark.parametrize("ahead, every", [(0, 1), (64, 1), (64, 8), (-3, 1)])
@pytest.mark.parametrize("block", [1, 64, 100, 1000])
def test_bench_prefetch_reads_every_row_once(block, ahead, every):
    # integers, so that the float32 sums are exact: a row read twice or not at all shows
    bp = _bench_prefetch()
    rng = np.random.default_rng(block)
    k = rng.integers(-8, 9, size=(2, 3, 999, 16)).astype(np.float32)
    v = rng.integers(-8, 9, size=(2, 3, 999, 16)).astype(np.float32)
    want = float(k.sum(dtype=np.float64) + v.sum(dtype=np.float64))
    assert float(bp.read_blocks(k, v, block, ahead, every)) == want
    assert float(bp.read_blocks(k, v * 0, block, ahead, every)) == float(k.sum(dtype=np.float64))


def test_bench_prefetch_check_fails_when_a_contender_is_wrong():
    bp = _bench_prefetch()
    rng = np.random.default_rng(4)
    shape = (1, bp.KV_HEADS, 256, bp.DIM)
    k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((1, bp.HEADS, 1, bp.DIM), dtype=np.float32)
    methods = bp.contenders(q, np.empty_like(q), 64)
    twins = bp.on_line(k), bp.on_line(v)
    bp.check(methods, q, k, v, twins)  # right as built
    skips = dict(methods, **{bp.PAGES: lambda k, v: bp.read_blocks(k[:, :, 1:], v, 64, 0, 1)})
    with pytest.raises(AssertionError, match="blocks \\+ page prefetch: sum"):
        bp.check(skips, q, k, v, twins)
    wrong = dict(methods, **{bp.KERNEL: lambda k, v: methods[bp.KERNEL](k, v) + 1e-3})
    with pytest.raises(AssertionError, match="nbkv kernel: .* off float64"):
        bp.check(wrong, q, k, v, twins)
    # the twins must hold the same values, on a line
    v2 = bp.on_line(v)
    v2[0, 0, 0, 0] += 1.0  # a change the kernel's output hides
    with pytest.raises(AssertionError, match="do not hold the copy's values"):
        bp.check(methods, q, k, v, (twins[0], v2))
    with pytest.raises(AssertionError, match="rows do not start on a line"):
        bp.check(methods, q, k, v, (k, v) if bp.line_offset(k) else (k[..., 4:], v))
    with pytest.raises(AssertionError, match="rows do not start on a line"):
        padded = bp.on_line(np.zeros((1, bp.KV_HEADS, 256, bp.DIM + 4), np.float32))
        padded[..., : bp.DIM] = k
        bp.check(methods, q, k, v, (padded[..., : bp.DIM], twins[1]))


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "uint8"])
def test_bench_prefetch_on_line_copies_start_on_a_line_and_hold_the_values(dtype):
    bp = _bench_prefetch()
    rng = np.random.default_rng(5)
    base = (rng.standard_normal((3, 4, 37, 24)) * 50).astype(dtype)
    views = [
        base.reshape(-1)[1:],  # numpy's start, one element on
        base[:, :, ::-1],  # negative strides
        base.transpose(0, 2, 1, 3),  # not contiguous
        base[1:, 2:, 3:7],
    ]
    for x in views:
        y = bp.on_line(x)
        assert bp.line_offset(y) == 0 and y.flags.c_contiguous
        assert y.shape == x.shape and y.dtype == x.dtype and not np.shares_memory(x, y)
        np.testing.assert_array_equal(y, x)


def test_bench_prefetch_measure_gives_the_on_line_kernel_the_twins():
    bp = _bench_prefetch()
    seen = {bp.READ: set(), bp.KERNEL: set(), bp.ON_LINE: set()}
    methods = {name: (lambda k, v, name=name: seen[name].add(id(k))) for name in seen}
    copies = [(np.zeros(4), np.zeros(4)) for _ in range(2)]
    twins = [(np.ones(4), np.ones(4)) for _ in range(2)]
    times = bp.measure(methods, copies, twins, 3)
    assert seen[bp.READ] == seen[bp.KERNEL] == {id(k) for k, _ in copies}
    assert seen[bp.ON_LINE] == {id(k) for k, _ in twins}
    assert all(len(t) == 3 for t in times.values())


def test_bench_host_main_checks_and_reports_every_contender(tmp_path):
    bh = _bench_script("host")
    out = tmp_path / "host.json"
    data = bh.main(["--quick", "--held", "1,5", "--json", str(out)])
    assert json.loads(out.read_text()) == data
    assert list(data["results"]) == [f"{d}, {h} held" for h in (1, 5) for d in bh.DTYPES]
    for name, r in data["results"].items():  # every contender timed (check() ran first)
        assert list(r) == list(bh.METHODS), name
        assert all(m["p10_us"] > 0 for m in r.values()), name
    assert data["rounds"] == 300 and data["quick"]
    assert data["machine"]["nbkv_path"] == str(Path(nbkv.__file__).resolve().parent)


def test_bench_host_refuses_a_size_the_api_would_run_in_parallel():
    bh = _bench_script("host")
    with pytest.raises(SystemExit, match="parallel"):
        bh.main(["--quick", "--held", "1000000"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_host_check_fails_when_a_contender_is_wrong(dtype):
    bh = _bench_script("host")
    step = bh.Step(dtype, 3, seed=0)
    calls = step.calls()
    step.check(calls)  # right as built
    assert step.cache.seq_len == 3

    def no_append():  # attends over what the cache held: one position short
        nbkv.attention(step.q, step.cache, out=step.outs["append_and_attend"])

    with pytest.raises(AssertionError, match="append_and_attend: the cache holds 3"):
        step.check(dict(calls, append_and_attend=no_append))

    def wrong_row():  # appends v as k
        step.cache.append(step.v, step.v)
        nbkv.attention(step.q, step.cache, out=step.outs["append + attention"])

    with pytest.raises(AssertionError, match="append \\+ attention: the appended position"):
        step.check(dict(calls, **{"append + attention": wrong_row}))

    def off():  # the kernels, their output nudged: every other contender now differs
        calls["kernels"]()
        step.outs["kernels"][0, 0, 0, 0] += 1e-3

    with pytest.raises(AssertionError, match="differs from the kernels' own"):
        step.check(dict(calls, kernels=off))

    def stale():  # attention over the held positions only, written where the API writes
        nbkv.attention(step.q, step.cache, out=step.outs["kernels"])

    with pytest.raises(AssertionError, match="differs from the kernels' own|float64"):
        step.check(dict(calls, kernels=stale))


def test_bench_host_measure_times_every_contender_each_round():
    bh = _bench_script("host")
    step = bh.Step("float16", 2, seed=1)
    times = bh.measure(step, rounds=7, warmup=2)
    assert list(times) == list(bh.METHODS)
    assert all(len(ts) == 7 and min(ts) > 0 for ts in times.values())
    assert step.cache.seq_len == 2  # cropped back after the last call


def test_bench_launch_main_checks_and_reports_every_launch(tmp_path):
    bl = _bench_script("launch")
    out = tmp_path / "launch.json"
    data = bl.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text())["rounds"] == data["rounds"] == 300
    if bl.no_launch_reason():  # the simulator: a record that says so, no figures
        assert data["skipped"] and data["results"] == {}
        return
    assert set(data["results"]) == set(bl.LAUNCHES)
    params = {name: r["parameters"] for name, r in data["results"].items()}
    assert params == {"attention": 102, "append_and_attend": 128, "append": 53}
    for result in data["results"].values():
        for method in bl.METHODS:
            assert result[method]["calls"] == 300
            assert 0 < result[method]["p10_us"] <= result[method]["median_us"]
        assert ("packing" in result) == (bl.PACK is not None)
    assert set(data["steps"]) == set(bl.STEPS) and data["numba_cuda"]
    for result in data["steps"].values():
        assert all(result[method]["calls"] == 300 for method in bl.METHODS)


def test_bench_launch_leaves_the_prepared_launches_as_it_found_them(monkeypatch):
    bl = _bench_script("launch")
    if bl.no_launch_reason():
        pytest.skip(bl.no_launch_reason())
    from nbkv import cuda_launch

    monkeypatch.setattr(cuda_launch, "ENABLED", False)  # NBKV_CUDA_PREPARED_LAUNCH=0
    bl.main(["--quick"])
    assert cuda_launch.ENABLED is False


def test_bench_launch_check_fails_when_the_prepared_list_is_wrong(monkeypatch):
    bl = _bench_script("launch")
    if bl.no_launch_reason():
        pytest.skip(bl.no_launch_reason())
    case = bl.Case("append_and_attend", seed=0)
    assert case.check() == 128
    wrong = case.prepared.parameters

    def stale_pointer(args):  # a new q's pointer not filled in
        params = wrong(args)
        params[4] = 0
        return params

    monkeypatch.setattr(case.prepared, "parameters", stale_pointer)
    with pytest.raises(AssertionError, match="differs from Numba's"):
        case.check()


def test_bench_launch_gives_each_call_new_arrays_for_what_a_step_makes_anew_and_the_next_layer():
    bl = _bench_script("launch")
    if bl.no_launch_reason():
        pytest.skip(bl.no_launch_reason())
    case = bl.Case("append_and_attend", seed=1)
    a, b = case.args(), case.args()
    arrays = [i for i, x in enumerate(a) if hasattr(x, "device_ctypes_pointer")]
    # q, the new k and v, and the next layer's K and V; the scratch and out kept
    assert [i for i in arrays if a[i] is not b[i]] == [0, 1, 2, 4, 5]
    layers = {id(case.args()[4]) for _ in range(2 * bl.LAYERS)}
    assert len(layers) == bl.LAYERS
