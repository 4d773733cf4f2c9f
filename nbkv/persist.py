"""Saving a cache to a file and loading it back: :func:`save`, :func:`load`, ``load_state``.

The file is a safetensors file (https://github.com/huggingface/safetensors), written and
read by nbkv's own pickle-free code (:mod:`nbkv._safetensors`): nothing in it is ever
executed, and any safetensors reader (the ``safetensors`` package's ``safe_open``, for
one) opens it. It holds only the positions each layer holds, never the capacity:

- tensors ``layers.{i}.k`` and ``layers.{i}.v``: positions ``[0, seq_len)`` of layer
  ``i``, in the cache's layout (``[batch, num_kv_heads, seq_len, head_dim]`` for "bhsd",
  ``[batch, seq_len, num_kv_heads, head_dim]`` for "bshd") and dtype (bfloat16 as
  safetensors' ``BF16``). An allocated layer holding nothing has tensors with a
  zero-length seq axis; a layer never allocated (a lazy cache) has none.
- ``__metadata__`` (strings only, as safetensors requires; lists and maps JSON-encoded):

  ==============  ==========================================================================
  format          ``"nbkv-cache"``
  format_version  ``"1"``; a reader refuses any version it does not know
  cache_type      ``"LayerKVCache"`` or ``"KVCache"``
  num_layers      ``"1"`` for a LayerKVCache
  layout          ``"bhsd"`` or ``"bshd"``: the axis order of the tensors
  dtype           ``"float32"``, ``"float64"``, ``"float16"``, ``"bfloat16"``; ``""``
                  while not known (a lazy cache built without one)
  batch           the sizes, ``""`` where not known yet (a lazy cache); one set for the
  num_kv_heads    whole cache
  head_dim
  seq_len         JSON list, per layer: positions held (rows stored)
  offset          JSON list, per layer: tokens seen; equal to ``seq_len`` for these
                  caches, the two are kept apart for a rotating cache (below)
  max_seq_len     JSON list, per layer: capacity (layers grown with ``on_overflow="grow"``
                  may differ)
  allocated       JSON list of bools, per layer
  on_overflow     ``"error"`` or ``"grow"``
  grow_step       an int
  crc32           JSON object: tensor name -> ``zlib.crc32`` of its bytes, 8 hex digits
  nbkv_version    the writer's version (informational)
  ==============  ==========================================================================

A ``RotatingKVCache`` (a sliding window with attention sinks) is ``cache_type=
"RotatingKVCache"`` (one layer) with three more fields: ``window``, ``sinks`` and
``sink_count`` (JSON list: the sink positions held); ``offset`` (tokens seen) runs ahead
of ``seq_len`` (rows stored, at most the window), and the tensors hold the rows in
position order (unrotated): the sinks held, then the ring's positions oldest first.
Readers that do not know a cache type refuse it by name.

Writes are atomic: the file is written under a temporary name in the target's folder,
flushed and fsync'ed, then renamed over the target (``os.replace``), so a crash never
leaves a truncated file under the target's name.

Reads check everything before they build or change anything: the safetensors structure,
every metadata field, the name, dtype and shape of every tensor, and every tensor's CRC32.
A file that fails any check raises :class:`~nbkv.errors.CacheFormatError` naming what is
wrong; a cache is never returned (or, with ``load_state``, left) half filled.

Examples
--------
>>> import os, tempfile
>>> import numpy as np, nbkv
>>> cache = nbkv.KVCache(2, 4096, batch=1, num_kv_heads=2, head_dim=4, dtype="float32")
>>> k = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
>>> for layer in cache:
...     layer.append(k, -k)
>>> path = os.path.join(tempfile.mkdtemp(), "cache.safetensors")
>>> nbkv.save(path, cache)
>>> cache.nbytes, os.path.getsize(path) < 2048  # 3 positions held, not the capacity
(524288, True)
>>> back = nbkv.load(path)
>>> back.seq_len, back.max_seq_len, bool((back[1].get_kv()[1] == -k).all())
(3, 4096, True)
"""

from __future__ import annotations

import json
import os
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _safetensors as _st
from . import layout as _layout
from .errors import (
    ArgumentTypeError,
    CacheFormatError,
    CacheOverflowError,
    DTypeMismatchError,
    ShapeMismatchError,
)

