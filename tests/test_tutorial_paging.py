"""nbkv.tutorial.paging: what notebook 06 calls."""

from __future__ import annotations

import numpy as np
import pytest

import nbkv
from nbkv.tutorial import paging

from conftest import cpu_only

pytestmark = cpu_only


def test_pool_map_sees_owners_sharing_fill_and_cached_blocks():
    cache = nbkv.PagedKVCache(
        8, 2, num_kv_heads=1, head_dim=2, dtype="float32", prefix_caching=True
    )
    a = cache.add()
    step = cache.reserve({a: np.array([1, 2, 3])})
    cache.write(0, step, np.zeros((3, 1, 2), np.float32), np.zeros((3, 1, 2), np.float32))
    f = cache.fork(a)
    m = paging.pool_map(cache)
    assert m.owner[:2].tolist() == [a, a] and m.refs[:2].tolist() == [2, 2]
    assert m.fill[:2].tolist() == [2, 1] and (m.owner[2:] == paging.FREE).all()
    cache.free(a)
    cache.free(f)
    m = paging.pool_map(cache)
    assert m.owner[0] == paging.CACHED and m.owner[1] == paging.FREE  # only full blocks keyed


def test_draw_pool_draws_every_block():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cache = nbkv.PagedKVCache(10, 4, num_kv_heads=1, head_dim=2, dtype="float32")
    cache.fork(cache.add())
    cache.reserve({0: 6})
    fig, ax = plt.subplots()
    paging.draw_pool(ax, cache, "a pool", per_row=5)
    assert len(ax.patches) >= cache.num_blocks and ax.get_title() == "a pool"
    plt.close(fig)


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("grow_by", [None, 3])
def test_paged_copy_holds_the_batch_and_ends_with_a_decode_step(layout, grow_by):
    rng = np.random.default_rng(0)
    K = rng.standard_normal((3, 2, 11, 4)).astype(np.float32)
    V = rng.standard_normal((3, 2, 11, 4)).astype(np.float32)
    cache, step = paging.paged_copy(K, V, 4, grow_by=grow_by, layout=layout)
    assert step.seq_lens.tolist() == [11, 11, 11] and step.num_tokens == 3
    for s in range(3):
        k, v = cache.get_kv(0, s)
        np.testing.assert_array_equal(k, K[s])
        np.testing.assert_array_equal(v, V[s])
    q = rng.standard_normal((3, 4, 4)).astype(np.float32)
    want = nbkv.attention(q[:, :, None], (K, V))[:, :, 0]
    np.testing.assert_allclose(nbkv.paged_attention(q, cache, 0, step), want, atol=1e-6)


@pytest.mark.parametrize("grow_by", [None, 3])
def test_paged_copy_can_end_with_a_prefill_step(grow_by):
    rng = np.random.default_rng(1)
    K = rng.standard_normal((2, 2, 11, 4)).astype(np.float32)
    V = rng.standard_normal((2, 2, 11, 4)).astype(np.float32)
    cache, step = paging.paged_copy(K, V, 4, grow_by=grow_by, new=5)
    assert step.host("q_indptr").tolist() == [0, 5, 10] and step.seq_lens.tolist() == [11, 11]
    for s in range(2):
        np.testing.assert_array_equal(cache.get_kv(0, s)[0], K[s])
        np.testing.assert_array_equal(cache.get_kv(0, s)[1], V[s])
    q = rng.standard_normal((10, 4, 4)).astype(np.float32)
    want = nbkv.attention(q.reshape(2, 5, 4, 4).transpose(0, 2, 1, 3), (K, V))
    got = nbkv.paged_attention(q, cache, 0, step).reshape(2, 5, 4, 4).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(got, want, atol=1e-6)
    for bad in (0, 12):
        with pytest.raises(nbkv.InvalidArgumentError, match=f"new must be 1 to seq_len.*{bad}"):
            paging.paged_copy(K, V, 4, new=bad)


def test_request_lengths_are_checked():
    with pytest.raises(nbkv.InvalidArgumentError):
        paging.request_lengths(0, median=10, sigma=1.0, cap=5)
    x = paging.request_lengths(500, median=50, sigma=2.0, cap=300, seed=1)
    assert x.min() >= 1 and x.max() <= 300 and abs(np.median(x) - 50) < 15
