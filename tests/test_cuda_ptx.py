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


# the specialisations the backend launches (nbkv.kernels.cuda_attention.Spec: rows per
# block, head_dim, storage dtype, vector width, bshd, fused): decode at group 4 and
# head_dim 128 in every form, and the edges (group 1 and 8, prefill's 16 rows, head_dim
# 72, 96 and 3, float32 and float64 storage, no vectors)
ATTENTION_SPECS = [
    (4, 128, "float16", 8, False, False),
    (4, 128, "uint16", 8, False, False),
    (4, 128, "float16", 8, True, False),
    (4, 128, "float16", 8, False, True),
    (4, 128, "uint16", 8, True, True),
    (1, 72, "float32", 4, False, False),
    (8, 96, "uint16", 8, True, False),
    (16, 128, "float16", 8, False, False),
    (16, 3, "float64", 1, False, True),
]


def attention_signature(spec, q_dtype=types.float32, q_layout="C"):
    """The signature the CUDA backend launches ``spec``'s kernel with."""
    f32, i64 = types.float32, types.int64
    st = getattr(types, spec.dtype)
    stats = (types.Array(f32, 5, "C"), types.Array(f32, 5, "C"), types.Array(types.int32, 2, "C"))
    q = types.Array(q_dtype, 4, q_layout)
    cache = types.Array(st, 4, "C")
    options = (f32, types.boolean, i64, types.Array(f32, 1, "C"))
    out = types.Array(q_dtype, 4, "C")
    if spec.fused:
        new = types.Array(st, 4, "A")
        return (q, new, new, i64, cache, cache, *options, *stats, out)
    return (q, cache, cache, i64, *options, *stats, out)


@functools.cache
def attention_ptx(fields: tuple, q_dtype=types.float32, q_layout="C") -> str:
    """``compile_ptx`` of one specialisation, with the launch bound the backend's has."""
    from nbkv.kernels import cuda_attention as ca

    spec = ca.Spec(*fields)
    kernel = ca.attention_kernel(spec)
    ptx, restype = cuda.compile_ptx(
        kernel.py_func,
        attention_signature(spec, q_dtype, q_layout),
        cc=H200,
        launch_bounds=ca.launch_bounds(spec),
    )
    assert restype == types.void
    return ptx


@pytest.mark.parametrize("fields", ATTENTION_SPECS, ids=str)
def test_attention_specialisations_compile_for_h200(fields):
    _nvvm_or_skip()
    assert ".target sm_90" in attention_ptx(fields)


def test_the_main_case_compiles_for_strided_and_16_bit_queries():
    _nvvm_or_skip()
    for q_dtype, layout in ((types.float32, "A"), (types.float16, "C"), (types.float64, "C")):
        assert ".target sm_90" in attention_ptx(ATTENTION_SPECS[0], q_dtype, layout)


def test_the_kernel_families_launch_what_the_backend_caches():
    """``attend_kernel[grid, threads]`` (a hand-made launch) and the backend's plan pick
    the same specialisation; ``py_func`` is the main case's, for ``compile_ptx``."""
    from nbkv.kernels import cuda_attention as ca

    assert ca.attend_kernel.py_func is ca.attention_kernel(ca.Spec(*ATTENTION_SPECS[0])).py_func
    assert ca.rows_per_block(4, 1) == 4 and ca.rows_per_block(3, 5) == 16


_F64_ARITHMETIC = re.compile(
    r"\b(?:add|sub|mul|fma|div|max|min|neg|abs|ex2|setp|selp)[.a-z]*\.f64\b"
)


def _row_kernels():
    from nbkv.kernels import cuda as kc

    i64 = types.int64
    for st, vec, bshd, layout in [
        (types.float16, 8, False, "C"),
        (types.uint16, 8, True, "C"),
        (types.float32, 4, False, "A"),
        (types.float16, 1, True, "A"),
    ]:
        new, cache = types.Array(st, 4, layout), types.Array(st, 4, "C")
        kernel = kc.write_rows_kernel(vec, bshd, True)
        yield (st, vec, bshd), kernel, (new, new, i64, cache, cache)


