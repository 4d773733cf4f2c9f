"""nbkv.PagedKVCache: blocks, forks, prefix caching, steps and paged attention, against a
dense per-sequence NumPy model, on this run's backend.

K/V in these tests are a deterministic function of a sequence's token prefix (as in a
real model), so that a block reused from the prefix cache must hold exactly what the
new sequence would have computed.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import nbkv
from nbkv import reference

from conftest import DEVICE, host

HEADS, KV_HEADS, DIM, LAYERS = 4, 2, 3, 2


def kv_of(tokens, layer: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """K and V rows [n, KV_HEADS, DIM] of every position of ``tokens``: position p's
    depends on tokens[: p + 1] and the layer only."""
    k, v = [], []
    for p in range(len(tokens)):
        seed = zlib.crc32(np.asarray(tokens[: p + 1], "<i4").tobytes() + bytes([layer]))
        rows = np.random.default_rng(seed).standard_normal((2, KV_HEADS, DIM)) * 2 + 0.5
        k.append(rows[0])
        v.append(rows[1])
    shape = (-1, KV_HEADS, DIM)
    return np.array(k, dtype).reshape(shape), np.array(v, dtype).reshape(shape)


def make(num_blocks=16, block_size=4, **kw):
    kw = dict(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype="float32") | kw
    return nbkv.PagedKVCache(num_blocks, block_size, device=DEVICE, **kw)


def write_step(cache, step, tokens_of: dict, dtype=np.float32):
    """Write every layer of a step: the K/V of each sequence's new positions."""
    for layer in range(cache.num_layers):
        ks, vs = [], []
        for i, sid in enumerate(step.host("seq_ids")):
            n = int(step.host("q_indptr")[i + 1] - step.host("q_indptr")[i])
            k, v = kv_of(tokens_of[int(sid)], layer, dtype)
            ks.append(k[len(k) - n :])
            vs.append(v[len(v) - n :])
        cache.write(layer, step, np.concatenate(ks), np.concatenate(vs))


