"""Every CUDA kernel compiles to PTX for the H200 (compute capability 9.0).

The simulator runs kernels as Python and checks no types, so it would accept code no GPU
can run. ``numba.cuda.compile_ptx`` runs the real compiler (NVVM, from numba-cuda[cu13])
without a GPU, for each signature nbkv can launch: every storage dtype, contiguous ("C")
or strided ("A") inputs, contiguous cache buffers, an int64 position.
"""

from __future__ import annotations

import itertools

import pytest

from conftest import SIMULATOR

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")

cuda = pytest.importorskip("numba.cuda")
from numba import types  # noqa: E402

try:
    from nbkv.kernels import cuda as kernels
except Exception as err:  # pragma: no cover - numba-cuda missing or broken
    pytest.skip(f"nbkv.kernels.cuda does not import: {err}", allow_module_level=True)

H200 = (9, 0)
# what kernels see: float16 and bfloat16 travel as uint16 bit patterns
STORAGE = [types.float32, types.float64, types.uint16]
LAYOUTS = ["C", "A"]


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
    kernel = getattr(kernels, name)
    for sig in signatures_kv():
        ptx, restype = cuda.compile_ptx(kernel.py_func, sig, cc=H200)
        assert ".target sm_90" in ptx and restype == types.void, sig


@pytest.mark.parametrize("name", ["write_cache_kernel", "write_cache_bshd_kernel"])
def test_write_cache_kernels_compile_for_h200(name):
    _nvvm_or_skip()
    kernel = getattr(kernels, name)
    for sig in signatures_cache():
        ptx, restype = cuda.compile_ptx(kernel.py_func, sig, cc=H200)
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
    from nbkv.kernels import cuda_attention

    kernel = getattr(cuda_attention, name)
    for sig in signatures_attention(fused):
        ptx, restype = cuda.compile_ptx(kernel.py_func, sig, cc=H200)
        assert ".target sm_90" in ptx and restype == types.void, sig
