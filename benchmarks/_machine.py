"""What every benchmark records about the run: machine, versions, threads, command, commit.

Imported by the ``bench_*.py`` scripts (run as scripts, so this folder is on ``sys.path``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def git_state() -> dict | None:
    """The commit measured, and files of nbkv/ changed since it (read-only git calls)."""

    def git(*args: str) -> str:
        cmd = ["git", "--no-optional-locks", *args]  # --no-optional-locks: writes nothing
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        return done.stdout

    try:
        dirty = git("status", "--porcelain", "--", "nbkv").splitlines()
        kernel = hashlib.sha256((ROOT / "nbkv/kernels/cpu_attention.py").read_bytes())
        return {
            "commit": git("rev-parse", "HEAD").strip(),
            "nbkv_changed": dirty,
            "cpu_attention_py_sha256": kernel.hexdigest(),
        }
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_identity() -> str | None:
    """``"family F model M, <widest vectors>"`` from ``/proc/cpuinfo`` (None elsewhere).

    A guest names its CPU "AMD EPYC" whatever the generation: a Zen 2 (family 23, AVX2)
    and a Zen 4 (family 25, AVX-512) read alike, and two runs of 2026-12-06 were filed as
    the Zen 4's until their L3 size (16 MiB, not 32) gave them away."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    widest = next((f for f in ("avx512f", "avx2", "avx", "sse2") if f in flags), "unknown")
    if "cpu family" not in fields:  # not x86 (an ARM host names its parts otherwise)
        return None
    return f"family {fields['cpu family']} model {fields.get('model', '?')}, {widest}"


def machine(torch=None) -> dict:
    """Machine, library versions and thread settings, the command line and the commit."""
    import numba

    import nbkv

    cpu, cpu_id = platform.processor(), cpu_identity()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        l3 = None
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{blas.get('name')} {blas.get('version')}"
    except Exception:  # only for the record
        blas = None
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpu_id": cpu_id,
        "l3_cache": l3,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numpy_blas": blas,
        "numba": numba.__version__,
        "numba_threads": numba.get_num_threads(),
        "nbkv": nbkv.__version__,
        # the package imported: "git" below is the checkout's, which a run that imports
        # another copy (PYTHONPATH=<an older worktree>) did not measure
        "nbkv_path": str(Path(nbkv.__file__).resolve().parent),
        "torch": None if torch is None else torch.__version__,
        "torch_threads": None if torch is None else torch.get_num_threads(),
        "thread_env": {
            k: os.environ[k]
            for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")
            if k in os.environ
        },
        # what each library compiles or dispatches for: Numba's target (NUMBA_CPU_NAME,
        # NUMBA_CPU_FEATURES) and torch's kernels (ATEN_CPU_CAPABILITY, oneDNN's, MKL's)
        "isa_env": {
            k: os.environ[k]
            for k in (
                "NUMBA_CPU_NAME",
                "NUMBA_CPU_FEATURES",
                "ATEN_CPU_CAPABILITY",
                "ONEDNN_MAX_CPU_ISA",
                "MKL_ENABLE_INSTRUCTIONS",
            )
            if k in os.environ
        },
        "torch_cpu_capability": _torch_capability(torch),
        "command": " ".join([sys.executable, *sys.argv]),
        "git": git_state(),
    }


def _torch_capability(torch) -> str | None:
    """The vector ISA torch's own CPU kernels run with (``"AVX512"``, ``"AVX2"``, ...)."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # no torch, or one too old to say: only for the record
        return None
