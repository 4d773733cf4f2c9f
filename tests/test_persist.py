"""nbkv.save / nbkv.load / load_state: bit-exact round trips, and every bad file refused."""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np
import pytest

import nbkv
from nbkv import _format, _safetensors

from conftest import DEVICE, DTYPES, LAYOUTS, SIMULATOR, assert_bits_equal, host, randn, shape_of
from test_errors import assert_same, snapshot

OTHER = {"bhsd": "bshd", "bshd": "bhsd"}
SIZES = {"batch": 2, "num_kv_heads": 3, "head_dim": 5}  # head_dim not a power of two


def filled(rng, n=5, cap=16, dtype="float32", layout="bhsd", device=DEVICE, **kwargs):
    """A LayerKVCache holding ``n`` random positions, and those K and V (host arrays)."""
    sizes = SIZES | kwargs
    cache = nbkv.LayerKVCache(cap, **sizes, dtype=dtype, device=device, layout=layout)
    shape = shape_of(layout, sizes["batch"], sizes["num_kv_heads"], n, sizes["head_dim"])
    k, v = randn(rng, shape, dtype), randn(rng, shape, dtype)
    if n:
        cache.append(k, v)
    return cache, k, v


def model(rng, lens=(5, 5, 4), cap=16, dtype="float32", layout="bhsd", device=DEVICE):
    """A KVCache whose layers hold ``lens`` random positions; and each layer's K, V."""
    cache = nbkv.KVCache(len(lens), cap, **SIZES, dtype=dtype, device=device, layout=layout)
    data = []
    for layer, n in zip(cache, lens, strict=True):
        shape = shape_of(layout, SIZES["batch"], SIZES["num_kv_heads"], n, SIZES["head_dim"])
        k, v = randn(rng, shape, dtype), randn(rng, shape, dtype)
        layer.append(k, v)
        data.append((k, v))
    return cache, data


def assert_holds(layer, k, v):
    assert layer.seq_len == k.shape[2 if layer.layout == "bhsd" else 1]
    K, V = layer.get_kv()
    assert_bits_equal(K, k)
    assert_bits_equal(V, v)


def assert_like(a: nbkv.LayerKVCache, b: nbkv.LayerKVCache):
    fields = ("seq_len", "max_seq_len", "dtype", "layout", "batch", "num_kv_heads")
    fields += ("head_dim", "on_overflow", "grow_step", "is_allocated", "shape", "nbytes")
    for field in fields:
        assert getattr(a, field) == getattr(b, field), field


def to_layout(x, src, dst):
    return x if src == dst else np.ascontiguousarray(x.transpose(0, 2, 1, 3))


# -- round trips ----------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_round_trip_is_bit_exact(tmp_path, rng, dtype, layout):
    cache, k, v = filled(rng, dtype=dtype, layout=layout)
    path = tmp_path / "c.safetensors"
    nbkv.save(path, cache)
    back = nbkv.load(path, device=DEVICE)
    assert type(back) is nbkv.LayerKVCache and back.device == DEVICE
    assert_like(back, cache)
    assert_holds(back, k, v)
    # and the loaded cache goes on working: append after the restored positions
    more = randn(rng, shape_of(layout, 2, 3, 2, 5), dtype)
    back.append(more, more)
    assert back.seq_len == 7


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kvcache_of_several_layers_round_trips(tmp_path, rng, layout):
    cache, data = model(rng, lens=(5, 5, 4), layout=layout, dtype="float16")
    nbkv.save(tmp_path / "m.safetensors", cache)
    back = nbkv.load(tmp_path / "m.safetensors", device=DEVICE)
    assert type(back) is nbkv.KVCache and back.num_layers == 3 and back.seq_len == 4
    for got, want, (k, v) in zip(back, cache, data, strict=True):
        assert_like(got, want)
        assert_holds(got, k, v)


def test_grown_layers_keep_their_own_capacity(tmp_path, rng):
    cache = nbkv.KVCache(2, 4, **SIZES, dtype="float32", on_overflow="grow", grow_step=3)
    k = randn(rng, (2, 3, 6, 5), "float32")
    cache[1].append(k, k)  # layer 1 grows to 6, layer 0 stays at 4
    nbkv.save(tmp_path / "g.safetensors", cache)
    back = nbkv.load(tmp_path / "g.safetensors", device=DEVICE)
    assert [layer.max_seq_len for layer in back] == [4, 6]
    assert back[1].on_overflow == "grow" and back[1].grow_step == 3
    assert_holds(back[1], k, k)
    assert back[0].seq_len == 0


