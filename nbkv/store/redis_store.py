"""RedisStore: a store on a Redis server that several machines share (the protocol:
:mod:`nbkv.store`)."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence

from ..errors import ArgumentTypeError, BackendUnavailableError, InvalidArgumentError, StoreError
from ._keys import _check_items, _check_key, _check_keys, _check_value


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