def check_step_arrays(cache, step, requests: dict, held_before: dict):
    """A step's arrays against their definitions, sequence by sequence, from the tables
    the cache holds after it (reserve builds them with whole-array operations)."""
    bs = cache.block_size
    names = ("positions", "slot_mapping", "seq_lens", "kv_indices", "last_page_len")
    want: dict[str, list] = {name: [] for name in names}
    q_indptr, kv_indptr = [0], [0]
    for sid in requests:
        table, held = cache.block_table(sid).tolist(), cache.seq_len(sid)
        pos = list(range(held_before[sid], held))
        want["positions"] += pos
        want["slot_mapping"] += [table[p // bs] * bs + p % bs for p in pos]
        want["seq_lens"].append(held)
        want["kv_indices"] += table
        want["last_page_len"].append(held - (len(table) - 1) * bs)
        q_indptr.append(q_indptr[-1] + len(pos))
        kv_indptr.append(kv_indptr[-1] + len(table))
    got = {name: step.host(name) for name in (*want, "seq_ids", "q_indptr", "kv_indptr")}
    assert all(arr.dtype == np.int32 for arr in got.values())
    assert got["seq_ids"].tolist() == list(requests)
    assert got["q_indptr"].tolist() == q_indptr and got["kv_indptr"].tolist() == kv_indptr
    for name, values in want.items():
        assert got[name].tolist() == values, name


def check_attention(cache, step, tokens_of, rng, window=None, layer=0, tol=3e-5):
    q = rng.standard_normal((step.num_tokens, HEADS, DIM)).astype(np.float32)
    got = host(nbkv.paged_attention(q, cache, layer, step, window=window))
    qi = step.host("q_indptr")
    for i, sid in enumerate(step.host("seq_ids")):
        K, V = kv_of(tokens_of[int(sid)], layer, np.float64)
        qs = q[qi[i] : qi[i + 1]].transpose(1, 0, 2)[None]
        want = reference.attention(
            qs, K.transpose(1, 0, 2)[None], V.transpose(1, 0, 2)[None], window=window
        )
        np.testing.assert_allclose(
            got[qi[i] : qi[i + 1]], want[0].transpose(1, 0, 2), atol=tol, rtol=0
        )


# -- the basics ---------------------------------------------------------------------------


def test_two_sequences_of_different_lengths_share_one_pool(rng):
    cache = make(num_blocks=8, block_size=4)
    a, b = cache.add(), cache.add()
    toks = {a: rng.integers(0, 50, 10), b: rng.integers(0, 50, 3)}
    step = cache.reserve({a: toks[a], b: toks[b]})
    assert step.host("q_indptr").tolist() == [0, 10, 13]
    assert step.host("positions").tolist() == list(range(10)) + [0, 1, 2]
    assert [len(cache.block_table(s)) for s in (a, b)] == [3, 1]
    bs = cache.block_size
    table_a = cache.block_table(a)
    assert step.host("slot_mapping")[:10].tolist() == [
        table_a[p // bs] * bs + p % bs for p in range(10)
    ]
    write_step(cache, step, toks)
    check_attention(cache, step, toks, rng)
    check_attention(cache, step, toks, rng, window=3)
    for sid in (a, b):
        K, V = cache.get_kv(1, sid)
        want = kv_of(toks[sid], 1, np.float32)
        np.testing.assert_array_equal(host(K), want[0].transpose(1, 0, 2))
        np.testing.assert_array_equal(host(V), want[1].transpose(1, 0, 2))
    s = cache.stats()
    assert s["blocks_used"] == 4 and s["blocks_free"] == 4 and s["positions"] == 13
    assert s["bytes_data"] == 13 * 2 * LAYERS * KV_HEADS * DIM * 4
    assert s["bytes_reserved"] == 4 * bs * 2 * LAYERS * KV_HEADS * DIM * 4


def test_decode_steps_grow_block_by_block_and_match_the_reference(rng):
    cache = make(num_blocks=6, block_size=2)
    sid = cache.add()
    toks = {sid: rng.integers(0, 50, 3)}
    write_step(cache, cache.reserve({sid: toks[sid]}), toks)
    for _ in range(6):
        new = rng.integers(0, 50, 1)
        toks[sid] = np.concatenate([toks[sid], new])
        step = cache.reserve({sid: new})
        write_step(cache, step, toks)
        check_attention(cache, step, toks, rng)
        assert len(cache.block_table(sid)) == -(-cache.seq_len(sid) // 2)


def test_a_fork_shares_every_block_and_copies_only_the_one_it_writes(rng):
    cache = make(num_blocks=10, block_size=4)
    a = cache.add()
    toks = {a: rng.integers(0, 50, 10)}  # 2 full blocks and a partial one
    write_step(cache, cache.reserve({a: toks[a]}), toks)
    b = cache.fork(a)
    assert cache.block_table(b).tolist() == cache.block_table(a).tolist()
    used = cache.stats()["blocks_used"]
    assert used == 3  # shared, not copied
    new = rng.integers(0, 50, 1)
    toks[b] = np.concatenate([toks[a], new])
    step = cache.reserve({b: new})
    tb, ta = cache.block_table(b), cache.block_table(a)
    assert tb[:2].tolist() == ta[:2].tolist() and tb[2] != ta[2]  # only the partial block
    assert cache.stats()["blocks_used"] == 4
    write_step(cache, step, toks)
    check_attention(cache, step, toks, rng)
    Ka, _ = cache.get_kv(0, a)
    np.testing.assert_array_equal(host(Ka), kv_of(toks[a], 0, np.float32)[0].transpose(1, 0, 2))
    # the last holder of a shared block writes in place
    new_a = rng.integers(0, 50, 1)
    toks[a] = np.concatenate([toks[a], new_a])
    before = cache.block_table(a)
    write_step(cache, cache.reserve({a: new_a}), toks)
    assert cache.block_table(a).tolist() == before.tolist()


def test_forked_sequences_writing_in_one_step_copy_once_each_but_the_last(rng):
    cache = make(num_blocks=10, block_size=4)
    a = cache.add()
    toks = {a: rng.integers(0, 50, 6)}
    write_step(cache, cache.reserve({a: toks[a]}), toks)
    b, c = cache.fork(a), cache.fork(a)
    news = {s: rng.integers(0, 50, 1) for s in (a, b, c)}
    for s in (b, c):
        toks[s] = toks[a].copy()
    for s in (a, b, c):
        toks[s] = np.concatenate([toks[s], news[s]])
    free = cache.num_free_blocks
    step = cache.reserve({s: news[s] for s in (a, b, c)})
    assert cache.num_free_blocks == free - 2  # two copies: the last holder writes in place
    write_step(cache, step, toks)
    check_attention(cache, step, toks, rng)


def test_prefix_caching_reuses_full_blocks_and_never_all_the_tokens(rng):
    cache = make(num_blocks=12, block_size=4, prefix_caching=True)
    prompt = rng.integers(0, 50, 11)
    a = cache.add(prompt)
    assert cache.seq_len(a) == 0  # nothing cached yet
    toks = {a: prompt}
    write_step(cache, cache.reserve({a: prompt}), toks)
    b = cache.add(prompt)  # 2 full blocks match (8 tokens); the rest is computed
    assert cache.seq_len(b) == 8
    assert cache.block_table(b).tolist() == cache.block_table(a)[:2].tolist()
    toks[b] = prompt
    step = cache.reserve({b: prompt[8:]})
    write_step(cache, step, toks)
    check_attention(cache, step, toks, rng)
    exact = cache.add(prompt[:8])  # 8 tokens: only 1 block may match (one left to compute)
    assert cache.seq_len(exact) == 4
    other = cache.add(np.concatenate([prompt[:4], prompt[4:8] + 1]))  # diverges in block 2
    assert cache.seq_len(other) == 4
    s = cache.stats()
    assert s["prefix_query_tokens"] == 11 + 11 + 8 + 8 and s["prefix_hit_tokens"] == 8 + 4 + 4


def test_match_finds_what_add_would_and_changes_nothing(rng):
    cache = make(num_blocks=8, block_size=2, prefix_caching=True)
    prompt = rng.integers(0, 50, 7)
    a = cache.add(prompt)
    write_step(cache, cache.reserve({a: prompt}), {a: prompt})
    assert cache.match(prompt) == (6, 0)  # 3 full blocks, in use (not cached)
    cache.free(a)
    before = (cache.stats(), cache.cached_blocks().tolist())
    assert cache.match(prompt) == (6, 3) and cache.match(prompt[:3]) == (2, 1)
    assert (cache.stats(), cache.cached_blocks().tolist()) == before
    assert cache.seq_len(cache.add(prompt)) == 6


def test_freed_blocks_stay_cached_until_evicted_tail_first(rng):
    cache = make(num_blocks=4, block_size=2, prefix_caching=True)
    prompt = rng.integers(0, 50, 8)  # 4 full blocks: the whole pool
    a = cache.add(prompt)
    write_step(cache, cache.reserve({a: prompt}), {a: prompt})
    cache.free(a)
    s = cache.stats()
    assert (s["blocks_cached"], s["blocks_free"], cache.num_free_blocks) == (4, 0, 4)
    b = cache.add(prompt)
    assert cache.seq_len(b) == 6  # 3 blocks back (one token left), from the cache
    cache.free(b)
    c = cache.add()  # a new sequence of 2 blocks evicts the oldest: the tail first
    cache.reserve({c: rng.integers(0, 50, 4)})
    d = cache.add(prompt)
    assert cache.seq_len(d) == 4  # blocks 3 and 2 of the prompt were evicted, 0 and 1 kept


def test_a_block_is_registered_only_once_its_step_is_written_in_every_layer(rng):
    cache = make(num_blocks=8, block_size=2, prefix_caching=True)
    prompt = rng.integers(0, 50, 5)
    a = cache.add(prompt)
    step = cache.reserve({a: prompt})
    k, v = kv_of(prompt, 0, np.float32)
    cache.write(0, step, k, v)  # layer 0 only
    assert cache.seq_len(cache.add(prompt)) == 0  # not registered: layer 1 is missing
    b = cache.add()  # (the step went stale with that add: it will never register)
    with pytest.raises(nbkv.StaleStepError):
        cache.write(1, step, k, v)
    del b


def test_a_step_goes_stale_when_the_cache_changes_and_another_caches_step_is_refused(rng):
    cache, other = make(), make()
    a = cache.add()
    step = cache.reserve({a: 2})
    k = np.zeros((2, KV_HEADS, DIM), np.float32)
    with pytest.raises(nbkv.StaleStepError, match="another"):
        other.write(0, step, k, k)
    cache.write(0, step, k, k)  # valid: nothing changed since
    failed = {a: 10**6}
    with pytest.raises(nbkv.OutOfBlocksError):
        cache.reserve(failed)  # a call that raises leaves the step valid
    cache.write(1, step, k, k)
    cache.fork(a)
    q = np.zeros((2, HEADS, DIM), np.float32)
    for call in (
        lambda: cache.write(0, step, k, k),
        lambda: nbkv.paged_attention(q, cache, 0, step),
        lambda: nbkv.paged_append_and_attend(q, k, k, cache, 0, step),
    ):
        with pytest.raises(nbkv.StaleStepError, match="stale"):
            call()
    assert step.host("seq_lens").tolist() == [2]  # its arrays stay readable


def test_out_of_blocks_names_what_the_step_needs_and_changes_nothing():
    cache = make(num_blocks=3, block_size=4)
    a, b = cache.add(), cache.add()
    cache.reserve({a: 8})
    before = (cache.block_table(a).tolist(), cache.stats(), cache.seq_len(b))
    with pytest.raises(nbkv.OutOfBlocksError, match="needs 2 blocks .* 1 are free") as info:
        cache.reserve({a: 1, b: 2})
    assert isinstance(info.value, nbkv.CacheOverflowError)
    assert (cache.block_table(a).tolist(), cache.stats(), cache.seq_len(b)) == before


@pytest.mark.parametrize(
    "requests, error",
    [
        ([(0, 1)], nbkv.ArgumentTypeError),
        ({}, nbkv.InvalidArgumentError),
        ({99: 1}, nbkv.InvalidArgumentError),
        ({0: 0}, nbkv.InvalidArgumentError),
        ({0: True}, nbkv.ArgumentTypeError),
        ({0: 1.5}, nbkv.ArgumentTypeError),
        ({0: np.array([], np.int64)}, nbkv.InvalidArgumentError),
        ({0: np.ones((2, 2), np.int64)}, nbkv.ArgumentTypeError),
        ({0: "ab"}, nbkv.ArgumentTypeError),
        ({"0": 1}, nbkv.ArgumentTypeError),
    ],
)
def test_bad_reserves_are_typed_errors_that_change_nothing(requests, error):
    cache = make()
    cache.add()
    before = cache.stats(), cache.seq_len(0)
    with pytest.raises(error):
        cache.reserve(requests)
    assert (cache.stats(), cache.seq_len(0)) == before


def test_a_prefix_cache_needs_token_ids_not_counts():
    cache = make(prefix_caching=True)
    sid = cache.add()
    with pytest.raises(nbkv.InvalidArgumentError, match="token ids"):
        cache.reserve({sid: 3})


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"num_blocks": 0}, nbkv.InvalidArgumentError),
        ({"block_size": 0}, nbkv.InvalidArgumentError),
        ({"layout": "bhsd"}, nbkv.InvalidArgumentError),
        ({"dtype": "int8"}, nbkv.DTypeMismatchError),
        ({"prefix_caching": 1}, nbkv.ArgumentTypeError),
        ({"num_kv_heads": 2**40}, nbkv.InvalidArgumentError),
    ],
)
def test_bad_constructions_are_typed_errors(kwargs, error):
    with pytest.raises(error):
        make(**kwargs)