__all__ = ["FORMAT", "FORMAT_VERSION", "CACHE_TYPES", "save", "load", "load_state"]

FORMAT = "nbkv-cache"
FORMAT_VERSION = "1"
CACHE_TYPES = ("LayerKVCache", "KVCache", "RotatingKVCache")

# the storage dtypes and their safetensors names
_CODES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16"}
_SIZES = ("batch", "num_kv_heads", "head_dim")
_CRC_PLACEHOLDER = "00000000"  # same width as a real one: the header is rewritten in place


def _tensor_name(layer: int, which: str) -> str:
    return f"layers.{layer}.{which}"


def _layers_of(cache: Any, what: str = "cache") -> tuple[str, list]:
    """``(cache type, [LayerKVCache, ...])`` of a cache, or ArgumentTypeError."""
    from .cache import KVCache, LayerKVCache
    from .rotating import RotatingKVCache

    if type(cache) is RotatingKVCache:
        return "RotatingKVCache", [cache]
    if type(cache) is KVCache:
        kind, layers = "KVCache", list(cache)
    else:
        kind, layers = "LayerKVCache", [cache]
    for layer in layers:
        # exact types: a KVCache of rotating layers is not a format of version 1
        if type(layer) is not LayerKVCache:
            raise ArgumentTypeError(
                f"{what} must be an nbkv.LayerKVCache, a KVCache of them or an "
                f"nbkv.RotatingKVCache, got "
                f"{type(layer).__name__}; format version {FORMAT_VERSION} stores no other"
            )
    return kind, layers


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


