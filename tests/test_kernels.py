"""The CPU kernels against nbkv.reference, called directly and from a user's @njit code."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from nbkv import reference
from nbkv.kernels import write_cache, write_cache_bshd, write_kv, write_kv_bshd

from conftest import LAYOUTS, cpu_only, randn, shape_of

pytestmark = cpu_only

WRITE_KV = {"bhsd": write_kv, "bshd": write_kv_bshd}
WRITE_CACHE = {"bhsd": write_cache, "bshd": write_cache_bshd}
SEQ = {"bhsd": 2, "bshd": 1}


def kernel_form(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("batch,heads,head_dim", [(1, 1, 1), (2, 3, 5), (1, 8, 128)])
@pytest.mark.parametrize("pos,n", [(0, 1), (3, 7), (0, 12), (2, 40)])  # 40: prefill-sized
def test_write_kv_matches_reference_and_touches_nothing_else(
    rng, layout, dtype, batch, heads, head_dim, pos, n
):
    cap = 12 if pos + n <= 12 else pos + n
    k_cache = randn(rng, shape_of(layout, batch, heads, cap, head_dim), dtype)
    v_cache = randn(rng, shape_of(layout, batch, heads, cap, head_dim), dtype)
    k = randn(rng, shape_of(layout, batch, heads, n, head_dim), dtype)
    v = randn(rng, shape_of(layout, batch, heads, n, head_dim), dtype)
    want_k, want_v = k_cache.copy(), v_cache.copy()
    index = [slice(None)] * 4
    index[SEQ[layout]] = slice(pos, pos + n)
    want_k[tuple(index)], want_v[tuple(index)] = k, v
    WRITE_KV[layout](
        kernel_form(k), kernel_form(v), pos, kernel_form(k_cache), kernel_form(v_cache)
    )
    np.testing.assert_array_equal(kernel_form(k_cache), kernel_form(want_k))
    np.testing.assert_array_equal(kernel_form(v_cache), kernel_form(want_v))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_cache_reads_transposed_and_reversed_views(rng, layout):
    other = "bshd" if layout == "bhsd" else "bhsd"
    x = randn(rng, shape_of(other, 2, 3, 4, 6), "float32").transpose(0, 2, 1, 3)[..., ::-1]
    cache = randn(rng, shape_of(layout, 2, 3, 9, 6), "float32")
    K, _ = reference.empty_kv(2, 3, 6, np.float32, layout)
    WRITE_CACHE[layout](x, 0, cache)
    index = [slice(None)] * 4
    index[SEQ[layout]] = slice(0, 4)
    np.testing.assert_array_equal(cache[tuple(index)], reference.append(K, K, x, x, layout)[0])


def test_a_user_njit_decode_loop_calls_the_kernels(rng):
    @njit
    def decode(ks, vs, k_cache, v_cache, start):
        # a user's decode loop: one position per step, inside compiled code
        pos = start
        for t in range(ks.shape[2]):
            write_kv(ks[:, :, t : t + 1], vs[:, :, t : t + 1], pos, k_cache, v_cache)
            pos += 1
        return pos

    ks, vs = randn(rng, (2, 4, 10, 16), "float32"), randn(rng, (2, 4, 10, 16), "float32")
    k_cache = randn(rng, (2, 4, 32, 16), "float32")
    v_cache = randn(rng, (2, 4, 32, 16), "float32")
    before = k_cache.copy()
    assert decode(ks, vs, k_cache, v_cache, 3) == 13
    np.testing.assert_array_equal(k_cache[:, :, 3:13], ks)
    np.testing.assert_array_equal(v_cache[:, :, 3:13], vs)
    np.testing.assert_array_equal(k_cache[:, :, :3], before[:, :, :3])
    np.testing.assert_array_equal(k_cache[:, :, 13:], before[:, :, 13:])


def test_user_njit_code_can_fill_a_cache_from_get_kv_buffers(rng):
    """A pipeline can hand an nbkv cache's own buffers to compiled code."""
    import nbkv

    cache = nbkv.LayerKVCache(8, batch=1, num_kv_heads=2, head_dim=4, dtype="float32")
    k = randn(rng, (1, 2, 8, 4), "float32")
    cache.append(k, k)  # fills the capacity; get_kv now views the whole buffers
    K, V = cache.get_kv()
    new = randn(rng, (1, 2, 2, 4), "float32")

    @njit
    def overwrite(new, k_cache, v_cache):
        write_kv(new, new, 6, k_cache, v_cache)

    overwrite(new, K, V)
    np.testing.assert_array_equal(cache.get_kv()[0][:, :, 6:], new)
