"""The nbkv cache file: a safetensors file written and read here, knowing no cache class.

It stores a :class:`~nbkv.protocol.CacheState` (what a cache exports) and reads back a
:class:`~nbkv.protocol.LoadedState` (what a cache imports); which class builds a cache
from it is for :mod:`nbkv.persist` to say. Any safetensors reader opens the file.

Layout of a file (format version 2)
-----------------------------------
- tensors ``layers.{i}.k`` and ``layers.{i}.v`` for every allocated layer ``i``: the
  ``seq_len`` positions it holds, in position order, in the layer's layout and dtype
  (bfloat16 as safetensors' ``BF16``); an allocated layer holding nothing has tensors with
  a zero-length seq axis, a layer never allocated has none;
- ``__metadata__`` (strings only, as safetensors requires):

  ==============  ==========================================================================
  format          ``"nbkv-cache"``
  format_version  ``"2"``; a reader refuses any version it does not know
  cache           JSON: ``{"type": <cache type>, "layers": [<layer meta>, ...]}``; each
                  layer meta has ``type``, ``layout``, ``dtype`` (``""`` while unknown),
                  ``batch``, ``num_kv_heads``, ``head_dim`` (``null`` while unknown),
                  ``seq_len`` (rows held), ``allocated``, and its type's own fields
                  (see :mod:`nbkv.protocol`)
  crc32           JSON: tensor name -> ``zlib.crc32`` of its bytes, 8 hex digits
  header_crc32    ``zlib.crc32`` of the whole header (the JSON after the 8-byte length,
                  padding included) with this field's value set to ``"00000000"``
  nbkv_version    the writer's version (informational)
  ==============  ==========================================================================

Reads are bounded and check everything before anything is allocated for the data: the
header's size (at most :data:`MAX_HEADER_BYTES`), nesting, integers, its checksum, the
structure, every common layer field, the name, dtype and shape of every tensor against
them, and that the sizes claimed match the bytes the file holds; then each tensor's
CRC32 as it is read. A file that fails any check raises :class:`~nbkv.CacheFormatError`.
A read opens the file once and reads that one snapshot, so a concurrent atomic save of
the same path is seen whole or not at all.

Writes are atomic: a temporary file in the target's folder, flushed and fsync'ed, then
renamed over the target. A failed write removes its temporary file; a write also removes
temporary files of the same target left by processes of this machine that have died.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _safetensors as _st
from . import layout as _layout
from .errors import ArgumentTypeError, CacheFormatError
from .protocol import CacheState, LoadedLayer, LoadedState

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "MetaReader",
    "write_file",
    "read_file",
    "open_file",
    "check_loaded",
    "check_loaded_layer",
    "FileTensor",
    "meta_dtype",
    "in_layout",
    "file_path",
]

FORMAT = "nbkv-cache"
FORMAT_VERSION = "2"
MAX_HEADER_BYTES = 16 * 2**20
MAX_SIZE = 2**31 - 1  # any size or count a file may claim
MAX_LAYERS = 100_000
# the storage dtypes and their safetensors names
CODES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16"}
_PLACEHOLDER = "00000000"  # same width as a real CRC: the header is rewritten in place
_TMP = ".nbkv-tmp"


def file_path(path: Any, name: str = "path") -> str:
    """``path`` as a str if it is a str or os.PathLike, else ArgumentTypeError."""
    if isinstance(path, (str, os.PathLike)):
        value = os.fspath(path)
        if isinstance(value, str) and value:
            return value
    raise ArgumentTypeError(
        f"{name} must be a file path (a non-empty str or os.PathLike), got "
        f"{type(path).__name__} {path!r:.80}"
    )


def tensor_name(layer: int, which: str) -> str:
    return f"layers.{layer}.{which}"


def meta_dtype(meta: dict) -> np.dtype | None:
    """The dtype a checked layer meta names (None while unknown)."""
    name = meta["dtype"]
    return None if not name else np.dtype(_st.DTYPES[CODES[name]])


def in_layout(arr: np.ndarray, src: str, dst: str) -> np.ndarray:
    """``arr`` in layout ``src`` seen in layout ``dst`` (a transposed view, no copy)."""
    return arr if src == dst else arr.transpose(0, 2, 1, 3)


class MetaReader:
    """Typed reads of a layer meta that raise CacheFormatError naming the field."""

    def __init__(self, meta: dict, where: str) -> None:
        self.meta, self.where = meta, where

    def fail(self, message: str) -> CacheFormatError:
        return CacheFormatError(f"{self.where}: {message}")

    def get(self, key: str) -> Any:
        if key not in self.meta:
            raise self.fail(f"the metadata has no {key!r} field; the file is malformed")
        return self.meta[key]

    def int(self, key: str, minimum: int = 0, maximum: int = MAX_SIZE) -> int:
        value = self.get(key)
        if type(value) is not int or not minimum <= value <= maximum:
            raise self.fail(
                f"metadata {key} must be an int in [{minimum}, {maximum}], got {value!r:.40}"
            )
        return value

    def optional_int(self, key: str, minimum: int = 1) -> int | None:
        return None if self.get(key) is None else self.int(key, minimum)

    def choice(self, key: str, options: tuple) -> Any:
        value = self.get(key)
        if not isinstance(value, (str, bool)) or value not in options:
            raise self.fail(f"metadata {key} must be one of {options}, got {value!r:.40}")
        return value


# -- writing -------------------------------------------------------------------------


def _pieces(a: np.ndarray) -> Iterator[memoryview]:
    """The bytes of ``a`` in C order, as contiguous pieces (no copy of a strided view).

    A view of the positions held is contiguous below some axis ([seq, head_dim] slabs
    for "bhsd"), so this yields one piece per slab rather than copying the view.
    """
    if a.size == 0:
        return
    if a.flags.c_contiguous:
        yield memoryview(a.reshape(-1).view(np.uint8))
    elif a.ndim <= 1:
        yield memoryview(np.ascontiguousarray(a).view(np.uint8))
    else:
        for sub in a:
            yield from _pieces(sub)


def _write(f, piece: memoryview) -> None:
    """Write one piece of tensor data (a seam for tests that simulate a crash)."""
    f.write(piece)


def _layer_shape(meta: dict) -> tuple[int, int, int, int]:
    return _layout.buffer_shape(
        meta["layout"], meta["batch"], meta["num_kv_heads"], meta["seq_len"], meta["head_dim"]
    )


def _layer_specs(meta: dict) -> list[tuple[str, str, tuple]]:
    """(name, safetensors dtype, shape) of each tensor of a checked layer meta: ``k`` and
    ``v`` of the layer's shape and dtype, or the tensors it declares; none if never
    allocated."""
    if not meta["allocated"]:
        return []
    if "tensors" in meta:
        return [(name, code, tuple(shape)) for name, (code, shape) in meta["tensors"].items()]
    return [(w, CODES[meta["dtype"]], _layer_shape(meta)) for w in "kv"]


_TENSOR_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_TENSORS = 16  # tensors a layer may declare


def _check_declared(m: MetaReader) -> None:
    """A layer meta's own ``tensors``: name -> [safetensors dtype, shape], bounded."""
    declared = m.get("tensors")
    if not isinstance(declared, dict) or not 0 < len(declared) <= MAX_TENSORS:
        raise m.fail(f"metadata tensors must map 1 to {MAX_TENSORS} names to [dtype, shape]")
    for name, spec in declared.items():
        if not _TENSOR_NAME.fullmatch(name) or name in ("k", "v"):
            raise m.fail(f"metadata tensors: {name!r:.40} is not a tensor name this format allows")
        ok = isinstance(spec, list) and len(spec) == 2 and spec[0] in _st.DTYPES
        shape = spec[1] if ok else None
        ok = ok and isinstance(shape, list) and 1 <= len(shape) <= 8
        if not ok or not all(type(x) is int and 0 <= x <= MAX_SIZE for x in shape):
            raise m.fail(f"metadata tensors: {name} must be [dtype, shape], got {spec!r:.60}")
        if _st.DTYPES[spec[0]] is None:
            raise m.fail(f"metadata tensors: {name} is {spec[0]}, which needs ml_dtypes")


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _header(specs, metadata: dict, crcs: dict) -> bytes:
    """The header with ``crcs`` in and its own checksum computed and filled in."""
    metadata = {**metadata, "crc32": _compact(crcs), "header_crc32": _PLACEHOLDER}
    head = _st.header_bytes(specs, metadata)
    metadata["header_crc32"] = f"{zlib.crc32(head[8:]):08x}"
    final = _st.header_bytes(specs, metadata)
    if len(final) != len(head):  # cannot happen: every CRC is 8 hex digits
        raise RuntimeError("nbkv.save: the header changed length")
    return final


