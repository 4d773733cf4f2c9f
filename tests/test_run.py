"""tests/run.py, the README's test command: both halves side by side, each line relayed
under its half's name, and a failure in either half fails the run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from conftest import cpu_only

pytestmark = cpu_only  # it starts both halves itself

RUN = Path(__file__).resolve().parent / "run.py"


def _module():
    spec = importlib.util.spec_from_file_location("nbkv_tests_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(cwd, *args):
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return subprocess.run(
        [sys.executable, str(RUN), "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=cwd,
    )


def test_both_halves_run_each_on_its_backend_and_each_line_says_which(tmp_path):
    # started elsewhere: it runs from the repository root
    done = _run(
        tmp_path, "tests/test_alloc.py", "tests/test_cuda_kernels.py", "-k", "row_copy or steady"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "cpu | nbkv backend: cpu" in lines
    assert "sim | nbkv backend: cuda under Numba's CUDA simulator" in lines
    for half in ("cpu", "sim"):
        summary = [line for line in lines if line.startswith(f"{half} | ") and " in " in line]
        assert summary and "passed" in summary[-1] and "failed" not in summary[-1], half
    assert "CPU half passed (exit 0), simulator half passed (exit 0)" in lines[-1]


def test_a_failure_in_either_half_fails_the_run(tmp_path):
    # a test that passes on the CPU half only, in a folder of its own
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import os\n\ndef test_cpu_half():\n"
        "    assert os.environ.get('NUMBA_ENABLE_CUDASIM') != '1'\n"
    )
    args = (str(probe), "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"))
    done = _run(tmp_path, *args)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "CPU half passed (exit 0), simulator half FAILED (exit 1)" in done.stdout
    # and a usage error in both: the CPU half's status
    done = _run(tmp_path, "tests/test_alloc.py::no_such_test")
    assert done.returncode == 4, done.stdout[-3000:]
    assert "CPU half FAILED (exit 4), simulator half FAILED (exit 4)" in done.stdout


def test_the_whole_suite_moves_the_h200_compilation_checks_behind_the_simulator_half():
    run = _module()
    cpu_lane, sim_lane = run.plan([])
    assert cpu_lane == [("cpu", False, [f"--ignore={p}" for p in run.PTX])]
    assert sim_lane == [("sim", True, []), ("ptx", False, list(run.PTX))]
    for path in run.PTX:  # each is a test file, and only they run compile_ptx
        assert (run.ROOT / path).is_file()
    others = [
        p
        for p in (run.ROOT / "tests").glob("test_*.py")
        if f"tests/{p.name}" not in run.PTX and p.name != "test_run.py"
    ]
    assert not [p.name for p in others if "compile_ptx(" in p.read_text()]
    # a selection of the user's runs in both halves as given, and nothing else
    assert run.plan(["-x", "tests/test_paged.py"]) == [
        [("cpu", False, ["-x", "tests/test_paged.py"])],
        [("sim", True, ["-x", "tests/test_paged.py"])],
    ]


def test_a_lane_runs_its_runs_in_order_and_every_status_counts(capsys, tmp_path):
    run = _module()
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import os\n\ndef test_cpu_half():\n"
        "    assert os.environ.get('NUMBA_ENABLE_CUDASIM') != '1'\n"
    )
    alone = [str(probe), "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini")]
    lanes = [[("cpu", False, alone)], [("sim", True, alone), ("ptx", False, alone)]]
    assert run.main([], lanes=lanes) == 1  # the simulator's failure
    out = capsys.readouterr().out.splitlines()
    sim_done = next(i for i, line in enumerate(out) if line.startswith("sim | ") and " in " in line)
    ptx_start = next(i for i, line in enumerate(out) if line.startswith("ptx | "))
    assert sim_done < ptx_start  # one after the other in the lane
    assert out[-1].startswith(
        "tests/run.py: CPU half passed (exit 0), simulator half FAILED (exit 1), "
        "H200 compilation checks passed (exit 0), "
    )