def _held_on_host(layer) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays (or views) of the positions ``layer`` holds, in its logical dtype.

    CPU: views of the buffers, no copy. CUDA: the positions held are gathered into a
    contiguous device array by the copy kernel, then copied to the host once each
    (the explicit device->host copy of a save).
    """
    from .rotating import RotatingKVCache

    be = layer._backend
    if isinstance(layer, RotatingKVCache):
        # the rows in position order (a gather on the device once the ring has wrapped)
        kv = layer.get_kv() or layer._ordered()
        if be.name == "cpu":
            return kv
        return tuple(x.copy_to_host().view(layer.dtype) for x in kv)
    k, v = layer._buffers()
    index = _layout.seq_index(layer.layout, 0, layer.seq_len)
    if be.name == "cpu":
        return k[index], v[index]
    shape = _layout.buffer_shape(
        layer.layout, layer.batch, layer.num_kv_heads, layer.seq_len, layer.head_dim
    )
    dk = be.kernel_view(be.empty(shape, layer.dtype))
    dv = be.kernel_view(be.empty(shape, layer.dtype))
    if layer.seq_len:
        be.write_kv(layer.layout, layer._kk[index], layer._vk[index], 0, dk, dv)
    return dk.copy_to_host().view(layer.dtype), dv.copy_to_host().view(layer.dtype)


def _common(layers: list, field: str) -> Any:
    """The value every layer that knows ``field`` agrees on (None if none knows it)."""
    known = {getattr(layer, field) for layer in layers} - {None}
    if len(known) > 1:
        raise ShapeMismatchError(
            f"the layers of this cache disagree in {field} ({sorted(map(str, known))}); "
            "a saved cache holds one value for the whole cache"
        )
    return known.pop() if known else None


def save(path: str | os.PathLike, cache: Any) -> None:
    """Write ``cache`` (a LayerKVCache or KVCache) to a safetensors file at ``path``.

    Only the positions held are written (``seq_len`` per layer, not the capacity),
    bit-exact, with the cache's configuration and a CRC32 of every tensor (the format is
    described in :mod:`nbkv.persist`). Lazy caches, allocated or not, save too. The write
    is atomic: a temporary file in the same folder, flushed and fsync'ed, then
    ``os.replace``'d onto ``path``; on any error the target is untouched and the
    temporary file removed.

    Parameters
    ----------
    path : path-like
        Where to write (conventionally ``*.safetensors``); an existing file is replaced.
    cache : LayerKVCache or KVCache
        On any device: CUDA data are gathered on the device and copied to the host once.

    Raises
    ------
    ArgumentTypeError
        ``cache`` is not an nbkv cache.
    ShapeMismatchError
        The layers of a KVCache disagree in a size or dtype (built lazily from
        different first appends).
    OSError
        The folder does not exist or cannot be written.

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np, nbkv
    >>> cache = nbkv.LayerKVCache(64, batch=1, num_kv_heads=2, head_dim=8, dtype="float16")
    >>> cache.append(np.ones((1, 2, 5, 8), np.float16), np.zeros((1, 2, 5, 8), np.float16))
    >>> path = os.path.join(tempfile.mkdtemp(), "layer.safetensors")
    >>> nbkv.save(path, cache)
    >>> nbkv.load(path).seq_len
    5
    """
    kind, layers = _layers_of(cache)
    sizes = {field: _common(layers, field) for field in _SIZES}
    dtype = _common(layers, "dtype")
    dtype_name = "" if dtype is None else str(dtype)
    layout = layers[0].layout
    specs = []
    for i, layer in enumerate(layers):
        if layer.is_allocated:
            shape = _layout.buffer_shape(
                layout, layer.batch, layer.num_kv_heads, layer.seq_len, layer.head_dim
            )
            specs += [(_tensor_name(i, w), _CODES[dtype_name], shape) for w in "kv"]
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "cache_type": kind,
        "num_layers": str(len(layers)),
        "layout": layout,
        "dtype": dtype_name,
        **{field: "" if value is None else str(value) for field, value in sizes.items()},
        "seq_len": json.dumps([layer.seq_len for layer in layers]),
        "offset": json.dumps([layer.offset for layer in layers]),
        "max_seq_len": json.dumps([layer.max_seq_len for layer in layers]),
        "allocated": json.dumps([layer.is_allocated for layer in layers]),
        "on_overflow": layers[0].on_overflow,
        "grow_step": str(layers[0].grow_step),
        "nbkv_version": _nbkv_version(),
    }
    if kind == "RotatingKVCache":
        metadata["window"] = str(cache.window)
        metadata["sinks"] = str(cache.sinks)
        metadata["sink_count"] = json.dumps([cache._sink_count])
    crcs = {name: _CRC_PLACEHOLDER for name, _, _ in specs}
    metadata["crc32"] = json.dumps(crcs)
    head = _st.header_bytes(specs, metadata)

    target = os.fspath(path)
    folder, base = os.path.split(os.path.abspath(target))
    tmp = os.path.join(folder, f".{base}.{uuid.uuid4().hex}.tmp")
    # O_EXCL: never write through a name someone else made; mode 0o666 lets umask decide
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with open(fd, "wb") as f:
            f.write(head)  # with placeholder CRCs, rewritten below at the same length
            for i, layer in enumerate(layers):
                if not layer.is_allocated:
                    continue
                for which, arr in zip("kv", _held_on_host(layer), strict=True):
                    crc = 0
                    for piece in _pieces(arr):
                        crc = zlib.crc32(piece, crc)
                        _write(f, piece)
                    crcs[_tensor_name(i, which)] = f"{crc:08x}"
            metadata["crc32"] = json.dumps(crcs)
            final = _st.header_bytes(specs, metadata)
            if len(final) != len(head):  # cannot happen: every CRC is 8 hex digits
                raise RuntimeError("nbkv.save: the header changed length")
            f.seek(0)
            f.write(final)
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


def _nbkv_version() -> str:
    from . import __version__

    return __version__


# -- reading: the header -------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """What a checked file holds: its metadata parsed and its tensors' places."""

    path: str
    cache_type: str
    layout: str
    dtype: np.dtype | None
    sizes: dict  # batch, num_kv_heads, head_dim -> int or None
    seq_len: tuple[int, ...]
    max_seq_len: tuple[int, ...]
    allocated: tuple[bool, ...]
    on_overflow: str
    grow_step: int
    tensors: dict  # name -> (dtype, shape, begin, end), offsets within the data
    crc: dict  # name -> int
    start: int  # where the data begin in the file
    offset: tuple[int, ...] = ()
    window: int | None = None  # a RotatingKVCache's
    sinks: int | None = None
    sink_count: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.seq_len)


