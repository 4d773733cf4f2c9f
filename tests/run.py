"""Run the whole test suite: its two halves side by side, one process each.

    python tests/run.py [pytest arguments]

The suite runs twice (``tests/conftest.py``): once on the CPU backend, and once on the
CUDA backend under Numba's simulator, which ``NUMBA_ENABLE_CUDASIM=1`` switches on only if
it is set before Numba is imported, hence two processes. One after the other they ran out
of CI's 90 minutes on a two-core guest. Each half is mostly one busy thread (the CPU half
compiling kernels, the simulator running every CUDA thread in Python), so on two cores
they barely slow each other. Both share Numba's on-disk cache, whose files Numba writes
whole and renames into place.

The simulator half is the shorter, so for the whole suite (no arguments) the CPU half
leaves the H200 compilation checks (``PTX``: ``compile_ptx`` and ``ptxas``, which the
simulator half skips) to a third run on the CPU backend, in the simulator's lane once it
is done. With arguments, both halves run them as given, and no third run
(``python tests/run.py tests/test_paged.py -x``, paths from the repository root).

Each line a run prints comes out as it is printed, after ``cpu |``, ``sim |`` or ``ptx |``.
The exit status is 0 only when every run passes; otherwise the first failing one's, in
that order. One half alone: ``python -m pytest``, or ``NUMBA_ENABLE_CUDASIM=1 python -m
pytest``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PTX = ("tests/test_cuda_ptx.py", "tests/test_quant_ptx.py")
NAMES = {"cpu": "CPU half", "sim": "simulator half", "ptx": "H200 compilation checks"}


def plan(argv: list[str]) -> list[list[tuple[str, bool, list[str]]]]:
    """Lanes that run side by side, each a list of (name, simulator?, pytest arguments)
    run one after the other."""
    if argv:
        return [[("cpu", False, argv)], [("sim", True, argv)]]
    skip = [f"--ignore={path}" for path in PTX]
    return [[("cpu", False, skip)], [("sim", True, []), ("ptx", False, list(PTX))]]


def _env(simulator: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # lines arrive as the run prints them
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return env


def _run(name: str, simulator: bool, args: list[str], lock: threading.Lock) -> int:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", *args],
        cwd=ROOT,
        env=_env(simulator),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    try:
        for line in proc.stdout:
            with lock:
                sys.stdout.write(f"{name} | {line}")
                sys.stdout.flush()
        return proc.wait()
    finally:
        if proc.poll() is None:  # the relay failed (its stdout gone): stop the run too
            proc.terminate()


def main(argv: list[str], lanes=None) -> int:
    lanes = plan(argv) if lanes is None else lanes
    lock, codes = threading.Lock(), {}

    def lane(runs):
        for name, simulator, args in runs:
            codes[name] = _run(name, simulator, args, lock)

    start = time.perf_counter()
    threads = [threading.Thread(target=lane, args=(runs,), daemon=True) for runs in lanes]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():  # (a plain join() would not hear Ctrl-C)
            thread.join(1.0)
    took = time.perf_counter() - start
    verdict = {0: "passed", 5: "collected nothing"}
    order = [name for runs in lanes for name, _, _ in runs]
    status = {n: codes.get(n, 1) for n in order}  # a run that never started: 1
    parts = [f"{NAMES[n]} {verdict.get(status[n], 'FAILED')} (exit {status[n]})" for n in order]
    print(f"tests/run.py: {', '.join(parts)}, {took:.0f} s side by side")
    return next((status[n] for n in order if status[n] != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