def test_lazy_caches_save_with_no_tensors_and_stay_lazy(tmp_path):
    for cache in (
        nbkv.LayerKVCache(8, device=DEVICE),
        nbkv.LayerKVCache(8, batch=2, device=DEVICE, layout="bshd"),
        nbkv.KVCache(3, 8, head_dim=4, dtype="float16", device=DEVICE),
    ):
        path = tmp_path / "lazy.safetensors"
        nbkv.save(path, cache)
        assert _safetensors.load_file(path) == {}
        back = nbkv.load(path, device=DEVICE)
        assert type(back) is type(cache)
        for got, want in zip(
            back if isinstance(back, nbkv.KVCache) else [back],
            cache if isinstance(cache, nbkv.KVCache) else [cache],
            strict=True,
        ):
            assert_like(got, want)
            assert not got.is_allocated


def test_a_partly_allocated_kvcache_round_trips(tmp_path, rng):
    cache = nbkv.KVCache(2, 8, device=DEVICE)  # fully lazy; only layer 0 gets data
    k = randn(rng, (1, 2, 3, 4), "float32")
    cache[0].append(k, k)
    nbkv.save(tmp_path / "p.safetensors", cache)
    assert sorted(_safetensors.load_file(tmp_path / "p.safetensors")) == [
        "layers.0.k",
        "layers.0.v",
    ]
    back = nbkv.load(tmp_path / "p.safetensors", device=DEVICE)
    assert_holds(back[0], k, k)
    assert not back[1].is_allocated and back[1].seq_len == 0
    back[1].append(k, k)  # the lazy layer allocates as before
    assert back.seq_len == 3


def test_allocated_but_empty_cache_round_trips(tmp_path):
    cache = nbkv.LayerKVCache(8, **SIZES, dtype="float64", device=DEVICE)
    nbkv.save(tmp_path / "e.safetensors", cache)
    tensors = _safetensors.load_file(tmp_path / "e.safetensors")
    assert tensors["layers.0.k"].shape == (2, 3, 0, 5)
    back = nbkv.load(tmp_path / "e.safetensors", device=DEVICE)
    assert back.is_allocated and back.seq_len == 0 and back.get_kv() is None
    assert_like(back, cache)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_the_positions_held_are_written(tmp_path, rng, layout):
    cap = 64 if SIMULATOR else 4096
    cache, k, v = filled(rng, n=3, cap=cap, layout=layout)
    path = tmp_path / "small.safetensors"
    nbkv.save(path, cache)
    held = k.nbytes + v.nbytes
    assert held <= os.path.getsize(path) <= held + 4096  # the header is a few hundred bytes
    assert os.path.getsize(path) < cache.nbytes / 4 or SIMULATOR


@pytest.mark.skipif(DEVICE != "cuda", reason="moves a cache between cpu and cuda")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_to_file_to_cuda_and_back(tmp_path, rng, dtype):
    cpu, k, v = filled(rng, n=3, cap=8, dtype=dtype, device="cpu")
    nbkv.save(tmp_path / "a.safetensors", cpu)
    gpu = nbkv.load(tmp_path / "a.safetensors", device="cuda")
    assert gpu.device == "cuda"
    assert_holds(gpu, k, v)
    nbkv.save(tmp_path / "b.safetensors", gpu)
    again = nbkv.load(tmp_path / "b.safetensors", device="cpu")
    assert again.device == "cpu"
    assert_like(again, cpu)
    assert_holds(again, k, v)
    with open(tmp_path / "a.safetensors", "rb") as a, open(tmp_path / "b.safetensors", "rb") as b:
        assert a.read() == b.read()  # the same cache gives the same bytes from either device


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_into_the_other_layout_transposes(tmp_path, rng, layout):
    cache, k, v = filled(rng, layout=layout, dtype="bfloat16")
    nbkv.save(tmp_path / "c.safetensors", cache)
    back = nbkv.load(tmp_path / "c.safetensors", device=DEVICE, layout=OTHER[layout])
    assert back.layout == OTHER[layout]
    assert_holds(back, to_layout(k, layout, OTHER[layout]), to_layout(v, layout, OTHER[layout]))