class _Fields:
    """Typed reads of ``__metadata__`` that raise CacheFormatError naming the field."""

    def __init__(self, metadata: dict[str, str], where: str) -> None:
        self.m, self.where = metadata, where

    def fail(self, message: str) -> CacheFormatError:
        return CacheFormatError(f"{self.where}: {message}")

    def str(self, key: str) -> str:
        if key not in self.m:
            raise self.fail(f"the metadata has no {key!r} field; the file is malformed")
        return self.m[key]

    def choice(self, key: str, options: tuple[str, ...]) -> str:
        value = self.str(key)
        if value not in options:
            raise self.fail(f"metadata {key} must be one of {options}, got {value!r}")
        return value

    def int(self, key: str, minimum: int = 1, optional: bool = False) -> int | None:
        raw = self.str(key)
        if optional and raw == "":
            return None
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 20) or int(raw) < minimum:
            also = " or empty" if optional else ""
            raise self.fail(f"metadata {key} must be an int >= {minimum}{also}, got {raw!r}")
        return int(raw)

    def json(self, key: str) -> Any:
        raw = self.str(key)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise self.fail(f"metadata {key} is not valid JSON: {raw[:80]!r}") from None

    def int_list(self, key: str, n: int, minimum: int) -> tuple[int, ...]:
        value = self.json(key)
        if not (
            isinstance(value, list)
            and len(value) == n
            and all(type(x) is int and x >= minimum for x in value)
        ):
            raise self.fail(
                f"metadata {key} must be a JSON list of {n} ints >= {minimum} (one per "
                f"layer), got {self.m[key][:80]!r}"
            )
        return tuple(value)


def _read_spec(path: str | os.PathLike) -> _Spec:
    """Read and check a file's header and metadata; read no tensor data."""
    where = os.fspath(path)
    try:
        tensors, metadata, start, _ = _st._read_header(where)
    except _st.SafetensorsError as err:
        raise CacheFormatError(f"not a valid nbkv cache file: {err}") from None
    if not metadata or "format" not in metadata:
        raise CacheFormatError(
            f"{where}: not an nbkv cache file (a safetensors file without nbkv's 'format' metadata)"
        )
    m = _Fields(metadata, where)
    if metadata["format"] != FORMAT:
        raise m.fail(f"format is {metadata['format']!r}, not {FORMAT!r}: not an nbkv cache file")
    version = m.str("format_version")
    if version != FORMAT_VERSION:
        raise m.fail(
            f"format_version is {version!r}, but this nbkv reads version {FORMAT_VERSION!r} "
            "only; load it with the nbkv that wrote it"
        )
    cache_type = m.str("cache_type")
    if cache_type not in CACHE_TYPES:
        raise m.fail(f"cache_type is {cache_type!r}; this nbkv loads only {', '.join(CACHE_TYPES)}")
    n = m.int("num_layers")
    if cache_type != "KVCache" and n != 1:
        raise m.fail(f"a {cache_type} file must have num_layers 1, got {n}")
    layout = m.choice("layout", _layout.LAYOUTS)
    dtype_name = m.choice("dtype", ("", *_CODES))
    dtype = None
    if dtype_name:
        want = _st.DTYPES[_CODES[dtype_name]]
        if want is None:  # bfloat16 without ml_dtypes
            raise m.fail(
                "the cache holds bfloat16, which needs ml_dtypes: pip install 'nbkv[bf16]'"
            )
        dtype = np.dtype(want)
    sizes = {field: m.int(field, optional=True) for field in _SIZES}
    seq_len = m.int_list("seq_len", n, 0)
    offset = m.int_list("offset", n, 0)
    max_seq_len = m.int_list("max_seq_len", n, 1)
    allocated = m.json("allocated")
    if not (
        isinstance(allocated, list)
        and len(allocated) == n
        and all(type(a) is bool for a in allocated)
    ):
        raise m.fail(f"metadata allocated must be a JSON list of {n} bools, got {allocated!r:.80}")
    on_overflow = m.choice("on_overflow", ("error", "grow"))
    grow_step = m.int("grow_step")
    crc = m.json("crc32")
    if not isinstance(crc, dict) or not all(
        isinstance(v, str) and len(v) == 8 and all(c in "0123456789abcdef" for c in v)
        for v in crc.values()
    ):
        raise m.fail("metadata crc32 must map tensor names to 8 lowercase hex digits")
    # the fields must agree with one another ...
    for i in range(n):
        if seq_len[i] > max_seq_len[i]:
            raise m.fail(f"layer {i} holds seq_len {seq_len[i]} > its max_seq_len {max_seq_len[i]}")
        if offset[i] != seq_len[i] and cache_type != "RotatingKVCache":
            raise m.fail(
                f"layer {i} has offset {offset[i]} but seq_len {seq_len[i]}; "
                f"a {cache_type} stores every token it has seen"
            )
        if not allocated[i] and seq_len[i]:
            raise m.fail(f"layer {i} is not allocated but holds seq_len {seq_len[i]}")
    if any(allocated) and (dtype is None or None in sizes.values()):
        raise m.fail("the cache has allocated layers, but its dtype or sizes are missing")
    # ... and with the tensors, which must be exactly those of the allocated layers
    expected = {}
    for i in range(n):
        if allocated[i]:
            shape = _layout.buffer_shape(
                layout, sizes["batch"], sizes["num_kv_heads"], seq_len[i], sizes["head_dim"]
            )
            for which in "kv":
                expected[_tensor_name(i, which)] = shape
    missing = sorted(expected.keys() - tensors.keys())
    extra = sorted(tensors.keys() - expected.keys())
    if missing or extra:
        raise m.fail(
            f"the tensors do not match the metadata: missing {missing}, unexpected {extra}"
        )
    for name, shape in expected.items():
        got_dtype, got_shape = tensors[name][:2]
        if got_dtype != dtype or got_shape != shape:
            raise m.fail(
                f"tensor {name!r} is {got_dtype} of shape {got_shape}, but the metadata "
                f"says {dtype} of shape {shape} (layout {layout!r})"
            )
    if crc.keys() != expected.keys():
        raise m.fail(
            f"metadata crc32 names {sorted(crc)}, but the file's tensors are {sorted(expected)}"
        )
    ring = {}
    if cache_type == "RotatingKVCache":
        window, sinks = m.int("window"), m.int("sinks", minimum=0)
        sink_count = m.int_list("sink_count", n, 0)
        held_ring = seq_len[0] - sink_count[0]
        if not (
            sinks < window == max_seq_len[0]
            and sink_count[0] <= min(sinks, seq_len[0])
            and 0 <= held_ring <= window - sinks
            and offset[0] >= seq_len[0]
            and (held_ring == 0 or offset[0] - held_ring >= sinks)
        ):
            raise m.fail(
                f"window {window}, sinks {sinks}, sink_count {sink_count[0]}, seq_len "
                f"{seq_len[0]}, offset {offset[0]} and max_seq_len {max_seq_len[0]} do not "
                "describe a rotating cache"
            )
        ring = {"window": window, "sinks": sinks, "sink_count": sink_count}
    return _Spec(
        path=where,
        offset=offset,
        **ring,
        cache_type=cache_type,
        layout=layout,
        dtype=dtype,
        sizes=sizes,
        seq_len=seq_len,
        max_seq_len=max_seq_len,
        allocated=tuple(allocated),
        on_overflow=on_overflow,
        grow_step=grow_step,
        tensors=tensors,
        crc={name: int(value, 16) for name, value in crc.items()},
        start=start,
    )


