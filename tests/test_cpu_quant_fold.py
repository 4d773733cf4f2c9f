"""The 8-bit quantized attention's folded K path (nbkv.kernels.cpu_quant) against the
dequantizing path it replaces, on random shapes that reach the edges: K's scale and zero
point folded into the queries (``_fold_k_group``, scores over the codes themselves, then
``_add_rows``) against ``_dequant_k`` then ``_scores``. Every cell is compared, and the
cells past the block must stay unwritten."""

from __future__ import annotations

import numpy as np
import pytest

from nbkv.kernels import cpu_attention, cpu_quant

from conftest import cpu_only

pytestmark = cpu_only


@pytest.mark.parametrize("seed", range(6))
def test_k_folded_into_the_queries_matches_dequantized_k(seed):
    rng = np.random.default_rng(seed)
    for _ in range(8):
        rows = int(rng.integers(1, 14))
        nb = int(rng.integers(1, 65))
        dim = int(rng.choice([16, 32, 48, 64, 128, 256]))
        qs = rng.standard_normal((rows, dim)).astype(np.float32)
        codes = rng.integers(0, 256, (nb, dim)).astype(np.uint8)
        scale = (rng.random(dim) * 0.05 + 1e-3).astype(np.float32)
        zero = rng.uniform(-4, 1, dim).astype(np.float32)  # offsets that cancel
        want = np.full((rows, 64), np.nan, np.float32)
        buf = np.empty((64, dim), np.float32)
        cpu_attention._scores(qs, cpu_quant._dequant_k(codes, scale, zero, 8, buf), want, 0)
        q_sc, q_ze = np.empty((rows, dim), np.float32), np.empty(rows, np.float32)
        cpu_quant._fold_k_group(qs, scale, zero, q_sc, q_ze)
        got = np.full((rows, 64), np.nan, np.float32)
        cpu_attention._scores(q_sc, codes, got, 0)
        cpu_quant._add_rows(got, nb, q_ze)
        exact = qs.astype(np.float64) @ (zero + codes * scale.astype(np.float64)).T
        bound = 1e-5 * np.abs(qs).sum(1, keepdims=True) * (np.abs(zero).max() + 1)
        assert np.isnan(got[:, nb:]).all()  # nothing past the block
        assert (np.abs(got[:, :nb] - exact) <= bound).all()
        assert (np.abs(want[:, :nb] - exact) <= bound).all()
