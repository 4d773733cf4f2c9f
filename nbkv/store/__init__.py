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

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..errors import ArgumentTypeError, StoreError
from ._keys import MAX_KEY_BYTES, _check_items, _check_keys
from .local import STALE_TMP_SECONDS as STALE_TMP_SECONDS  # re-exported, not in __all__
from .local import LocalStore
from .record import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    NAMESPACE_SALT,
    BlockGeometry,
    decode_block,
    encode_block,
    namespace,
    store_key,
)
from .redis_store import RedisStore

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


# --- the protocol ---------------------------------------------------------------------


@runtime_checkable
class Store(Protocol):
    """What an engine needs of a K/V store: three methods over ``bytes`` (see the module)."""

    def put(self, key: bytes, value: bytes) -> None: ...

    def get(self, key: bytes) -> bytes | None: ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...


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