def test_bad_writes_and_queries_are_typed_errors_that_write_nothing(rng):
    cache = make()
    a = cache.add()
    toks = {a: rng.integers(0, 50, 3)}
    step = cache.reserve({a: toks[a]})
    write_step(cache, step, toks)
    K0 = host(cache.get_kv(0, a)[0]).copy()
    k = np.zeros((3, KV_HEADS, DIM), np.float32)
    q = np.zeros((3, HEADS, DIM), np.float32)
    fused = nbkv.paged_append_and_attend
    for call, error in (
        (lambda: cache.write(0, step, k[:2], k[:2]), nbkv.ShapeMismatchError),
        (lambda: cache.write(0, step, k.astype(np.float64), k), nbkv.DTypeMismatchError),
        (lambda: cache.write(5, step, k, k), nbkv.LayerIndexError),
        (lambda: cache.write(0, "step", k, k), nbkv.ArgumentTypeError),
        (lambda: nbkv.paged_attention(q[:2], cache, 0, step), nbkv.ShapeMismatchError),
        (lambda: nbkv.paged_attention(q[:, :3], cache, 0, step), nbkv.ShapeMismatchError),
        (lambda: nbkv.paged_attention(q, cache, 0, step, window=0), nbkv.InvalidArgumentError),
        (lambda: fused(q, k + 1, k + 1, cache, 0, step, window=0), nbkv.InvalidArgumentError),
        (lambda: fused(q[:, :3], k + 1, k + 1, cache, 0, step), nbkv.ShapeMismatchError),
        (lambda: nbkv.paged_attention(q, {"a": 1}, 0, step), nbkv.ArgumentTypeError),
        (lambda: cache.get_kv(0, 77), nbkv.InvalidArgumentError),
        (lambda: cache.get_kv(-3, a), nbkv.LayerIndexError),
        (lambda: cache.trim(a, -1), nbkv.InvalidArgumentError),
        (lambda: cache.fork(1.0), nbkv.ArgumentTypeError),
        (lambda: cache.free(99), nbkv.InvalidArgumentError),
        (lambda: cache.add("abc"), nbkv.ArgumentTypeError),
        (lambda: cache.add(np.ones((2, 2), np.int64)), nbkv.ArgumentTypeError),
        (lambda: cache.match(np.array([], np.int64)), nbkv.InvalidArgumentError),
        (lambda: cache.match([1.5]), nbkv.ArgumentTypeError),
        (lambda: cache.blocks_needed({a: 0}), nbkv.InvalidArgumentError),
        (lambda: cache.blocks_needed([a]), nbkv.ArgumentTypeError),
        (lambda: cache.blocks_needed({99: 1}), nbkv.InvalidArgumentError),
    ):  # fmt: skip
        before = _everything(cache)
        with pytest.raises(error):
            call()
        assert _everything(cache) == before
    np.testing.assert_array_equal(host(cache.get_kv(0, a)[0]), K0)


