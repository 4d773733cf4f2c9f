"""Run the whole test suite: its two halves side by side, one process each.

    python tests/run.py [pytest arguments]

The suite runs twice (``tests/conftest.py``): once on the CPU backend, and once on the
CUDA backend under Numba's simulator, which ``NUMBA_ENABLE_CUDASIM=1`` switches on only if
it is set before Numba is imported, hence two processes. Run one after the other they took
about 95 minutes on a two-core guest; side by side, about as long as the CPU half alone.
Each half is mostly one busy thread (the CPU half compiling kernels, the simulator running
every CUDA thread in Python), so on two cores they barely slow each other. Both share
Numba's on-disk cache, whose files Numba writes whole and renames into place.

Each line either half prints comes out as it is printed, after ``cpu |`` or ``sim |``. The
arguments go to both halves (``python tests/run.py tests/test_paged.py -x``). The exit
status is 0 only when both halves pass; otherwise the CPU half's status, or the
simulator's if the CPU half passed. One half alone: ``python -m pytest``, or
``NUMBA_ENABLE_CUDASIM=1 python -m pytest``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(simulator: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # lines arrive as the half prints them
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return env


def _relay(name: str, stream, lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            sys.stdout.write(f"{name} | {line}")
            sys.stdout.flush()


def main(argv: list[str]) -> int:
    lock = threading.Lock()
    halves, relays = {}, []
    start = time.perf_counter()
    for name, simulator in (("cpu", False), ("sim", True)):
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *argv],
            cwd=ROOT,
            env=_env(simulator),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        halves[name] = proc
        relay = threading.Thread(target=_relay, args=(name, proc.stdout, lock), daemon=True)
        relay.start()
        relays.append(relay)
    try:
        codes = {name: proc.wait() for name, proc in halves.items()}
    except KeyboardInterrupt:
        for proc in halves.values():
            proc.terminate()
        raise
    for relay in relays:
        relay.join()
    took = time.perf_counter() - start
    verdict = {0: "passed", 5: "collected nothing"}
    print(
        f"tests/run.py: CPU half {verdict.get(codes['cpu'], 'FAILED')} (exit {codes['cpu']}), "
        f"simulator half {verdict.get(codes['sim'], 'FAILED')} (exit {codes['sim']}), "
        f"{took:.0f} s side by side"
    )
    return codes["cpu"] or codes["sim"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
