"""A small, pickle-free reader and writer of the safetensors format.

The format (https://github.com/huggingface/safetensors) is::

    8 bytes     N, the header length, unsigned little-endian
    N bytes     a JSON object: {"name": {"dtype": "F32", "shape": [2, 3],
                "data_offsets": [begin, end]}, ..., "__metadata__": {"key": "value"}}
    the rest    the byte buffer; each tensor's little-endian, C-order bytes lie at
                [begin, end) of it, and the tensors cover it exactly, without holes

Reading never executes anything from the file: the header is JSON, the data are viewed
with ``np.memmap`` or ``np.frombuffer``. Every offset and size is checked before any
array is made, and a file that breaks the format raises :class:`SafetensorsError`.

>>> import numpy as np, os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
>>> save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, path, {"format": "np"})
>>> load_file(path)["w"]
memmap([[0., 1., 2.],
        [3., 4., 5.]], dtype=float32)
>>> read_metadata(path)
{'format': 'np'}
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import ArgumentTypeError, KVCacheError

__all__ = [
    "SafetensorsError",
    "DTYPES",
    "load_file",
    "load",
    "read_metadata",
    "save_file",
    "save",
]

# the Rust library refuses headers above 100 MB; so do we, before reading them
MAX_HEADER_BYTES = 100_000_000
_HEADER_LEN_BYTES = 8


class SafetensorsError(KVCacheError, ValueError):
    """A safetensors file (or the tensors given to write one) breaks the format."""


def _ml_dtype(name: str) -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(getattr(ml_dtypes, name))


# safetensors dtype name -> NumPy dtype (little-endian); None: needs ml_dtypes
DTYPES: dict[str, np.dtype | None] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": _ml_dtype("bfloat16"),
    "F8_E4M3": _ml_dtype("float8_e4m3fn"),
    "F8_E5M2": _ml_dtype("float8_e5m2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


def _name_of(dtype: np.dtype) -> str | None:
    """The safetensors name of a NumPy dtype (any byte order), or None."""
    native = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    for name, candidate in DTYPES.items():
        if candidate is not None and candidate == native:
            return name
    return None


# -- reading -------------------------------------------------------------------------


# bounds on what a header's JSON may hold, checked before or while it is decoded
MAX_DEPTH = 16  # nesting of arrays and objects
MAX_DIGITS = 19  # digits of an integer (int64 has 19)
_BRACKETS = np.zeros(256, np.int8)
_BRACKETS[[ord("["), ord("{")]] = 1
_BRACKETS[[ord("]"), ord("}")]] = -1
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


class _Refused(ValueError):
    """A JSON value the decoder refuses (raised inside json's hooks)."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise _Refused(f"an integer of {len(text)} characters (at most {MAX_DIGITS} digits)")
    return int(text)


def _no_float(text: str) -> float:
    raise _Refused(f"a floating-point number ({text[:20]}); headers hold only ints")


def _no_constant(text: str) -> float:
    raise _Refused(f"{text}, which is not JSON")


def _unique(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise _Refused(f"the key {dup[:60]!r} twice")
    return dict(pairs)


def loads(raw: bytes, where: str, error: type = None) -> Any:
    """Decode ``raw`` JSON with bounds: nesting at most MAX_DEPTH, integers of at most
    MAX_DIGITS digits, no floats, NaN or infinities, no duplicate keys. Anything else
    raises ``error`` (default SafetensorsError) naming ``where``."""
    error = error or SafetensorsError
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{where}: the header is not valid UTF-8 JSON ({err})") from None
    # the nesting, counted over the brackets outside strings, before the recursive decoder
    depth = np.cumsum(_BRACKETS[np.frombuffer(_STRING.sub(b'""', raw), np.uint8)], dtype=np.int64)
    if depth.size and depth.max() > MAX_DEPTH:
        raise error(
            f"{where}: the header nests {int(depth.max())} levels deep (at most {MAX_DEPTH})"
        )
    try:
        return json.loads(
            text,
            parse_int=_int,
            parse_float=_no_float,
            parse_constant=_no_constant,
            object_pairs_hook=_unique,
        )
    except _Refused as err:
        raise error(f"{where}: the header holds {err}") from None
    except (json.JSONDecodeError, RecursionError) as err:
        raise error(f"{where}: the header is not valid UTF-8 JSON ({err})") from None


def _parse_header(raw: bytes, data_len: int, where: str) -> tuple[dict, dict[str, str] | None]:
    """Decode and check a header; return ``(tensors, metadata)``.

    ``tensors`` maps each name to ``(dtype, shape, begin, end)``, offsets relative to the
    byte buffer of ``data_len`` bytes.
    """
    return check_header(loads(raw, where), data_len, where)


def check_header(header: Any, data_len: int, where: str) -> tuple[dict, dict[str, str] | None]:
    """Check a decoded header against a data buffer of ``data_len`` bytes."""
    if not isinstance(header, dict):
        raise SafetensorsError(
            f"{where}: the header must be a JSON object, got {type(header).__name__}"
        )
    header = dict(header)
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise SafetensorsError(
            f"{where}: __metadata__ must map strings to strings, got {metadata!r:.80}"
        )
    tensors = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise SafetensorsError(
                f"{where}: tensor {name!r:.60} must have dtype, shape and data_offsets, "
                f"got {entry!r:.80}"
            )
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(code, str) or code not in DTYPES:
            raise SafetensorsError(
                f"{where}: tensor {name!r:.60} has dtype {code!r:.40}; known dtypes are "
                f"{', '.join(DTYPES)}"
            )
        dtype = DTYPES[code]
        if dtype is None:
            raise SafetensorsError(
                f"{where}: tensor {name!r:.60} has dtype {code}, which needs ml_dtypes: "
                "pip install 'nbkv[bf16]'"
            )
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise SafetensorsError(
                f"{where}: tensor {name!r:.60} must have a shape of non-negative ints, "
                f"got {shape!r:.80}"
            )
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise SafetensorsError(
                f"{where}: tensor {name!r:.60} has data_offsets {offsets!r:.60}, outside the "
                f"{data_len}-byte data buffer [0, {data_len}]"
            )
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise SafetensorsError(
                f"{where}: tensor {name!r:.60} of dtype {code} and shape {shape} needs "
                f"{nbytes} bytes, but its data_offsets {offsets} span {end - begin}"
            )
        tensors[name] = (dtype, tuple(shape), begin, end)
    # the tensors must tile the buffer: no overlap, no hole, nothing left over
    cursor = 0
    for name, (_, _, begin, end) in sorted(tensors.items(), key=lambda item: item[1][2:]):
        if begin != cursor:
            what = "overlaps the tensor before it" if begin < cursor else "leaves a hole"
            raise SafetensorsError(
                f"{where}: tensor {name!r:.60} starts at byte {begin} of the data buffer, "
                f"expected {cursor}: it {what}"
            )
        cursor = end
    if cursor != data_len:
        raise SafetensorsError(
            f"{where}: the tensors cover {cursor} bytes but the data buffer holds "
            f"{data_len}: the file has trailing bytes"
        )
    return tensors, metadata


def _header_length(first: bytes, total: int, where: str) -> int:
    if total < _HEADER_LEN_BYTES:
        raise SafetensorsError(
            f"{where}: {total} bytes is too short for a safetensors file (at least "
            f"{_HEADER_LEN_BYTES} for the header length); is it truncated?"
        )
    n = int.from_bytes(first[:_HEADER_LEN_BYTES], "little")
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(
            f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit; "
            "this is not a safetensors file"
        )
    if _HEADER_LEN_BYTES + n > total:
        raise SafetensorsError(
            f"{where}: header length {n} runs past the end of the {total}-byte file; "
            "is it truncated?"
        )
    return n


def _arrays(buffer: np.ndarray, start: int, tensors: dict) -> dict[str, np.ndarray]:
    """Views of ``buffer`` (uint8, the whole file) for each checked header entry."""
    out = {}
    for name, (dtype, shape, begin, end) in tensors.items():
        raw = buffer[start + begin : start + end]
        out[name] = raw.view(dtype).reshape(shape)
    return out


def _read_header(path: str | os.PathLike) -> tuple[dict, dict[str, str] | None, int, int]:
    where = os.fspath(path)
    total = os.path.getsize(where)
    with open(where, "rb") as f:
        n = _header_length(f.read(_HEADER_LEN_BYTES), total, where)
        raw = f.read(n)
    start = _HEADER_LEN_BYTES + n
    tensors, metadata = _parse_header(raw, total - start, where)
    return tensors, metadata, start, total


def load_file(path: str | os.PathLike, *, mmap: bool = True) -> dict[str, np.ndarray]:
    """Read every tensor of a safetensors file.

    Parameters
    ----------
    path : path-like
    mmap : bool, default True
        Map the file (nothing is read until used; the arrays are ``np.memmap`` views).
        Otherwise read it whole into memory.

    Returns
    -------
    dict of name -> read-only ndarray
        In the file's dtypes (BF16 and F8 as ``ml_dtypes`` types), native byte order on
        little-endian machines.

    Raises
    ------
    SafetensorsError
        A truncated file, a header that is not JSON, an unknown dtype, offsets outside
        the data or not matching the shape, overlapping tensors or holes between them.
    """
    tensors, _, start, total = _read_header(path)
    if not tensors:
        return {}
    if mmap:
        buffer = np.memmap(path, dtype=np.uint8, mode="r", shape=(total,))
    else:
        with open(path, "rb") as f:
            buffer = np.frombuffer(f.read(), dtype=np.uint8)
    return _arrays(buffer, start, tensors)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (``{}`` when it has none)."""
    return dict(_read_header(path)[1] or {})


def load(data: bytes) -> dict[str, np.ndarray]:
    """Read every tensor of a safetensors file held in ``data`` (read-only views)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"data must be bytes, got {type(data).__name__}")
    buffer = np.frombuffer(data, dtype=np.uint8)
    total = buffer.size
    n = _header_length(bytes(buffer[:_HEADER_LEN_BYTES]), total, "data")
    start = _HEADER_LEN_BYTES + n
    tensors, _ = _parse_header(bytes(buffer[_HEADER_LEN_BYTES:start]), total - start, "data")
    return _arrays(buffer, start, tensors)


# -- writing -------------------------------------------------------------------------


def _plan(
    tensors: Mapping[str, Any], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[np.ndarray]]:
    """Check the tensors; return the padded header (with its length) and the arrays."""
    if not isinstance(tensors, Mapping):
        raise ArgumentTypeError(
            f"tensors must be a mapping of name -> array, got {type(tensors).__name__}"
        )
    arrays = {}
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise ArgumentTypeError(f"tensor names must be str, got {type(name).__name__}")
        if name == "__metadata__":
            raise SafetensorsError("'__metadata__' is reserved; pass metadata=... instead")
        arr = np.asarray(value)
        code = _name_of(arr.dtype)
        if code is None:
            raise SafetensorsError(
                f"tensor {name!r:.60} has dtype {arr.dtype}, which safetensors cannot hold "
                f"(it holds {', '.join(DTYPES)})"
            )
        arrays[name] = (code, np.asarray(arr, dtype=DTYPES[code], order="C"))  # keeps 0-d
    if metadata is not None and not (
        isinstance(metadata, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise ArgumentTypeError(f"metadata must map str to str, got {metadata!r:.80}")
    # widest dtypes first keeps every tensor aligned to its item size (as the Rust writer)
    order = sorted(arrays, key=lambda name: (-arrays[name][1].dtype.itemsize, name))
    specs = [(name, arrays[name][0], arrays[name][1].shape) for name in order]
    return header_bytes(specs, metadata), [arrays[n][1] for n in order]


def header_bytes(
    specs: list[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> bytes:
    """The 8-byte length and the padded JSON header of a file of these tensors.

    ``specs`` lists ``(name, dtype code, shape)`` in the order the tensors' bytes follow
    the header, for writers that stream the data themselves (nbkv.persist). The
    ``metadata`` is taken as it is (str -> str, checked by the caller).
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, code, shape in specs:
        nbytes = math.prod(shape) * DTYPES[code].itemsize
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data then start 8-byte aligned
    return len(raw).to_bytes(_HEADER_LEN_BYTES, "little") + raw


def save(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (see :func:`save_file`)."""
    head, arrays = _plan(tensors, metadata)
    return head + b"".join(arr.tobytes() for arr in arrays)


def save_file(
    tensors: Mapping[str, Any],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` (name -> array) to a safetensors file at ``path``.

    Arrays of any strides and byte order are written C-ordered and little-endian; BF16 and
    F8 need ``ml_dtypes`` arrays. ``metadata`` becomes ``__metadata__`` (str -> str).

    Raises
    ------
    SafetensorsError
        A dtype safetensors cannot hold, or a tensor named ``__metadata__``.
    ArgumentTypeError
        Names or metadata that are not strings.
    """
    head, arrays = _plan(tensors, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for arr in arrays:
            f.write(arr.reshape(-1).view(np.uint8).data)