def _nbkv_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nbkv")
    except PackageNotFoundError:
        return "unknown"


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


def _remove_stale(folder: str, base: str) -> None:
    """Remove temporary files of ``base`` that dead processes of this host left behind.

    POSIX only: there ``os.kill(pid, 0)`` asks whether a process lives; on Windows it
    would terminate it, so nothing is removed there."""
    if os.name == "nt":
        return
    prefix, tag = f".{base}.", _host_tag()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(_TMP)):
            continue
        parts = name[len(prefix) : -len(_TMP)].split(".")
        if len(parts) != 3 or parts[0] != tag or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
            continue  # alive (or another process has its pid): leave it
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, OSError):
            continue
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass


def write_file(path: Any, state: CacheState) -> None:
    """Write ``state`` to ``path`` atomically (see the module docstring)."""
    target = file_path(path)
    metas = [layer.meta for layer in state.layers]
    specs = [
        (tensor_name(i, w), code, shape)
        for i, meta in enumerate(metas)
        for w, code, shape in _layer_specs(meta)
    ]
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "cache": _compact({"type": state.type, "layers": metas}),
        "nbkv_version": _nbkv_version(),
    }
    crcs = {name: _PLACEHOLDER for name, _, _ in specs}
    head = _header(specs, metadata, crcs)

    folder, base = os.path.split(os.path.abspath(target))
    _remove_stale(folder, base)
    tmp = os.path.join(folder, f".{base}.{_host_tag()}.{os.getpid()}.{uuid.uuid4().hex}{_TMP}")
    # O_EXCL: never write through a name someone else made; mode 0o666 lets umask decide
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with open(fd, "wb") as f:
            f.write(head)  # with placeholder CRCs, rewritten below at the same length
            for i, layer in enumerate(state.layers):
                if not layer.meta["allocated"]:
                    continue
                held = layer.held()
                if not isinstance(held, dict):
                    held = dict(zip("kv", held, strict=True))
                for which, _, shape in _layer_specs(layer.meta):
                    name, arr = tensor_name(i, which), held[which]
                    if tuple(arr.shape) != shape:
                        raise RuntimeError(
                            f"nbkv.save: {name} has shape {arr.shape}, not its meta's"
                        )
                    crc = 0
                    for piece in _pieces(arr):
                        crc = zlib.crc32(piece, crc)
                        _write(f, piece)
                    crcs[name] = f"{crc:08x}"
            f.seek(0)
            f.write(_header(specs, metadata, crcs))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
    """Make the rename durable too (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- reading -------------------------------------------------------------------------


def _check_header_crc(raw: bytes, metadata: dict, where: str) -> None:
    value = metadata.get("header_crc32")
    if not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{8}", value)):
        raise CacheFormatError(f"{where}: the metadata has no valid header_crc32 field")
    field = f'"header_crc32":"{value}"'.encode()
    if raw.count(field) != 1:
        raise CacheFormatError(
            f"{where}: the header's header_crc32 field is not where nbkv puts it"
        )
    got = zlib.crc32(raw.replace(field, f'"header_crc32":"{_PLACEHOLDER}"'.encode()))
    if got != int(value, 16):
        raise CacheFormatError(
            f"{where}: the header is corrupted: its CRC32 is {got:08x} but the file records "
            f"{value} (the metadata or the tensor table was changed)"
        )


def _check_layer_meta(meta: Any, here: str) -> dict:
    """The fields every layer meta has, checked; the type's own are its class's to check."""
    if not isinstance(meta, dict):
        raise CacheFormatError(f"{here}: a layer's metadata must be a JSON object")
    m = MetaReader(meta, here)
    kind = m.get("type")
    if not isinstance(kind, str) or not 0 < len(kind) <= 64:
        raise m.fail(f"metadata type must be a cache type name, got {kind!r:.40}")
    m.choice("layout", _layout.LAYOUTS)
    dtype = m.choice("dtype", ("", *CODES))
    if dtype and _st.DTYPES[CODES[dtype]] is None:
        raise m.fail("the cache holds bfloat16, which needs ml_dtypes: pip install 'nbkv[bf16]'")
    sizes = [m.optional_int(field) for field in _layout.SIZES]
    m.int("seq_len")
    allocated = m.choice("allocated", (True, False))
    if allocated and (not dtype or None in sizes):
        raise m.fail("the layer is allocated, but its dtype or sizes are missing")
    if not allocated and meta["seq_len"]:
        raise m.fail(f"the layer is not allocated but holds seq_len {meta['seq_len']}")
    if "tensors" in meta:
        _check_declared(m)
    return meta


def check_loaded_layer(layer: Any, i: int | None, where: str) -> LoadedLayer:
    """Check one layer of a state from anywhere (a file, or a caller's own transport):
    its meta's common fields, and tensors of exactly the shape and dtype it describes
    (none for a layer never allocated). CacheFormatError naming what is wrong."""
    if not isinstance(layer, LoadedLayer):
        raise ArgumentTypeError(
            f"a state's layers must be nbkv.protocol.LoadedLayer, got {type(layer).__name__}"
        )
    here = where if i is None else f"{where} (layer {i})"
    meta = _check_layer_meta(layer.meta, here)
    if not meta["allocated"]:
        if layer.k is not None or layer.v is not None:
            raise CacheFormatError(f"{here}: a layer never allocated holds no tensors")
        return layer
    specs = _layer_specs(meta)
    if "tensors" in meta:
        got = layer.tensors if isinstance(layer.tensors, dict) else {}
        if layer.k is not None or layer.v is not None or got.keys() != meta["tensors"].keys():
            raise CacheFormatError(
                f"{here}: the layer declares tensors {sorted(meta['tensors'])[:8]}, and holds "
                f"k, v and {sorted(got)[:8]}"
            )
    else:
        got = {"k": layer.k, "v": layer.v}
    for which, code, want in specs:
        t, dtype = got[which], _st.DTYPES[code]
        if not (isinstance(t, np.ndarray) or isinstance(t, FileTensor)):
            raise CacheFormatError(
                f"{here}: tensor {which} must be a host array of shape {want}, got "
                f"{type(t).__name__}"
            )
        if tuple(t.shape) != want or np.dtype(t.dtype) != dtype:
            raise CacheFormatError(
                f"{here}: tensor {which} is {t.dtype} of shape {tuple(t.shape)}, but the meta "
                f"says {dtype} of shape {want} (seq_len {meta['seq_len']})"
            )
    return layer


def check_loaded(state: Any) -> LoadedState:
    """Check a whole state (see :func:`check_loaded_layer`): what every import runs."""
    if not isinstance(state, LoadedState):
        raise ArgumentTypeError(
            f"state must be an nbkv.protocol.LoadedState, got {type(state).__name__}"
        )
    if not isinstance(state.type, str) or not isinstance(state.layers, list):
        raise CacheFormatError(f"{state.where}: a state has a type name and a list of layers")
    if not 0 < len(state.layers) <= MAX_LAYERS:
        raise CacheFormatError(f"{state.where}: a state holds 1 to {MAX_LAYERS} layers")
    for i, layer in enumerate(state.layers):
        check_loaded_layer(layer, i, state.where)
    return state


def _parse(raw: bytes, data_len: int, where: str) -> tuple[str, list[dict], dict, dict]:
    """Check a header: ``(cache type, layer metas, tensors, crcs)``."""
    header = _st.loads(raw, where, CacheFormatError)
    try:
        tensors, metadata = _st.check_header(header, data_len, where)
    except _st.SafetensorsError as err:
        raise CacheFormatError(str(err)) from None
    metadata = metadata or {}
    if metadata.get("format") != FORMAT:
        raise CacheFormatError(
            f"{where}: not an nbkv cache file (metadata format is "
            f"{metadata.get('format')!r:.40}, expected {FORMAT!r})"
        )
    version = metadata.get("format_version")
    if version != FORMAT_VERSION:
        raise CacheFormatError(
            f"{where}: format_version {version!r:.20}; this nbkv reads version {FORMAT_VERSION} "
            "(a file of version 1, from before the cache protocol, must be saved again)"
        )
    _check_header_crc(raw, metadata, where)
    for field in ("cache", "crc32"):
        if field not in metadata:
            raise CacheFormatError(f"{where}: the metadata has no {field!r} field")
    cache = _st.loads(metadata["cache"].encode(), f"{where} (metadata cache)", CacheFormatError)
    if not isinstance(cache, dict) or not isinstance(cache.get("type"), str):
        raise CacheFormatError(f"{where}: metadata cache must be an object with a type")
    layers = cache.get("layers")
    if not isinstance(layers, list) or not 0 < len(layers) <= MAX_LAYERS:
        raise CacheFormatError(f"{where}: metadata cache must hold 1 to {MAX_LAYERS} layers")
    metas = [_check_layer_meta(meta, f"{where} (layer {i})") for i, meta in enumerate(layers)]
    crc = _st.loads(metadata["crc32"].encode(), f"{where} (metadata crc32)", CacheFormatError)
    if not isinstance(crc, dict) or not all(
        isinstance(v, str) and re.fullmatch(r"[0-9a-f]{8}", v) for v in crc.values()
    ):
        raise CacheFormatError(f"{where}: metadata crc32 must map tensor names to 8 hex digits")
    return cache["type"], metas, tensors, crc


def _expected(metas: list[dict], tensors: dict, crc: dict, where: str) -> dict:
    """The tensors the metas describe, checked against those the file holds."""
    expected = {}
    for i, meta in enumerate(metas):
        for which, code, shape in _layer_specs(meta):
            expected[tensor_name(i, which)] = (_st.DTYPES[code], shape)
    missing = sorted(expected.keys() - tensors.keys())
    extra = sorted(tensors.keys() - expected.keys())
    if missing or extra:
        raise CacheFormatError(
            f"{where}: the tensors do not match the metadata: missing {missing[:4]}, "
            f"unexpected {extra[:4]}"
        )
    for name, (dtype, shape) in expected.items():
        got_dtype, got_shape = tensors[name][:2]
        if got_dtype != dtype or got_shape != shape:
            raise CacheFormatError(
                f"{where}: tensor {name!r} is {got_dtype} of shape {got_shape}, but the "
                f"metadata says {dtype} of shape {shape}"
            )
    if crc.keys() != expected.keys():
        raise CacheFormatError(
            f"{where}: metadata crc32 names {sorted(crc)[:4]}, but the file's tensors are "
            f"{sorted(expected)[:4]}"
        )
    return expected


def _read_exactly(f, n: int, where: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CacheFormatError(
            f"{where}: the file ended {n - len(data)} bytes early; is it truncated?"
        )
    return data


class FileTensor:
    """One tensor of an open cache file, read on demand and checked by its CRC32.

    ``shape`` and ``dtype`` are the checked header's. :meth:`read` returns a new host
    array; :meth:`read_into` reads straight into an array of that shape (any strides:
    the buffers of a new cache), piece by piece, computing the CRC32 on the way; on a
    mismatch it raises CacheFormatError and ``out`` holds garbage (so only a cache that
    is not yet anyone's is read into).
    """

    def __init__(self, f, where: str, name: str, dtype: np.dtype, shape: tuple, at: int, crc: int):
        self._f, self.where, self.name = f, where, name
        self.dtype, self.shape, self._at, self._crc = dtype, shape, at, crc

    def read_into(self, out: np.ndarray) -> np.ndarray:
        if tuple(out.shape) != self.shape or out.dtype.itemsize != self.dtype.itemsize:
            raise ValueError(
                f"{self.name}: cannot read {self.shape} {self.dtype} into {out.shape} {out.dtype}"
            )
        self._f.seek(self._at)
        crc = 0
        for piece in _pieces(out):
            got = 0
            while got < len(piece):
                k = self._f.readinto(piece[got:])
                if not k:
                    raise CacheFormatError(
                        f"{self.where}: the file ended inside tensor {self.name!r} (it changed "
                        "while being read, or is truncated)"
                    )
                got += k
            crc = zlib.crc32(piece, crc)
        if crc != self._crc:
            raise CacheFormatError(
                f"{self.where}: tensor {self.name!r} is corrupted: its CRC32 is {crc:08x} but "
                f"the file records {self._crc:08x}"
            )
        return out

    def read(self) -> np.ndarray:
        return self.read_into(np.empty(self.shape, self.dtype))


@contextlib.contextmanager
def open_file(path: Any) -> Iterator[LoadedState]:
    """Open and check a cache file; yield a :class:`~nbkv.protocol.LoadedState` whose
    layers hold :class:`FileTensor` objects, readable while the ``with`` block lasts.

    Everything but the tensors' CRC32 (checked as each is read) is checked before this
    yields: the header (size, nesting, integers, checksum, structure) and every tensor's
    name, dtype, shape and place against the metadata and the file's size. The file is
    opened once, so what is read is one snapshot of it, whatever a writer does meanwhile.

    Raises
    ------
    ArgumentTypeError
        ``path`` is not a path.
    FileNotFoundError, OSError
        No file, or one that cannot be read.
    CacheFormatError
        Anything wrong with the file (see the module docstring).
    """
    where = file_path(path)
    with open(where, "rb", buffering=0) as f:  # one open: one snapshot of the file
        total = os.fstat(f.fileno()).st_size
        if total < 8:
            raise CacheFormatError(
                f"{where}: {total} bytes is too short for a cache file; is it truncated?"
            )
        n = int.from_bytes(_read_exactly(f, 8, where), "little")
        if n > MAX_HEADER_BYTES:
            raise CacheFormatError(
                f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit; "
                "this is not an nbkv cache file"
            )
        if 8 + n > total:
            raise CacheFormatError(
                f"{where}: header length {n} runs past the end of the {total}-byte file; "
                "is it truncated?"
            )
        raw = _read_exactly(f, n, where)
        # the tensors must tile the data exactly: the sizes claimed are the bytes held
        kind, metas, tensors, crc = _parse(raw, total - 8 - n, where)
        _expected(metas, tensors, crc, where)

        def tensor(i: int, which: str) -> FileTensor | None:
            name = tensor_name(i, which)
            if name not in tensors:
                return None
            dtype, shape, begin, _ = tensors[name]
            return FileTensor(f, where, name, dtype, shape, 8 + n + begin, int(crc[name], 16))

        def declared(i: int, meta: dict) -> dict | None:
            if "tensors" not in meta:
                return None
            return {name: tensor(i, name) for name in meta["tensors"]}

        layers = [
            LoadedLayer(meta, tensor(i, "k"), tensor(i, "v"), declared(i, meta))
            for i, meta in enumerate(metas)
        ]
        yield LoadedState(kind, layers, where)


def read_file(path: Any) -> LoadedState:
    """Read and check a whole cache file: a LoadedState of host arrays (every tensor read
    and its CRC32 checked before this returns). Raises as :func:`open_file`."""
    with open_file(path) as state:
        layers = [
            LoadedLayer(
                x.meta,
                *(None if t is None else t.read() for t in (x.k, x.v)),
                None if x.tensors is None else {n: t.read() for n, t in x.tensors.items()},
            )
            for x in state.layers
        ]
    return LoadedState(state.type, layers, state.where)
