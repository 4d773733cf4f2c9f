"""The block record: one full block of every layer as one store value (its layout is in
:mod:`nbkv.store`)."""

from __future__ import annotations

import hashlib
import math
import struct
import zlib
from typing import NamedTuple

import numpy as np

from .._validate import positive_int
from ..dtypes import resolve_dtype
from ..errors import (
    ArgumentTypeError,
    CacheFormatError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
)

FORMAT_VERSION = 1
MAGIC = b"NBKV-BLK"
NAMESPACE_SALT = b"nbkv-store-v1"

_HEADER = struct.Struct("<8sIIIII16s4s32s32sQ")
_U32 = struct.Struct("<I")
HEADER_BYTES = _HEADER.size  # 120
_LAYOUTS = ("nhd", "hnd")


class BlockGeometry(NamedTuple):
    """What one block record holds: K and V of one block of every layer.

    ``dtype`` is a canonical dtype name (``str(np.dtype(...))``: ``"float16"``,
    ``"bfloat16"``), ``layout`` the paged cache's ``"nhd"`` or ``"hnd"``.

    >>> g = BlockGeometry(2, 16, 8, 64, "float16", "hnd")
    >>> g.block_shape, g.nbytes
    ((8, 16, 64), 65536)
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layout: str

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One layer's block: ``(block_size, num_kv_heads, head_dim)`` for ``"nhd"``,
        ``(num_kv_heads, block_size, head_dim)`` for ``"hnd"``."""
        if self.layout == "nhd":
            return (self.block_size, self.num_kv_heads, self.head_dim)
        if self.layout == "hnd":
            return (self.num_kv_heads, self.block_size, self.head_dim)
        raise InvalidArgumentError(f"geometry.layout must be 'nhd' or 'hnd', got {self.layout!r}")

    @property
    def nbytes(self) -> int:
        """Bytes of a record's payload: K and V of every layer."""
        per_layer = math.prod(self.block_shape) * resolve_dtype(self.dtype).itemsize
        return 2 * self.num_layers * per_layer


def _check_geometry(geometry: object) -> tuple[BlockGeometry, np.dtype]:
    if not isinstance(geometry, BlockGeometry):
        raise ArgumentTypeError(
            f"geometry must be an nbkv.store.BlockGeometry, got {type(geometry).__name__}"
        )
    ints = [positive_int(getattr(geometry, f), f"geometry.{f}") for f in geometry._fields[:4]]
    if not isinstance(geometry.dtype, str):
        raise ArgumentTypeError(
            f"geometry.dtype must be a dtype name (str), got {type(geometry.dtype).__name__}"
        )
    dtype = resolve_dtype(geometry.dtype, "geometry.dtype")
    if str(dtype) != geometry.dtype:  # one name per dtype, or namespaces would split
        raise InvalidArgumentError(
            f"geometry.dtype must be the canonical name {str(dtype)!r}, got {geometry.dtype!r}"
        )
    if geometry.layout not in _LAYOUTS:
        raise InvalidArgumentError(
            f"geometry.layout must be 'nhd' or 'hnd', got {geometry.layout!r}"
        )
    return BlockGeometry(*ints, geometry.dtype, geometry.layout), dtype


def _check_digest(value: object, name: str) -> bytes:
    if not isinstance(value, bytes):
        raise ArgumentTypeError(f"{name} must be bytes, got {type(value).__name__}")
    if len(value) != 32:
        raise InvalidArgumentError(f"{name} must be 32 bytes (a sha256), got {len(value)} bytes")
    return value


def namespace(model_identity: bytes, geometry: BlockGeometry) -> bytes:
    """The namespace of a model's blocks of ``geometry`` (32 bytes): sha256 of
    :data:`NAMESPACE_SALT`, the identity's length (u64 LE) and bytes, then
    ``|num_layers|block_size|num_kv_heads|head_dim|dtype|layout`` in ASCII.

    >>> namespace(b"my-model", BlockGeometry(2, 16, 8, 64, "float16", "nhd")).hex()[:16]
    '1e2e05e684c4d4fe'
    """
    if not isinstance(model_identity, bytes):
        raise ArgumentTypeError(
            f"model_identity must be bytes, got {type(model_identity).__name__}"
        )
    g, _ = _check_geometry(geometry)
    fields = "|".join(str(x) for x in g)
    return hashlib.sha256(
        NAMESPACE_SALT
        + struct.pack("<Q", len(model_identity))
        + model_identity
        + f"|{fields}".encode()
    ).digest()


def store_key(ns: bytes, block_key: bytes) -> bytes:
    """The store key of a block (32 bytes): sha256 of ``ns`` and the block's prefix key."""
    ns = _check_digest(ns, "ns")
    if not isinstance(block_key, bytes) or not block_key:
        raise ArgumentTypeError(
            f"block_key must be non-empty bytes, got {type(block_key).__name__} {block_key!r:.60}"
        )
    return hashlib.sha256(ns + block_key).digest()