def test_the_file_opens_with_the_safetensors_package(tmp_path, rng):
    safetensors = pytest.importorskip("safetensors")
    cache, data = model(rng, lens=(4, 3), dtype="float16")
    path = tmp_path / "m.safetensors"
    nbkv.save(path, cache)
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(f"layers.{i}.{w}" for i in range(2) for w in "kv")
        meta = f.metadata()
        for i, (k, v) in enumerate(data):
            assert_bits_equal(f.get_tensor(f"layers.{i}.k"), k)
            assert_bits_equal(f.get_tensor(f"layers.{i}.v"), v)
    assert meta["format"] == "nbkv-cache" and meta["format_version"] == "2"
    described = json.loads(meta["cache"])
    assert described["type"] == "KVCache" and len(described["layers"]) == 2
    assert [layer["seq_len"] for layer in described["layers"]] == [4, 3]
    assert {layer["dtype"] for layer in described["layers"]} == {"float16"}


def test_a_kvcache_of_rotating_and_plain_layers_round_trips(tmp_path, rng):
    ring = nbkv.RotatingKVCache(4, sinks=1, **SIZES, dtype="float32", device=DEVICE)
    plain = nbkv.LayerKVCache(16, **SIZES, dtype="float32", device=DEVICE, on_overflow="grow")
    for _ in range(3):  # the ring wraps: 9 tokens seen, 4 held
        k = randn(rng, (2, 3, 3, 5), "float32")
        ring.append(k, k)
        plain.append(k, -k)
    cache = nbkv.KVCache.from_layers([ring, plain])
    nbkv.save(tmp_path / "mixed.safetensors", cache)
    back = nbkv.load(tmp_path / "mixed.safetensors", device=DEVICE, layout="bshd")
    assert [type(x) for x in back] == [nbkv.RotatingKVCache, nbkv.LayerKVCache]
    assert (back[0].offset, back[0].seq_len, back[0].window, back[0].sinks) == (9, 4, 4, 1)
    assert back[1].on_overflow == "grow" and back[1].seq_len == 9
    for got, want in zip(back, cache, strict=True):
        for g, w in zip(got.get_kv(), want.get_kv(), strict=True):
            assert_bits_equal(g, to_layout(host(w, want.dtype), "bhsd", "bshd"))
    cache.clear()
    cache.load_state(tmp_path / "mixed.safetensors")
    assert (cache[0].offset, cache[1].seq_len) == (9, 9)


# -- bad files ------------------------------------------------------------------------


def saved(tmp_path, rng, cache=None) -> tuple[str, bytes]:
    if cache is None:
        cache, _ = model(rng, lens=(3, 2), dtype="float32")
    path = str(tmp_path / "c.safetensors")
    nbkv.save(path, cache)
    with open(path, "rb") as f:
        return path, f.read()


def refused(path, *fragments):
    with pytest.raises(nbkv.CacheFormatError) as info:
        nbkv.load(path, device=DEVICE)
    assert isinstance(info.value, nbkv.KVCacheError) and isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def signed(tensors: dict, metadata: dict) -> bytes:
    """A file whose header_crc32 is right, computed as nbkv._format documents it."""
    metadata = {**metadata, "header_crc32": "00000000"}
    blob = _safetensors.save(tensors, metadata)
    n = struct.unpack("<Q", blob[:8])[0]
    metadata["header_crc32"] = f"{zlib.crc32(blob[8 : 8 + n]):08x}"
    return _safetensors.save(tensors, metadata)


def rewrite(path, change, sign=True, recrc=True):
    """Re-save the file with ``change(tensors, metadata, cache)`` applied, where ``cache``
    is the decoded ``cache`` field; tensor CRCs and the header checksum recomputed (so
    the change reaches the checks behind them) unless told otherwise."""
    tensors = {n: np.array(a) for n, a in _safetensors.load_file(path).items()}
    metadata = _safetensors.read_metadata(path)
    original = metadata["cache"]
    cache = json.loads(original)
    change(tensors, metadata, cache)
    if metadata.get("cache") == original:  # the change edited the decoded cache, if at all
        metadata["cache"] = json.dumps(cache)
    if recrc and "crc32" in metadata:
        crcs = {
            n: f"{zlib.crc32(np.ascontiguousarray(t).tobytes()):08x}" for n, t in tensors.items()
        }
        metadata["crc32"] = json.dumps(crcs)
    blob = signed(tensors, metadata) if sign else _safetensors.save(tensors, metadata)
    with open(path, "wb") as f:
        f.write(blob)


