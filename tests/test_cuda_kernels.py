"""The specialised CUDA attention and append kernels (the simulator, or a GPU) against
nbkv.reference in float64, at the edges of their specialisations, and the backend's
launch plans: made once per signature, reused, allocating nothing when ``out=`` is given.

Small shapes and few launches: the simulator runs every thread in Python.
"""

from __future__ import annotations

import numpy as np
import pytest

import nbkv
from nbkv import reference

from conftest import DEVICE, dtype_of, host, randn, shape_of

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="launches CUDA kernels")

# |nbkv - float64 reference| for float32 queries: float32 arithmetic throughout
TOL = 3e-5

# (group, head_dim, seq_len before, new positions, n_q, window, layout, dtype, splits)
CASES = [
    (1, 72, 0, 1, 1, None, "bhsd", "float16", None),  # seq_len 1; head_dim not 2**k
    (4, 96, 44, 1, 1, None, "bshd", "bfloat16", None),  # 45 held: past one tile, not two
    (8, 72, 60, 3, 3, 20, "bhsd", "float32", 3),  # a window, forced splits, prefill rows
    (4, 16, 30, 3, 3, 2, "bshd", "float16", None),  # new positions before the window
    (4, 6, 39, 1, 1, None, "bhsd", "float64", 5),  # float64 storage, 5 splits to combine
]


def _cache(rng, layout, dtype, kv_heads, head_dim, held, cap):
    cache = nbkv.LayerKVCache(
        cap, batch=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=DEVICE,
        layout=layout,
    )  # fmt: skip
    shape = shape_of(layout, 1, kv_heads, held, head_dim)
    K, V = randn(rng, shape, dtype), randn(rng, shape, dtype)
    if held:
        cache.append(K, V)
    return cache, K, V


@pytest.mark.parametrize("group, dim, held, n, n_q, window, layout, dtype, splits", CASES)
def test_fused_append_attend_matches_the_reference_and_writes_every_row(
    rng, group, dim, held, n, n_q, window, layout, dtype, splits
):
    kv_heads = 2
    cap = held + n + 5  # unused capacity after the write: it must stay untouched
    cache, K, V = _cache(rng, layout, dtype, kv_heads, dim, held, cap)
    k = randn(rng, shape_of(layout, 1, kv_heads, n, dim), dtype)
    v = randn(rng, shape_of(layout, 1, kv_heads, n, dim), dtype)
    q = randn(rng, (1, kv_heads * group, n_q, dim), "float32")
    with nbkv.override_tunables(ATTENTION_SPLITS=splits):
        got = host(nbkv.append_and_attend(q, k, v, cache, window=window))
    K2, V2 = reference.append(K, V, k, v, layout)
    want = reference.attention(q, K2, V2, window=window, layout=layout)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    # every row the fused kernel wrote, bit for bit (a fused path once left rows
    # unwritten while its output was right)
    held_k, held_v = cache.get_kv()
    want_dtype = dtype_of(dtype)
    for got_x, want_x in ((held_k, K2), (held_v, V2)):
        got_x = host(got_x, want_dtype)
        np.testing.assert_array_equal(
            np.ascontiguousarray(got_x).view(np.uint8), np.ascontiguousarray(want_x).view(np.uint8)
        )


@pytest.mark.parametrize("group, dim, held, n, n_q, window, layout, dtype, splits", CASES[1:3])
def test_attention_matches_the_reference(
    rng, group, dim, held, n, n_q, window, layout, dtype, splits
):
    kv_heads = 1
    cache, K, V = _cache(rng, layout, dtype, kv_heads, dim, held + n, held + n)
    q = randn(rng, (1, kv_heads * group, n_q, dim), "float32")
    with nbkv.override_tunables(ATTENTION_SPLITS=splits):
        got = host(nbkv.attention(q, cache, window=window))
    want = reference.attention(q, K, V, window=window, layout=layout)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the simulator
