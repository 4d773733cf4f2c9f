"""K/V stores: where an engine keeps full blocks beyond its GPU pool, and the block record.

The store protocol
------------------
A store maps keys to values, and both are ``bytes``: nothing else crosses it (no arrays,
no strings, no pickles). Three methods make a store (:class:`Store`):

- ``put(key, value) -> None`` keeps ``value`` under ``key`` (or drops it: a store is a
  cache and may evict anything at any time, or refuse a value too large for it);
- ``get(key) -> bytes | None`` returns a value kept under ``key``, or ``None`` on a miss;
- ``contains(keys) -> list[bool]`` says for each key whether a ``get`` would find it now.

A store may add ``get_many(keys) -> list[bytes | None]`` and ``put_many(items) -> None``
to serve many keys in one round trip; :func:`get_many` and :func:`put_many` use them when
present, else loop over ``get`` and ``put``, so a user's three-method store works. Keys
are non-empty and at most :data:`MAX_KEY_BYTES` long. A store that cannot be reached or
fails raises :class:`~nbkv.errors.StoreError` naming the store and the cause; a bad
argument raises a typed nbkv error and changes nothing.

Two stores come with nbkv: :class:`LocalStore`, a directory on one machine's disk (the
embedded default), and :class:`RedisStore`, a Redis server that several machines share.

The block record
----------------
An engine keeps one full block of every layer as one value, a *record*
(:func:`encode_block`, :func:`decode_block`), under :func:`store_key` of the block's
prefix key in a :func:`namespace` of the model and the block's geometry, so that two
models, dtypes, layouts or block sizes never share keys. A record is, little-endian:

=========  =====  ===========================================================
offset     size   field
=========  =====  ===========================================================
0          8      magic ``b"NBKV-BLK"``
8          4      format version (u32, :data:`FORMAT_VERSION`)
12         4×4    ``num_layers``, ``block_size``, ``num_kv_heads``, ``head_dim`` (u32)
28         16     dtype name, ASCII, zero-padded (``"bfloat16"``)
44         4      layout, ASCII, zero-padded (``"nhd"`` or ``"hnd"``)
48         32     namespace (:func:`namespace`)
80         32     the store key the record was written under (:func:`store_key`)
112        8      payload length in bytes (u64)
120        n      payload: K then V, each ``(num_layers, *block_shape)`` in C order
120 + n    4      CRC32 (``zlib.crc32``) of everything before it
=========  =====  ===========================================================

:func:`decode_block` checks all of it against what the caller expects before it
allocates anything, and raises :class:`~nbkv.errors.CacheFormatError` naming what differs.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import os
import re
import struct
import time
import uuid
import zlib
from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from ._validate import positive_int
from .dtypes import resolve_dtype
from .errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    CacheFormatError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
    StoreError,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "HEADER_BYTES",
    "NAMESPACE_SALT",
    "MAX_KEY_BYTES",
    "Store",
    "get_many",
    "put_many",
    "LocalStore",
    "RedisStore",
    "BlockGeometry",
    "namespace",
    "store_key",
    "encode_block",
    "decode_block",
]

FORMAT_VERSION = 1
MAGIC = b"NBKV-BLK"
NAMESPACE_SALT = b"nbkv-store-v1"
MAX_KEY_BYTES = 100  # a LocalStore file name is the key's hex, and names stop at 255 bytes

_HEADER = struct.Struct("<8sIIIII16s4s32s32sQ")
_U32 = struct.Struct("<I")
HEADER_BYTES = _HEADER.size  # 120
_LAYOUTS = ("nhd", "hnd")


# --- the protocol ---------------------------------------------------------------------


@runtime_checkable
class Store(Protocol):
    """What an engine needs of a K/V store: three methods over ``bytes`` (see the module)."""

    def put(self, key: bytes, value: bytes) -> None: ...

    def get(self, key: bytes) -> bytes | None: ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...


def _check_key(key: object, name: str = "key") -> bytes:
    if not isinstance(key, bytes):
        raise ArgumentTypeError(f"{name} must be bytes, got {type(key).__name__} {key!r:.60}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise InvalidArgumentError(
            f"{name} must be 1 to {MAX_KEY_BYTES} bytes long, got {len(key)} bytes"
        )
    return key


def _check_value(value: object, name: str = "value") -> bytes:
    if not isinstance(value, bytes):
        raise ArgumentTypeError(f"{name} must be bytes, got {type(value).__name__}")
    return value


def _sequence(obj: object, name: str, of: str) -> Sequence:
    if isinstance(obj, (bytes, bytearray, str)) or not isinstance(obj, Sequence):
        raise ArgumentTypeError(f"{name} must be a sequence of {of}, got {type(obj).__name__}")
    return obj


def _check_keys(keys: object, name: str = "keys") -> list[bytes]:
    return [_check_key(k, f"{name}[{i}]") for i, k in enumerate(_sequence(keys, name, "bytes"))]


def _check_items(items: object, name: str = "items") -> list[tuple[bytes, bytes]]:
    out = []
    for i, item in enumerate(_sequence(items, name, "(key, value) pairs")):
        if not isinstance(item, tuple) or len(item) != 2:
            raise ArgumentTypeError(f"{name}[{i}] must be a (key, value) tuple, got {item!r:.60}")
        out.append(
            (_check_key(item[0], f"{name}[{i}][0]"), _check_value(item[1], f"{name}[{i}][1]"))
        )
    return out


def _check_store(store: object) -> Store:
    if not isinstance(store, Store):
        raise ArgumentTypeError(
            f"store must have put, get and contains methods, got {type(store).__name__}"
        )
    return store


def get_many(store: Store, keys: Sequence[bytes]) -> list[bytes | None]:
    """The value of each key in ``store`` (``None`` for a miss): one call of the store's
    own ``get_many`` where it has one, else one ``get`` per key.

    >>> s = LocalStore(getfixture("tmp_path"), max_bytes=1000)
    >>> s.put(b"a", b"1"); get_many(s, [b"a", b"b"])
    [b'1', None]
    """
    keys = _check_keys(keys)
    method = getattr(_check_store(store), "get_many", None)
    if not callable(method):
        return [store.get(k) for k in keys]
    values = list(method(keys))
    if len(values) != len(keys):
        raise StoreError(f"{store!r}.get_many returned {len(values)} values for {len(keys)} keys")
    return values


def put_many(store: Store, items: Sequence[tuple[bytes, bytes]]) -> None:
    """Put each ``(key, value)`` of ``items`` into ``store``: one call of the store's own
    ``put_many`` where it has one, else one ``put`` per item."""
    items = _check_items(items)
    method = getattr(_check_store(store), "put_many", None)
    if callable(method):
        method(items)
    else:
        for key, value in items:
            store.put(key, value)


# --- LocalStore -----------------------------------------------------------------------

_TMP_PREFIX = ".tmp-"  # never a value's name: those are hex
_VALUE_NAME = re.compile(r"(?:[0-9a-f]{2})+")
_SUBDIR = re.compile(r"[0-9a-f]{2}")
STALE_TMP_SECONDS = 600  # a temporary file this old belongs to a writer that died


class LocalStore:
    """A store in a directory on this machine's disk, evicting least recently used values.

    Each value is one file, named by its key's hex under a subdirectory named by the key's
    first byte (``ab/ab12...``), written atomically: a temporary file in the same folder,
    flushed and fsync'ed, then renamed over the name, so a reader sees a whole value or
    none. Several processes may share a directory; a value another process removes is a
    miss. Recency is a file's modification time, set at each ``put`` and refreshed by each
    ``get`` hit. When the bytes held pass ``max_bytes``, the least recently used values go
    until at most nine tenths of ``max_bytes`` are held (so that a full store does not
    rescan itself on every put); a value larger than ``max_bytes`` is not kept.
    Temporary files of a killed writer are never read and are removed once
    :data:`STALE_TMP_SECONDS` old, at open and at each eviction.

    Parameters
    ----------
    path : str or os.PathLike
        The directory; created if absent.
    max_bytes : int
        The most bytes of values to hold (>= 1).

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError
        For a bad argument, before anything on disk changes.
    StoreError
        If the directory cannot be created, read or written (naming the path and cause).

    Examples
    --------
    >>> store = LocalStore(getfixture("tmp_path") / "kv", max_bytes=2**20)
    >>> store.put(b"key", b"value")
    >>> store.get(b"key"), store.get(b"other"), store.contains([b"key", b"other"])
    (b'value', None, [True, False])
    >>> store.nbytes
    5
    """

    def __init__(self, path: str | os.PathLike, *, max_bytes: int) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise ArgumentTypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        root = os.fspath(path)
        if not isinstance(root, str):
            raise ArgumentTypeError(f"path must name a str path, got {type(root).__name__}")
        if not root:
            raise InvalidArgumentError("path must name a directory, got ''")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Integral):
            raise ArgumentTypeError(
                f"max_bytes must be an int >= 1, got {type(max_bytes).__name__} {max_bytes!r:.60}"
            )
        if max_bytes < 1:
            raise InvalidArgumentError(f"max_bytes must be an int >= 1, got {max_bytes}")
        self._root = os.path.abspath(root)
        self._max = int(max_bytes)
        self._last_ns = 0
        try:
            os.makedirs(self._root, exist_ok=True)
        except OSError as err:
            raise self._error("creating the directory", err) from err
        self._held = 0  # this process's estimate of the bytes held; a scan makes it exact
        self._since_scan = 0
        self._evict()

    def __repr__(self) -> str:
        return f"LocalStore({self._root!r}, max_bytes={self._max})"

    @property
    def path(self) -> str:
        """The store's directory (absolute)."""
        return self._root

    @property
    def max_bytes(self) -> int:
        """The most bytes of values the store holds."""
        return self._max

    @property
    def nbytes(self) -> int:
        """Bytes of values held now, by every process sharing the directory (a scan)."""
        self._held = sum(size for _, size, _ in self._scan())
        return self._held

    def _error(self, doing: str, err: OSError) -> StoreError:
        return StoreError(f"LocalStore at {self._root!r}: {doing} failed: {err}")

    def _file(self, key: bytes) -> tuple[str, str]:
        name = key.hex()
        sub = os.path.join(self._root, name[:2])
        return sub, os.path.join(sub, name)

    def _now_ns(self) -> int:
        # strictly increasing within this process, so that recency never ties
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        return self._last_ns

    def put(self, key: bytes, value: bytes) -> None:
        """Keep ``value`` under ``key`` (replacing what was there), evicting if need be."""
        key, value = _check_key(key), _check_value(value)
        self._evict_if_full(self._put(key, value))

    def _put(self, key: bytes, value: bytes) -> str:
        sub, path = self._file(key)
        if len(value) > self._max:
            self._remove(path)  # the key now holds nothing rather than an older value
            return path
        tmp = os.path.join(sub, f"{_TMP_PREFIX}{key.hex()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileNotFoundError:
                os.makedirs(sub, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with open(fd, "wb") as f:
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            now = self._now_ns()
            os.utime(tmp, ns=(now, now))
            os.replace(tmp, path)
        except OSError as err:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise self._error(f"writing {path!r}", err) from err
        self._held += len(value)
        self._since_scan += len(value)
        return path

    def _evict_if_full(self, keep: str | None) -> None:
        # a scan also after a tenth of max_bytes written: other processes write too
        if self._held > self._max or self._since_scan > self._max // 10:
            self._evict(keep)

    def get(self, key: bytes) -> bytes | None:
        """The value kept under ``key``, or ``None``; a hit makes it the most recent."""
        _, path = self._file(_check_key(key))
        try:
            with open(path, "rb") as f:
                value = f.read()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise self._error(f"reading {path!r}", err) from err
        try:  # recency is best effort: a read-only or shrinking store still serves
            now = self._now_ns()
            os.utime(path, ns=(now, now))
        except OSError:
            pass
        return value

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` holds a value now (recency unchanged)."""
        out = []
        for key in _check_keys(keys):
            _, path = self._file(key)
            try:
                os.stat(path)
            except FileNotFoundError:
                out.append(False)
            except OSError as err:
                raise self._error(f"reading {path!r}", err) from err
            else:
                out.append(True)
        return out

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """:meth:`get` of each of ``keys``."""
        return [self.get(k) for k in _check_keys(keys)]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """:meth:`put` of each ``(key, value)``, all checked before any is written."""
        last = None
        for key, value in _check_items(items):
            last = self._put(key, value)
        self._evict_if_full(last)

    def clear(self) -> None:
        """Remove every value (and stale temporary files); the directory stays."""
        for _, _, path in self._scan():
            self._remove(path)
        self._held = self._since_scan = 0

    def _remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as err:
            raise self._error(f"removing {path!r}", err) from err

    def _scan(self) -> list[tuple[int, int, str]]:
        """``(mtime_ns, size, path)`` of every value file; removes stale temporary files."""
        found = []
        stale = time.time() - STALE_TMP_SECONDS
        try:
            with os.scandir(self._root) as it:
                subs = [e.path for e in it if _SUBDIR.fullmatch(e.name)]
            for sub in subs:
                try:
                    with os.scandir(sub) as it:
                        entries = list(it)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                for entry in entries:
                    try:
                        if entry.name.startswith(_TMP_PREFIX):
                            if entry.stat().st_mtime < stale:
                                os.unlink(entry.path)
                        elif _VALUE_NAME.fullmatch(entry.name):
                            st = entry.stat()
                            found.append((st.st_mtime_ns, st.st_size, entry.path))
                    except FileNotFoundError:  # another process removed it meanwhile
                        continue
        except OSError as err:
            raise self._error("scanning the directory", err) from err
        return found

    def _evict(self, keep: str | None = None) -> None:
        files = self._scan()
        held = sum(size for _, size, _ in files)
        if held > self._max:
            target = self._max - self._max // 10
            for _, size, path in sorted(files):
                if held <= target:
                    break
                if path != keep:
                    self._remove(path)
                    held -= size
        self._held, self._since_scan = held, 0


# --- RedisStore -----------------------------------------------------------------------


def _redact(url: str) -> str:
    """``url`` without its user information or ``password=`` query value."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    tail = re.sub(r"(?i)(password=)[^&]*", r"\1***", tail)
    return f"{scheme}://{netloc}{slash}{tail}"


def _positive_real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(
            f"{name} must be a positive number, got {type(value).__name__} {value!r:.60}"
        )
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class RedisStore:
    """A store on a Redis server, through the ``redis`` client (``pip install "nbkv[store]"``).

    Keys are kept as ``prefix.encode() + key``. ``put`` is one ``SET`` (with ``PX`` when
    ``ttl`` is given), ``get`` one ``GET``, ``get_many`` one ``MGET``, ``put_many`` one
    pipeline of ``SET`` and ``contains`` one pipeline of ``EXISTS``. Eviction is the
    server's: its ``maxmemory-policy`` (``allkeys-lru`` suits a cache) and the TTL. The
    client connects on first use and never retries: a server that is down or slow costs at
    most about ``timeout`` seconds per call and raises :class:`~nbkv.errors.StoreError`.

    Parameters
    ----------
    url : str
        ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` or ``unix://...``.
    ttl : float, optional
        Seconds each value lives (rounded to milliseconds); ``None``: until evicted.
    prefix : str
        Put before every key, so that several users can share one server.
    timeout : float
        Seconds to connect, and to wait for each reply.

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError
        For a bad argument.
    BackendUnavailableError
        If the ``redis`` client is not installed.
    """

    def __init__(
        self, url: str, *, ttl: float | None = None, prefix: str = "nbkv:", timeout: float = 1.0
    ) -> None:
        if not isinstance(url, str):
            raise ArgumentTypeError(f"url must be a str, got {type(url).__name__}")
        px = None if ttl is None else max(1, round(_positive_real(ttl, "ttl") * 1000))
        if not isinstance(prefix, str):
            raise ArgumentTypeError(f"prefix must be a str, got {type(prefix).__name__}")
        timeout = _positive_real(timeout, "timeout")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise BackendUnavailableError(
                'RedisStore needs the redis client: pip install "nbkv[store]"'
            ) from None
        self._url = _redact(url)
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 0),
                decode_responses=False,
            )
        except (ValueError, TypeError) as err:
            raise InvalidArgumentError(
                f"url must be a redis://, rediss:// or unix:// URL, got {self._url!r} ({err})"
            ) from None
        self._errors = (redis.RedisError, OSError)
        self._px, self._ttl, self._prefix, self._timeout = px, ttl, prefix, timeout
        self._raw_prefix = prefix.encode()

    def __repr__(self) -> str:
        return (
            f"RedisStore({self._url!r}, ttl={self._ttl!r}, prefix={self._prefix!r}, "
            f"timeout={self._timeout!r})"
        )

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections (a later call opens new ones)."""
        self._client.close()

    def _call(self, doing: str, fn):
        try:
            return fn()
        except self._errors as err:
            raise StoreError(
                f"RedisStore at {self._url}: {doing} failed: {type(err).__name__}: {err}"
            ) from err

    def _value(self, value: object) -> bytes | None:
        if value is None or isinstance(value, bytes):
            return value
        raise StoreError(f"RedisStore at {self._url} returned {type(value).__name__}, not bytes")

    def put(self, key: bytes, value: bytes) -> None:
        """``SET prefix+key value [PX ttl]``."""
        name, value = self._raw_prefix + _check_key(key), _check_value(value)
        self._call("SET", lambda: self._client.set(name, value, px=self._px))

    def get(self, key: bytes) -> bytes | None:
        """``GET prefix+key``."""
        name = self._raw_prefix + _check_key(key)
        return self._value(self._call("GET", lambda: self._client.get(name)))

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """One ``MGET`` of all ``keys`` (none for no keys)."""
        names = [self._raw_prefix + k for k in _check_keys(keys)]
        if not names:
            return []
        values = self._call("MGET", lambda: self._client.mget(names))
        if len(values) != len(names):
            raise StoreError(
                f"RedisStore at {self._url}: MGET of {len(names)} keys "
                f"returned {len(values)} values"
            )
        return [self._value(v) for v in values]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """One pipeline (not a transaction) of ``SET`` for all ``items``."""
        items = _check_items(items)
        if not items:
            return
        pipe = self._client.pipeline(transaction=False)
        for key, value in items:
            pipe.set(self._raw_prefix + key, value, px=self._px)
        self._call("pipelined SET", pipe.execute)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """One pipeline of ``EXISTS`` for all ``keys``."""
        names = [self._raw_prefix + k for k in _check_keys(keys)]
        if not names:
            return []
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(n) for n in self._call("pipelined EXISTS", pipe.execute)]


# --- the block record -----------------------------------------------------------------


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
    """One block of every layer as a record (layout in the module docstring).

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
