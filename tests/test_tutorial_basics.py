"""nbkv.tutorial.basics: the three decoders of notebook 01 agree, and their accounting holds."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import nbkv
from nbkv.tutorial.basics import (
    METHODS,
    AttentionLayer,
    ConcatDecoder,
    NbkvDecoder,
    RecomputeDecoder,
    make_decoder,
    run_decode,
    step_work,
    time_decode,
    trace_memory,
)

from conftest import cpu_only

pytestmark = cpu_only


@pytest.fixture(params=[(8, 8), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def layer(request) -> AttentionLayer:
    heads, kv_heads = request.param
    return AttentionLayer(d_model=32, num_heads=heads, num_kv_heads=kv_heads, head_dim=8, batch=2)


def test_projections_have_the_bhsd_shapes(layer):
    x = layer.inputs(5)
    assert x.shape == (2, 5, 32) and x.dtype == np.float32
    q = layer.project_q(x)
    k, v = layer.project_kv(x)
    assert q.shape == (2, layer.num_heads, 5, 8)
    assert k.shape == v.shape == (2, layer.num_kv_heads, 5, 8)
    assert all(a.flags.c_contiguous and a.dtype == np.float32 for a in (q, k, v))
    # position t of K is the projection of input t alone
    k2, _ = layer.project_kv(x[:, 2:3])
    np.testing.assert_allclose(k[:, :, 2:3], k2, rtol=1e-5, atol=1e-6)
    assert layer.kv_nbytes_per_position == k[:, :, :1].nbytes * 2


def test_the_three_decoders_agree_with_the_reference(layer):
    n = 12
    xs = layer.inputs(n, seed=3)
    decoders = [make_decoder(m, layer, n) for m in METHODS]
    outs = [run_decode(d, xs) for d in decoders]
    assert [d.seq_len for d in decoders] == [n] * 3
    kvs = [d.get_kv() for d in decoders]
    # concatenate and nbkv store the same per-step projections: bit for bit
    for a, b in zip(kvs[1], kvs[2], strict=True):
        np.testing.assert_array_equal(a, b)
    # recompute projects all rows in one matmul: equal up to float32 rounding
    for a, b in zip(kvs[0], kvs[2], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # every step's output is attention of its query over the positions so far
    K, V = kvs[2]
    q = layer.project_q(xs)
    want = nbkv.reference.attention(q, K, V)  # causal: query t sees positions <= t
    for out in outs:
        assert out.shape == (2, layer.num_heads, n, 8) and out.dtype == np.float32
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_decoders_keep_what_they_say():
    layer = AttentionLayer(d_model=16, num_heads=2, num_kv_heads=2, head_dim=8)
    xs = layer.inputs(4)
    r, c, k = RecomputeDecoder(layer, 10), ConcatDecoder(layer), NbkvDecoder(layer, 10)
    assert r.get_kv() is None and c.get_kv() is None and k.get_kv() is None
    assert k.kv_nbytes == 10 * layer.kv_nbytes_per_position  # allocated at once
    for d in (r, c, k):
        run_decode(d, xs)
    assert r.kv_nbytes == 0
    assert c.kv_nbytes == 4 * layer.kv_nbytes_per_position
    assert k.kv_nbytes == 10 * layer.kv_nbytes_per_position
    K, _ = k.get_kv()
    K2, _ = k.get_kv()
    assert np.shares_memory(K, K2)  # views of the cache, no copies


def test_make_decoder_rejects_an_unknown_method():
    layer = AttentionLayer(d_model=16, num_heads=2, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="method"):
        make_decoder("numpy", layer, 4)
    with pytest.raises(ValueError, match="method"):
        step_work(layer, "numpy", 0)
    with pytest.raises(ValueError, match="multiple"):
        AttentionLayer(d_model=16, num_heads=3, num_kv_heads=2, head_dim=8)


def test_step_work_counts_flops_and_bytes():
    layer = AttentionLayer(d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, batch=3)
    row = layer.kv_nbytes_per_position
    kv_proj = 2 * 64 * (2 * 2 * 16)  # one row's K and V projection
    for pos in (0, 1, 7, 100):
        (fr, br), (fc, bc), (fn, bn) = (step_work(layer, m, pos) for m in METHODS)
        assert fc == fn  # concatenation only copies: no extra arithmetic
        assert fr - fn == 3 * pos * kv_proj  # recompute re-projects the pos earlier rows
        assert br == bc == (pos + 1) * row and bn == row
    # attention grows linearly with the position for every method
    assert step_work(layer, "nbkv", 11)[0] - step_work(layer, "nbkv", 10)[0] == 3 * 4 * 4 * 16


def test_time_decode_times_every_step():
    layer = AttentionLayer(d_model=16, num_heads=2, num_kv_heads=2, head_dim=8)
    xs = layer.inputs(6)
    made = []

    def make():
        made.append(NbkvDecoder(layer, 6))
        return made[-1]

    ns = time_decode(make, xs, repeats=2)
    assert ns.shape == (2, 6) and ns.dtype == np.int64 and (ns > 0).all()
    assert len(made) == 2 and all(d.seq_len == 6 for d in made)


def test_trace_memory_measures_held_and_peak():
    layer = AttentionLayer(d_model=64, num_heads=4, num_kv_heads=4, head_dim=16)
    n, row = 20, layer.kv_nbytes_per_position
    xs = layer.inputs(n)
    pos = np.arange(1, n + 1)
    was = tracemalloc.is_tracing()

    nb = trace_memory(lambda: NbkvDecoder(layer, n), xs)
    assert (nb["held"] == n * row).all()
    assert (nb["peak"] >= nb["held"]).all()
    extra = nb["peak"] - nb["held"]  # the step's temporaries: no K/V, so no growth
    assert extra.max() - extra.min() < row

    cat = trace_memory(lambda: ConcatDecoder(layer), xs)
    np.testing.assert_array_equal(cat["held"], pos * row)
    # the old arrays and the new ones are alive together
    assert (cat["peak"] >= (2 * pos - 1) * row).all()

    rec = trace_memory(lambda: RecomputeDecoder(layer, n), xs)
    assert (rec["held"] == 0).all()
    assert (rec["peak"] >= pos * row).all()  # K and V of every position, made anew
    assert tracemalloc.is_tracing() == was
