"""The CPU kernels' vectorisable building blocks (nbkv.kernels.cpu_math), and the paths of
CPU attention they opened: the float32 ``exp``, 16-bit widening without a table, the
prefetch hint, and prefill in query chunks, each against float64 NumPy or the reference."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from numba import njit

import nbkv
from nbkv import _config, reference
from nbkv.dtypes import kernel_dtype, resolve_dtype, widen_table
from nbkv.kernels import cpu_attention
from nbkv.kernels.cpu_math import (
    PREFETCH_LOCALITY,
    exp32,
    kind16,
    prefetch,
    target_features,
    touch,
    touch_rows,
    widen16,
)
from nbkv.kernels.cpu_simd import accumulate_rows

from conftest import cpu_only

pytestmark = cpu_only

ULP = 2.0**-24  # float32's relative spacing, at the least


@njit(fastmath=_config.FASTMATH)
def _exp_fast(x, out):
    # the kernels' licences: exp32 must stay exact under them (Numba passes a caller's
    # fastmath flags on to what it calls)
    for i in range(x.shape[0]):
        out[i] = exp32(x[i])


@njit
def _exp_strict(x, out):
    for i in range(x.shape[0]):
        out[i] = exp32(x[i])


@pytest.mark.parametrize("loop", [_exp_fast, _exp_strict], ids=["fastmath", "strict"])
def test_exp32_is_within_a_few_ulp_of_float64_exp(rng, loop):
    x = np.concatenate(
        [
            np.linspace(-86.98, 88.72, 400_001, dtype=np.float32),
            rng.uniform(-30, 0, 100_000).astype(np.float32),  # where softmax weights live
            np.float32([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5 * math.log(2)]),
        ]
    )
    got = np.empty_like(x)
    loop(x, got)
    want = np.exp(x.astype(np.float64))
    rel = np.abs(got - want) / want
    # 8 ulp, plus what the licence to reassociate may cost where the CPU has no FMA
    # (NUMBA_CPU_NAME=generic): n ln2 rounded to float32, |x| * 2**-24 (the module
    # docstring). With FMA the reduction contracts first and the 8 ulp hold alone. The
    # strict loop gets the allowance too: Numba compiles exp32 once per signature, with
    # the flags of whichever caller came first (here the fastmath one)
    fold = 0.0 if "+fma" in target_features() else 2.0**-24
    bound = 8 * ULP + np.abs(x.astype(np.float64)) * fold
    worst = np.argmax(rel / bound)
    assert rel[worst] <= bound[worst], f"worst at x = {x[worst]}: {rel[worst] / ULP:.1f} ulp"


@pytest.mark.parametrize("loop", [_exp_fast, _exp_strict], ids=["fastmath", "strict"])
def test_exp32_edges(loop):
    x = np.float32([-np.inf, np.inf, np.nan, -1e4, -87.0, 88.8, 1e4, -np.nan])
    got = np.empty_like(x)
    loop(x, got)
    assert got[0] == 0.0 and got[3] == 0.0 and got[4] == 0.0  # -inf and underflow: 0
    assert got[1] == np.inf and got[5] == np.inf and got[6] == np.inf
    assert np.isnan(got[2]) and np.isnan(got[7])


@njit
def _widen_all(bits, kind, out):
    for i in range(bits.shape[0]):
        out[i] = widen16(bits[i], kind)


def test_widen16_is_exact_for_every_float16_pattern():
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(1 << 16, np.float32)
    _widen_all(bits, 0, got)
    want = bits.view(np.float16).astype(np.float32)
    finite = ~np.isnan(want)
    # every number, subnormals, zeros (signed) and infinities bit for bit; NaN stays NaN
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    assert np.isnan(got[~finite]).all()


def test_widen16_is_exact_for_every_bfloat16_pattern():
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(1 << 16, np.float32)
    _widen_all(bits, 1, got)
    assert np.array_equal(got.view(np.uint32), bits.astype(np.uint32) << 16)


def test_kind16_reads_the_format_off_the_widening_table():
    assert kind16(widen_table(np.dtype(np.float16))) == 0
    assert kind16(widen_table(resolve_dtype("bfloat16"))) == 1
    assert kind16(widen_table(np.dtype(np.float32))) == -1


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_the_widening_table_is_shared_and_read_only(name):
    table = widen_table(resolve_dtype(name))
    assert table is widen_table(resolve_dtype(name))
    with pytest.raises(ValueError, match="read-only"):
        table[0x3C00] = 0.0
    assert table[0x3C00] == (1.0 if name == "float16" else np.uint32(0x3C00 << 16).view(np.float32))


@njit
def _touch(a, i, j):
    prefetch(a, i, j)
    return a[0, 0]


def test_prefetch_is_a_hint_that_never_faults_or_writes():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    before = a.copy()
    for i, j in [(0, 0), (2, 3), (3, 0), (-1, 0), (10**6, 10**6)]:  # past the end too
        assert _touch(a, i, j) == 0.0
    assert _touch(a[:, ::2], 1, 1) == 0.0  # a strided view
    assert np.array_equal(a, before)


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(5 * 128, dtype=np.float32).reshape(5, 128),
        lambda: np.arange(3 * 40, dtype=np.uint16).reshape(3, 40),  # a row ends mid-line
        lambda: np.arange(3 * 9, dtype=np.uint8).reshape(3, 9),  # shorter than a line
        lambda: np.arange(6 * 4 * 32, dtype=np.float32).reshape(6, 4, 32)[:, 2],  # "nhd"
        lambda: np.arange(64, dtype=np.float32).reshape(8, 8)[:, ::2],  # strided elements
        lambda: np.zeros((4, 0), np.float32),  # rows of nothing: no byte to read
        lambda: np.zeros((0, 16), np.float32),
        lambda: np.arange(4 * 16, dtype=np.float32).reshape(4, 16)[1:2],  # inside a buffer
    ],
)
def test_touch_rows_reads_every_row_and_writes_nothing(make):
    x = make()
    before = x.copy()
    touch_rows(x)
    assert np.array_equal(x, before)


@njit  # not cached, so that its IR can be read (touch_rows' own is cached)
def _touch_line(x):
    for t in range(x.shape[0]):
        touch(x, t, 0)


def test_touch_loads_are_kept():
    # atomic loads whose values are dropped: the optimiser may not delete them (a plain
    # load would be, and touch_rows would do nothing)
    _touch_line(np.zeros((2, 32), np.float32))
    text = "".join(_touch_line.inspect_llvm().values())
    assert len(re.findall(r"load atomic i8, ptr [^,]+ monotonic", text)) >= 1, text[-2000:]


@njit
def _accumulate_ahead(s, vb, acc):
    accumulate_rows(s, 0, vb, vb.shape[0], acc, 0, -1, 64)


def _prefetch_calls(ir_text):
    call = r"call void @llvm\.prefetch\.p0\(ptr [^,]+, i32 (\d+), i32 (\d+), i32 (\d+)\)"
    return re.findall(call, ir_text)


def test_both_prefetch_paths_emit_the_one_hint_locality():
    # the scalar kernels' intrinsic and the vector-IR accumulate share prefetch_ir, so a
    # change of PREFETCH_LOCALITY reaches both (each was once written out on its own)
    a = np.zeros((4, 16), np.float32)
    _touch(a, 1, 0)
    acc = np.zeros((4, 128), np.float32)
    _accumulate_ahead(np.ones((4, 8), np.float32), np.ones((8, 128), np.float32), acc)
    for fn in (_touch, _accumulate_ahead):
        calls = [c for ir_text in fn.inspect_llvm().values() for c in _prefetch_calls(ir_text)]
        assert calls, f"{fn.__name__}: no llvm.prefetch call"
        assert set(calls) == {("0", str(PREFETCH_LOCALITY), "1")}, calls


def _chunked_cases():
    """(group, n_q, seq_len, head_dim, window, causal, dtype): prefill chunks that span
    one, several and a partial last query chunk (``_CHUNK_ROWS // group`` queries each),
    blocks not a multiple of the block size, windows inside a chunk and across it."""
    rows = cpu_attention._CHUNK_ROWS
    return [
        (4, rows // 4 * 3 + 5, 300, 72, 0, True, "float32"),
        (1, rows + 1, 200, 16, 0, True, "float32"),
        (8, 40, 130, 128, 0, True, "float16"),
        (3, 70, 150, 7, 50, True, "bfloat16"),
        (4, 33, 65, 32, 20, False, "float32"),
        (2, 100, 100, 24, 0, True, "float64"),
        (4, 1, 1000, 128, 0, True, "float16"),  # a decode step
        (5, 64, 129, 40, 3, True, "float32"),
    ]


@pytest.mark.parametrize("group,n_q,seq_len,head_dim,window,causal,dtype", _chunked_cases())
@pytest.mark.parametrize("parallel", [True, False])
def test_chunked_prefill_matches_the_reference(
    rng, group, n_q, seq_len, head_dim, window, causal, dtype, parallel
):
    dt = resolve_dtype(dtype)
    kv_heads, batch = 2, 2
    k = rng.standard_normal((batch, kv_heads, seq_len, head_dim)).astype(dt)
    v = rng.standard_normal((batch, kv_heads, seq_len, head_dim)).astype(dt)
    acc = np.float64 if dt == np.float64 else np.float32
    q = rng.standard_normal((batch, kv_heads * group, n_q, head_dim)).astype(acc)
    out = np.full_like(q, np.nan)
    kernel = cpu_attention.attend if parallel else cpu_attention.attend_serial
    kd = kernel_dtype(dt)
    scale = 1 / math.sqrt(head_dim)
    kernel(q, k.view(kd), v.view(kd), seq_len, scale, causal, window, widen_table(dt), out)
    want = reference.attention(
        q, k.astype(np.float64), v.astype(np.float64), causal=causal, window=window or None
    )
    np.testing.assert_allclose(out, want, rtol=0, atol=3e-5 if acc == np.float32 else 1e-12)


def test_attention_through_the_api_uses_the_same_chunked_kernel(rng):
    cache = nbkv.LayerKVCache(256, batch=1, num_kv_heads=2, head_dim=64, dtype="float16")
    k = rng.standard_normal((1, 2, 200, 64)).astype(np.float16)
    v = rng.standard_normal((1, 2, 200, 64)).astype(np.float16)
    cache.append(k, v)
    q = rng.standard_normal((1, 8, 90, 64)).astype(np.float32)
    want = reference.attention(q, k.astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(nbkv.attention(q, cache), want, rtol=0, atol=3e-5)


@pytest.mark.parametrize("seed", range(6))
def test_prefetching_ahead_leaves_scores_and_sums_bit_identical(seed):
    # the score and value loops prefetch ``ahead`` rows past the one they compute (past
    # the block's end too): the arithmetic must not change by a bit, for every row count
    # (the 4-row passes and the rows left over), every block length (the 4- and 8-position
    # passes and the positions left over) and every storage dtype
    rng = np.random.default_rng(seed)
    for _ in range(8):
        rows = int(rng.integers(1, 11))
        nb = int(rng.integers(1, 70))
        dim = int(rng.choice([3, 16, 48, 64, 128]))  # 48: a 16-bit tile's lines, then a pass
        ahead = int(rng.choice([1, 7, 64, 1000, -1, -1000]))  # < 0: a paged kernel's page
        qs = rng.standard_normal((rows, dim)).astype(np.float32)
        w = rng.random((rows, nb)).astype(np.float32)
        block = rng.standard_normal((nb + 5, dim)).astype(np.float32)  # rows after the block
        for name in ("float32", "float16", "bfloat16"):
            dtype = resolve_dtype(name)
            stored = block.astype(dtype).view(kernel_dtype(dtype)) if name != "float32" else block
            kind = kind16(widen_table(dtype))
            kb = stored[:nb]
            got_s, want_s = np.zeros((rows, nb), np.float32), np.zeros((rows, nb), np.float32)
            cpu_attention._scores(qs, kb, got_s, 0, kind, ahead)
            cpu_attention._scores(qs, kb, want_s, 0, kind, 0)
            np.testing.assert_array_equal(got_s, want_s)
            acc0 = rng.standard_normal((rows, dim)).astype(np.float32)
            got_a, want_a = acc0.copy(), acc0.copy()
            cpu_attention._accumulate(w, kb, got_a, 0, kind, ahead)
            cpu_attention._accumulate(w, kb, want_a, 0, kind, 0)
            np.testing.assert_array_equal(got_a, want_a)
            np.testing.assert_array_equal(stored[:nb], kb)  # a hint writes nothing
