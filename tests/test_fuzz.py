"""Fuzzing, seeded and short: mutated files through load and load_state, and bad arguments
through every public entry point. The promise under test: a typed nbkv error or a correct
result, and after an error the cache exactly as it was.

Each test runs a fixed number of cases from a fixed seed (a failure names its case, so it
reruns alone with ``-k`` and the same seed); ``NBKV_FUZZ_CASES`` scales them up for a
longer campaign.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

import nbkv

from conftest import DEVICE, SIMULATOR, assert_bits_equal, host, randn
from test_errors import assert_same, snapshot

SCALE = float(os.environ.get("NBKV_FUZZ_CASES", "1"))
FILE_CASES = int((300 if SIMULATOR else 2500) * SCALE)
CALL_CASES = int((300 if SIMULATOR else 2500) * SCALE)


def caches(rng):
    """A few caches of every type, holding random data."""
    plain = nbkv.LayerKVCache(
        12, batch=2, num_kv_heads=2, head_dim=3, dtype="float16", device=DEVICE
    )
    plain.append(randn(rng, (2, 2, 5, 3), "float16"), randn(rng, (2, 2, 5, 3), "float16"))
    ring = nbkv.RotatingKVCache(
        4, sinks=1, batch=1, num_kv_heads=1, head_dim=2, device=DEVICE, layout="bshd"
    )
    ring.append(randn(rng, (1, 7, 1, 2), "float32"), randn(rng, (1, 7, 1, 2), "float32"))
    grow = nbkv.LayerKVCache(2, on_overflow="grow", grow_step=3, device=DEVICE)
    grow.append(randn(rng, (1, 1, 4, 2), "float64"), randn(rng, (1, 1, 4, 2), "float64"))
    lazy = nbkv.LayerKVCache(8, head_dim=4, device=DEVICE)
    mixed = nbkv.KVCache.from_layers([ring.copy(), grow.copy()])
    return {"plain": plain, "ring": ring, "grow": grow, "lazy": lazy, "mixed": mixed}


def layers_of(cache):
    return list(cache) if isinstance(cache, nbkv.KVCache) else [cache]


def state(cache):
    return [(snapshot(x), x.offset, x.max_seq_len) for x in layers_of(cache)]


def assert_unchanged(before, cache):
    for (snap, offset, cap), layer in zip(before, layers_of(cache), strict=True):
        assert_same(snap, snapshot(layer))
        assert (layer.offset, layer.max_seq_len) == (offset, cap)


def mutate(raw: bytes, rng: np.random.Generator) -> bytes:
    """One random corruption: flipped bits, cut, spliced or repeated bytes, a header
    length or a JSON token changed."""
    b = bytearray(raw)
    n = struct.unpack("<Q", raw[:8])[0]
    kind = rng.integers(8)
    if kind == 0:  # flip bits anywhere
        for _ in range(rng.integers(1, 4)):
            b[rng.integers(len(b))] ^= 1 << rng.integers(8)
    elif kind == 1:  # flip a bit in the header JSON
        b[8 + rng.integers(n)] ^= 1 << rng.integers(8)
    elif kind == 2:  # truncate
        b = b[: rng.integers(len(b))]
    elif kind == 3:  # splice in random bytes
        at = rng.integers(len(b))
        b[at:at] = rng.integers(0, 256, rng.integers(1, 40), dtype=np.uint8).tobytes()
    elif kind == 4:  # delete a run
        at = rng.integers(len(b))
        del b[at : at + rng.integers(1, 40)]
    elif kind == 5:  # a wrong header length
        b[:8] = struct.pack("<Q", int(rng.choice([0, 1, n - 1, n + 1, 2**63, len(b), 2**20])))
    elif kind == 6:  # replace a digit of the header by another (JSON stays valid)
        digits = [i for i in range(8, 8 + n) if chr(b[i]).isdigit()]
        if digits:
            b[int(rng.choice(digits))] = ord(str(rng.integers(10)))
    else:  # repeat the data region
        b += b[8 + n :]
    return bytes(b)


@pytest.mark.parametrize("name", ["plain", "ring", "grow", "lazy", "mixed"])
def test_mutated_files_load_correctly_or_raise_cache_format_error(tmp_path, rng, name):
    cache = caches(rng)[name]
    path = tmp_path / "c.safetensors"
    nbkv.save(path, cache)
    raw = path.read_bytes()
    twin = cache.copy()
    before = state(twin)
    outcomes = {"refused": 0, "loaded": 0}
    for case in range(FILE_CASES // 5):
        bad = mutate(raw, np.random.default_rng([case, len(name)]))
        path.write_bytes(bad)
        try:
            back = nbkv.load(path, device=DEVICE)
        except nbkv.CacheFormatError:
            outcomes["refused"] += 1
        except Exception as err:  # noqa: BLE001 - anything else is the finding
            raise AssertionError(f"case {case}: load raised {err!r}") from err
        else:  # only a file whose every checksum holds loads, and then as it was saved
            outcomes["loaded"] += 1
            for got, want in zip(layers_of(back), layers_of(cache), strict=True):
                assert (got.seq_len, got.offset, got.max_seq_len) == (
                    want.seq_len,
                    want.offset,
                    want.max_seq_len,
                )
                if want.seq_len:
                    for g, w in zip(got.get_kv(), want.get_kv(), strict=True):
                        assert_bits_equal(g, host(w, want.dtype))
        try:
            twin.load_state(path)
        except nbkv.KVCacheError:
            assert_unchanged(before, twin)
        except Exception as err:  # noqa: BLE001
            raise AssertionError(f"case {case}: load_state raised {err!r}") from err
        else:
            before = state(twin)
    assert outcomes["refused"] > outcomes["loaded"]  # the mutations do reach the checks


# -- bad arguments ----------------------------------------------------------------------

JUNK = [
    None, True, -1, 0, 1, 3, 2**31, 2**62, 2**70, 1.5, float("nan"), -0.0, "x", "bhsd", "",
    b"bhsd", [1], [0, 0], (), {}, np.int64(2), np.float32(1), np.array([1, 2]),
    np.array("bhsd"), object(), np.bool_(True),
]  # fmt: skip


# never a real file name: a fuzzed save must not write into the working folder
NOT_PATHS = [None, 3, -1, b"x.safetensors", [1], (), {}, object(), np.array("x"), "", 1.5]
TUNABLES = ["ATTENTION_SPLITS", "MAX_BLOCKS", "THREADS_PER_BLOCK", "ATTENTION_ROWS", "nonsense"]


def junk(rng, pool=JUNK):
    return pool[rng.integers(len(pool))]


def some_array(rng, cache):
    """An array near what the cache takes: right or wrong in rank, size, dtype, order."""
    dims = [cache.batch or 1, cache.num_kv_heads or 1, 2, cache.head_dim or 2]
    if cache.layout == "bshd":
        dims[1], dims[2] = dims[2], dims[1]
    kind = rng.integers(7)
    if kind == 1:
        dims[rng.integers(4)] += int(rng.integers(1, 3))
    elif kind == 2:
        dims = dims[: rng.integers(4)]
    elif kind == 3:
        dims[rng.integers(4)] = 0
    dtype = cache.dtype or np.float32
    if kind == 4:
        dtype = [np.float32, np.float64, np.float16, np.int32, np.bool_][rng.integers(5)]
    x = randn(rng, tuple(dims), dtype) if dtype != np.bool_ else np.zeros(dims, bool)
    if kind == 5 and x.ndim == 4:
        x = x.transpose(0, 1, 3, 2)
    if kind == 6:
        x = x.tolist()
    return x


def a_call(rng, cache):
    """A random call on ``cache`` (or nbkv's functions), with mostly bad arguments."""
    k, v = some_array(rng, cache), some_array(rng, cache)
    heads = (cache.num_kv_heads or 1) * int(rng.choice([1, 2, 3]))
    q_shape = (cache.batch or 1, heads, int(rng.integers(0, 4)), cache.head_dim or 2)
    q = randn(rng, q_shape, "float32") if rng.random() < 0.8 else junk(rng)
    opt = {
        "window": junk(rng) if rng.random() < 0.5 else None,
        "scale": junk(rng) if rng.random() < 0.3 else None,
        "causal": junk(rng) if rng.random() < 0.2 else True,
    }
    calls = [
        lambda: cache.append(k, v),
        lambda: cache.append(junk(rng), v),
        lambda: nbkv.attention(q, cache, **opt),
        lambda: nbkv.append_and_attend(q, k, v, cache, **opt),
        lambda: cache.crop(junk(rng)),
        lambda: cache.trim(junk(rng)),
        lambda: cache.reorder(junk(rng)),
        lambda: cache.select(junk(rng)),
        lambda: cache.check_room(junk(rng)),
        lambda: nbkv.save(junk(rng, NOT_PATHS), cache),
        lambda: nbkv.load(junk(rng, NOT_PATHS)),
        lambda: cache.load_state(junk(rng, NOT_PATHS)),
        lambda: nbkv.LayerKVCache(junk(rng), batch=junk(rng), device=DEVICE),
        lambda: nbkv.LayerKVCache(8, layout=junk(rng), device=DEVICE),
        lambda: nbkv.LayerKVCache(8, dtype=junk(rng), on_overflow=junk(rng), device=DEVICE),
        lambda: nbkv.RotatingKVCache(junk(rng), sinks=junk(rng), device=DEVICE),
        lambda: nbkv.KVCache(junk(rng), junk(rng), device=DEVICE),
        lambda: nbkv.KVCache.from_layers(junk(rng)),
        lambda: nbkv.attention(q, (k, v), layout=junk(rng)),
        lambda: nbkv.attention_grid(*(junk(rng) for _ in range(5)), sm_count=junk(rng)),
        lambda: _override({junk(rng, TUNABLES): junk(rng)}),
    ]
    return int(rng.integers(len(calls))), calls


def _override(values):
    with nbkv.override_tunables(**values):  # restored on the way out
        return nbkv.tunables()


def test_bad_arguments_raise_typed_errors_and_change_nothing(rng):
    pool = caches(rng)
    names = sorted(pool)
    seen = set()
    for case in range(CALL_CASES):
        crng = np.random.default_rng([case, 7])
        name = names[crng.integers(len(names))]
        cache = pool[name]
        target = cache[0] if isinstance(cache, nbkv.KVCache) else cache
        which, calls = a_call(crng, target)
        before = state(cache)
        try:
            result = calls[which]()
        except nbkv.KVCacheError:
            assert_unchanged(before, cache)
            seen.add((which, "error"))
            continue
        except Exception as err:  # noqa: BLE001 - a raw exception is the finding
            raise AssertionError(f"case {case} (call {which} on {name}): {err!r}") from err
        seen.add((which, "ok"))
        del result
        if which in (0, 3) and target.seq_len > 8:
            target.clear()  # keep room for more appends
    assert len(seen) >= 25  # most calls were reached, failing and succeeding