def _payload(x: object, name: str, shape: tuple, dtype: np.dtype) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise ArgumentTypeError(f"{name} must be a host numpy array, got {type(x).__name__}")
    if x.dtype != dtype:
        raise DTypeMismatchError(f"{name} has dtype {x.dtype}, but the geometry holds {dtype}")
    if x.shape != shape:
        raise ShapeMismatchError(f"{name} has shape {x.shape}, but the geometry holds {shape}")
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def encode_block(
    ns: bytes, key: bytes, geometry: BlockGeometry, k: np.ndarray, v: np.ndarray
) -> bytes:
    """One block of every layer as a record (layout in the :mod:`nbkv.store` docstring).

    Parameters
    ----------
    ns, key : bytes
        The namespace (:func:`namespace`) and the store key (:func:`store_key`).
    geometry : BlockGeometry
    k, v : numpy.ndarray
        shape: ``[num_layers, *geometry.block_shape]``, of the geometry's dtype.

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError, ShapeMismatchError, DTypeMismatchError

    >>> g = BlockGeometry(1, 2, 1, 3, "float32", "nhd")
    >>> ns = namespace(b"m", g); key = store_key(ns, b"block")
    >>> k = np.arange(6, dtype=np.float32).reshape(1, 2, 1, 3)
    >>> record = encode_block(ns, key, g, k, -k)
    >>> len(record) == HEADER_BYTES + g.nbytes + 4
    True
    >>> decode_block(record, ns, key, g)[1][0, 1, 0]
    array([-3., -4., -5.], dtype=float32)
    """
    ns, key = _check_digest(ns, "ns"), _check_digest(key, "key")
    g, dtype = _check_geometry(geometry)
    shape = (g.num_layers, *g.block_shape)
    kb, vb = _payload(k, "k", shape, dtype), _payload(v, "v", shape, dtype)
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        *g[:4],
        g.dtype.encode(),
        g.layout.encode(),
        ns,
        key,
        kb.nbytes + vb.nbytes,
    )
    crc = zlib.crc32(vb, zlib.crc32(kb, zlib.crc32(header)))
    return b"".join([header, kb, vb, _U32.pack(crc)])


def decode_block(
    record: bytes, ns: bytes, key: bytes, geometry: BlockGeometry
) -> tuple[np.ndarray, np.ndarray]:
    """K and V of a record, fresh (owned, writable) arrays of shape
    ``[num_layers, *geometry.block_shape]``, after checking every field of it.

    Raises
    ------
    CacheFormatError
        If ``record`` is not bytes, not a block record, of another format version,
        truncated or corrupted (its CRC32 differs), or written for another model or
        geometry or under another key; the message says which.
    ArgumentTypeError, InvalidArgumentError
        For a bad ``ns``, ``key`` or ``geometry``.
    """
    ns, key = _check_digest(ns, "ns"), _check_digest(key, "key")
    g, dtype = _check_geometry(geometry)
    if not isinstance(record, (bytes, bytearray, memoryview)):
        raise CacheFormatError(f"a block record must be bytes, got {type(record).__name__}")
    try:
        view = memoryview(record).cast("B")
    except TypeError as err:
        raise CacheFormatError(f"a block record must be contiguous bytes ({err})") from None
    n = len(view)
    if bytes(view[:8]) != MAGIC[:n]:
        raise CacheFormatError(
            f"not an nbkv block record: it starts {bytes(view[:8])!r}, not {MAGIC!r}"
        )
    if n < 12:
        raise CacheFormatError(f"block record truncated: {n} bytes, not even a header")
    version = _U32.unpack_from(view, 8)[0]
    if version != FORMAT_VERSION:
        raise CacheFormatError(
            f"block record has format version {version}, but this nbkv reads version "
            f"{FORMAT_VERSION} only"
        )
    if n < HEADER_BYTES + _U32.size:
        raise CacheFormatError(
            f"block record truncated: {n} bytes, shorter than its {HEADER_BYTES}-byte header"
        )
    _, _, *dims, rdtype, rlayout, rns, rkey, plen = _HEADER.unpack_from(view)
    if n != HEADER_BYTES + plen + _U32.size:
        raise CacheFormatError(
            f"block record truncated or corrupted: {n} bytes, but its header describes "
            f"{HEADER_BYTES + plen + _U32.size}"
        )
    stored, computed = _U32.unpack_from(view, n - _U32.size)[0], zlib.crc32(view[: n - _U32.size])
    if stored != computed:
        raise CacheFormatError(
            f"block record checksum mismatch: stored crc32 {stored:08x}, computed "
            f"{computed:08x} (the record is corrupted)"
        )
    got = BlockGeometry(
        *dims,
        rdtype.rstrip(b"\0").decode("ascii", "replace"),
        rlayout.rstrip(b"\0").decode("ascii", "replace"),
    )
    if got != g:
        raise CacheFormatError(f"block record holds another geometry: {got}, expected {g}")
    if rns != ns:
        raise CacheFormatError(
            f"block record belongs to another model or geometry: namespace {rns.hex()[:16]}..., "
            f"expected {ns.hex()[:16]}..."
        )
    if rkey != key:
        raise CacheFormatError(
            f"block record was written under another key: {rkey.hex()[:16]}..., "
            f"expected {key.hex()[:16]}..."
        )
    if plen != g.nbytes:
        raise CacheFormatError(f"block record payload is {plen} bytes, expected {g.nbytes}")
    shape, count = (g.num_layers, *g.block_shape), plen // 2 // dtype.itemsize
    k = np.frombuffer(view, dtype, count, HEADER_BYTES).reshape(shape).copy()
    v = np.frombuffer(view, dtype, count, HEADER_BYTES + plen // 2).reshape(shape).copy()
    return k, v
