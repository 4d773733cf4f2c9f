"""Checks of the keys and values that cross a store (the protocol: :mod:`nbkv.store`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ArgumentTypeError, InvalidArgumentError

MAX_KEY_BYTES = 100  # a LocalStore file name is the key's hex, and names stop at 255 bytes


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
