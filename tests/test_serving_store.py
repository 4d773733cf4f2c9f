"""The paged cache's second tier: blocks out (prefix_keys, read_blocks), blocks in
(load_prefix), and an Engine with a store: the same tokens as without one, whatever the
store does (hits, misses, garbage, errors, another model); on this run's backend.

The Redis-backed cases (two engines in two processes, a server killed mid-run, records
corrupted in the server) are at the end; they start a real ``redis-server``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nbkv
from nbkv.errors import (
    ArgumentTypeError,
    DTypeMismatchError,
    InvalidArgumentError,
    OutOfBlocksError,
    ShapeMismatchError,
    StoreError,
)
from nbkv.models import Llama
from nbkv.serving import Engine
from nbkv.store import LocalStore

import redis_server as rs
from conftest import DEVICE, dtype_of, host, randn

redis_url = rs.redis_url  # the fixture (tests/redis_server.py), under its own name

SIM = DEVICE == "cuda"  # the simulator runs every CUDA thread in Python: fewer tokens
NEW = 3 if SIM else 8
# the simulator runs every CUDA thread in Python: a short prefix in small blocks there
PREFIX = (
    b"class Cache:\n"
    if SIM
    else b"class Cache:\n    def __init__(self, size):\n        self.size = size\n"
)
BLOCK = 4 if SIM else 16
cpu_engine = pytest.mark.skipif(
    SIM,
    reason="the tier's logic is the same on both backends: the simulator runs the block "
    "copies above and one engine test",
)


@pytest.fixture(scope="module")
def model():
    return Llama.default()


class DictStore:
    """The three-method store protocol over a dict, recording every call."""

    def __init__(self):
        self.data, self.calls = {}, []

    def put(self, key, value):
        self.calls.append("put")
        self.data[key] = value

    def get(self, key):
        self.calls.append("get")
        return self.data.get(key)

    def contains(self, keys):
        return [k in self.data for k in keys]


class BrokenStore(DictStore):
    """Raises on every call, as a store that is down."""

    def put(self, key, value):
        raise StoreError("down")

    def get(self, key):
        raise StoreError("down")


def prompts(n=4):
    tails = [b"  def get", b"  def put(self, k", b"  def __len__", b"  # cap"]
    return [np.frombuffer(PREFIX + tails[i % 4], np.uint8).astype(np.int64) for i in range(n)]


def alone(model, ps):
    return [model.generate(p, NEW)[0] for p in ps]


def filled_cache(rng, dtype="float32", layout="nhd", n=40, block_size=8, **kw):
    """A prefix-caching paged cache holding ``n`` random positions of one sequence."""
    dt = dtype_of(dtype)
    cache = nbkv.PagedKVCache(
        kw.pop("num_blocks", 16), block_size, num_layers=2, num_kv_heads=2, head_dim=4,
        dtype=dt, device=DEVICE, layout=layout, prefix_caching=True,
    )  # fmt: skip
    tokens = rng.integers(0, 256, n)
    sid = cache.add(tokens)
    step = cache.reserve({sid: tokens})
    for layer in range(2):
        k = randn(rng, (n, 2, 4), dt)
        cache.write(layer, step, k, randn(rng, (n, 2, 4), dt))
    return cache, sid, tokens


def state(cache):
    return (
        cache.stats(), cache.block_refs().tolist(), cache.cached_blocks().tolist(),
        cache.num_free_blocks,
    )  # fmt: skip


# -- blocks out and in -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_blocks_read_from_one_cache_and_loaded_into_another_read_back_the_same(rng, dtype, layout):
    src, sid, tokens = filled_cache(rng, dtype, layout)
    full = len(tokens) // src.block_size
    k, v = src.read_blocks(src.block_table(sid)[:full])
    assert k.shape == (2, full, *src.block_shape) and k.dtype == dtype_of(dtype)
    dst = nbkv.PagedKVCache(
        16, src.block_size, num_layers=2, num_kv_heads=2, head_dim=4, dtype=dtype_of(dtype),
        device=DEVICE, layout=layout, prefix_caching=True,
    )  # fmt: skip
    assert dst.prefix_keys(tokens) == src.prefix_keys(tokens)  # the same chain of keys
    got = dst.load_prefix(tokens, k[:, :2], v[:, :2], first_block=0)  # two, then the rest
    assert got == 2 * src.block_size == dst.match(tokens)[0]
    got = dst.load_prefix(tokens, k[:, 2:], v[:, 2:], first_block=2)
    assert got == full * src.block_size
    assert dst.match(tokens) == (min(got, (len(tokens) - 1) // 8 * 8), (len(tokens) - 1) // 8)
    new = dst.add(tokens)
    held = dst.seq_len(new)
    for layer in range(2):
        for a, b in zip(src.get_kv(layer, sid), dst.get_kv(layer, new), strict=True):
            np.testing.assert_array_equal(host(a)[:, :held].view(np.uint8), host(b).view(np.uint8))


def test_prefix_keys_are_the_chain_of_full_blocks(rng):
    cache, _, tokens = filled_cache(rng, n=21, block_size=4)
    keys = cache.prefix_keys(tokens)
    assert len(keys) == 5 and len(set(keys)) == 5 and all(len(k) == 32 for k in keys)
    assert cache.prefix_keys(tokens[:8]) == keys[:2]
    other = tokens.copy()
    other[0] += 1  # a different first token changes every key after it
    assert not set(cache.prefix_keys(other)) & set(keys)


def test_load_prefix_never_evicts_the_blocks_it_extends(rng):
    cache, sid, tokens = filled_cache(rng, n=32, block_size=8, num_blocks=5)
    k, v = cache.read_blocks(cache.block_table(sid))
    cache.free(sid)  # four cached blocks, one free; extend the first two by two blocks
    longer = np.concatenate([tokens[:16], tokens[16:] + 1, tokens[:1]])
    assert cache.match(longer)[0] == 16
    got = cache.load_prefix(longer, k[:, 2:], v[:, 2:], first_block=2)
    assert got == 32 and cache.match(longer)[0] == 32


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda c, t, k, v: c.load_prefix(t, k, v, first_block=1), InvalidArgumentError),
        (lambda c, t, k, v: c.load_prefix(t[:8], k, v, first_block=0), InvalidArgumentError),
        (lambda c, t, k, v: c.load_prefix(t, k[:, :, :1], v, first_block=0), ShapeMismatchError),
        (lambda c, t, k, v: c.load_prefix(t, k, v[:, :1], first_block=0), ShapeMismatchError),
        (lambda c, t, k, v: c.load_prefix(t, k.astype("f8"), v, first_block=0), DTypeMismatchError),
        (lambda c, t, k, v: c.load_prefix(t, k.tolist(), v, first_block=0), ArgumentTypeError),
        (lambda c, t, k, v: c.load_prefix("abc", k, v, first_block=0), ArgumentTypeError),
        (lambda c, t, k, v: c.load_prefix(t, k, v, first_block=-1), InvalidArgumentError),
        (lambda c, t, k, v: c.read_blocks([0, 99]), InvalidArgumentError),
        (lambda c, t, k, v: c.read_blocks([[0]]), ArgumentTypeError),
        (lambda c, t, k, v: c.read_blocks([0.5]), ArgumentTypeError),
        (lambda c, t, k, v: c.prefix_keys(3.5), ArgumentTypeError),
    ],
)  # fmt: skip
def test_bad_block_calls_are_typed_errors_that_change_nothing(rng, call, error):
    src, sid, tokens = filled_cache(rng, n=24, block_size=8)
    k, v = src.read_blocks(src.block_table(sid))
    dst, _, _ = filled_cache(rng, n=8, block_size=8)
    before = state(dst)
    with pytest.raises(error):
        call(dst, tokens, k, v)
    assert state(dst) == before


def test_load_prefix_needs_room_and_prefix_caching(rng):
    src, sid, tokens = filled_cache(rng, n=24, block_size=8)
    k, v = src.read_blocks(src.block_table(sid))
    full, _, _ = filled_cache(rng, n=24, block_size=8, num_blocks=4)  # one block spare
    before = state(full)
    with pytest.raises(OutOfBlocksError):
        full.load_prefix(tokens, k, v, first_block=0)
    assert state(full) == before
    plain = nbkv.PagedKVCache(8, 8, num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
    with pytest.raises(InvalidArgumentError, match="prefix_caching"):
        plain.load_prefix(tokens, k, v, first_block=0)


def test_a_copy_that_fails_part_way_leaves_no_block_keyed(rng, monkeypatch):
    src, sid, tokens = filled_cache(rng, n=24, block_size=8)
    k, v = src.read_blocks(src.block_table(sid))
    dst, _, _ = filled_cache(rng, n=8, block_size=8)
    calls = []
    be = dst.view(0, dst.reserve({dst.seq_ids[0]: [1]})).backend  # (a step, then none)
    real = be.write_paged

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:  # the second layer's copy
            raise MemoryError("injected")
        return real(*args)

    monkeypatch.setattr(be, "write_paged", failing)
    before = dst.match(tokens)
    with pytest.raises(MemoryError):
        dst.load_prefix(tokens, k, v, first_block=0)
    monkeypatch.undo()
    assert dst.match(tokens) == before  # nothing found that was not fully written
    assert dst.load_prefix(tokens, k, v, first_block=0) == 24  # and it still works


# -- an engine with a store ---------------------------------------------------------------


def serve(model, store, ps, **kw):
    engine = Engine(model, device=DEVICE, block_size=BLOCK, store=store, **kw)
    out = engine.generate(ps, max_new_tokens=NEW)
    assert engine.flush(timeout=60)
    engine.close()
    return out, engine.stats()


def test_a_second_engine_loads_the_prefix_the_first_published(model):
    ps, store = prompts(), DictStore()
    want = alone(model, ps)
    got1, s1 = serve(model, store, ps)
    got2, s2 = serve(model, store, ps)
    for a, b, w in zip(got1, got2, want, strict=True):
        np.testing.assert_array_equal(a, w)
        np.testing.assert_array_equal(b, w)
    assert s1["store_published_blocks"] == len(store.data) > 0
    assert s1["store_bytes_written"] == sum(len(r) for r in store.data.values())
    blocks = len(PREFIX) // BLOCK  # the full blocks of the shared prefix
    assert s2["store_hit_blocks"] >= blocks  # the first admission loads the shared prefix
    assert s2["store_rejected"] == s2["store_errors"] == 0
    assert s2["store_published_blocks"] < s1["store_published_blocks"]  # hits are not re-sent


@cpu_engine
def test_garbage_truncated_and_foreign_records_cost_recomputation_only(model):
    ps, store = prompts(2), DictStore()
    want = alone(model, ps)
    serve(model, store, ps)
    keys = sorted(store.data)
    for i, key in enumerate(keys):  # every way a record can be wrong
        rec = store.data[key]
        wrong = [rec[: len(rec) // 2], rec[:-1] + bytes([rec[-1] ^ 1]), b"", os.urandom(64)]
        store.data[key] = wrong[i % 4]
    got, s = serve(model, store, ps)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert s["store_hit_blocks"] == 0 and s["store_rejected"] >= 1


@cpu_engine
def test_another_model_or_block_size_never_shares_blocks(model):
    ps, store = prompts(2), DictStore()
    serve(Llama.seeded(0), store, ps)  # another model's blocks under its own keys
    _, s = serve(model, store, ps)
    assert s["store_hit_blocks"] == 0 and s["store_rejected"] == 0  # absent, not refused
    other = DictStore()
    Engine(model, block_size=8, store=other).generate(ps, max_new_tokens=1)  # (8, not 16)
    _, s = serve(model, other, ps)
    assert s["store_hit_blocks"] == 0


@cpu_engine
def test_a_store_that_is_down_costs_recomputation_and_is_backed_off(model):
    ps = prompts(4)
    got, s = serve(model, BrokenStore(), ps)
    for g, w in zip(got, alone(model, ps), strict=True):
        np.testing.assert_array_equal(g, w)
    assert s["store_errors"] >= 2  # a lookup and a publication failed
    assert s["store_skipped"] >= 1  # later admissions did not wait on it
    assert s["store_hit_blocks"] == 0


@cpu_engine
def test_engine_store_arguments_are_checked(model):
    with pytest.raises(ArgumentTypeError, match="store"):
        Engine(model, store=object())
    with pytest.raises(InvalidArgumentError, match="prefix_caching"):
        Engine(model, store=DictStore(), prefix_caching=False)
    engine = Engine(model)
    assert engine.flush() is True and "store_hit_blocks" not in engine.stats()
    # flush's timeout, with and without a store: a typed error naming it, nothing waited
    for e in (engine, Engine(model, store=DictStore())):
        for bad in ("1", [1], True):
            with pytest.raises(ArgumentTypeError, match="timeout"):
                e.flush(timeout=bad)
        for bad in (-1, -0.5, float("nan")):
            with pytest.raises(InvalidArgumentError, match="timeout"):
                e.flush(timeout=bad)
        assert e.flush(timeout=0) is True and e.flush(timeout=np.float32(1.5)) is True


@cpu_engine
def test_a_local_store_serves_a_second_engine(model, tmp_path):
    ps = prompts(2)
    want = alone(model, ps)
    serve(model, LocalStore(tmp_path / "kv", max_bytes=64 << 20), ps)
    got, s = serve(model, LocalStore(tmp_path / "kv", max_bytes=64 << 20), ps)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert s["store_hit_blocks"] > 0


# -- through a real Redis, in other processes --------------------------------------------------

_CHILD = """
import json, sys
import numpy as np
from nbkv.models import Llama
from nbkv.serving import Engine
from nbkv.store import RedisStore
url, new, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
engine = Engine(Llama.default(), block_size=16, store=RedisStore(url, timeout=0.5))
out = engine.generate([np.array(p) for p in prompts], max_new_tokens=new)
engine.flush(timeout=60)
print(json.dumps({"out": [o.tolist() for o in out], "stats": engine.stats()}))
"""


def child(url, ps):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, url, str(NEW), json.dumps([p.tolist() for p in ps])],
        capture_output=True, text=True, check=True, env=env, timeout=600,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(SIM, reason="the processes serve on the CPU")
def test_two_engines_in_two_processes_share_a_prefix_through_redis(model, redis_url):
    ps = prompts(4)
    want = [w.tolist() for w in alone(model, ps)]
    first = child(redis_url, ps)
    second = child(redis_url, ps)
    assert first["out"] == want and second["out"] == want
    assert first["stats"]["store_published_blocks"] > 0
    assert second["stats"]["store_hit_blocks"] >= len(PREFIX) // 16
    assert second["stats"]["store_errors"] == 0


@pytest.mark.skipif(SIM, reason="the server is checked on the CPU")
def test_redis_killed_mid_run_or_records_corrupted_in_it_cost_recomputation(model):
    from nbkv.store import RedisStore

    redis = rs.require_redis_client()
    ps = prompts(2)
    want = alone(model, ps)
    with rs.redis_server() as server:
        store = RedisStore(server.url, timeout=0.5)
        serve(model, store, ps)
        client = redis.Redis.from_url(server.url)
        corrupt_and_kill(model, store, client, server, ps, want)


def corrupt_and_kill(model, store, client, server, ps, want):
    keys = client.keys("nbkv:*")
    assert keys
    for i, key in enumerate(keys):  # truncated, flipped, emptied
        rec = client.get(key)
        client.set(key, [rec[:100], rec[:-5] + b"xxxxx", b""][i % 3])
    got, s = serve(model, store, ps)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert s["store_hit_blocks"] == 0 and s["store_rejected"] >= 1
    server.kill()
    got, s = serve(model, store, ps)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert s["store_errors"] >= 1 and s["store_hit_blocks"] == 0