# -- reading: the data ---------------------------------------------------------------


def _read_tensor(f, spec: _Spec, name: str, out: np.ndarray | None = None) -> np.ndarray:
    """Read tensor ``name`` into ``out`` (any strides; a new array when None), CRC-checked.

    The bytes go straight from the file into ``out``'s memory, piece by piece, and the
    CRC32 is computed over them on the way.
    """
    dtype, shape, begin, end = spec.tensors[name]
    if out is None:
        out = np.empty(shape, dtype)
    f.seek(spec.start + begin)
    crc = 0
    for piece in _pieces(out):
        got = 0
        while got < len(piece):
            n = f.readinto(piece[got:])
            if not n:
                raise CacheFormatError(
                    f"{spec.path}: the file ended inside tensor {name!r} (it changed "
                    "while being read, or is truncated)"
                )
            got += n
        crc = zlib.crc32(piece, crc)
    if crc != spec.crc[name]:
        raise CacheFormatError(
            f"{spec.path}: tensor {name!r} is corrupted: its CRC32 is {crc:08x} but the "
            f"file records {spec.crc[name]:08x}"
        )
    return out


def _open(spec: _Spec):
    return open(spec.path, "rb", buffering=0)


def _in_layout(arr: np.ndarray, src: str, dst: str) -> np.ndarray:
    """``arr`` in layout ``src`` seen in layout ``dst`` (a transposed view, no copy)."""
    return arr if src == dst else arr.transpose(0, 2, 1, 3)


