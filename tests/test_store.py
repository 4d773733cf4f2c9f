"""nbkv.store: the store protocol, LocalStore (a directory), RedisStore (a real
redis-server, started by tests/redis_server.py) and the block record format."""

from __future__ import annotations

import errno
import os
import socket
import struct
import sys
import time
import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbkv import store as S
from nbkv.errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    CacheFormatError,
    DTypeMismatchError,
    InvalidArgumentError,
    KVCacheError,
    ShapeMismatchError,
    StoreError,
)

import redis_server as rs
from conftest import cpu_only, dtype_of

pytestmark = cpu_only

redis_url = rs.redis_url  # the fixture (tests/redis_server.py), under its own name


def files(root) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> contents): what a failed call must keep."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


# --- LocalStore -----------------------------------------------------------------------


def test_local_round_trip_miss_and_contains(tmp_path):
    s = S.LocalStore(tmp_path / "kv", max_bytes=10_000)
    assert isinstance(s, S.Store)
    s.put(b"\x01\x02", b"hello")
    s.put(b"\xff", b"")
    assert s.get(b"\x01\x02") == b"hello" and s.get(b"\xff") == b""
    assert s.get(b"\x03") is None
    assert s.contains([b"\x01\x02", b"\x03", b"\xff"]) == [True, False, True]
    assert s.contains([]) == []
    assert s.nbytes == 5
    s.put(b"\x01\x02", b"bye")  # replaces
    assert s.get(b"\x01\x02") == b"bye" and s.nbytes == 3
    assert (tmp_path / "kv" / "01" / "0102").read_bytes() == b"bye"  # the documented layout
    assert repr(s) == f"LocalStore({str(tmp_path / 'kv')!r}, max_bytes=10000)"
    s.clear()
    assert s.nbytes == 0 and s.get(b"\xff") is None


def test_local_get_many_and_put_many(tmp_path):
    s = S.LocalStore(tmp_path, max_bytes=10_000)
    s.put_many([(b"a", b"1"), (b"b", b"22")])
    assert s.get_many([b"b", b"x", b"a"]) == [b"22", None, b"1"]
    S.put_many(s, [(b"c", b"333")])
    assert S.get_many(s, [b"c", b"a", b"y"]) == [b"333", b"1", None]
    assert S.get_many(s, []) == [] and s.put_many([]) is None


class ThreeMethods:
    """A user's store with only the protocol's three methods."""

    def __init__(self):
        self.d, self.calls = {}, []

    def put(self, key, value):
        self.calls.append("put")
        self.d[key] = value

    def get(self, key):
        self.calls.append("get")
        return self.d.get(key)

    def contains(self, keys):
        return [k in self.d for k in keys]


class Batched(ThreeMethods):
    def get_many(self, keys):
        self.calls.append("get_many")
        return [self.d.get(k) for k in keys]

    def put_many(self, items):
        self.calls.append("put_many")
        self.d.update(items)


def test_module_functions_loop_over_a_three_method_store_and_batch_where_they_can():
    plain, batched = ThreeMethods(), Batched()
    for s in (plain, batched):
        assert isinstance(s, S.Store)
        S.put_many(s, [(b"a", b"1"), (b"b", b"2")])
        assert S.get_many(s, [b"a", b"z", b"b"]) == [b"1", None, b"2"]
    assert plain.calls == ["put", "put", "get", "get", "get"]
    assert batched.calls == ["put_many", "get_many"]
    with pytest.raises(ArgumentTypeError, match="store must have put, get and contains"):
        S.get_many(object(), [b"a"])
    with pytest.raises(ArgumentTypeError, match=r"keys\[1\] must be bytes"):
        S.get_many(plain, [b"a", "b"])
    with pytest.raises(ArgumentTypeError, match=r"items\[0\] must be a \(key, value\)"):
        S.put_many(plain, [b"ab"])
    assert plain.d == {b"a": b"1", b"b": b"2"}  # unchanged

    class Short(Batched):
        def get_many(self, keys):
            return []

    with pytest.raises(StoreError, match="returned 0 values for 1 keys"):
        S.get_many(Short(), [b"a"])


