"""nbkv.tutorial.cuda: the hand-made flash-decoding launch of notebook 05 (a GPU or the
simulator), against the float64 reference and the backend's own launch."""

from __future__ import annotations

import numpy as np
import pytest

import nbkv
from nbkv import reference

from conftest import DEVICE, host, randn

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="launches a CUDA kernel")


@pytest.mark.parametrize("window, n_q, splits", [(None, 1, 3), (40, 5, 2), (None, 2, None)])
def test_the_hand_made_launch_is_the_backends(rng, window, n_q, splits):
    from nbkv.tutorial.cuda import launch_attention

    K = randn(rng, (1, 2, 100, 8), "float32")
    V = randn(rng, (1, 2, 100, 8), "float32")
    q = randn(rng, (1, 4, n_q, 8), "float32")
    run = launch_attention(q, K, V, window=window, splits=splits)
    np.testing.assert_allclose(run.out, reference.attention(q, K, V, window=window), atol=3e-5)
    assert (run.counters == 0).all()  # the last block of each task reset its counter
    assert run.part_stats.shape[3] == run.grid.splits
    cache = nbkv.LayerKVCache(
        100, batch=1, num_kv_heads=2, head_dim=8, dtype="float32", device=DEVICE
    )
    cache.append(K, V)
    with nbkv.override_tunables(ATTENTION_SPLITS=run.grid.splits):
        np.testing.assert_array_equal(host(nbkv.attention(q, cache, window=window)), run.out)


def test_zero_keys_make_each_splits_sum_its_number_of_positions(rng):
    from nbkv.tutorial.cuda import launch_attention

    zeros = np.zeros((2, 2, 100, 8), np.float32)
    run = launch_attention(randn(rng, (2, 4, 1, 8), "float32"), zeros, zeros, splits=3)
    assert run.part_stats[..., 1].astype(int)[0, 0, 0].tolist() == [34, 34, 32]


def test_bad_arrays_are_typed_errors(rng):
    from nbkv.tutorial.cuda import launch_attention

    K = randn(rng, (1, 2, 10, 8), "float32")
    with pytest.raises(nbkv.ShapeMismatchError):
        launch_attention(randn(rng, (1, 4, 1, 8), "float64"), K, K)
    with pytest.raises(nbkv.ShapeMismatchError):
        launch_attention(randn(rng, (1, 4, 1, 6), "float32"), K, K)
    with pytest.raises(nbkv.InvalidArgumentError, match="window"):
        launch_attention(randn(rng, (1, 4, 1, 8), "float32"), K, K, window=0)
