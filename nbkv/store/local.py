"""LocalStore: a store in a directory on one machine's disk (the protocol: :mod:`nbkv.store`)."""

from __future__ import annotations

import numbers
import os
import re
import time
import uuid
from collections.abc import Sequence

from ..errors import ArgumentTypeError, InvalidArgumentError, StoreError
from ._keys import _check_items, _check_key, _check_keys, _check_value

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