def test_local_evicts_the_least_recently_used_past_max_bytes(tmp_path):
    s = S.LocalStore(tmp_path, max_bytes=350)
    for key in (b"a", b"b", b"c"):
        s.put(key, key * 100)
    assert s.get(b"a") == b"a" * 100  # a is now more recent than b and c
    s.put(b"d", b"d" * 100)  # 400 bytes > 350: the oldest (b) goes
    assert s.contains([b"a", b"b", b"c", b"d"]) == [True, False, True, True]
    assert s.nbytes == 300
    s.put(b"e", b"e" * 100)  # then c, the oldest
    assert s.contains([b"a", b"c", b"d", b"e"]) == [True, False, True, True]
    assert s.nbytes <= s.max_bytes


def test_local_eviction_sees_other_processes_values_and_keeps_the_new_one(tmp_path):
    other = S.LocalStore(tmp_path, max_bytes=1000)
    other.put_many([(bytes([i]), bytes(100)) for i in range(9)])  # 900 bytes
    s = S.LocalStore(tmp_path, max_bytes=1000)
    s.put(b"big", bytes(950))  # only the value just written may stay
    assert s.get(b"big") == bytes(950) and s.nbytes == 950
    assert other.get_many([bytes([i]) for i in range(9)]) == [None] * 9


def test_local_a_value_larger_than_max_bytes_is_not_kept(tmp_path):
    s = S.LocalStore(tmp_path, max_bytes=10)
    s.put(b"k", b"small")
    s.put(b"j", b"0123456789")  # exactly max_bytes: kept
    assert s.get(b"j") == b"0123456789"
    s.put(b"k", b"x" * 11)
    assert s.get(b"k") is None  # nothing, not the older value
    assert s.nbytes <= 10


@pytest.mark.parametrize("fails", ["write", "fsync", "replace"])
def test_local_failed_write_raises_store_error_and_keeps_the_old_value(
    tmp_path, monkeypatch, fails
):
    s = S.LocalStore(tmp_path, max_bytes=10_000)
    s.put(b"k", b"old")
    before = files(tmp_path)

    def boom(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if fails == "write":
        real_open = open

        class Full:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            write = boom

        monkeypatch.setattr(
            "builtins.open", lambda fd, mode="r", *a, **k: Full(real_open(fd, mode))
        )
    else:
        monkeypatch.setattr(os, fails, boom)
    with pytest.raises(StoreError, match=r"LocalStore at .*writing .*No space left") as err:
        s.put(b"k", b"new value")
    assert str(tmp_path) in str(err.value)
    monkeypatch.undo()
    assert files(tmp_path) == before  # no temporary file left, nothing half-written
    assert s.get(b"k") == b"old"
    with pytest.raises(StoreError):
        monkeypatch.setattr(os, "replace", boom)
        s.put(b"new", b"v")
    monkeypatch.undo()
    assert s.get(b"new") is None and s.nbytes == 3


def test_local_read_error_raises_store_error(tmp_path):
    s = S.LocalStore(tmp_path, max_bytes=100)
    os.makedirs(tmp_path / "6b" / "6b")  # a directory where the value of b"k" would be
    with pytest.raises(StoreError, match="reading"):
        s.get(b"k")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreError, match="creating the directory"):
        S.LocalStore(tmp_path / "file", max_bytes=100)


def test_local_stale_temporary_files_are_never_read_and_are_cleaned(tmp_path):
    s = S.LocalStore(tmp_path, max_bytes=1000)
    sub = tmp_path / "6b"
    sub.mkdir()
    stale = sub / ".tmp-6b-12345-deadbeef0000"  # a writer of b"k" killed mid-write
    young = sub / ".tmp-6b-12346-deadbeef0001"  # a writer still at work
    stale.write_bytes(b"half a val")
    young.write_bytes(b"half")
    old = time.time() - S.STALE_TMP_SECONDS - 60
    os.utime(stale, (old, old))
    assert s.get(b"k") is None and s.contains([b"k"]) == [False] and s.nbytes == 0
    S.LocalStore(tmp_path, max_bytes=1000)  # opening cleans
    assert not stale.exists() and young.exists()


def test_two_stores_on_one_directory_see_each_others_values(tmp_path):
    a = S.LocalStore(tmp_path, max_bytes=1000)
    b = S.LocalStore(str(tmp_path), max_bytes=1000)
    a.put(b"x", b"from a")
    b.put(b"y", b"from b")
    assert b.get(b"x") == b"from a" and a.get(b"y") == b"from b"
    assert a.nbytes == b.nbytes == 12