def test_a_resigned_file_still_loads(tmp_path, rng):
    # the test's own signing follows the documented algorithm: a no-op rewrite loads
    path, _ = saved(tmp_path, rng)
    rewrite(path, lambda t, m, c: None)
    assert nbkv.load(path, device=DEVICE).seq_len == 2


def test_a_truncated_file_is_refused_at_every_cut(tmp_path, rng):
    path, raw = saved(tmp_path, rng)
    data_start = 8 + struct.unpack("<Q", raw[:8])[0]
    for cut in (0, 5, 8, 40, data_start - 1, data_start, data_start + 7, len(raw) - 1):
        with open(path, "wb") as f:
            f.write(raw[:cut])
        refused(path)


def test_a_flipped_byte_in_a_tensor_is_a_crc_error(tmp_path, rng):
    path, raw = saved(tmp_path, rng)
    data_start = 8 + struct.unpack("<Q", raw[:8])[0]
    for where in (data_start, len(raw) - 1):  # the first and the last tensor
        bad = bytearray(raw)
        bad[where] ^= 0x01
        with open(path, "wb") as f:
            f.write(bad)
        refused(path, "CRC32", "corrupted")


def test_any_edit_of_the_metadata_is_caught_by_the_header_checksum(tmp_path, rng):
    path, raw = saved(tmp_path, rng)
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8 : 8 + n].decode()
    # each edit keeps the JSON valid and the length unchanged: only the checksum sees it
    for old, new in (
        ('max_seq_len\\":16', 'max_seq_len\\":61'),
        ('grow_step\\":256', 'grow_step\\":652'),
    ):
        assert old in header, old
        bad = raw[:8] + header.replace(old, new, 1).encode() + raw[8 + n :]
        with open(path, "wb") as f:
            f.write(bad)
        refused(path, "header is corrupted")
    rewrite(path, lambda t, m, c: c["layers"][0].update(seq_len=2), sign=False)
    refused(path, "header")


def layer0(**fields):
    return lambda t, m, c: c["layers"][0].update(fields)


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda t, m, c: m.update(format_version="1"), "format_version"),
        (lambda t, m, c: m.update(format="other"), "not an nbkv cache file"),
        (lambda t, m, c: c.update(type="RotatingKVCache"), "RotatingKVCache"),
        (lambda t, m, c: c.update(type="Nonsense"), "not one this nbkv knows"),
        (lambda t, m, c: c.update(layers=[]), "layers"),
        (lambda t, m, c: c.update(layers={"a": 1}), "layers"),
        (lambda t, m, c: c["layers"].__setitem__(0, 7), "JSON object"),
        (layer0(type="KVCache"), "cannot be a layer"),
        (layer0(type=["LayerKVCache"]), "type"),
        (layer0(layout="hbsd"), "layout"),
        (layer0(dtype="int8"), "dtype"),
        (layer0(dtype=["float32"]), "dtype"),
        (layer0(batch=4), "tensor"),
        (layer0(batch=0), "batch"),
        (layer0(batch=2**62), "batch"),
        (layer0(seq_len=20), "tensor"),
        (layer0(max_seq_len=2), "max_seq_len"),
        (layer0(seq_len=True), "seq_len"),
        (layer0(seq_len=-1), "seq_len"),
        (layer0(allocated="yes"), "allocated"),
        (layer0(allocated=False), "not allocated"),
        (layer0(on_overflow="explode"), "on_overflow"),
        (layer0(grow_step=0), "grow_step"),
        (layer0(max_seq_len="big"), "max_seq_len"),
        (layer0(max_seq_len=2**40), "max_seq_len"),
        (lambda t, m, c: m.update(crc32="{}"), "crc32"),
        (lambda t, m, c: m.update(crc32="[[[[[["), "crc32"),
        (lambda t, m, c: m.update(cache="[" * 3000 + "]" * 3000), "nests"),
        (lambda t, m, c: m.update(cache='{"type": 1' + "0" * 5000 + "}"), "digits"),
        (lambda t, m, c: m.update(cache='{"type": 1.5e300}'), "floating-point"),
        (lambda t, m, c: m.update(cache='{"type": "KVCache", "type": "KVCache"}'), "twice"),
    ],
)
def test_bad_metadata_is_refused_by_name(tmp_path, rng, change, fragment):
    path, _ = saved(tmp_path, rng)
    rewrite(path, change, recrc="crc32" not in fragment)
    refused(path, fragment)


