"""The pickle-free safetensors reader and writer (nbkv._safetensors)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import nbkv
from nbkv._safetensors import (
    DTYPES,
    SafetensorsError,
    load,
    load_file,
    read_metadata,
    save,
    save_file,
)

from conftest import bits, cpu_only

pytestmark = cpu_only

AVAILABLE = [name for name, dtype in DTYPES.items() if dtype is not None]


def sample(rng: np.random.Generator, code: str, shape) -> np.ndarray:
    """Random data of a safetensors dtype, never all zeros."""
    dtype = DTYPES[code]
    if code == "BOOL":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), shape, endpoint=True).astype(
            dtype
        )
    return (rng.standard_normal(shape) * 3 + 0.5).astype(dtype)


def raw_file(header: dict, data: bytes) -> bytes:
    """A file of a hand-written header and data, to break the format on purpose."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("code", AVAILABLE)
@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_of_every_dtype_is_bit_exact(tmp_path, rng, code, mmap):
    tensors = {
        "matrix": sample(rng, code, (3, 5)),
        "vector": sample(rng, code, (7,)),
        "scalar": sample(rng, code, ()),
        "empty": sample(rng, code, (0, 4)),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    got = load_file(path, mmap=mmap)
    assert sorted(got) == sorted(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        np.testing.assert_array_equal(bits(got[name]), bits(want))
    from_bytes = load(save(tensors))
    for name, want in tensors.items():
        np.testing.assert_array_equal(bits(from_bytes[name]), bits(want))


def test_metadata_round_trips_and_defaults_to_empty(tmp_path, rng):
    x = {"x": sample(rng, "F32", (2, 2))}
    save_file(x, tmp_path / "a.safetensors", metadata={"format": "pt", "note": "é ok"})
    save_file(x, tmp_path / "b.safetensors")
    assert read_metadata(tmp_path / "a.safetensors") == {"format": "pt", "note": "é ok"}
    assert read_metadata(tmp_path / "b.safetensors") == {}
    np.testing.assert_array_equal(load_file(tmp_path / "a.safetensors")["x"], x["x"])


def test_strided_and_big_endian_arrays_are_written_c_ordered_little_endian(tmp_path, rng):
    base = sample(rng, "F64", (6, 8))
    strided = base[::2, 1::3].T
    big = base.astype(">f4")
    save_file({"strided": strided, "big": big}, tmp_path / "s.safetensors")
    got = load_file(tmp_path / "s.safetensors")
    np.testing.assert_array_equal(got["strided"], strided)
    assert got["big"].dtype == np.dtype("<f4")
    np.testing.assert_array_equal(got["big"], big)


def test_header_is_padded_and_wider_dtypes_come_first(tmp_path, rng):
    tensors = {"a8": sample(rng, "U8", (3,)), "b64": sample(rng, "F64", (2,))}
    data = save(tensors)
    n = struct.unpack("<Q", data[:8])[0]
    assert n % 8 == 0
    header = json.loads(data[8 : 8 + n])
    assert header["b64"]["data_offsets"] == [0, 16]
    assert header["a8"]["data_offsets"] == [16, 19]
    assert len(data) == 8 + n + 19


def test_loaded_arrays_are_read_only(tmp_path, rng):
    save_file({"x": sample(rng, "F32", (4,))}, tmp_path / "x.safetensors")
    for arr in (load_file(tmp_path / "x.safetensors")["x"], load(save({"x": np.ones(2)}))["x"]):
        with pytest.raises(ValueError):
            arr[0] = 1.0


@pytest.mark.parametrize("keep", [0, 5, 8, 20, -1])
def test_truncated_file_raises(tmp_path, rng, keep):
    data = save({"x": sample(rng, "F32", (4, 4)), "y": sample(rng, "I64", (3,))})
    cut = data[:keep] if keep >= 0 else data[:-1]
    path = tmp_path / "cut.safetensors"
    path.write_bytes(cut)
    with pytest.raises(SafetensorsError):
        load_file(path)
    with pytest.raises(SafetensorsError):
        load(cut)


@pytest.mark.parametrize(
    "header, data_len, match",
    [
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, 8, "outside"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, 8, "outside"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, 8, "outside"),
        ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, "needs 12 bytes"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 12, "trailing"),
        (
            {
                "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            12,
            "overlaps",
        ),
        (
            {
                "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "y": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
            },
            12,
            "hole",
        ),
        ({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, 8, "dtype 'C64'"),
        ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4, "shape"),
        ({"x": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, 4, "floating-point"),
        ({"x": {"dtype": "F32", "shape": [1]}}, 4, "data_offsets"),
        ({"x": [1, 2]}, 4, "data_offsets"),
        ({"__metadata__": {"k": 1}}, 0, "__metadata__"),
    ],
)
def test_bad_headers_raise(tmp_path, header, data_len, match):
    blob = raw_file(header, bytes(range(1, data_len + 1)))
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(SafetensorsError, match=match):
        load_file(path)
    with pytest.raises(SafetensorsError, match=match):
        load(blob)


@pytest.mark.parametrize(
    "blob, match",
    [
        (struct.pack("<Q", 3) + b"{x}", "JSON"),
        (struct.pack("<Q", 2) + b"[]", "JSON object"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "UTF-8"),
        (struct.pack("<Q", 2**40) + b"{}", "limit"),
        (struct.pack("<Q", 100) + b"{}", "truncated"),
    ],
)
def test_headers_that_are_not_safetensors_raise(tmp_path, blob, match):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(SafetensorsError, match=match):
        load_file(path)


def test_safetensors_error_is_an_nbkv_error_and_a_value_error():
    assert issubclass(SafetensorsError, nbkv.KVCacheError)
    assert issubclass(SafetensorsError, ValueError)


@pytest.mark.parametrize(
    "tensors, metadata, error",
    [
        ({"x": np.array([1 + 2j])}, None, SafetensorsError),
        ({"x": np.array(["text"])}, None, SafetensorsError),
        ({"__metadata__": np.ones(2)}, None, SafetensorsError),
        ({1: np.ones(2)}, None, nbkv.ArgumentTypeError),
        ({"x": np.ones(2)}, {"k": 1}, nbkv.ArgumentTypeError),
        ([("x", np.ones(2))], None, nbkv.ArgumentTypeError),
    ],
)
def test_writer_rejects_what_the_format_cannot_hold(tmp_path, tensors, metadata, error):
    path = tmp_path / "w.safetensors"
    with pytest.raises(error):
        save_file(tensors, path, metadata)
    assert not path.exists()


# -- interoperability with the reference implementation ------------------------------

NUMPY_CODES = ["F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL"]


def test_files_we_write_are_read_by_the_safetensors_package(tmp_path, rng):
    st = pytest.importorskip("safetensors.numpy")
    tensors = {code: sample(rng, code, (3, 2)) for code in NUMPY_CODES}
    save_file(tensors, tmp_path / "ours.safetensors", metadata={"format": "np"})
    got = st.load_file(str(tmp_path / "ours.safetensors"))
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype
        np.testing.assert_array_equal(got[name], want)
    safe_open = pytest.importorskip("safetensors").safe_open
    with safe_open(str(tmp_path / "ours.safetensors"), framework="np") as f:
        assert f.metadata() == {"format": "np"}


def test_files_the_safetensors_package_writes_are_read_by_us(tmp_path, rng):
    st = pytest.importorskip("safetensors.numpy")
    tensors = {code: sample(rng, code, (4, 3)) for code in NUMPY_CODES}
    st.save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"who": "rust"})
    got = load_file(tmp_path / "theirs.safetensors")
    for name, want in tensors.items():
        np.testing.assert_array_equal(bits(got[name]), bits(want))
    assert read_metadata(tmp_path / "theirs.safetensors") == {"who": "rust"}


def test_bfloat16_interoperates_with_safetensors_torch(tmp_path, rng):
    st_torch = pytest.importorskip("safetensors.torch")
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    x = torch.from_numpy(sample(rng, "F32", (5, 3))).to(torch.bfloat16)
    st_torch.save_file({"x": x}, str(tmp_path / "theirs.safetensors"))
    ours = load_file(tmp_path / "theirs.safetensors")["x"]
    assert ours.dtype == DTYPES["BF16"]
    np.testing.assert_array_equal(ours.view(np.uint16), x.view(torch.uint16).numpy())
    save_file({"x": ours}, tmp_path / "ours.safetensors")
    back = st_torch.load_file(str(tmp_path / "ours.safetensors"))["x"]
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)
