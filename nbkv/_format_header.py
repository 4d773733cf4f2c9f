"""The header of an nbkv cache file: its metadata, encoded and checked, knowing no cache class.

Pure functions over bytes and dicts (no file is opened here): the metadata fields and
their bounds, a layer meta's common fields (:class:`MetaReader`, :func:`check_layer_meta`),
the tensors a layer meta describes (:func:`layer_specs`), the header a writer puts first
(:func:`encode_header`, its own CRC32 filled in) and the checks a reader runs on it
(:func:`parse_header`, :func:`expected_tensors`). The layout of a file, and the reading
and writing of it, are :mod:`nbkv._format`'s.
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any

import numpy as np

from . import _safetensors as _st
from . import layout as _layout
from .errors import CacheFormatError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MAX_SIZE",
    "MAX_LAYERS",
    "MAX_TENSORS",
    "CODES",
    "PLACEHOLDER",
    "MetaReader",
    "tensor_name",
    "meta_dtype",
    "layer_specs",
    "check_layer_meta",
    "compact",
    "encode_header",
    "parse_header",
    "expected_tensors",
]

FORMAT = "nbkv-cache"
FORMAT_VERSION = "2"
MAX_SIZE = 2**31 - 1  # any size or count a file may claim
MAX_LAYERS = 100_000
# the storage dtypes and their safetensors names
CODES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16"}
PLACEHOLDER = "00000000"  # same width as a real CRC: the header is rewritten in place


def tensor_name(layer: int, which: str) -> str:
    return f"layers.{layer}.{which}"


def meta_dtype(meta: dict) -> np.dtype | None:
    """The dtype a checked layer meta names (None while unknown)."""
    name = meta["dtype"]
    return None if not name else np.dtype(_st.DTYPES[CODES[name]])


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


# -- what a layer meta describes --------------------------------------------------------


def _layer_shape(meta: dict) -> tuple[int, int, int, int]:
    return _layout.buffer_shape(
        meta["layout"], meta["batch"], meta["num_kv_heads"], meta["seq_len"], meta["head_dim"]
    )


def layer_specs(meta: dict) -> list[tuple[str, str, tuple]]:
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


def check_layer_meta(meta: Any, here: str) -> dict:
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


# -- writing -------------------------------------------------------------------------


def compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def encode_header(specs, metadata: dict, crcs: dict) -> bytes:
    """The header with ``crcs`` in and its own checksum computed and filled in."""
    metadata = {**metadata, "crc32": compact(crcs), "header_crc32": PLACEHOLDER}
    head = _st.header_bytes(specs, metadata)
    metadata["header_crc32"] = f"{zlib.crc32(head[8:]):08x}"
    final = _st.header_bytes(specs, metadata)
    if len(final) != len(head):  # cannot happen: every CRC is 8 hex digits
        raise RuntimeError("nbkv.save: the header changed length")
    return final


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
    got = zlib.crc32(raw.replace(field, f'"header_crc32":"{PLACEHOLDER}"'.encode()))
    if got != int(value, 16):
        raise CacheFormatError(
            f"{where}: the header is corrupted: its CRC32 is {got:08x} but the file records "
            f"{value} (the metadata or the tensor table was changed)"
        )


def parse_header(raw: bytes, data_len: int, where: str) -> tuple[str, list[dict], dict, dict]:
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
    metas = [check_layer_meta(meta, f"{where} (layer {i})") for i, meta in enumerate(layers)]
    crc = _st.loads(metadata["crc32"].encode(), f"{where} (metadata crc32)", CacheFormatError)
    if not isinstance(crc, dict) or not all(
        isinstance(v, str) and re.fullmatch(r"[0-9a-f]{8}", v) for v in crc.values()
    ):
        raise CacheFormatError(f"{where}: metadata crc32 must map tensor names to 8 hex digits")
    return cache["type"], metas, tensors, crc


def expected_tensors(metas: list[dict], tensors: dict, crc: dict, where: str) -> dict:
    """The tensors the metas describe, checked against those the file holds."""
    expected = {}
    for i, meta in enumerate(metas):
        for which, code, shape in layer_specs(meta):
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