def _new_layer(spec: _Spec, i: int, device: str, layout: str):
    from .cache import LayerKVCache
    from .rotating import RotatingKVCache

    if spec.cache_type == "RotatingKVCache":
        layer = RotatingKVCache(
            spec.window,
            sinks=spec.sinks,
            **spec.sizes,
            dtype=spec.dtype,
            device=device,
            layout=layout,
        )
        if not spec.allocated[i] and layer.is_allocated:
            layer._release()
        return layer
    layer = LayerKVCache(
        spec.max_seq_len[i],
        **spec.sizes,
        dtype=spec.dtype,
        device=device,
        layout=layout,
        on_overflow=spec.on_overflow,
        grow_step=spec.grow_step,
    )
    if not spec.allocated[i] and layer.is_allocated:
        layer._release()  # every size was known, but this layer had not been allocated
    return layer


def load(path: str | os.PathLike, *, device: str = "cpu", layout: str | None = None) -> Any:
    """Load a cache written by :func:`save`: a new LayerKVCache or KVCache.

    Every check runs before the cache is returned (structure, metadata, tensor shapes,
    CRC32 of every tensor); a file failing one raises, and nothing half filled escapes.

    Parameters
    ----------
    path : path-like
    device : {"cpu", "cuda"}
        Where the new cache lives, whatever device the saved one lived on.
    layout : {"bhsd", "bshd"}, optional
        The layout of the new cache; default the file's. Another layout than the file's
        is a transposing copy, still bit-exact.

    Returns
    -------
    LayerKVCache or KVCache
        As saved: ``cache_type``, layers, sizes, dtype, capacities, ``on_overflow`` and
        ``grow_step``, positions held and their bits; lazy layers stay lazy. (A layer
        that was allocated by its first append comes back built with those sizes, as if
        they had been given to the constructor.)

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    CacheFormatError
        A truncated or corrupted file (CRC mismatch), one of another format, version or
        cache type, or malformed metadata; the message names what is wrong.
    InvalidArgumentError, BackendUnavailableError
        An unknown ``device`` or ``layout``, or a device that cannot be used here.

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np, nbkv
    >>> cache = nbkv.LayerKVCache(32, batch=1, num_kv_heads=2, head_dim=4, dtype="float32")
    >>> k = np.arange(16, dtype=np.float32).reshape(1, 2, 2, 4)
    >>> cache.append(k, k + 1)
    >>> path = os.path.join(tempfile.mkdtemp(), "c.safetensors")
    >>> nbkv.save(path, cache)
    >>> back = nbkv.load(path, layout="bshd")  # transposed on the way in
    >>> back.layout, back.get_kv()[0].shape, bool((back.get_kv()[0][0, :, 1] == k[0, 1]).all())
    ('bshd', (1, 2, 2, 4), True)
    """
    spec = _read_spec(path)
    layout = spec.layout if layout is None else _layout.check_layout(layout)
    layers = [_new_layer(spec, i, device, layout) for i in range(spec.num_layers)]
    with _open(spec) as f:
        for i, layer in enumerate(layers):
            n = spec.seq_len[i]
            if not n:
                if spec.cache_type == "RotatingKVCache":
                    layer._offset = spec.offset[i]  # tokens seen, though none is held
                continue
            names = _tensor_name(i, "k"), _tensor_name(i, "v")
            if spec.cache_type == "RotatingKVCache":
                k, v = (_in_layout(_read_tensor(f, spec, x), spec.layout, layout) for x in names)
                layer._restore(spec.offset[i], spec.sink_count[i], k, v)
            elif layer.device == "cpu" and layout == spec.layout:
                # straight from the file into the buffers: the new cache is not returned
                # unless every tensor checks out
                index = _layout.seq_index(layout, 0, n)
                for name, buf in zip(names, layer._buffers(), strict=True):
                    _read_tensor(f, spec, name, buf[index])
                layer._seq_len = n
            else:
                k, v = (_in_layout(_read_tensor(f, spec, x), spec.layout, layout) for x in names)
                layer.append(k, v)  # one host->device copy on CUDA
    if spec.cache_type != "KVCache":
        return layers[0]
    from .cache import KVCache

    cache = object.__new__(KVCache)
    cache._layers = layers
    return cache