def test_a_value_removed_behind_the_stores_back_is_a_miss(tmp_path):
    s = S.LocalStore(tmp_path, max_bytes=1000)
    s.put(b"k", b"value")
    os.unlink(tmp_path / "6b" / "6b")
    assert s.get(b"k") is None and s.contains([b"k"]) == [False] and s.nbytes == 0
    s.put(b"k", b"again")  # and the store goes on
    assert s.get(b"k") == b"again"


LOCAL_BAD = [
    (lambda s: s.put("k", b"v"), ArgumentTypeError, "key must be bytes"),
    (lambda s: s.put(b"", b"v"), InvalidArgumentError, "key must be 1 to 100 bytes"),
    (lambda s: s.put(b"k" * 101, b"v"), InvalidArgumentError, "got 101 bytes"),
    (lambda s: s.put(b"k", "v"), ArgumentTypeError, "value must be bytes, got str"),
    (lambda s: s.put(b"k", bytearray(b"v")), ArgumentTypeError, "got bytearray"),
    (lambda s: s.get(1), ArgumentTypeError, "key must be bytes, got int"),
    (lambda s: s.contains(b"ab"), ArgumentTypeError, "keys must be a sequence"),
    (lambda s: s.contains([b"a", None]), ArgumentTypeError, r"keys\[1\]"),
    (lambda s: s.get_many([b"a", b""]), InvalidArgumentError, r"keys\[1\]"),
    (lambda s: s.put_many([(b"n", b"1"), (b"m", 2)]), ArgumentTypeError, r"items\[1\]\[1\]"),
    (lambda s: s.put_many({b"n": b"1"}), ArgumentTypeError, "items must be a sequence"),
    (lambda s: s.put_many([(b"n", b"1", b"2")]), ArgumentTypeError, r"items\[0\]"),
]


@pytest.mark.parametrize("call,error,match", LOCAL_BAD)
def test_local_bad_arguments_raise_typed_errors_and_change_nothing(tmp_path, call, error, match):
    s = S.LocalStore(tmp_path, max_bytes=1000)
    s.put(b"k", b"old")
    before = files(tmp_path)
    with pytest.raises(error, match=match):
        call(s)
    assert files(tmp_path) == before and s.get(b"k") == b"old"


@pytest.mark.parametrize(
    "path,max_bytes,error,match",
    [
        (1, 10, ArgumentTypeError, "path must be a str or os.PathLike, got int"),
        (b"/tmp/x", 10, ArgumentTypeError, "got bytes"),
        ("", 10, InvalidArgumentError, "path must name a directory"),
        ("new", 0, InvalidArgumentError, "max_bytes must be an int >= 1, got 0"),
        ("new", -5, InvalidArgumentError, "got -5"),
        ("new", 1.5, ArgumentTypeError, "max_bytes must be an int >= 1, got float"),
        ("new", True, ArgumentTypeError, "got bool"),
        ("new", None, ArgumentTypeError, "got NoneType"),
    ],
)
def test_local_bad_construction_raises_typed_errors_and_creates_nothing(
    tmp_path, monkeypatch, path, max_bytes, error, match
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=match):
        S.LocalStore(path, max_bytes=max_bytes)
    assert os.listdir(tmp_path) == []


def test_local_max_bytes_may_exceed_32_bits(tmp_path):
    assert S.LocalStore(tmp_path, max_bytes=2**40).max_bytes == 2**40


# --- RedisStore -----------------------------------------------------------------------


def _client(url):
    return rs.require_redis_client().Redis.from_url(url)


def test_redis_round_trip_miss_contains_and_prefix(redis_url):
    with S.RedisStore(redis_url, prefix="t1:") as s:
        assert isinstance(s, S.Store)
        s.put(b"\x00k", b"value")
        s.put_many([(b"a", b"1"), (b"b", b"")])
        assert s.get(b"\x00k") == b"value" and s.get(b"missing") is None
        assert s.get_many([b"a", b"nope", b"b"]) == [b"1", None, b""]
        assert s.contains([b"a", b"nope", b"\x00k"]) == [True, False, True]
        assert s.get_many([]) == [] and s.contains([]) == [] and s.put_many([]) is None
        assert repr(s) == f"RedisStore({redis_url!r}, ttl=None, prefix='t1:', timeout=1.0)"
    client = _client(redis_url)
    assert sorted(client.keys("*")) == [b"t1:\x00k", b"t1:a", b"t1:b"]
    assert client.pttl(b"t1:a") == -1  # no TTL without ttl
    assert S.RedisStore(redis_url, prefix="other:").get(b"a") is None