@pytest.mark.parametrize("key", ["format_version", "cache", "crc32", "header_crc32"])
def test_a_missing_metadata_field_is_refused(tmp_path, rng, key):
    path, _ = saved(tmp_path, rng)
    rewrite(path, lambda t, m, c: m.pop(key), recrc=False, sign=key != "header_crc32")
    refused(path, key)


@pytest.mark.parametrize("key", ["type", "seq_len", "dtype", "layout", "allocated", "head_dim"])
def test_a_missing_layer_field_is_refused(tmp_path, rng, key):
    path, _ = saved(tmp_path, rng)
    rewrite(path, lambda t, m, c: c["layers"][1].pop(key))
    refused(path, key, "layer 1")


def test_a_plain_safetensors_file_is_not_a_cache(tmp_path):
    path = str(tmp_path / "w.safetensors")
    _safetensors.save_file({"w": np.ones(3, np.float32)}, path)
    refused(path, "not an nbkv cache file")


def test_missing_extra_or_misshapen_tensors_are_refused(tmp_path, rng):
    path, _ = saved(tmp_path, rng)
    rewrite(path, lambda t, m, c: t.pop("layers.1.v"))
    refused(path, "missing ['layers.1.v']")
    path, _ = saved(tmp_path, rng)
    rewrite(path, lambda t, m, c: t.update({"extra": np.ones(2, np.float32)}))
    refused(path, "unexpected ['extra']")
    path, _ = saved(tmp_path, rng)
    rewrite(path, lambda t, m, c: t.update({"layers.0.k": t["layers.0.k"][:, :, :2]}))
    refused(path, "layers.0.k")
    path, _ = saved(tmp_path, rng)
    rewrite(path, lambda t, m, c: t.update({"layers.0.k": t["layers.0.k"].astype(np.float64)}))
    refused(path, "layers.0.k")


def header_file(path, header: bytes, data: bytes = b"") -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)