def test_nan_and_minus_inf_follow_ieee_through_the_split_combine(rng):
    K = np.abs(randn(rng, (1, 1, 40, 4), "float32"))
    V = randn(rng, (1, 1, 40, 4), "float32")
    K[0, 0, 3] = -np.inf  # weight 0: as if the position were absent
    q = np.abs(randn(rng, (1, 2, 1, 4), "float32"))
    cache = nbkv.LayerKVCache(
        40, batch=1, num_kv_heads=1, head_dim=4, dtype="float32", device=DEVICE
    )
    cache.append(K, V)
    with nbkv.override_tunables(ATTENTION_SPLITS=3):
        got = host(nbkv.attention(q, cache))
        want = reference.attention(q, np.delete(K, 3, axis=2), np.delete(V, 3, axis=2))
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
        K[0, 0, 30] = np.nan  # a NaN score: the row's output is NaN, in every split's combine
        cache.clear()
        cache.append(K, V)
        assert np.isnan(host(nbkv.attention(q, cache))).all()


def _backend_device():
    from nbkv.backends import get_backend

    return get_backend("cuda")._dev


def test_a_decode_step_reuses_its_plan_and_allocates_nothing_with_out(rng, monkeypatch):
    from numba import cuda

    cache, K, V = _cache(rng, "bhsd", "float16", 2, 8, 20, 24)
    q = cuda.to_device(randn(rng, (1, 8, 1, 8), "float32"))
    out = cuda.device_array(q.shape, np.float32)
    nbkv.attention(q, cache, out=out)  # the first call makes the plan
    plans = _backend_device().plans()
    before = dict(plans)
    made = []
    for name in ("device_array", "to_device", "device_array_like"):
        real = getattr(cuda, name)
        monkeypatch.setattr(
            cuda, name, lambda *a, _real=real, **k: made.append(a) or _real(*a, **k)
        )
    for _ in range(2):
        assert nbkv.attention(q, cache, out=out) is out
    assert made == []  # no output, no scratch, no table: everything came from the plan
    assert plans == before
    np.testing.assert_allclose(host(out), reference.attention(q.copy_to_host(), K, V), atol=TOL)


def test_the_row_copy_kernel_writes_rows_exactly_with_and_without_vectors(rng):
    from numba import cuda

    from nbkv.backends import get_backend
    from nbkv.kernels.cuda_vec import vector_width

    for layout in ("bhsd", "bshd"):
        be = get_backend("cuda", layout)
        cache = randn(rng, shape_of(layout, 2, 3, 9, 16), "float16")
        wide = randn(rng, shape_of(layout, 2, 3, 4, 17), "float16")
        aligned = cuda.to_device(np.ascontiguousarray(wide[..., :16]).view(np.uint16))
        misaligned = cuda.to_device(wide.view(np.uint16))[..., 1:]  # 2 bytes off
        assert vector_width(2, 16, (aligned,)) == 8
        assert vector_width(2, 16, (misaligned,)) == 1
        for src, new in ((aligned, wide[..., :16]), (misaligned, wide[..., 1:])):
            dk = cuda.to_device(cache.view(np.uint16))
            dv = cuda.to_device(cache.view(np.uint16))
            be.write_kv(src, src, 3, dk, dv)
            want = cache.copy()
            index = [slice(None)] * 4
            index[2 if layout == "bhsd" else 1] = slice(3, 7)
            want[tuple(index)] = new
            np.testing.assert_array_equal(dk.copy_to_host(), want.view(np.uint16))
            np.testing.assert_array_equal(dv.copy_to_host(), want.view(np.uint16))


def test_one_plan_serves_every_split_count_in_any_order(rng):
    # a plan keeps a launch per split count; each must run with its own grid and scratch
    # (the simulator configures a kernel in place: a kept launch once ran with the split
    # count configured last, past the end of its scratch)
    cache, K, V = _cache(rng, "bhsd", "float32", 2, 16, 100, 128)
    q = randn(rng, (1, 8, 1, 16), "float32")
    want = reference.attention(q, K, V)
    for splits in (1, 3, 2, None, 3, 1, None):
        with nbkv.override_tunables(ATTENTION_SPLITS=splits):
            got = host(nbkv.attention(q, cache))
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL, err_msg=f"splits={splits}")