def test_redis_get_many_is_one_mget(redis_url):
    client = _client(redis_url)

    def mgets():
        return client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)

    s = S.RedisStore(redis_url)
    s.put_many([(bytes([i]), bytes([i]) * 3) for i in range(1, 20)])
    before = mgets()
    assert S.get_many(s, [bytes([i]) for i in range(1, 25)])[18:20] == [b"\x13" * 3, None]
    assert mgets() == before + 1


def test_redis_ttl_sets_a_ttl(redis_url):
    s = S.RedisStore(redis_url, ttl=30.0, prefix="")
    s.put(b"one", b"1")
    s.put_many([(b"two", b"2")])
    client = _client(redis_url)
    assert 0 < client.pttl(b"one") <= 30_000 and 0 < client.pttl(b"two") <= 30_000
    S.RedisStore(redis_url, ttl=0.05, prefix="").put(b"brief", b"x")
    time.sleep(0.15)
    assert s.get(b"brief") is None  # the server evicted it


def test_redis_server_killed_raises_store_error_on_every_call():
    with rs.redis_server() as server:
        s = S.RedisStore(server.url, timeout=0.5)
        s.put(b"k", b"v")
        assert s.get(b"k") == b"v"
        server.kill()
        calls = {
            "get": lambda: s.get(b"k"),
            "put": lambda: s.put(b"k", b"v"),
            "contains": lambda: s.contains([b"k"]),
            "get_many": lambda: s.get_many([b"k", b"j"]),
            "put_many": lambda: s.put_many([(b"k", b"v")]),
        }
        for name, call in calls.items():
            start = time.monotonic()
            with pytest.raises(StoreError, match=f"RedisStore at {server.url}: .*Error") as err:
                call()
            assert time.monotonic() - start < 3, name
            assert isinstance(err.value, KVCacheError)


def test_redis_out_of_memory_is_a_store_error():
    with rs.redis_server("--maxmemory", "1mb", "--maxmemory-policy", "noeviction") as server:
        s = S.RedisStore(server.url)
        with pytest.raises(StoreError, match="(?i)OOM|maxmemory"):
            for i in range(20):
                s.put(bytes([i + 1]), bytes(200_000))


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_redis_unreachable_raises_store_error_quickly_without_the_password():
    rs.require_redis_client()
    url = f"redis://user:s3cret@127.0.0.1:{_closed_port()}/0?password=s3cret"
    s = S.RedisStore(url, timeout=0.5)
    assert "s3cret" not in repr(s)
    start = time.monotonic()
    with pytest.raises(StoreError, match=r"RedisStore at redis://\*\*\*@127.0.0.1") as err:
        s.get(b"k")
    assert time.monotonic() - start < 2
    assert "s3cret" not in str(err.value) and "password=***" in str(err.value)


def test_redis_a_silent_server_raises_store_error_after_about_the_timeout():
    rs.require_redis_client()
    with socket.socket() as listener:  # accepts connections (the backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        s = S.RedisStore(f"redis://127.0.0.1:{listener.getsockname()[1]}", timeout=0.3)
        start = time.monotonic()
        with pytest.raises(StoreError, match="Timeout"):
            s.put(b"k", b"v")
        assert 0.25 < time.monotonic() - start < 2.5  # one try, no retries with backoff


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"url": 1}, ArgumentTypeError, "url must be a str, got int"),
        ({"url": "http://x"}, InvalidArgumentError, "url must be a redis://"),
        ({"ttl": 0}, InvalidArgumentError, "ttl must be a positive finite number, got 0"),
        ({"ttl": -1.0}, InvalidArgumentError, "ttl"),
        ({"ttl": float("nan")}, InvalidArgumentError, "ttl"),
        ({"ttl": "1"}, ArgumentTypeError, "ttl must be a positive number, got str"),
        ({"ttl": True}, ArgumentTypeError, "got bool"),
        ({"prefix": b"x"}, ArgumentTypeError, "prefix must be a str, got bytes"),
        ({"timeout": 0}, InvalidArgumentError, "timeout"),
        ({"timeout": None}, ArgumentTypeError, "timeout"),
    ],
)
def test_redis_bad_arguments_raise_typed_errors(kwargs, error, match):
    rs.require_redis_client()
    kwargs = {"url": "redis://127.0.0.1:1/0", **kwargs}
    with pytest.raises(error, match=match):
        S.RedisStore(kwargs.pop("url"), **kwargs)