def test_trim_releases_blocks_and_a_trimmed_cached_block_is_copied_before_a_write(rng):
    cache = make(num_blocks=6, block_size=4, prefix_caching=True)
    prompt = rng.integers(0, 50, 8)
    a = cache.add(prompt)
    toks = {a: prompt}
    write_step(cache, cache.reserve({a: prompt}), toks)
    assert cache.trim(a, 3) == 3 and cache.seq_len(a) == 5
    assert len(cache.block_table(a)) == 2
    registered = cache.block_table(a)[1]
    new = rng.integers(0, 50, 1)
    toks[a] = np.concatenate([prompt[:5], new])
    step = cache.reserve({a: new})
    assert cache.block_table(a)[1] != registered  # it carried a key: copied, not written
    write_step(cache, step, toks)
    check_attention(cache, step, toks, rng)
    b = cache.add(prompt)  # the original block 1 is still in the prefix cache
    assert cache.seq_len(b) == 4 and cache.trim(b, 100) == 4
    cache.free(a)
    cache.free(b)
    assert cache.stats()["blocks_used"] == 0 and cache.seq_ids == []


def test_the_tables_are_what_flashinfer_and_vllm_document(rng):
    cache = make(num_blocks=12, block_size=4)
    a, b = cache.add(), cache.add()
    cache.reserve({a: 6})
    step = cache.reserve({a: 1, b: 9})
    fi = {k: host(v) for k, v in step.flashinfer().items()}
    ta, tb = cache.block_table(a), cache.block_table(b)
    # FlashInfer: CSR over pages; last page length in [1, page_size]
    assert fi["qo_indptr"].tolist() == [0, 1, 10]
    assert fi["paged_kv_indptr"].tolist() == [0, len(ta), len(ta) + len(tb)]
    assert fi["paged_kv_indices"].tolist() == ta.tolist() + tb.tolist()
    assert fi["paged_kv_last_page_len"].tolist() == [3, 1]  # 7 = 4 + 3, 9 = 4 + 4 + 1
    assert all(v.dtype == np.int32 for v in fi.values())
    vl = {k: host(v) for k, v in step.vllm().items()}
    assert vl["block_tables"].shape == (2, 3) and vl["block_tables"].dtype == np.int32
    assert vl["block_tables"][0].tolist() == ta.tolist() + [0]  # padded with 0
    assert vl["seq_lens"].tolist() == [7, 9] and vl["query_start_loc"].tolist() == [0, 1, 10]
    assert vl["slot_mapping"].dtype == np.int64
    assert vl["slot_mapping"].tolist() == host(step.slot_mapping).tolist()
    assert host(step.positions).tolist() == [6] + list(range(9))


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_pools_layouts_and_dtypes(rng, layout, dtype):
    from conftest import dtype_of

    dt = dtype_of(dtype)
    cache = make(num_blocks=5, block_size=3, layout=layout, dtype=dtype)
    k_pool, _ = cache.pools(0)
    want = (5, 3, KV_HEADS, DIM) if layout == "nhd" else (5, KV_HEADS, 3, DIM)
    assert tuple(k_pool.shape) == want
    assert cache.nbytes == 2 * LAYERS * 5 * 3 * KV_HEADS * DIM * dt.itemsize
    a = cache.add()
    toks = {a: rng.integers(0, 50, 7)}
    step = cache.reserve({a: toks[a]})
    write_step(cache, step, toks, dt)
    tol = 3e-5 if dt.itemsize >= 4 else 1e-2  # 16-bit K/V: the reference sees the rounding
    q = rng.standard_normal((7, HEADS, DIM)).astype(np.float32)
    got = host(nbkv.paged_append_and_attend(q, *kv_of(toks[a], 0, dt), cache, 0, step))
    K, V = (x.astype(np.float64).transpose(1, 0, 2)[None] for x in kv_of(toks[a], 0, dt))
    want_out = reference.attention(q.transpose(1, 0, 2)[None], K, V)[0].transpose(1, 0, 2)
    np.testing.assert_allclose(got, want_out, atol=tol, rtol=0)
    got_k = host(cache.get_kv(0, a)[0], dt)
    np.testing.assert_array_equal(
        got_k.view(np.uint8), np.ascontiguousarray(K[0].astype(dt)).view(np.uint8)
    )


def test_the_kernels_run_inside_user_njit_code():
    if DEVICE != "cpu":
        pytest.skip("the CPU kernels")
    from numba import njit

    from nbkv.kernels import paged_attend, write_paged

    @njit
    def step(k, v, slots, k_pool, v_pool, q, qi, ki, kx, lens, out):
        write_paged(k, v, slots, k_pool, v_pool)
        paged_attend(q, k_pool, v_pool, qi, ki, kx, lens, 1.0, 0, out)

    k_pool = np.zeros((3, 2, 1, 2), np.float32)
    v_pool = np.zeros_like(k_pool)
    k = np.zeros((3, 1, 2), np.float32)
    v = np.arange(6, dtype=np.float32).reshape(3, 1, 2)
    out = np.empty((1, 1, 2), np.float32)
    i32 = np.int32
    tables = [np.array(x, i32) for x in ([0, 1], [0, 2], [2, 0], [3])]
    step(k, v, np.array([4, 5, 0], i32), k_pool, v_pool, np.zeros((1, 1, 2), np.float32),
         *tables, out)  # fmt: skip
    assert out[0, 0].tolist() == [2.0, 3.0]