def test_garbage_headers_are_refused(tmp_path):
    path = str(tmp_path / "g.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 2**40) + b"{}")
    refused(path, "header length")
    header_file(path, b"{not json")
    refused(path, "JSON")
    header_file(path, b"[1, 2]")
    refused(path, "JSON object")
    header_file(path, b'{"__metadata__": {"format": 1}}')
    refused(path, "__metadata__")
    header_file(path, b'{"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}', b"abcd")
    refused(path, "dtype")
    header_file(path, b"[" * 2000 + b"]" * 2000)
    refused(path, "nests")


def test_offsets_outside_the_data_are_refused(tmp_path, rng):
    path, raw = saved(tmp_path, rng)
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    begin, end = header["layers.0.k"]["data_offsets"]
    header["layers.0.k"]["data_offsets"] = [begin + 10**6, end + 10**6]
    header_file(path, json.dumps(header).encode(), raw[8 + n :])
    refused(path, "data_offsets")


def test_a_small_file_cannot_make_load_allocate_more_than_it_holds(tmp_path, rng):
    # a tensor table that claims 58 TiB in a file of a few hundred bytes
    path, raw = saved(tmp_path, rng)
    rewrite(path, layer0(batch=2**20, num_kv_heads=2**20))
    refused(path, "tensor")  # the claimed shape must match the bytes in the file


def test_a_capacity_no_machine_can_address_is_refused(tmp_path, rng):
    # held tensors of zero positions (no bytes), but buffers of 2**31 - 1 rows of 2**40
    # elements each: a valid checksum cannot make that a cache
    def huge(t, m, c):
        c["layers"][0].update(seq_len=0, batch=2**31 - 1, num_kv_heads=2**20, max_seq_len=2**31 - 1)
        for w in "kv":
            t[f"layers.0.{w}"] = np.empty((2**31 - 1, 2**20, 0, 5), np.float32)

    path, _ = saved(tmp_path, rng)
    rewrite(path, huge)
    refused(path, "address")


def test_a_lazy_layer_is_loaded_without_allocating_its_capacity(tmp_path):
    lazy = nbkv.LayerKVCache(2**31 - 1, batch=2**10, num_kv_heads=2**10, device=DEVICE)
    nbkv.save(tmp_path / "lazy.safetensors", lazy)
    back = nbkv.load(tmp_path / "lazy.safetensors", device=DEVICE)  # 2**51 elements, unmade
    assert not back.is_allocated and back.max_seq_len == 2**31 - 1 and back.batch == 2**10


def test_a_rotating_file_with_a_hole_before_the_offset_is_refused(tmp_path, rng):
    ring = nbkv.RotatingKVCache(8, sinks=4, **SIZES, dtype="float32", device=DEVICE)
    k = randn(rng, (2, 3, 2, 5), "float32")
    ring.append(k, k)  # offset 2, sink_count 2
    path, _ = saved(tmp_path, rng, ring)
    rewrite(path, layer0(offset=3))  # sink_count 2 < offset 3 < sinks 4: position 2 missing
    refused(path, "do not describe a rotating cache")
    for bad in ({"sink_count": 3}, {"offset": 1}, {"window": 4}, {"sinks": 9}, {"offset": "x"}):
        path, _ = saved(tmp_path, rng, ring)
        rewrite(path, layer0(**bad))
        refused(path)


def test_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        nbkv.load(tmp_path / "nothing.safetensors")
    cache = nbkv.LayerKVCache(4, device=DEVICE)
    with pytest.raises(FileNotFoundError):
        cache.load_state(tmp_path / "nothing.safetensors")


@pytest.mark.parametrize("bad", [None, 3, b"x.safetensors", "", ["a"]])
def test_a_path_that_is_no_path_is_a_type_error(tmp_path, bad):
    cache = nbkv.LayerKVCache(4, device=DEVICE)
    for call in (
        lambda: nbkv.save(bad, cache),
        lambda: nbkv.load(bad),
        lambda: cache.load_state(bad),
        lambda: nbkv.load_state(cache, bad),
    ):
        with pytest.raises(nbkv.ArgumentTypeError, match="path"):
            call()
    assert not os.listdir(tmp_path)


def test_save_of_something_else_is_a_type_error(tmp_path):
    class Subclass(nbkv.LayerKVCache):  # a cache type the format does not know
        pass

    for bad in ({"k": np.ones(3)}, nbkv.LayerKVCache, 3):
        with pytest.raises(nbkv.ArgumentTypeError, match="cache must be"):
            nbkv.save(tmp_path / "x.safetensors", bad)
    with pytest.raises(nbkv.ArgumentTypeError, match="Subclass.*register"):
        nbkv.save(tmp_path / "x.safetensors", Subclass(4, device=DEVICE))
    mixed = nbkv.KVCache.from_layers([nbkv.LayerKVCache(4), Subclass(4, device=DEVICE)])
    with pytest.raises(nbkv.ArgumentTypeError, match="layer 1"):
        nbkv.save(tmp_path / "x.safetensors", mixed)
    assert not os.listdir(tmp_path)
    nbkv.save(tmp_path / "x.safetensors", nbkv.LayerKVCache(4))
    with pytest.raises(nbkv.ArgumentTypeError, match="Subclass"):
        Subclass(4, device=DEVICE).load_state(tmp_path / "x.safetensors")


# -- load_state -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_state_replaces_the_positions_held(tmp_path, rng, layout):
    src, k, v = filled(rng, n=5, layout=layout)
    nbkv.save(tmp_path / "s.safetensors", src)
    for dst in (
        filled(rng, n=9, layout=layout)[0],  # holding other data, more of it
        filled(rng, n=9, layout=OTHER[layout])[0],  # the other layout: transposed in
        nbkv.LayerKVCache(6, device=DEVICE, layout=layout),  # lazy: allocates
        nbkv.LayerKVCache(2, device=DEVICE, on_overflow="grow", grow_step=4),  # grows
    ):
        dst.load_state(tmp_path / "s.safetensors")
        want = [to_layout(x, layout, dst.layout) for x in (k, v)]
        assert_holds(dst, *want)


def test_load_state_of_a_kvcache_fills_every_layer(tmp_path, rng):
    src, data = model(rng, lens=(5, 5, 4))
    nbkv.save(tmp_path / "m.safetensors", src)
    dst, _ = model(rng, lens=(1, 7, 2))
    dst.load_state(tmp_path / "m.safetensors")
    for layer, (k, v) in zip(dst, data, strict=True):
        assert_holds(layer, k, v)


def test_load_state_of_a_lazy_file_clears(tmp_path, rng):
    nbkv.save(tmp_path / "lazy.safetensors", nbkv.LayerKVCache(8))
    dst, _, _ = filled(rng, n=3)
    dst.load_state(tmp_path / "lazy.safetensors")
    assert dst.seq_len == 0 and dst.is_allocated


def unchanged(cache, call, error, *fragments):
    layers = list(cache) if isinstance(cache, nbkv.KVCache) else [cache]
    before = [snapshot(layer) for layer in layers]
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, nbkv.KVCacheError)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    for layer, b in zip(layers, before, strict=True):
        assert_same(b, snapshot(layer))