def test_redis_bad_keys_raise_typed_errors_and_send_nothing(redis_url):
    s = S.RedisStore(redis_url)
    for call in (
        lambda: s.put("k", b"v"),
        lambda: s.put(b"k", "v"),
        lambda: s.get_many([b"a", 1]),
        lambda: s.put_many([(b"a", b"1"), (b"", b"2")]),
        lambda: s.contains(b"k"),
    ):
        with pytest.raises((ArgumentTypeError, InvalidArgumentError)):
            call()
    assert _client(redis_url).dbsize() == 0


def test_redis_without_the_client_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(BackendUnavailableError, match=r'pip install "nbkv\[store\]"'):
        S.RedisStore("redis://127.0.0.1:6379/0")


# --- the block record -----------------------------------------------------------------


def geometry(dtype="float32", layout="nhd", **kw) -> S.BlockGeometry:
    fields = {"num_layers": 2, "block_size": 4, "num_kv_heads": 3, "head_dim": 5, **kw}
    return S.BlockGeometry(**fields, dtype=dtype, layout=layout)


def block(rng, g: S.BlockGeometry):
    shape = (g.num_layers, *g.block_shape)
    k = (rng.standard_normal(shape) * 3).astype(dtype_of(g.dtype))
    v = (rng.standard_normal(shape) * 3).astype(dtype_of(g.dtype))
    return k, v


def record_for(rng, g=None, identity=b"model-a"):
    g = g or geometry()
    ns = S.namespace(identity, g)
    key = S.store_key(ns, b"\x07" * 32)
    k, v = block(rng, g)
    return S.encode_block(ns, key, g, k, v), ns, key, g, k, v


def test_block_geometry_shapes_and_sizes():
    assert geometry(layout="nhd").block_shape == (4, 3, 5)
    assert geometry(layout="hnd").block_shape == (3, 4, 5)
    assert geometry("float16").nbytes == 2 * 2 * 4 * 3 * 5 * 2


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_a_record_round_trips_bit_exactly(rng, dtype, layout):
    record, ns, key, g, k, v = record_for(rng, geometry(dtype, layout))
    assert isinstance(record, bytes)
    assert len(record) == S.HEADER_BYTES + g.nbytes + 4
    assert record[:8] == S.MAGIC and struct.unpack_from("<I", record, 8)[0] == S.FORMAT_VERSION
    for r in (record, bytearray(record), memoryview(record)):
        k2, v2 = S.decode_block(r, ns, key, g)
        for a, b in ((k, k2), (v, v2)):
            assert b.dtype == a.dtype and b.shape == a.shape
            assert b.flags.writeable and b.flags.owndata and b.flags.c_contiguous
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_a_non_contiguous_block_is_written_in_c_order(rng):
    g = geometry(layout="hnd")
    k, v = block(rng, geometry(layout="nhd"))
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # views, not C-contiguous
    ns = S.namespace(b"m", g)
    key = S.store_key(ns, b"b")
    k2, v2 = S.decode_block(S.encode_block(ns, key, g, kt, vt), ns, key, g)
    np.testing.assert_array_equal(k2, kt)
    np.testing.assert_array_equal(v2, vt)


def test_namespaces_differ_for_every_model_and_geometry_field():
    g = geometry()
    seen = {S.namespace(b"model-a", g)}
    for other in (
        S.namespace(b"model-b", g),
        S.namespace(b"model-a" + b"\x00", g),
        S.namespace(b"", g),
        S.namespace(b"model-a", g._replace(num_layers=3)),
        S.namespace(b"model-a", g._replace(block_size=8)),
        S.namespace(b"model-a", g._replace(num_kv_heads=1)),
        S.namespace(b"model-a", g._replace(head_dim=6)),
        S.namespace(b"model-a", g._replace(dtype="float16")),
        S.namespace(b"model-a", g._replace(layout="hnd")),
    ):
        assert len(other) == 32 and other not in seen
        seen.add(other)
    assert S.namespace(b"model-a", g) in seen  # deterministic
    ns = S.namespace(b"model-a", g)
    key = S.store_key(ns, b"\x01" * 32)
    assert len(key) == 32 and key == S.store_key(ns, b"\x01" * 32)
    assert key != S.store_key(S.namespace(b"model-b", g), b"\x01" * 32)


