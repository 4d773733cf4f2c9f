"""Every CUDA kernel compiles to PTX for the H200 (compute capability 9.0).

The simulator runs kernels as Python and checks no types, so it would accept code no GPU
can run. ``numba.cuda.compile_ptx`` runs the real compiler (NVVM, from numba-cuda[cu13])
without a GPU, for each signature nbkv can launch: every storage dtype, contiguous ("C")
or strided ("A") inputs, contiguous cache buffers, an int64 position.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import subprocess
import tempfile

import pytest

from conftest import SIMULATOR

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")

cuda = pytest.importorskip("numba.cuda")
from numba import types  # noqa: E402

try:
    from nbkv.kernels import cuda as kernels  # noqa: F401 - imports, or the module skips
except Exception as err:  # pragma: no cover - numba-cuda missing or broken
    pytest.skip(f"nbkv.kernels.cuda does not import: {err}", allow_module_level=True)

H200 = (9, 0)
# what kernels see: float16 and bfloat16 travel as uint16 bit patterns; float16 device
# arrays are also gathered as they are (to_host of a strided float16 view)
STORAGE = [types.float32, types.float64, types.uint16, types.float16]
LAYOUTS = ["C", "A"]


@functools.cache
def ptx_of(module: str, name: str, sig: tuple) -> tuple[str, object]:
    """``compile_ptx`` of one kernel and signature, once per test session."""
    import importlib

    kernel = getattr(importlib.import_module(f"nbkv.kernels.{module}"), name)
    return cuda.compile_ptx(kernel.py_func, sig, cc=H200)


def _nvvm_or_skip():
    try:
        cuda.compile_ptx(lambda a: None, (types.float32[::1],), cc=H200)
    except Exception as err:  # NVVM missing: numba-cuda installed without [cu13]
        pytest.skip(f"no NVVM to compile with: {err}")


def signatures_kv():
    for dtype, k_layout, v_layout in itertools.product(STORAGE, LAYOUTS, LAYOUTS):
        cache = types.Array(dtype, 4, "C")
        k, v = types.Array(dtype, 4, k_layout), types.Array(dtype, 4, v_layout)
        yield (k, v, types.int64, cache, cache)


def signatures_cache():
    for dtype, layout in itertools.product(STORAGE, LAYOUTS):
        yield (types.Array(dtype, 4, layout), types.int64, types.Array(dtype, 4, "C"))


@pytest.mark.parametrize("name", ["write_kv_kernel", "write_kv_bshd_kernel"])
def test_write_kv_kernels_compile_for_h200(name):
    _nvvm_or_skip()
    for sig in signatures_kv():
        ptx, restype = ptx_of("cuda", name, sig)
        assert ".target sm_90" in ptx and restype == types.void, sig


@pytest.mark.parametrize("name", ["write_cache_kernel", "write_cache_bshd_kernel"])
def test_write_cache_kernels_compile_for_h200(name):
    _nvvm_or_skip()
    for sig in signatures_cache():
        ptx, restype = ptx_of("cuda", name, sig)
        assert ".target sm_90" in ptx and restype == types.void, sig


def test_a_kernel_that_cannot_be_typed_fails_to_compile():
    """The check has teeth: a kernel returning a value is refused by the real compiler."""
    _nvvm_or_skip()

    def bad(a):
        return a[0]

    with pytest.raises(Exception):  # noqa: B017 - numba's typing errors vary by version
        cuda.compile_ptx(bad, (types.float32[::1],), cc=H200)


def signatures_attention(fused: bool):
    """The signatures the CUDA backend launches attention with."""
    f32, i64 = types.float32, types.int64
    stats = (types.Array(f32, 5, "C"), types.Array(f32, 5, "C"), types.Array(types.int32, 2, "C"))
    storage = [types.float32, types.float64, types.float16, types.uint16]
    # every storage dtype with contiguous float32 queries; strided and float16 queries once
    combos = [(st, f32, "C") for st in storage]
    combos += [(types.float32, f32, "A"), (types.float32, types.float16, "C")]
    for st, q_dtype, q_layout in combos:
        q = types.Array(q_dtype, 4, q_layout)
        cache = types.Array(st, 4, "C")
        options = (types.float64, types.boolean, i64, types.Array(f32, 1, "C"))
        out = types.Array(q_dtype, 4, "C")
        if fused:
            new = types.Array(st, 4, "A")
            yield (q, new, new, i64, cache, cache, *options, *stats, out)
        else:
            yield (q, cache, cache, i64, *options, *stats, out)


@pytest.mark.parametrize(
    "name,fused",
    [
        ("attend_kernel", False),
        ("attend_bshd_kernel", False),
        ("append_attend_kernel", True),
        ("append_attend_bshd_kernel", True),
    ],
)
def test_attention_kernels_compile_for_h200(name, fused):
    _nvvm_or_skip()
    for sig in signatures_attention(fused):
        ptx, restype = ptx_of("cuda_attention", name, sig)
        assert ".target sm_90" in ptx and restype == types.void, sig


# -- ptxas: registers, spills, local memory -------------------------------------------

PTXAS = shutil.which("ptxas")


def ptxas_report(ptx: str) -> dict:
    """``ptxas -arch=sm_90 -v`` of one kernel's PTX: registers, stack, spills, barriers.

    The machine's ptxas (CUDA 13.0) reads PTX ISA up to 9.0 while numba-cuda's NVVM may
    write a newer .version; the header is lowered to 9.0, which ptxas accepts only if the
    kernel uses nothing newer (it refuses otherwise, and this test fails).
    """
    ptx = re.sub(r"^\.version \d+\.\d+", ".version 9.0", ptx, count=1, flags=re.M)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        run = subprocess.run(
            [PTXAS, "-arch=sm_90", "-v", path, "-o", os.path.join(folder, "k.cubin")],
            capture_output=True,
            text=True,
        )
    assert run.returncode == 0, run.stderr[-2000:]
    info = run.stderr
    numbers = {
        "registers": r"Used (\d+) registers",
        "stack": r"(\d+) bytes stack frame",
        "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads",
    }
    return {key: int(re.search(pattern, info).group(1)) for key, pattern in numbers.items()}


needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="no ptxas (the CUDA toolkit) on PATH")


@needs_ptxas
@pytest.mark.parametrize(
    "name, signatures",
    [
        ("write_kv_kernel", signatures_kv),
        ("write_kv_bshd_kernel", signatures_kv),
        ("write_cache_kernel", signatures_cache),
        ("write_cache_bshd_kernel", signatures_cache),
    ],
)
def test_copy_kernels_assemble_without_spills_or_local_memory(name, signatures):
    _nvvm_or_skip()
    for sig in signatures():
        report = ptxas_report(ptx_of("cuda", name, sig)[0])
        assert report["spill_stores"] == report["spill_loads"] == report["stack"] == 0, sig
        assert report["registers"] <= 64, (sig, report)


@needs_ptxas
@pytest.mark.parametrize(
    "name, fused",
    [
        ("attend_kernel", False),
        ("attend_bshd_kernel", False),
        ("append_attend_kernel", True),
        ("append_attend_bshd_kernel", True),
    ],
)
def test_attention_kernels_fit_four_blocks_per_sm_without_spills(name, fused):
    """128-thread blocks at ATTENTION_BLOCKS_PER_SM = 4 need at most 128 registers a
    thread (65,536 per SM); the only local memory is the accumulators and dot products
    (cuda.local arrays of ROWS * ceil(MAX_HEAD_DIM / THREADS) + ROWS floats)."""
    _nvvm_or_skip()
    from nbkv import _config
    from nbkv.kernels import cuda_attention

    if cuda_attention.THREADS != 128:
        pytest.skip("the simulator's 32-thread block is not what a GPU runs")
    per_sm = 65_536 // (cuda_attention.THREADS * _config.ATTENTION_BLOCKS_PER_SM)
    local = 4 * (cuda_attention._ACC_SIZE + cuda_attention.ROWS)
    for sig in list(signatures_attention(fused))[:4]:  # every storage dtype
        report = ptxas_report(ptx_of("cuda_attention", name, sig)[0])
        assert report["spill_stores"] == report["spill_loads"] == 0, (sig, report)
        assert report["registers"] <= per_sm, (sig, report)
        assert report["stack"] <= local, (sig, report)


# -- the paged cache's kernels (nbkv.kernels.cuda_paged) ---------------------------------


def signatures_paged_write():
    i32 = types.Array(types.int32, 1, "C")
    for dtype, layout in itertools.product(STORAGE, LAYOUTS):
        rows, pool = types.Array(dtype, 3, layout), types.Array(dtype, 4, "C")
        yield (rows, rows, i32, pool, pool)


def signatures_copy_blocks():
    i32 = types.Array(types.int32, 1, "C")
    for dtype in STORAGE:
        pool = types.Array(dtype, 4, "C")
        yield (i32, i32, pool, pool)


def signatures_paged_attention(fused: bool):
    """The signatures the CUDA backend launches paged attention with."""
    f32 = types.float32
    i32 = types.Array(types.int32, 1, "C")
    stats = (types.Array(f32, 4, "C"), types.Array(f32, 4, "C"), types.Array(types.int32, 2, "C"))
    storage = [types.float32, types.float64, types.float16, types.uint16]
    combos = [(st, f32, "C") for st in storage]
    combos += [(types.float32, f32, "A"), (types.float32, types.float16, "C")]
    for st, q_dtype, q_layout in combos:
        q = types.Array(q_dtype, 3, q_layout)
        pool = types.Array(st, 4, "C")
        tables = (i32, i32, i32, i32, types.float64, types.int64, types.Array(f32, 1, "C"))
        out = types.Array(q_dtype, 3, "C")
        if fused:
            new = types.Array(st, 3, "A")
            yield (q, new, new, i32, pool, pool, *tables, *stats, out)
        else:
            yield (q, pool, pool, *tables, *stats, out)


PAGED_ATTENTION = [
    ("paged_attend_kernel", False),
    ("paged_attend_hnd_kernel", False),
    ("paged_append_attend_kernel", True),
    ("paged_append_attend_hnd_kernel", True),
]
PAGED_COPIES = [
    ("write_paged_kernel", signatures_paged_write),
    ("write_paged_hnd_kernel", signatures_paged_write),
    ("copy_blocks_kernel", signatures_copy_blocks),
]


@pytest.mark.parametrize("name, signatures", PAGED_COPIES)
def test_paged_copy_kernels_compile_for_h200(name, signatures):
    _nvvm_or_skip()
    for sig in signatures():
        ptx, restype = ptx_of("cuda_paged", name, sig)
        assert ".target sm_90" in ptx and restype == types.void, sig


@pytest.mark.parametrize("name, fused", PAGED_ATTENTION)
def test_paged_attention_kernels_compile_for_h200(name, fused):
    _nvvm_or_skip()
    for sig in signatures_paged_attention(fused):
        ptx, restype = ptx_of("cuda_paged", name, sig)
        assert ".target sm_90" in ptx and restype == types.void, sig


@needs_ptxas
@pytest.mark.parametrize("name, signatures", PAGED_COPIES)
def test_paged_copy_kernels_assemble_without_spills_or_local_memory(name, signatures):
    _nvvm_or_skip()
    for sig in signatures():
        report = ptxas_report(ptx_of("cuda_paged", name, sig)[0])
        assert report["spill_stores"] == report["spill_loads"] == report["stack"] == 0, sig
        assert report["registers"] <= 64, (sig, report)


@needs_ptxas
@pytest.mark.parametrize("name, fused", PAGED_ATTENTION)
def test_paged_attention_kernels_fit_four_blocks_per_sm_without_spills(name, fused):
    """As the contiguous kernels: at most 128 registers a thread, no spills, local memory
    only for the accumulators and dot products."""
    _nvvm_or_skip()
    from nbkv import _config
    from nbkv.kernels import cuda_attention

    if cuda_attention.THREADS != 128:
        pytest.skip("the simulator's 32-thread block is not what a GPU runs")
    per_sm = 65_536 // (cuda_attention.THREADS * _config.ATTENTION_BLOCKS_PER_SM)
    local = 4 * (cuda_attention._ACC_SIZE + cuda_attention.ROWS)
    for sig in list(signatures_paged_attention(fused))[:4]:  # every storage dtype
        report = ptxas_report(ptx_of("cuda_paged", name, sig)[0])
        assert report["spill_stores"] == report["spill_loads"] == 0, (sig, report)
        assert report["registers"] <= per_sm, (sig, report)
        assert report["stack"] <= local, (sig, report)