def load_state(cache: Any, path: str | os.PathLike) -> None:
    """Replace the contents of ``cache`` with those saved at ``path``, or change nothing.

    The cache keeps its own device, layout, capacity and overflow policy; the file
    supplies the positions held and their data. A file in the other layout is transposed
    on the way in. Layers the file holds unallocated (a lazy cache) are cleared; their
    buffers are kept.

    Everything is read and checked before anything is written: the file (as
    :func:`load`), then type, number of layers, sizes, dtype and capacity against the
    cache, for every layer of a KVCache, and every tensor's CRC32. The data are held in
    host memory meanwhile (the positions held, K and V, every layer).

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    CacheFormatError
        A file :func:`load` would refuse, or one holding another cache type or number of
        layers than ``cache``.
    ShapeMismatchError, DTypeMismatchError
        The file's batch, num_kv_heads, head_dim or dtype differ from the cache's.
    CacheOverflowError
        A layer of the file holds more positions than the cache's capacity, unless the
        cache was built with ``on_overflow="grow"`` (it then grows).

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np, nbkv
    >>> cache = nbkv.LayerKVCache(8, batch=1, num_kv_heads=1, head_dim=2, dtype="float32")
    >>> cache.append(np.ones((1, 1, 3, 2), np.float32), np.ones((1, 1, 3, 2), np.float32))
    >>> path = os.path.join(tempfile.mkdtemp(), "c.safetensors")
    >>> nbkv.save(path, cache)
    >>> cache.trim(2)
    2
    >>> cache.load_state(path)
    >>> cache.seq_len
    3
    """
    kind, layers = _layers_of(cache)
    spec = _read_spec(path)
    where = spec.path
    if spec.cache_type != kind:
        raise CacheFormatError(f"{where} holds a {spec.cache_type}, but this cache is a {kind}")
    if spec.num_layers != len(layers):
        raise CacheFormatError(
            f"{where} holds {spec.num_layers} layers, but this cache has {len(layers)}"
        )
    if kind == "RotatingKVCache" and (spec.window, spec.sinks) != (cache.window, cache.sinks):
        raise CacheFormatError(
            f"{where} holds a rotating cache of window {spec.window} and sinks {spec.sinks}, "
            f"but this one has window {cache.window} and sinks {cache.sinks}"
        )
    for i, layer in enumerate(layers):
        _check_fits(spec, i, layer)
    held: list[tuple[np.ndarray, np.ndarray] | None] = []
    with _open(spec) as f:
        for i in range(spec.num_layers):
            names = _tensor_name(i, "k"), _tensor_name(i, "v")
            held.append(tuple(_read_tensor(f, spec, x) for x in names) if spec.seq_len[i] else None)
    # every check passed: from here on only writes
    for i, (layer, kv) in enumerate(zip(layers, held, strict=True)):
        layer.clear()
        if kv is None:
            if kind == "RotatingKVCache":
                layer._offset = spec.offset[i]  # tokens seen, though none is held
            continue
        kv = tuple(_in_layout(x, spec.layout, layer.layout) for x in kv)
        if kind == "RotatingKVCache":
            layer._restore(spec.offset[i], spec.sink_count[i], *kv)
        else:
            layer.append(*kv)


def _check_fits(spec: _Spec, i: int, layer) -> None:
    where = f"{spec.path} (layer {i})" if spec.cache_type == "KVCache" else spec.path
    for field in _SIZES:
        want, got = getattr(layer, field), spec.sizes[field]
        if want is not None and got is not None and want != got:
            raise ShapeMismatchError(f"{where} holds {field} {got}, but this cache holds {want}")
    if layer.dtype is not None and spec.dtype is not None and layer.dtype != spec.dtype:
        raise DTypeMismatchError(
            f"{where} holds dtype {spec.dtype}, but this cache holds {layer.dtype}; "
            "nbkv never casts"
        )
    n = spec.seq_len[i]
    if n > layer.max_seq_len and layer.on_overflow != "grow":
        raise CacheOverflowError(
            f"{where} holds {n} positions, more than this cache's capacity "
            f"max_seq_len = {layer.max_seq_len}; build it with max_seq_len >= {n} or "
            "on_overflow='grow'"
        )