def test_a_record_of_another_model_or_geometry_is_refused(rng):
    record, ns, key, g, *_ = record_for(rng)
    with pytest.raises(CacheFormatError, match="another model or geometry"):
        S.decode_block(record, S.namespace(b"model-b", g), key, g)
    with pytest.raises(CacheFormatError, match="another key"):
        S.decode_block(record, ns, S.store_key(ns, b"\x08" * 32), g)
    for other in (g._replace(block_size=8), g._replace(dtype="float16"), g._replace(layout="hnd")):
        with pytest.raises(CacheFormatError, match="another geometry"):
            S.decode_block(record, ns, key, other)
        # and a record written with that geometry, read as this one
        bad = record_for(rng, other)[0]
        with pytest.raises(CacheFormatError, match="another geometry|describes"):
            S.decode_block(bad, ns, key, g)


def _with_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_a_record_of_another_format_version_is_refused(rng):
    record, ns, key, g, *_ = record_for(rng)
    for version in (0, 2, 2**32 - 1):
        other = _with_crc(record[:8] + struct.pack("<I", version) + record[12:-4])
        with pytest.raises(CacheFormatError, match=f"format version {version}, but"):
            S.decode_block(other, ns, key, g)
    with pytest.raises(CacheFormatError, match="not an nbkv block record"):
        S.decode_block(_with_crc(b"NBKV-OLD" + record[8:-4]), ns, key, g)


def test_a_truncated_or_extended_record_is_refused(rng):
    record, ns, key, g, *_ = record_for(rng)
    n = len(record)
    for length in (
        0,
        1,
        7,
        8,
        11,
        12,
        100,
        S.HEADER_BYTES,
        S.HEADER_BYTES + 3,
        n // 2,
        n - 4,
        n - 1,
    ):
        with pytest.raises(CacheFormatError, match="truncated"):
            S.decode_block(record[:length], ns, key, g)
    with pytest.raises(CacheFormatError, match="truncated or corrupted"):
        S.decode_block(record + b"\x00", ns, key, g)


def test_one_flipped_byte_anywhere_is_refused(rng):
    g = S.BlockGeometry(1, 2, 1, 3, "float32", "nhd")
    record, ns, key, *_ = record_for(rng, g)
    for pos in range(len(record)):  # small enough to try every byte
        bad = bytearray(record)
        bad[pos] ^= 0x40
        with pytest.raises(CacheFormatError):
            S.decode_block(bytes(bad), ns, key, g)
    big, ns, key, g, *_ = record_for(rng, geometry("float16"))
    for pos in rng.choice(len(big), 40, replace=False):
        bad = bytearray(big)
        bad[pos] ^= 0x01
        with pytest.raises(CacheFormatError):
            S.decode_block(bytes(bad), ns, key, g)
    bad = bytearray(big)
    bad[S.HEADER_BYTES + 5] ^= 0x01  # in the payload: only the checksum can tell
    with pytest.raises(CacheFormatError, match="checksum mismatch"):
        S.decode_block(bytes(bad), ns, key, g)


@pytest.mark.parametrize("record", ["text", None, [1, 2], np.zeros(4, np.uint8), 12])
def test_a_record_that_is_not_bytes_is_refused(rng, record):
    _, ns, key, g, *_ = record_for(rng)
    with pytest.raises(CacheFormatError, match="must be bytes"):
        S.decode_block(record, ns, key, g)


def test_decoding_checks_the_length_before_allocating(rng):
    # a record claiming a huge payload against a huge expected geometry: refused unread
    g = S.BlockGeometry(2**20, 2**10, 2**10, 2**10, "float32", "nhd")
    ns = S.namespace(b"m", g)
    key = S.store_key(ns, b"k")
    header = struct.pack(
        "<8sIIIII16s4s32s32sQ",
        S.MAGIC,
        S.FORMAT_VERSION,
        *g[:4],
        b"float32",
        b"nhd",
        ns,
        key,
        g.nbytes,
    )
    with pytest.raises(CacheFormatError, match="truncated"):
        S.decode_block(_with_crc(header), ns, key, g)