@pytest.mark.parametrize("fields", ATTENTION_SPECS, ids=str)
def test_hot_attention_kernels_have_no_float64_arithmetic_and_no_local_memory(fields):
    """float32 throughout (a Python float once made the softmax float64), and per-row
    state in registers (a runtime-sized local array once put it in local memory)."""
    _nvvm_or_skip()
    ptx = attention_ptx(fields)
    assert not _F64_ARITHMETIC.findall(ptx), sorted(set(_F64_ARITHMETIC.findall(ptx)))
    if fields[2] != "float64":  # float64 storage: f64 loads, converted once, nothing more
        assert ".f64" not in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "ld.global.v4.u32" in ptx or fields[3] < 4  # 16-byte loads of K where aligned


def test_the_append_kernels_have_no_division_per_element_and_use_wide_accesses():
    _nvvm_or_skip()
    for name, kernel, sig in _row_kernels():
        ptx, restype = cuda.compile_ptx(kernel.py_func, sig, cc=H200)
        assert restype == types.void and ".f64" not in ptx and "ld.local" not in ptx, name
        # a row's indices: two divisions a row, outside the loop over its elements
        assert len(re.findall(r"\b(?:div|rem)\.", ptx)) <= 4, name
        if name[1] == 8:
            assert "st.global.v4.u32" in ptx and "ld.global.v4.u32" in ptx, name


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


needs_ptxas = pytest.mark.skipif(
    PTXAS is None,
    reason="no ptxas (the CUDA toolkit) on PATH: registers, stack and spills unchecked",
)


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
@pytest.mark.parametrize("fields", ATTENTION_SPECS, ids=str)
def test_attention_kernels_assemble_without_spills_stack_or_local_memory(fields):
    """ptxas: 0 bytes of stack frame and no spills, within the launch bound's registers
    (65,536 / (THREADS * min_blocks_per_sm)), so the blocks the backend counts on for
    one wave are resident."""
    _nvvm_or_skip()
    from nbkv.kernels import cuda_attention as ca

    if ca.THREADS != 128:
        pytest.skip("the simulator's 32-thread block is not what a GPU runs")
    spec = ca.Spec(*fields)
    report = ptxas_report(attention_ptx(fields))
    assert report["spill_stores"] == report["spill_loads"] == report["stack"] == 0, report
    assert report["registers"] <= 65_536 // (ca.THREADS * ca.min_blocks_per_sm(spec)), report


@needs_ptxas
def test_the_append_kernels_assemble_without_spills_or_local_memory():
    _nvvm_or_skip()
    for name, kernel, sig in _row_kernels():
        report = ptxas_report(cuda.compile_ptx(kernel.py_func, sig, cc=H200)[0])
        assert report["spill_stores"] == report["spill_loads"] == report["stack"] == 0, name
        assert report["registers"] <= 64, (name, report)


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


@pytest.mark.parametrize("name, fused", PAGED_ATTENTION)
def test_paged_attention_kernels_have_no_float64_arithmetic(name, fused):
    """float32 throughout for every pool but a float64 one (Python floats once made the
    paged softmax and combine float64); the float64 ``scale`` is converted once."""
    _nvvm_or_skip()
    checked = 0
    for sig in signatures_paged_attention(fused):
        if types.Array(types.float64, 4, "C") in sig:  # a float64 pool: f64 loads
            continue
        ptx = ptx_of("cuda_paged", name, sig)[0]
        found = sorted(set(_F64_ARITHMETIC.findall(ptx)))
        assert not found, (sig, found)
        checked += 1
    assert checked == 5  # float32, float16 and bfloat16 pools; strided and float16 q


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
    from nbkv.kernels import cuda_attention, cuda_paged

    if cuda_attention.THREADS != 128:
        pytest.skip("the simulator's 32-thread block is not what a GPU runs")
    per_sm = 65_536 // (cuda_attention.THREADS * 4)  # 4 blocks of 128 threads per SM
    local = 4 * (cuda_paged._ACC_SIZE + cuda_attention.ROWS)
    for sig in list(signatures_paged_attention(fused))[:4]:  # every storage dtype
        report = ptxas_report(ptx_of("cuda_paged", name, sig)[0])
        assert report["spill_stores"] == report["spill_loads"] == 0, (sig, report)
        assert report["registers"] <= per_sm, (sig, report)
        assert report["stack"] <= local, (sig, report)
