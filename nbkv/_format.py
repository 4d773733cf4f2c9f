"""The nbkv cache file: a safetensors file written and read here, knowing no cache class.

It stores a :class:`~nbkv.protocol.CacheState` (what a cache exports) and reads back a
:class:`~nbkv.protocol.LoadedState` (what a cache imports); which class builds a cache
from it is for :mod:`nbkv.persist` to say. Any safetensors reader opens the file. The
header (its metadata, encoded and checked) is :mod:`nbkv._format_header`'s; this module
writes and reads files.

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
import os
import re
import socket
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _safetensors as _st
from ._format_header import (
    CODES,
    FORMAT,
    FORMAT_VERSION,
    MAX_LAYERS,
    PLACEHOLDER,
    MetaReader,
    check_layer_meta,
    compact,
    encode_header,
    expected_tensors,
    layer_specs,
    meta_dtype,
    parse_header,
    tensor_name,
)
from .errors import ArgumentTypeError, CacheFormatError
from .protocol import CacheState, LoadedLayer, LoadedState

__all__ = [
    "CODES",
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

MAX_HEADER_BYTES = 16 * 2**20
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


def in_layout(arr: np.ndarray, src: str, dst: str) -> np.ndarray:
    """``arr`` in layout ``src`` seen in layout ``dst`` (a transposed view, no copy)."""
    return arr if src == dst else arr.transpose(0, 2, 1, 3)


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
        for w, code, shape in layer_specs(meta)
    ]
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "cache": compact({"type": state.type, "layers": metas}),
        "nbkv_version": _nbkv_version(),
    }
    crcs = {name: PLACEHOLDER for name, _, _ in specs}
    head = encode_header(specs, metadata, crcs)

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
                for which, _, shape in layer_specs(layer.meta):
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
            f.write(encode_header(specs, metadata, crcs))
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


def check_loaded_layer(layer: Any, i: int | None, where: str) -> LoadedLayer:
    """Check one layer of a state from anywhere (a file, or a caller's own transport):
    its meta's common fields, and tensors of exactly the shape and dtype it describes
    (none for a layer never allocated). CacheFormatError naming what is wrong."""
    if not isinstance(layer, LoadedLayer):
        raise ArgumentTypeError(
            f"a state's layers must be nbkv.protocol.LoadedLayer, got {type(layer).__name__}"
        )
    here = where if i is None else f"{where} (layer {i})"
    meta = check_layer_meta(layer.meta, here)
    if not meta["allocated"]:
        if layer.k is not None or layer.v is not None:
            raise CacheFormatError(f"{here}: a layer never allocated holds no tensors")
        return layer
    specs = layer_specs(meta)
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
        kind, metas, tensors, crc = parse_header(raw, total - 8 - n, where)
        expected_tensors(metas, tensors, crc, where)

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