def test_encoding_bad_blocks_raises_typed_errors(rng):
    g = geometry()
    ns = S.namespace(b"m", g)
    key = S.store_key(ns, b"k")
    k, v = block(rng, g)
    bad = [
        (lambda: S.encode_block(ns, key, g, k[:, :2], v), ShapeMismatchError, "k has shape"),
        (lambda: S.encode_block(ns, key, g, k, v[None]), ShapeMismatchError, "v has shape"),
        (lambda: S.encode_block(ns, key, g, k.astype(np.float16), v), DTypeMismatchError, "k"),
        (lambda: S.encode_block(ns, key, g, k.tolist(), v), ArgumentTypeError, "host numpy"),
        (lambda: S.encode_block(ns[:16], key, g, k, v), InvalidArgumentError, "ns must be 32"),
        (lambda: S.encode_block(ns, key.hex(), g, k, v), ArgumentTypeError, "key must be bytes"),
        (lambda: S.encode_block(ns, key, tuple(g), k, v), ArgumentTypeError, "BlockGeometry"),
        (
            lambda: S.encode_block(ns, key, g._replace(layout="bhsd"), k, v),
            InvalidArgumentError,
            "layout",
        ),
        (
            lambda: S.encode_block(ns, key, g._replace(dtype="f4"), k, v),
            InvalidArgumentError,
            "canonical name 'float32'",
        ),
        (
            lambda: S.encode_block(ns, key, g._replace(dtype="int8"), k, v),
            DTypeMismatchError,
            "geometry.dtype",
        ),
        (
            lambda: S.encode_block(ns, key, g._replace(head_dim=0), k, v),
            InvalidArgumentError,
            "geometry.head_dim",
        ),
        (lambda: S.namespace("m", g), ArgumentTypeError, "model_identity must be bytes"),
        (lambda: S.store_key(ns, b""), ArgumentTypeError, "block_key"),
        (
            lambda: S.decode_block(b"", ns, key, g._replace(num_layers=1.0)),
            ArgumentTypeError,
            "geometry.num_layers",
        ),
    ]
    for call, error, match in bad:
        with pytest.raises(error, match=match):
            call()


def test_a_record_travels_through_a_store(rng, tmp_path):
    record, ns, key, g, k, v = record_for(rng, geometry("float16", "hnd"))
    s = S.LocalStore(tmp_path, max_bytes=2**20)
    s.put(key, record)
    k2, v2 = S.decode_block(s.get(key), ns, key, g)
    np.testing.assert_array_equal(k2.view(np.uint16), k.view(np.uint16))
    np.testing.assert_array_equal(v2.view(np.uint16), v.view(np.uint16))


@given(
    dims=st.tuples(*[st.integers(1, 5)] * 4),
    dtype=st.sampled_from(["float32", "float64", "float16", "bfloat16"]),
    layout=st.sampled_from(["nhd", "hnd"]),
    identity=st.binary(max_size=16),
    block_key=st.binary(min_size=1, max_size=40),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_geometries_round_trip_and_refuse_any_other(
    dims, dtype, layout, identity, block_key, seed
):
    g = S.BlockGeometry(*dims, dtype, layout)
    ns = S.namespace(identity, g)
    key = S.store_key(ns, block_key)
    rng = np.random.default_rng(seed)
    shape = (g.num_layers, *g.block_shape)
    # random bit patterns, NaN payloads and signed zeros included
    itemsize = np.dtype(dtype_of(dtype)).itemsize
    k, v = (
        rng.integers(0, 256, (*shape[:-1], shape[-1] * itemsize), np.uint8).view(dtype_of(dtype))
        for _ in range(2)
    )
    record = S.encode_block(ns, key, g, k, v)
    k2, v2 = S.decode_block(record, ns, key, g)
    assert k2.view(np.uint8).tobytes() == k.view(np.uint8).tobytes()
    assert v2.view(np.uint8).tobytes() == v.view(np.uint8).tobytes()
    other = g._replace(block_size=g.block_size + 1)
    with pytest.raises(CacheFormatError):
        S.decode_block(record, ns, key, other)
