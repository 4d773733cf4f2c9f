"""The quantized cache's CUDA kernels (nbkv.kernels.cuda_quant) compile to PTX for the
H200 (compute capability 9.0), for every signature nbkv.quant_cuda launches, and what
ptxas makes of them: no spills, no local memory, the attention kernel within 128
registers (four 128-thread blocks an SM); no float64 arithmetic in the float32 paths; the
quantizer's IEEE division and round-half-even; a dequantization no FMA contracts (so
``get_kv`` is the CPU's bit for bit). The helpers are tests/test_cuda_ptx.py's.
"""

from __future__ import annotations

import itertools
import re

import pytest

from conftest import SIMULATOR

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")

cuda = pytest.importorskip("numba.cuda")
from numba import types  # noqa: E402

try:
    from nbkv.kernels import cuda_quant  # noqa: F401 - imports, or the module skips
except Exception as err:  # pragma: no cover - numba-cuda missing or broken
    pytest.skip(f"nbkv.kernels.cuda_quant does not import: {err}", allow_module_level=True)

from test_cuda_ptx import H200, _nvvm_or_skip, needs_ptxas, ptx_of, ptxas_report  # noqa: E402

i64, f32, u16 = types.int64, types.float32, types.uint16
TABLE = types.Array(f32, 1, "C")
WINDOW = [f32, u16]  # a float32 window, or uint16 bits of float16 / bfloat16


def storage(window):
    u8, bits16 = types.Array(types.uint8, 4, "C"), types.Array(u16, 4, "C")
    win = types.Array(window, 4, "C")
    return (u8, bits16, bits16, u8, bits16, bits16, win, win)


def signatures_append():
    """k, v as the cache passes them (contiguous copies, or a user's strided device
    views); held, q_len, new_q, k_bits, v_bits, group, v_group, kind as Python ints."""
    for window, layout in itertools.product(WINDOW, ["C", "A"]):
        new = types.Array(window, 4, layout)
        yield (new, new, *([i64] * 8), TABLE, *storage(window))


def signatures_dequantize():
    """Into fresh buffers ("C") or views of the window itself, as a trim writes ("A")."""
    for window, layout in itertools.product(WINDOW, ["C", "A"]):
        out = types.Array(window, 4, layout)
        yield (*storage(window), *([i64] * 6), TABLE, out, out)


def signatures_attend():
    """Every window dtype with contiguous float32 queries; strided, float64 and float16
    queries once. scale is the float32 CUDAQuant passes."""
    combos = [(w, f32, "C") for w in WINDOW]
    combos += [(f32, f32, "A"), (f32, types.float64, "C"), (u16, types.float16, "C")]
    for window, q_dtype, q_layout in combos:
        q = types.Array(q_dtype, 4, q_layout)
        options = (i64, i64, i64, i64, f32, types.boolean, i64, TABLE)
        yield (q, *storage(window), *options, types.Array(q_dtype, 4, "C"))


KERNELS = [
    ("quant_append_kernel", signatures_append),
    ("quant_append_bshd_kernel", signatures_append),
    ("dequantize_kernel", signatures_dequantize),
    ("dequantize_bshd_kernel", signatures_dequantize),
    ("attend_quant_kernel", signatures_attend),
]


def _float32_only(sig) -> bool:
    """Every float in the signature is float32 (uint16 bits are not floats)."""
    return all(
        getattr(t, "dtype", t) not in (types.float64, types.float16) for t in sig if t != i64
    )


@pytest.mark.parametrize("name, signatures", KERNELS)
def test_quantized_kernels_compile_for_h200(name, signatures):
    _nvvm_or_skip()
    for sig in signatures():
        ptx, restype = ptx_of("cuda_quant", name, sig)
        assert ".target sm_90" in ptx and restype == types.void, sig


def test_narrow16_compiles_as_a_device_function_in_a_kernel():
    _nvvm_or_skip()
    narrow16 = cuda_quant.narrow16

    def kernel(x, kind, out):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = narrow16(x[i], kind)

    sig = (types.Array(f32, 1, "C"), i64, types.Array(u16, 1, "C"))
    ptx, _ = cuda.compile_ptx(kernel, sig, cc=H200)
    assert ".target sm_90" in ptx and ".f64" not in ptx


@pytest.mark.parametrize("name, signatures", KERNELS)
def test_float32_paths_have_no_float64_arithmetic(name, signatures):
    """float64 creeps in through Python float constants and mixed comparisons; with
    float32 queries, window and scale, not one .f64 instruction is left."""
    _nvvm_or_skip()
    checked = 0
    for sig in signatures():
        if _float32_only(sig):
            ptx = ptx_of("cuda_quant", name, sig)[0]
            assert not re.findall(r"\.f64\b", ptx), (sig, re.findall(r".*\.f64\b.*", ptx)[:5])
            checked += 1
    assert checked


@pytest.mark.parametrize("name", ["quant_append_kernel", "quant_append_bshd_kernel"])
def test_the_quantizer_divides_as_ieee_and_rounds_half_to_even(name):
    _nvvm_or_skip()
    for sig in signatures_append():
        ptx = ptx_of("cuda_quant", name, sig)[0]
        assert "div.rn.f32" in ptx and "cvt.rni.f32.f32" in ptx, sig
        assert not re.search(r"div\.(approx|full)", ptx), sig


@pytest.mark.parametrize("name", ["dequantize_kernel", "dequantize_bshd_kernel"])
def test_dequantize_keeps_the_cpus_two_roundings(name):
    """zero + code * scale as mul.rn then add: NVVM would contract a plain product and sum
    into fma.rn.f32 (one rounding), and get_kv would differ from the CPU's in the last bit."""
    _nvvm_or_skip()
    for sig in signatures_dequantize():
        ptx = ptx_of("cuda_quant", name, sig)[0]
        assert "mul.rn.f32" in ptx and "fma.rn.f32" not in ptx, sig


REGISTERS = {  # the most each may use: 65,536 registers an SM
    "attend_quant_kernel": 128,  # four 128-thread blocks an SM
    "quant_append_kernel": 168,  # three
    "quant_append_bshd_kernel": 168,
    "dequantize_kernel": 64,
    "dequantize_bshd_kernel": 64,
}


@needs_ptxas
@pytest.mark.parametrize("name, signatures", KERNELS)
def test_quantized_kernels_assemble_without_spills_or_local_memory(name, signatures):
    """No spills and no stack frame (the attention kernel's accumulators are indexed by
    constants only, so they live in registers); registers within REGISTERS."""
    _nvvm_or_skip()
    if name == "attend_quant_kernel" and cuda_quant.THREADS != 128:
        pytest.skip("the simulator's 32-thread block is not what a GPU runs")
    for sig in list(signatures())[:4]:
        ptx = ptx_of("cuda_quant", name, sig)[0]
        report = ptxas_report(ptx)
        assert report["spill_stores"] == report["spill_loads"] == report["stack"] == 0, (
            sig,
            report,
        )
        assert report["registers"] <= REGISTERS[name], (sig, report)
        assert "ld.local" not in ptx and "st.local" not in ptx, sig
