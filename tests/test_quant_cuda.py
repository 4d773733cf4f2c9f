"""The quantized cache's CUDA kernels (nbkv.kernels.cuda_quant) against their CPU twins
(nbkv.kernels.cpu_quant), on fresh random data, under the simulator (or a GPU): codes,
scales, zero points and window bit for bit after every append, dequantize bit for bit,
attention within float32 tolerance; and nbkv.quant_cuda.CUDAQuant, the launcher.

Storages are filled by the CPU kernels themselves, one append at a time, with the
quantized cache's rule for how many positions leave the window.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import DEVICE, dtype_of

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA kernels: the simulator or a GPU")

if DEVICE == "cuda":
    from numba import cuda

    from nbkv.backends import get_backend
    from nbkv.dtypes import widen_table
    from nbkv.kernels import cpu_quant, cuda_quant
    from nbkv.quant_cuda import CUDAQuant

ATOL = {"float32": 2e-5, "float16": 2e-5, "bfloat16": 2e-5}  # float32 accumulation


class Layer:
    """One quantized layer's sizes, its storage on the host (the CPU kernels') and on the
    device (the CUDA kernels'), both starting from the same random bytes."""

    def __init__(self, rng, *, batch=1, heads=2, dim=6, max_seq_len=24, group=4, residual=3,
                 bits=(4, 4), dtype="float32"):  # fmt: skip
        self.rng, self.batch, self.heads, self.dim = rng, batch, heads, dim
        self.group, self.residual, self.bits = group, residual, bits
        self.dtype = dtype_of(dtype)
        self.wide = self.dtype.itemsize == 2
        self.kind = 1 if self.wide and self.dtype != np.float16 else 0
        self.v_group = min(group, dim)
        n_groups = max_seq_len // group
        self.w = max(1, min(max_seq_len, residual + group - 1))
        k_row, v_row = (-(-dim // (8 // b)) for b in bits)
        coded = n_groups * group
        n_c = dim // self.v_group
        wd = np.uint16 if self.wide else np.float32
        shapes = [
            ((batch, heads, coded, k_row), np.uint8),
            ((batch, heads, n_groups, dim), np.uint16),
            ((batch, heads, n_groups, dim), np.uint16),
            ((batch, heads, coded, v_row), np.uint8),
            ((batch, heads, coded, n_c), np.uint16),
            ((batch, heads, coded, n_c), np.uint16),
            ((batch, heads, self.w, dim), wd),
            ((batch, heads, self.w, dim), wd),
        ]
        # random bytes, never zeros: they would hide what a kernel failed to write
        self.host = [rng.integers(1, 255, s, dtype=np.uint8).view(np.uint8).astype(t) for s, t in
                     shapes]  # fmt: skip
        self.host[6][...] = self.kernel_form(self.values((batch, heads, self.w, dim)))
        self.host[7][...] = self.kernel_form(self.values((batch, heads, self.w, dim)))
        self.dev = [cuda.to_device(a) for a in self.host]
        scale_dtype = np.dtype(np.float16) if self.kind == 0 else self.dtype
        self.table = widen_table(scale_dtype)
        self.d_table = cuda.to_device(self.table)
        self.held = self.q_len = 0

    def values(self, shape):
        x = self.rng.standard_normal(shape) * 3 + 0.5
        return x.astype(self.dtype)

    def kernel_form(self, x):
        return x.view(np.uint16) if self.wide else x

    def next_q(self, total):
        g = self.group
        return self.q_len + g * max(0, (total - self.q_len - self.residual) // g)

    def append(self, n, layout="bhsd"):
        """n new positions through both kernels; returns (new_q, the new rows)."""
        b, h, d = self.batch, self.heads, self.dim
        k = self.kernel_form(self.values((b, h, n, d)))
        v = self.kernel_form(self.values((b, h, n, d)))
        new_q = self.next_q(self.held + n)
        args = (self.held, self.q_len, new_q, *self.bits, self.group, self.v_group, self.kind)
        cpu_quant.quant_append(k, v, *args, self.table, *self.host)
        if layout == "bshd":  # the kernel reads [batch, n, heads, head_dim]
            dk = cuda.to_device(np.ascontiguousarray(k.transpose(0, 2, 1, 3)))
            dv = cuda.to_device(np.ascontiguousarray(v.transpose(0, 2, 1, 3)))
            kernel = cuda_quant.quant_append_bshd_kernel
        else:
            dk, dv = cuda.to_device(k), cuda.to_device(v)
            kernel = cuda_quant.quant_append_kernel
        splits = max(1, (new_q - self.q_len) // self.group)
        kernel[(b * h, splits), cuda_quant.THREADS](dk, dv, *args, self.d_table, *self.dev)
        self.held, self.q_len = self.held + n, new_q
        return new_q

    def assert_same_storage(self):
        names = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_win", "v_win")
        for name, want, got in zip(names, self.host, self.dev, strict=True):
            got = got.copy_to_host()
            if name == "k_win" or name == "v_win":  # only the rows the window holds
                slots = [p % self.w for p in range(self.q_len, self.held)]
                want, got = want[:, :, slots], got[:, :, slots]
            else:  # the coded positions' rows (K's scales: one row a group)
                rows = self.q_len // self.group if name in ("k_scale", "k_zero") else self.q_len
                want, got = want[:, :, :rows], got[:, :, :rows]
            np.testing.assert_array_equal(got, want, err_msg=name)


# group sizes 1, 4, 5, 64; head_dim odd or not a multiple of a byte's codes (a multiple of
# V's channel group min(group, head_dim), as the cache requires); pairs of bits
CONFIGS = [
    dict(dim=12, group=4, residual=3, bits=(4, 8)),
    dict(dim=5, group=1, residual=2, bits=(2, 8), max_seq_len=12),
    dict(dim=5, group=5, residual=0, bits=(8, 2), max_seq_len=23),
    dict(dim=7, group=64, residual=2, bits=(4, 2), max_seq_len=130),
    dict(dim=3, group=4, residual=4, bits=(2, 4), heads=1, batch=2),
]
IDS = ["g4-d12-b48", "g1-d5-b28", "g5-d5-b82", "g64-d7-b42", "g4-d3-b24-batch2"]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_appends_give_the_cpu_kernels_codes_scales_and_window_bit_for_bit(rng, config, dtype):
    layer = Layer(rng, dtype=dtype, **config)
    g = layer.group
    # a prefill crossing several groups, then one position at a time across a group edge
    steps = [min(2 * g + 3, layer.host[0].shape[2] - g)] + [1] * (g + 2)
    for n in steps:
        if layer.held + n > layer.host[0].shape[2]:
            break
        layer.append(n)
        layer.assert_same_storage()
    assert layer.q_len >= g  # codes were written, not only the window


@pytest.mark.parametrize("bits", [(8, 8), (4, 2)])
def test_a_bshd_append_matches_the_cpu_kernel(rng, bits):
    layer = Layer(rng, dim=6, group=2, residual=3, bits=bits, max_seq_len=40, heads=3)
    for n in (9, 1, 1, 1, 13):
        layer.append(n, layout="bshd")
        layer.assert_same_storage()


def test_an_append_of_more_than_the_window_writes_only_what_stays(rng):
    """n far past W: most new positions go straight to codes; the ring keeps the last."""
    layer = Layer(rng, dim=4, group=4, residual=1, bits=(4, 4), max_seq_len=64)
    layer.append(3)
    layer.append(30)  # a ring slot's old row (position 0) is read by group 0 as it is reused
    layer.assert_same_storage()
    layer.append(1)
    layer.assert_same_storage()


def _dequantized(layer, p0, p1, layout, kernel_cpu=True):
    b, h, d = layer.batch, layer.heads, layer.dim
    wd = np.uint16 if layer.wide else np.float32
    args = (layer.q_len, p0, p1, *layer.bits, layer.kind)
    k_out, v_out = np.zeros((b, h, p1 - p0, d), wd), np.zeros((b, h, p1 - p0, d), wd)
    cpu_quant.dequantize(*layer.host, *args, layer.table, k_out, v_out)
    shape = (b, h, p1 - p0, d) if layout == "bhsd" else (b, p1 - p0, h, d)
    dk, dv = cuda.device_array(shape, wd), cuda.device_array(shape, wd)
    kernel = cuda_quant.dequantize_kernel if layout == "bhsd" else cuda_quant.dequantize_bshd_kernel
    kernel[4, 64](*layer.dev, *args, layer.d_table, dk, dv)
    got_k, got_v = dk.copy_to_host(), dv.copy_to_host()
    if layout == "bshd":
        got_k, got_v = got_k.transpose(0, 2, 1, 3), got_v.transpose(0, 2, 1, 3)
    return (k_out, v_out), (got_k, got_v)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("config", CONFIGS[:4], ids=IDS[:4])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dequantize_gives_the_cpu_kernels_values_bit_for_bit(rng, config, dtype, layout):
    layer = Layer(rng, dtype=dtype, **config)
    layer.append(min(3 * layer.group + 2, layer.host[0].shape[2]))
    for p0, p1 in [(0, layer.held), (1, layer.q_len), (layer.q_len - 1, layer.held)]:
        if p1 > p0 >= 0:
            want, got = _dequantized(layer, p0, p1, layout)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])


def _attend_both(layer, num_heads, n_q, causal, window, seq_len=None, q_dtype=np.float32):
    seq_len = layer.held if seq_len is None else seq_len
    q = (layer.rng.standard_normal((layer.batch, num_heads, n_q, layer.dim))).astype(q_dtype)
    scale = layer.dim**-0.5
    args = (layer.q_len, seq_len, *layer.bits, scale, causal, window)
    want = np.zeros(q.shape, np.float32)
    cpu_quant.attend_quant_serial(q.astype(np.float32), *layer.host, *args, layer.table, want)
    out = cuda.device_array(q.shape, q_dtype)
    chunks = -(-(num_heads // layer.heads) * n_q // cuda_quant.ROWS)
    cuda_quant.attend_quant_kernel[(layer.batch * layer.heads, chunks), cuda_quant.THREADS](
        cuda.to_device(q), *layer.dev, *args[:4], np.float32(scale), causal, window,
        layer.d_table, out,
    )  # fmt: skip
    return want, out.copy_to_host()


ATTEND = [  # (group, n_q, causal, window): decode, prefill chunks, windows, no causal mask
    (1, 1, True, 0),
    (4, 1, True, 0),
    (4, 5, True, 0),  # 20 rows: two chunks of query rows
    (1, 3, True, 3),
    (4, 2, False, 0),
    (4, 3, False, 5),
]


@pytest.mark.parametrize("group,n_q,causal,window", ATTEND)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_over_codes_matches_the_cpu_kernel(rng, dtype, group, n_q, causal, window):
    layer = Layer(rng, dim=8, group=4, residual=3, bits=(4, 2), dtype=dtype, max_seq_len=40)
    layer.append(19)  # 16 positions in codes (4 groups), 3 in the window
    assert (layer.q_len, layer.held) == (16, 19)
    want, got = _attend_both(layer, layer.heads * group, n_q, causal, window)
    np.testing.assert_allclose(got, want, atol=ATOL[dtype], rtol=1e-5)


@pytest.mark.parametrize("held", [5, 10])
def test_attention_over_the_window_alone_or_codes_alone(rng, held):
    """q_len = 0 (every position in the window), and seq_len == q_len (none in it)."""
    layer = Layer(rng, dim=5, group=5, residual=10, bits=(8, 4), max_seq_len=32)
    layer.append(held)
    assert layer.q_len == 0
    want, got = _attend_both(layer, 4, 2, True, 0)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    layer = Layer(rng, dim=5, group=5, residual=0, bits=(8, 4), max_seq_len=32)
    layer.append(held)
    assert layer.q_len == layer.held == held  # whole groups, nothing left in the window
    want, got = _attend_both(layer, 4, 1, True, 0)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


# the simulator runs the kernel as NumPy scalars, which warn of inf - inf
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_and_infinite_queries_give_the_cpu_kernels_nan_rows(rng):
    """An infinite query makes scores +-inf (NaN against a zero channel), a NaN query NaN
    ones: the rows are NaN on both devices, as IEEE arithmetic says; the others agree."""
    layer = Layer(rng, dim=4, group=4, residual=2, bits=(4, 4), max_seq_len=16)
    layer.append(7)
    q = rng.standard_normal((1, 4, 2, 4)).astype(np.float32)
    q[0, 1, 0, 2] = -np.inf
    q[0, 2, 1, 0] = np.nan
    args = (layer.q_len, layer.held, *layer.bits)
    want = np.zeros(q.shape, np.float32)
    cpu_quant.attend_quant_serial(q, *layer.host, *args, 0.5, True, 0, layer.table, want)
    out = cuda.device_array(q.shape, np.float32)
    cuda_quant.attend_quant_kernel[(2, 1), cuda_quant.THREADS](
        cuda.to_device(q), *layer.dev, *args, np.float32(0.5), True, 0, layer.d_table, out
    )
    got = out.copy_to_host()
    assert np.isnan(want[0, 2, 1]).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], atol=2e-5)


def test_narrow16_on_the_device_is_the_cpu_one_bit_for_bit():
    specials = [0.0, -0.0, 1.0, -1.5, 65504.0, 65520.0, 1e6, 6e-8, 3e-8, 2.98e-8, 1e-10,
                np.inf, -np.inf, np.nan, 1.0009765625, 1.00048828125, 2049.0, 2051.0,
                6.103515625e-05, 6.09e-05, 3.4e38, -1.17549435e-38]  # fmt: skip
    rng = np.random.default_rng(7)
    wild = np.concatenate([rng.standard_normal(64) * 10 ** rng.uniform(-9, 6, 64),
                           rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
                           .view(np.float32)])  # fmt: skip
    x = np.concatenate([np.array(specials, np.float32), wild.astype(np.float32)])

    @cuda.jit
    def narrow_all(x, out):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[0, i] = cuda_quant.narrow16(x[i], 0)
            out[1, i] = cuda_quant.narrow16(x[i], 1)

    out = cuda.device_array((2, x.size), np.uint16)
    narrow_all[-(-x.size // 32), 32](cuda.to_device(x), out)
    got = out.copy_to_host()
    want = np.array([[cpu_quant.narrow16(v, kind) for v in x] for kind in (0, 1)], np.uint16)
    np.testing.assert_array_equal(got, want)
    # and both are NumPy's / ml_dtypes' rounding (NaN payloads aside)
    finite = np.isfinite(x)
    with np.errstate(over="ignore"):  # past 65504: inf, as narrow16 gives
        f16 = x[finite].astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got[0, finite], f16)
    bf16 = dtype_of("bfloat16")
    np.testing.assert_array_equal(got[1, finite], x[finite].astype(bf16).view(np.uint16))


# -- CUDAQuant: the launcher ---------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_the_launcher_appends_dequantizes_and_attends_as_the_kernels(rng, layout):
    layer = Layer(rng, dim=8, group=4, residual=2, bits=(4, 8), max_seq_len=32)
    qb = CUDAQuant(get_backend("cuda", layout))
    twin = [cuda.to_device(a) for a in layer.host]  # the launcher's storage
    from nbkv.quant_backends import QStorage

    st = QStorage(*twin)
    for n in (6, 1, 4):
        k = layer.values((1, 2, n, 8))
        v = layer.values((1, 2, n, 8))
        new_q = layer.next_q(layer.held + n)
        args = (layer.held, layer.q_len, new_q, layer.bits, layer.group, layer.v_group)
        cpu_quant.quant_append(k, v, *args[:3], *layer.bits, *args[4:], layer.kind, layer.table,
                               *layer.host)  # fmt: skip
        if layout == "bshd":
            k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v))
        qb.append(cuda.to_device(k), cuda.to_device(v), *args, layer.kind, layer.d_table, st)
        layer.held, layer.q_len = layer.held + n, new_q
    layer.dev = twin
    layer.assert_same_storage()
    # dequantize into the layout's arrays
    shape = (1, 2, layer.held, 8) if layout == "bhsd" else (1, layer.held, 2, 8)
    dk, dv = cuda.device_array(shape, np.float32), cuda.device_array(shape, np.float32)
    qb.dequantize(st, layer.q_len, 0, layer.held, layer.bits, 0, layer.d_table, dk, dv, layout)
    k_out, v_out = (np.zeros((1, 2, layer.held, 8), np.float32) for _ in "kv")
    cpu_quant.dequantize(*layer.host, layer.q_len, 0, layer.held, *layer.bits, 0, layer.table,
                         k_out, v_out)  # fmt: skip
    got_k = dk.copy_to_host()
    got_k = got_k if layout == "bhsd" else got_k.transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(got_k, k_out)
    # attention, float64 queries in and out
    q = rng.standard_normal((1, 8, 2, 8))
    out = cuda.device_array(q.shape, np.float64)
    qb.attend(cuda.to_device(q), st, layer.q_len, layer.held, layer.bits, 0.4, True, 0,
              layer.d_table, out)  # fmt: skip
    want = np.zeros(q.shape, np.float32)
    cpu_quant.attend_quant_serial(q.astype(np.float32), *layer.host, layer.q_len, layer.held,
                                  *layer.bits, 0.4, True, 0, layer.table, want)  # fmt: skip
    np.testing.assert_allclose(out.copy_to_host(), want, atol=2e-5, rtol=1e-5)
    # copy_row: row 0 of every array into row 1 of a batch-2 storage
    dst = [cuda.to_device(np.zeros((2, *a.shape[1:]), a.dtype)) for a in layer.host]
    for a, b in zip(st, dst, strict=True):
        qb.copy_row(a, 0, b, 1)
    for a, b in zip(layer.host, dst, strict=True):
        got = b.copy_to_host()
        np.testing.assert_array_equal(got[1], a[0])
        assert not got[0].any()


def test_the_launcher_refuses_a_head_dim_past_the_kernels_limit(rng):
    from nbkv import InvalidArgumentError
    from nbkv.quant_backends import QStorage

    dim = cuda_quant.MAX_HEAD_DIM + 1
    layer = Layer(rng, dim=dim, group=dim, residual=1, bits=(8, 8), max_seq_len=dim, heads=1)
    qb = CUDAQuant(get_backend("cuda", "bhsd"))
    q = cuda.to_device(np.zeros((1, 1, 1, dim), np.float32))
    out = cuda.device_array((1, 1, 1, dim), np.float32)
    with pytest.raises(InvalidArgumentError, match=f"head_dim {dim}"):
        qb.attend(q, QStorage(*layer.dev), 0, 1, (8, 8), 1.0, True, 0, layer.d_table, out)