def test_load_state_that_does_not_fit_changes_nothing(tmp_path, rng):
    src, _, _ = filled(rng, n=5)
    path = tmp_path / "s.safetensors"
    nbkv.save(path, src)
    cases = [
        (filled(rng, n=2, head_dim=4)[0], nbkv.ShapeMismatchError, "head_dim 5"),
        (filled(rng, n=2, batch=1)[0], nbkv.ShapeMismatchError, "batch 2"),
        (filled(rng, n=2, dtype="float16")[0], nbkv.DTypeMismatchError, "float32"),
        (filled(rng, n=2, cap=4)[0], nbkv.CacheOverflowError, "max_seq_len = 4"),
        (model(rng, lens=(1,))[0], nbkv.CacheFormatError, "LayerKVCache"),
        (nbkv.LayerKVCache(4, device=DEVICE), nbkv.CacheOverflowError, "5 positions"),
    ]
    for dst, error, fragment in cases:
        unchanged(dst, lambda d=dst: d.load_state(path), error, fragment)


def test_load_state_checks_every_layer_before_writing_any(tmp_path, rng):
    src, _ = model(rng, lens=(3, 3, 3))
    path, raw = saved(tmp_path, rng, src)
    dst, _ = model(rng, lens=(2, 2, 2))
    other, _ = model(rng, lens=(2, 2))
    unchanged(other, lambda: other.load_state(path), nbkv.CacheFormatError, "3 layers")
    uneven, _ = model(rng, lens=(2, 2, 5))
    nbkv.save(tmp_path / "uneven.safetensors", uneven)
    small, _ = model(rng, lens=(1, 1, 1), cap=4)  # only the last layer does not fit
    unchanged(
        small,
        lambda: small.load_state(tmp_path / "uneven.safetensors"),
        nbkv.CacheOverflowError,
        "layer 2",
    )
    bad = bytearray(raw)
    bad[-1] ^= 0x80  # the last tensor, layers.2.v
    with open(path, "wb") as f:
        f.write(bad)
    unchanged(dst, lambda: dst.load_state(path), nbkv.CacheFormatError, "layers.2.v")
    with open(path, "wb") as f:
        f.write(raw[:-3])
    unchanged(dst, lambda: dst.load_state(path), nbkv.CacheFormatError)


# -- atomic writes --------------------------------------------------------------------


@pytest.mark.parametrize("existing", [False, True])
def test_a_crash_mid_save_leaves_the_target_untouched(tmp_path, rng, monkeypatch, existing):
    cache, _ = model(rng, lens=(3, 3))
    target = tmp_path / "c.safetensors"
    old = b"the previous file"
    if existing:
        target.write_bytes(old)
    calls = []
    write = _format._write

    def crash_on_the_third_piece(f, piece):
        calls.append(len(piece))
        if len(calls) == 3:
            raise OSError("disk on fire")
        write(f, piece)

    monkeypatch.setattr(_format, "_write", crash_on_the_third_piece)
    with pytest.raises(OSError, match="disk on fire"):
        nbkv.save(target, cache)
    assert len(calls) == 3
    assert os.listdir(tmp_path) == (["c.safetensors"] if existing else [])  # no temp file
    if existing:
        assert target.read_bytes() == old
    monkeypatch.setattr(_format, "_write", write)
    nbkv.save(target, cache)  # and a save that completes replaces it
    assert os.listdir(tmp_path) == ["c.safetensors"]
    assert nbkv.load(target, device=DEVICE).seq_len == 3
