"""nbkv.tutorial.timing: the measurement helpers of notebook 03 (no test asserts a time)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import nbkv
from nbkv.tutorial import timing

from conftest import cpu_only

pytestmark = cpu_only


def test_time_call_warms_up_untimed_then_times_each_repeat():
    calls = []
    t = timing.time_call(lambda: calls.append(1), repeats=5, warmup=3)
    assert len(calls) == 8
    assert t.repeats == 5
    assert 0 <= t.p10_s <= t.median_s <= t.p90_s
    assert t.first_s >= 0 and t.median_us == pytest.approx(t.median_s * 1e6)


def test_time_call_runs_before_ahead_of_every_call():
    log = []
    timing.time_call(
        lambda: log.append("call"), repeats=2, warmup=1, before=lambda: log.append("b")
    )
    assert log == ["b", "call"] * 3


def test_time_calls_interleaves_methods_and_runs_their_setups():
    log = []
    fns = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
    out = timing.time_calls(fns, repeats=3, warmup=1, before={"a": lambda: log.append("setup")})
    assert list(out) == ["a", "b"]
    assert all(t.repeats == 3 for t in out.values())
    # 4 rounds, order rotated each round: a b, b a, a b, b a
    assert [x for x in log if x != "setup"] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert log.count("setup") == 4


@pytest.mark.parametrize("bad", [{"repeats": 0}, {"warmup": 0}])
def test_time_call_rejects_no_repeats_or_no_warmup(bad):
    with pytest.raises(ValueError):
        timing.time_call(lambda: None, **bad)
    with pytest.raises(ValueError):
        timing.time_calls({"a": lambda: None}, **bad)


def test_gb_per_s_is_bytes_per_nanosecond():
    assert timing.gb_per_s(2e9, 0.5) == pytest.approx(4.0)


@pytest.mark.parametrize("n", [1, 7, 63, 64, 65, 1000, 4099])
def test_read_sum_adds_every_element_once(n):
    x = np.arange(n, dtype=np.float32) % 7
    assert timing.read_sum(x) == pytest.approx(float(x.astype(np.float64).sum()), rel=1e-6)


def test_bandwidth_probes_return_finite_positive_figures():
    for gbs in (
        timing.read_bandwidth(1 << 20, repeats=2),
        timing.copy_bandwidth(1 << 20, repeats=2),
    ):
        assert math.isfinite(gbs) and gbs > 0


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2), (6, 1)])
def test_numpy_grouped_attention_matches_the_reference(rng, heads, kv_heads):
    q = rng.standard_normal((2, heads, 1, 24)).astype(np.float32)
    K = rng.standard_normal((2, kv_heads, 37, 24)).astype(np.float32)
    V = rng.standard_normal(K.shape).astype(np.float32)
    got = timing.numpy_grouped_attention(q, K, V)
    assert got.shape == q.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, nbkv.reference.attention(q, K, V), atol=1e-5)


def test_torch_grouped_attention_matches_the_reference(rng):
    torch = pytest.importorskip("torch")
    q = rng.standard_normal((1, 8, 1, 16)).astype(np.float32)
    K = rng.standard_normal((1, 2, 21, 16)).astype(np.float32)
    V = rng.standard_normal(K.shape).astype(np.float32)
    got = timing.torch_grouped_attention(*(torch.from_numpy(x) for x in (q, K, V))).numpy()
    np.testing.assert_allclose(got, nbkv.reference.attention(q, K, V), atol=1e-5)


@pytest.mark.parametrize("n_q, seq_len", [(1, 21), (5, 21), (21, 21)])
def test_torch_grouped_attention_with_the_causal_mask_matches_the_reference(rng, n_q, seq_len):
    torch = pytest.importorskip("torch")
    q = rng.standard_normal((1, 8, n_q, 16)).astype(np.float32)
    K = rng.standard_normal((1, 2, seq_len, 16)).astype(np.float32)
    V = rng.standard_normal(K.shape).astype(np.float32)
    mask = timing.causal_mask(n_q, seq_len, group=4)
    got = timing.torch_grouped_attention(*(torch.from_numpy(x) for x in (q, K, V)), mask=mask)
    np.testing.assert_allclose(got.numpy(), nbkv.reference.attention(q, K, V), atol=1e-5)


@pytest.mark.parametrize(
    "n_q, seq_len, causal", [(1, 9, True), (3, 9, True), (9, 9, True), (4, 9, False)]
)
def test_attention_flops_count_the_visible_pairs(n_q, seq_len, causal):
    first = seq_len - n_q
    mask = np.arange(seq_len)[None, :] <= np.arange(first, seq_len)[:, None]
    pairs = int(mask.sum()) if causal else n_q * seq_len
    got = timing.attention_flops(n_q, seq_len, heads=6, head_dim=10, batch=2, causal=causal)
    assert got == 2 * 6 * pairs * 4 * 10


def test_attention_bytes_read_kv_once_per_kv_head():
    got = timing.attention_bytes(1, 100, heads=32, kv_heads=8, head_dim=128, itemsize=2)
    assert got == 2 * 8 * 100 * 128 * 2 + 2 * 32 * 128 * 2
    # decode at group 4 in float32: about 2 FLOP per byte, whatever the context length
    for seq_len in (1024, 32768):
        flop = timing.attention_flops(1, seq_len, heads=32, head_dim=128)
        nbytes = timing.attention_bytes(1, seq_len, heads=32, kv_heads=8, head_dim=128)
        assert flop / nbytes == pytest.approx(2.0, rel=0.01)


def test_roofline_is_bandwidth_times_intensity_up_to_the_peak():
    got = timing.roofline([0.5, 2.0, 100.0], peak_gflops=50.0, bandwidth_gbs=10.0)
    np.testing.assert_allclose(got, [5.0, 20.0, 50.0])


def test_peak_flops_probe_returns_a_finite_positive_rate():
    for best in (False, True):
        gflops = timing.peak_flops(64, repeats=3, best=best)
        assert math.isfinite(gflops) and gflops > 0


def test_best_takes_the_fastest_tenth_of_the_calls():
    t = timing.Timing(median_s=2.0, p10_s=1.0, p90_s=3.0, first_s=5.0, repeats=9)
    assert timing._seconds(t, best=True) == 1.0 and timing._seconds(t, best=False) == 2.0
    assert timing.read_bandwidth(1 << 20, repeats=3, best=True) > 0
    assert timing.copy_bandwidth(1 << 20, repeats=3, best=True) > 0


def test_jit_first_call_reports_the_three_times_from_a_child_process(tmp_path):
    r = timing.jit_first_call(str(tmp_path), heads=4, kv_heads=2, head_dim=8)
    assert set(r) == {"import_s", "first_call_s", "second_call_s"}
    assert all(v >= 0 for v in r.values())
    assert any(tmp_path.rglob("*.nbi")), "the child wrote its compiled kernels to the cache dir"