@given(
    bs=st.one_of(st.integers(1, 9), st.integers(10, 160)),
    most=st.sampled_from([None, 16]),
    seq_len=st.integers(1, 400),
    lo=st.integers(0, 399),
    heads=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_the_paged_runs_tile_the_positions_and_prefetch_the_rows_32_on(
    bs, most, seq_len, lo, heads, seed
):
    """``_segment``'s runs: each lies in one page, from the offset its position has there,
    and so do the positions ``PREFETCH_POSITIONS`` on (whole pages on, for pages up to
    that size: then a run is the rest of its page), at the row distance it says in either
    pool form; past the task's last position it prefetches nothing."""
    from nbkv.kernels import cpu_paged

    ahead_by = cpu_paged.PREFETCH_POSITIONS
    if bs <= ahead_by:  # rounded up to whole pages: a small page goes in one run
        ahead_by = -(-ahead_by // bs) * bs
    lo = min(lo, seq_len - 1)
    most = bs if most is None else most
    pages = np.random.default_rng(seed).permutation(-(-seq_len // bs) + 3)[: -(-seq_len // bs)]
    pages = pages.astype(np.int32)

    def row(p, hnd):  # position p's row among a head's: "nhd" strided, "hnd" flattened
        return (pages[p // bs] * (heads if hnd else 1) + (heads - 1) * hnd) * bs + p % bs

    for hnd in (False, True):
        page_rows = heads * bs if hnd else bs
        at = lo
        while at < seq_len:
            j1 = min(seq_len, (at // 128 + 1) * 128)  # a softmax chunk's end
            page, off, n, ahead = cpu_paged._segment(pages, bs, page_rows, at, j1, seq_len, most)
            assert 1 <= n <= min(most, j1 - at)
            if bs <= cpu_paged.PREFETCH_POSITIONS:
                assert n == min(bs - at % bs, most, j1 - at)
            assert (page, off) == (pages[at // bs], at % bs) and off + n <= bs
            t = at + ahead_by
            if t >= seq_len:
                assert ahead == 0
            else:
                assert t % bs + n <= bs  # the rows ahead lie in one page
                for i in range(n):
                    assert row(at + i, hnd) + ahead == row(t + i, hnd)
            at += n


@given(data=st.data())
def test_random_parameters_match_the_reference_and_the_fused_path_writes_every_row(data):
    """Paged attention on random sizes reaching the edges (block size 1, a window of 1,
    more query rows than one CUDA block takes, forced splits, empty and long histories,
    16-bit pools) equals the reference over each sequence's K/V; and the fused call leaves
    the pools bit for bit as write + attention does, with the same output."""
    from conftest import dtype_of

    dt = dtype_of(data.draw(st.sampled_from(["float32", "float16", "bfloat16"]), "dtype"))
    # past 16 and 32: "nhd" runs of 16 positions, rows prefetched from within the page
    bs = data.draw(st.one_of(st.integers(1, 9), st.sampled_from([17, 40])), "block_size")
    layout = data.draw(st.sampled_from(["nhd", "hnd"]), "layout")
    dim = data.draw(st.sampled_from([3, 8, 16, 40, 64]), "head_dim")  # 16, 64: vector IR
    held = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=4), "held")
    new = [data.draw(st.integers(1, 12), f"new {i}") for i in range(len(held))]
    window = data.draw(st.one_of(st.none(), st.integers(1, 20)), "window")
    splits = data.draw(st.one_of(st.none(), st.integers(1, 5)), "splits")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), "seed"))
    blocks = sum(-(-(h + n) // bs) for h, n in zip(held, new, strict=True)) + 1
    caches = [
        nbkv.PagedKVCache(blocks, bs, num_kv_heads=KV_HEADS, head_dim=dim, dtype=dt,
                          device=DEVICE, layout=layout)
        for _ in range(2)
    ]  # fmt: skip
    rows = {}  # sid -> (K, V) [n, KV_HEADS, dim], what each sequence holds
    sids = [caches[0].add() for _ in held]
    assert [caches[1].add() for _ in held] == sids
    for sid, h in zip(sids, held, strict=True):
        k, v = (rng.standard_normal((h + 1, KV_HEADS, dim)).astype(dt) for _ in range(2))
        rows[sid] = (k[:h], v[:h])
        if h:
            for c in caches:
                c.write(0, c.reserve({sid: h}), k[:h], v[:h])
    new_k, new_v = [], []
    for sid, n in zip(sids, new, strict=True):
        k, v = (rng.standard_normal((n, KV_HEADS, dim)).astype(dt) for _ in range(2))
        rows[sid] = (np.concatenate([rows[sid][0], k]), np.concatenate([rows[sid][1], v]))
        new_k.append(k)
        new_v.append(v)
    k, v = np.concatenate(new_k), np.concatenate(new_v)
    steps = [c.reserve(dict(zip(sids, new, strict=True))) for c in caches]
    q = rng.standard_normal((sum(new), HEADS, dim)).astype(np.float32)
    with nbkv.override_tunables(ATTENTION_SPLITS=splits):
        caches[0].write(0, steps[0], k, v)
        plain = host(nbkv.paged_attention(q, caches[0], 0, steps[0], window=window))
        fused = host(nbkv.paged_append_and_attend(q, k, v, caches[1], 0, steps[1], window=window))
    np.testing.assert_allclose(fused, plain, atol=1e-6, rtol=0)
    for sid in sids:
        a, b = caches[0].get_kv(0, sid), caches[1].get_kv(0, sid)
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(host(x, dt).view(np.uint8), host(y, dt).view(np.uint8))
    qi = steps[0].host("q_indptr")
    tol = 3e-5 if dt.itemsize >= 4 else 2e-3  # 16-bit: the same rounded K/V, float32 sums
    for i, sid in enumerate(sids):
        K, V = (x.astype(np.float64).transpose(1, 0, 2)[None] for x in rows[sid])
        qs = q[qi[i] : qi[i + 1]].transpose(1, 0, 2)[None]
        want = reference.attention(qs, K, V, window=window)[0].transpose(1, 0, 2)
        np.testing.assert_allclose(plain[qi[i] : qi[i + 1]], want, atol=tol, rtol=0)


def _everything(cache):
    """What a failed call must leave as it was: stats, tables, lengths, every K/V."""
    seqs = {
        s: (cache.seq_len(s), cache.block_table(s).tolist(),
            [host(x).tobytes() for layer in range(cache.num_layers)
             for x in (cache.get_kv(layer, s) or ())])
        for s in cache.seq_ids
    }  # fmt: skip
    return cache.stats(), seqs, cache.block_refs().tolist(), cache.cached_blocks().tolist()


@pytest.mark.parametrize("fail_on", [1, 4, 8, 9, 10])
def test_a_failed_device_copy_in_reserve_changes_nothing(rng, monkeypatch, fail_on):
    """The step's eight arrays, then the copy-on-write lists, are copied to the device
    before anything changes: whichever copy fails (MemoryError injected), the cache is
    as it was."""
    cache = make(num_blocks=12, block_size=2, prefix_caching=True)
    a = cache.add()
    toks = {a: rng.integers(0, 50, 5)}
    step = cache.reserve({a: toks[a]})
    write_step(cache, step, toks)
    f = cache.fork(a)  # a's last block (1 of 2 positions) is now shared: a write copies it
    before = _everything(cache)
    be = nbkv.backends.get_backend(DEVICE, "bshd")
    real, calls = be.to_device, [0]

    def failing(x):
        calls[0] += 1
        if calls[0] == fail_on:
            raise MemoryError("injected: the device is full")
        return real(x)

    monkeypatch.setattr(be, "to_device", failing)
    with pytest.raises(MemoryError):
        cache.reserve({a: rng.integers(0, 50, 2), f: rng.integers(0, 50, 3)})
    monkeypatch.undo()
    assert calls[0] == fail_on and _everything(cache) == before
    step = cache.reserve({a: rng.integers(0, 50, 2), f: rng.integers(0, 50, 3)})
    assert step.num_tokens == 5  # and it works once the fault is gone


def test_a_failed_copy_on_write_changes_nothing_a_sequence_holds(rng, monkeypatch):
    """The copies on write run before the tables change; if the second layer's copy
    fails, every sequence, table and count is as it was."""
    cache = make(num_blocks=12, block_size=4)
    a = cache.add()
    toks = {a: rng.integers(0, 50, 6)}
    write_step(cache, cache.reserve({a: toks[a]}), toks)
    f = cache.fork(a)
    before = _everything(cache)
    be = nbkv.backends.get_backend(DEVICE, "bshd")
    real, calls = be.copy_blocks, [0]

    def failing(*args):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected: the copy kernel failed")
        return real(*args)

    monkeypatch.setattr(be, "copy_blocks", failing)
    with pytest.raises(RuntimeError):
        cache.reserve({f: 1})
    monkeypatch.undo()
    assert calls[0] == 2 and _everything(cache) == before
    step = cache.reserve({f: 1})  # and it works once the fault is gone
    assert cache.block_table(f)[-1] != cache.block_table(a)[-1]
    assert step.num_tokens == 1


@pytest.mark.parametrize("window", [None, 50, 2**40])
def test_a_long_prefill_beside_decodes_matches_the_reference(rng, window):
    """More queries than one CPU task (QUERY_CHUNK) or one CUDA block takes, in one step
    with decodes of other sequences; a window far past every sequence changes nothing."""
    cache = make(num_blocks=64, block_size=8)
    a, b, c = cache.add(), cache.add(), cache.add()
    toks = {a: rng.integers(0, 50, 30), b: rng.integers(0, 50, 5), c: np.empty(0, np.int64)}
    write_step(cache, cache.reserve({a: toks[a], b: toks[b]}), toks)
    long = 150 if DEVICE == "cpu" else 24  # past QUERY_CHUNK (64) / past ROWS (16) rows
    new = {a: rng.integers(0, 50, 1), b: rng.integers(0, 50, 1), c: rng.integers(0, 50, long)}
    for sid in new:
        toks[sid] = np.concatenate([toks[sid], new[sid]])
    step = cache.reserve(new)
    write_step(cache, step, toks)
    check_attention(cache, step, toks, rng, window=window, layer=0)
    for splits in (1, 3) if DEVICE == "cpu" else (3,):
        with nbkv.override_tunables(ATTENTION_SPLITS=splits):
            check_attention(cache, step, toks, rng, window=window, layer=1)


def test_slots_must_fit_int32():
    with pytest.raises(nbkv.InvalidArgumentError, match="int32"):
        nbkv.PagedKVCache(2**21, 2**11, num_kv_heads=1, head_dim=1, dtype="float32")


# -- the state machine ----------------------------------------------------------------------


class PagedMachine(RuleBasedStateMachine):
    """add / reserve+write / fork / trim / free against a dense model, in a small pool
    (so that eviction happens), with paged attention checked at every step."""

    @initialize(
        num_blocks=st.integers(3, 10),
        block_size=st.integers(1, 4),
        prefix=st.booleans(),
        layout=st.sampled_from(["nhd", "hnd"]),
        seed=st.integers(0, 2**31),
    )
    def build(self, num_blocks, block_size, prefix, layout, seed):
        self.rng = np.random.default_rng(seed)
        self.cache = make(num_blocks, block_size, prefix_caching=prefix, layout=layout)
        self.tokens: dict[int, np.ndarray] = {}
        self.prompts: list[np.ndarray] = []  # for prefix hits: sequences start alike

    def new_tokens(self, n):
        return self.rng.integers(0, 6, n)  # few distinct ids: prefixes repeat

    @rule(from_prompt=st.booleans(), n=st.integers(1, 12))
    def add(self, from_prompt, n):
        if from_prompt and self.prompts:
            prompt = self.prompts[self.rng.integers(len(self.prompts))]
        else:
            prompt = self.new_tokens(n)
            self.prompts.append(prompt)
        sid = self.cache.add(prompt)
        held = self.cache.seq_len(sid)
        bs = self.cache.block_size
        assert held % bs == 0 and held <= max(0, len(prompt) - 1)
        if not self.cache.prefix_caching:
            assert held == 0
        self.tokens[sid] = prompt[:held]
        self.rest = getattr(self, "rest", {})
        self.rest[sid] = prompt[held:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), window=st.one_of(st.none(), st.integers(1, 6)), fused=st.booleans())
    def step(self, data, window, fused):
        sids = data.draw(
            st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=3, unique=True)
        )
        req = {}
        for sid in sids:
            rest = getattr(self, "rest", {}).get(sid)
            req[sid] = (
                rest
                if rest is not None and len(rest)
                else self.new_tokens(int(self.rng.integers(1, 4)))
            )
        snapshot = self.state()
        held = {sid: self.cache.seq_len(sid) for sid in req}
        try:
            step = self.cache.reserve(req)
        except nbkv.OutOfBlocksError:
            assert self.state() == snapshot  # nothing changed
            return
        check_step_arrays(self.cache, step, req, held)
        for sid, new in req.items():
            self.tokens[sid] = np.concatenate([self.tokens[sid], new])
            self.rest.pop(sid, None)
        if fused:  # layer 0 written and attended in one call, the others by write
            q = self.rng.standard_normal((step.num_tokens, HEADS, DIM)).astype(np.float32)
            ks, vs = zip(*(self.new_kv(step, i, 0) for i in range(len(sids))), strict=True)
            got = host(
                nbkv.paged_append_and_attend(
                    q, np.concatenate(ks), np.concatenate(vs), self.cache, 0, step, window=window
                )
            )
            for layer in range(1, LAYERS):
                ks, vs = zip(*(self.new_kv(step, i, layer) for i in range(len(sids))), strict=True)
                self.cache.write(layer, step, np.concatenate(ks), np.concatenate(vs))
            self.check_out(step, q, got, window)
        else:
            write_step(self.cache, step, self.tokens)
            check_attention(
                self.cache, step, self.tokens, self.rng, window=window, layer=LAYERS - 1
            )

    def new_kv(self, step, i, layer):
        sid = int(step.host("seq_ids")[i])
        n = int(step.host("q_indptr")[i + 1] - step.host("q_indptr")[i])
        k, v = kv_of(self.tokens[sid], layer, np.float32)
        return k[len(k) - n :], v[len(v) - n :]

    def check_out(self, step, q, got, window):
        qi = step.host("q_indptr")
        for i, sid in enumerate(step.host("seq_ids")):
            K, V = kv_of(self.tokens[int(sid)], 0, np.float64)
            qs = q[qi[i] : qi[i + 1]].transpose(1, 0, 2)[None]
            want = reference.attention(
                qs, K.transpose(1, 0, 2)[None], V.transpose(1, 0, 2)[None], window=window
            )
            np.testing.assert_allclose(
                got[qi[i] : qi[i + 1]], want[0].transpose(1, 0, 2), atol=3e-5
            )

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        new = self.cache.fork(sid)
        self.tokens[new] = self.tokens[sid].copy()
        if sid in self.rest:
            self.rest[new] = self.rest[sid].copy()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 8))
    def trim(self, data, n):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        held = len(self.tokens[sid])
        assert self.cache.trim(sid, n) == min(n, held)
        self.tokens[sid] = self.tokens[sid][: held - min(n, held)]
        self.rest.pop(sid, None)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(sid)
        del self.tokens[sid]
        self.rest.pop(sid, None)

    def state(self):
        c = self.cache
        return c.stats(), {s: (c.seq_len(s), c.block_table(s).tolist()) for s in c.seq_ids}

    @invariant()
    def matches_the_model(self):
        if not hasattr(self, "cache"):
            return
        c = self.cache
        assert c.seq_ids == sorted(self.tokens)
        refs: dict[int, int] = {}
        for sid, toks in self.tokens.items():
            assert c.seq_len(sid) == len(toks)
            table = c.block_table(sid)
            assert len(table) == -(-len(toks) // c.block_size)
            for b in table.tolist():
                refs[b] = refs.get(b, 0) + 1
            kv = c.get_kv(LAYERS - 1, sid)
            if len(toks) == 0:
                assert kv is None
            else:
                want = kv_of(toks, LAYERS - 1, np.float32)
                np.testing.assert_array_equal(host(kv[0]), want[0].transpose(1, 0, 2))
                np.testing.assert_array_equal(host(kv[1]), want[1].transpose(1, 0, 2))
        s = c.stats()
        assert s["blocks_used"] == len(refs)
        pool = c._pool  # (a test may look inside) every reference is one a table holds
        assert {b: int(pool.refs[b]) for b in np.flatnonzero(pool.refs)} == refs
        assert not set(pool.free) & set(pool.cached) and not set(refs) & set(pool.free)
        assert s["blocks_used"] + s["blocks_cached"] + s["blocks_free"] == c.num_blocks
        assert c.num_free_blocks == s["blocks_cached"] + s["blocks_free"]
        if not c.prefix_caching:
            assert s["blocks_cached"] == 0

    def teardown(self):
        if hasattr(self, "cache"):
            for sid in list(self.tokens):
                self.cache.free(sid)
            s = self.cache.stats()
            assert s["blocks_used"] == 0 and s["positions"] == 0  # nothing leaks


TestPagedMachine = PagedMachine.TestCase


@pytest.mark.skipif(DEVICE != "cuda", reason="a hand launch of the CUDA paged kernel")
@pytest.mark.parametrize("form", ["float16", "float16 bits", "bfloat16 bits", "float32"])
def test_a_hand_launch_widens_every_pool_form_with_its_table(rng, form):
    """The paged kernel tells its pool's form from ``table`` (empty: floats; bfloat16's:
    a shift; float16's, with uint16 bits: a lookup) and attends over the widened values."""
    from numba import cuda

    from nbkv.dtypes import resolve_dtype, widen_table
    from nbkv.kernels import cuda_attention, cuda_paged
    from nbkv.launch import attention_grid

    bs, pages, heads, kv_heads, dim, seq_len = 4, 5, 4, 2, 8, 13
    x = rng.standard_normal((2, pages, bs, kv_heads, dim)).astype(np.float32)
    table = np.empty(0, np.float32)
    if form == "bfloat16 bits":
        pools = (x.view(np.uint32) >> 16).astype(np.uint16)
        widened = (pools.astype(np.uint32) << 16).view(np.float32)
        table = widen_table(resolve_dtype("bfloat16"))
    elif form == "float16 bits":
        pools = x.astype(np.float16).view(np.uint16)
        widened = pools.view(np.float16).astype(np.float32)
        table = widen_table(np.dtype(np.float16))
    else:
        pools = x.astype(form)
        widened = pools.astype(np.float32)
    q = rng.standard_normal((1, heads, dim)).astype(np.float32)
    pages_of_seq = np.array([3, 0, 4, 1], np.int32)
    i32 = np.int32
    tables = (np.array([0, 1], i32), np.array([0, 4], i32), pages_of_seq, np.array([seq_len], i32))
    grid = attention_grid(1, heads, kv_heads, 1, seq_len, sm_count=1, splits=2)
    shapes = cuda_paged.paged_scratch_shapes(1, heads, dim, grid)
    part = [cuda.to_device(np.zeros(s, np.int32 if i == 2 else np.float32))
            for i, s in enumerate(shapes)]  # fmt: skip
    out = cuda.to_device(np.zeros((1, heads, dim), np.float32))
    dev = [cuda.to_device(a) for a in (q, pools[0], pools[1], *tables)]
    cuda_paged.paged_attend_kernel[tuple(grid), cuda_attention.THREADS](
        *dev, 1 / np.sqrt(dim), 0, cuda.to_device(table), *part, out
    )
    K, V = (w[pages_of_seq].reshape(-1, kv_heads, dim)[:seq_len] for w in widened)
    K, V = (a.astype(np.float64).transpose(1, 0, 2)[None] for a in (K, V))
    want = reference.attention(q.astype(np.float64).transpose(1, 0, 2)[None], K, V)
    np.testing.assert_allclose(out.copy_to_host(), want[0].transpose(1, 0, 2), atol=2e-6, rtol=0)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU kernels' prefill path")
@given(
    layout=st.sampled_from(["nhd", "hnd"]),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    bs=st.one_of(st.integers(1, 9), st.sampled_from([16, 17, 40, 128])),
    dim=st.sampled_from([16, 64, 128]),
    held=st.integers(0, 300),
    group=st.sampled_from([3, 4, 5]),  # rows left over past tiles of 6: 1 to 5
    new=st.integers(3, 70),  # 9 to 350 query rows: past QUERY_CHUNK (64) queries
    window=st.one_of(st.just(0), st.integers(1, 150)),
    splits=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_a_paged_prefill_equals_its_queries_one_by_one_and_the_reference(
    layout, dtype, bs, dim, group, new, held, window, splits, seed
):
    """A prefill's query chunks (more than 32 query rows: where ``cpu_prefill`` applies,
    each head's positions gathered and its passes taken as matrix products) against each
    query alone (a decode step's 4 rows: the page-by-page tiles they replace) over the
    same pages, and both against float64; every output row written. On AVX-512 targets
    the tiles take both (``cpu_prefill.TAKEN``), and this holds them to each other and the
    reference still; the AVX2 and SSE2 subprocesses of ``tests/test_cpu_targets.py`` run
    a paged prefill through the gathered path there."""
    from nbkv.dtypes import widen_table
    from nbkv.kernels import paged_attend, paged_attend_hnd

    from conftest import dtype_of

    dt = dtype_of(dtype)
    rng = np.random.default_rng(seed)
    kvh, seq = 2, held + new
    K, V = (rng.standard_normal((seq, kvh, dim)).astype(dt) for _ in range(2))
    n_pages = -(-seq // bs)
    pages = rng.permutation(n_pages + 2)[:n_pages].astype(np.int32)
    pools = []
    for X in (K, V):
        bits = X.view(np.uint16) if dt.itemsize == 2 else X
        pool = np.full((n_pages + 2, bs, kvh, dim), 0x7FC0 if dt.itemsize == 2 else np.nan,
                       bits.dtype)  # fmt: skip
        for i, p in enumerate(pages):
            rows = bits[i * bs : (i + 1) * bs]
            pool[p, : len(rows)] = rows
        pools.append(pool if layout == "nhd" else np.ascontiguousarray(pool.transpose(0, 2, 1, 3)))
    attend = paged_attend if layout == "nhd" else paged_attend_hnd
    table = widen_table(dt) if dt.itemsize == 2 else None
    q = rng.standard_normal((new, kvh * group, dim)).astype(np.float32)
    scale = float(dim) ** -0.5
    i32 = np.int32
    kv_indptr = np.array([0, n_pages], i32)

    def run(qs, seq_len):
        out = np.full_like(qs, np.nan)
        attend(qs, *pools, np.array([0, len(qs)], i32), kv_indptr, pages,
               np.array([seq_len], i32), scale, window, out, table, splits)  # fmt: skip
        return out

    chunk = run(q, seq)
    assert not np.isnan(chunk).any()  # every row written
    want = reference.attention(
        q.transpose(1, 0, 2)[None].astype(np.float64),
        K.astype(np.float64).transpose(1, 0, 2)[None],
        V.astype(np.float64).transpose(1, 0, 2)[None],
        scale=scale,
        window=window or None,
    )[0].transpose(1, 0, 2)
    np.testing.assert_allclose(chunk, want, atol=3e-5, rtol=0)
    for i in range(new):  # each query alone (at most 5 rows: the tiles), ending there
        alone = run(q[i : i + 1], held + i + 1)
        np.testing.assert_allclose(chunk[i], alone[0], atol=2e-5, rtol=0)
