"""The caches ``nbkv.eval`` compares, by name: the grammar (``fp16``, ``int4-g32-r64``,
``ring128s4``, ``paged16``, ...), :class:`KVSpec` (a parsed name that builds a fresh cache
for one window), and the sessions that feed a window through a model and a cache.
Public through :mod:`nbkv.eval`."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from ._validate import MAX_SIZE
from .errors import ArgumentTypeError, InvalidArgumentError

GRAMMAR = (
    "fp32 | fp16 | bf16 (contiguous, that storage dtype); "
    "int8 | int4 | int2 | k<K>v<V> (quantized K/V of 8, 4 or 2 bits; K and V bits apart), "
    "each with options -g<group_size> (64) and -r<residual> (128), e.g. int4-g32-r64, "
    "k8v4-g32-r0; ring<W> | ring<W>s<S> (a ring of W positions, S attention sinks); "
    "paged<B> (a paged cache of blocks of B)"
)
DEFAULT_KVS = ("fp16", "bf16", "int8", "int4", "int2")

REFERENCE = "reference"  # the name of the reference row
NOISE_FLOOR = "fp16"  # always measured, first after the reference

_FLOATS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_QUANT = re.compile(r"(?:int(?P<bits>8|4|2)|k(?P<k>8|4|2)v(?P<v>8|4|2))(?P<opts>(?:-[a-z]\d+)*)")
_RING = re.compile(r"ring(?P<window>\d+)(?:s(?P<sinks>\d+))?")
_PAGED = re.compile(r"paged(?P<block>\d+)")


# -- what a cache under test is ------------------------------------------------------


@runtime_checkable
class Session(Protocol):
    """One window's run of a cache under test: what a factory returns (or a KVCache).

    ``forward(ids)`` takes the next positions' token ids, 1-D int64 ``[n]`` (a prefill
    chunk, or one id for a decode step), and returns their logits, float32 ``[n,
    vocab_size]``: the distribution of the token after each. An ``nbytes`` attribute, if
    any, is reported as the cache's size.

    Examples
    --------
    >>> import numpy as np
    >>> from nbkv.models import Llama
    >>> from nbkv.eval import compare
    >>> class Recompute:  # no cache at all: the window so far, recomputed each call
    ...     def __init__(self, model):
    ...         self.model, self.seen = model, np.empty(0, np.int64)
    ...     def forward(self, ids):
    ...         self.seen = np.concatenate([self.seen, ids])
    ...         return self.model.forward_nocache(self.seen[None])[0, -len(ids) :]
    >>> rows = compare(Llama.default(), {"recompute": lambda model, n: Recompute(model)},
    ...                [b"x = 1\\ny = 2\\n"], context=8, prefill=4, chunk=2, progress=None)
    >>> rows[-1].name, rows[-1].kl_mean < 1e-6, rows[-1].nbytes
    ('recompute', True, None)
    """

    def forward(self, ids: NDArray[np.int64]) -> NDArray[np.float32]: ...


# factory(model, n): a fresh cache (or Session) for one window of n input positions
Factory = Callable[[Any, int], Any]


class CacheSession:
    """An :class:`nbkv.KVCache` driven through ``model.forward``.

    A chunk that would overwrite positions the cache still holds (a ring, once full) goes
    in as far as it fits, the rest one token a step: what the chunk's queries see is then
    what decoding them one by one would have seen.
    """

    def __init__(self, model: Any, cache: Any) -> None:
        self.model, self.cache = model, cache

    @property
    def nbytes(self) -> int:
        return int(self.cache.nbytes)

    def forward(self, ids: NDArray[np.int64]) -> NDArray[np.float32]:
        cache, forward = self.cache, self.model.forward
        room = max(cache.max_seq_len - cache.offset, 1)
        if len(ids) <= room:
            return forward(ids[None], cache)[0]
        out = [forward(ids[None, :room], cache)[0]]
        out += [forward(ids[None, t : t + 1], cache)[0] for t in range(room, len(ids))]
        return np.concatenate(out)


class _PagedSession:
    """One sequence of an :class:`nbkv.PagedKVCache`, a step per token.

    ``model.forward_paged`` answers only the logits after a sequence's last new token, so
    every byte is its own step (``reserve({sid: 1})``): each one reads the sequence's
    blocks through its block table, the paged decode path.
    """

    def __init__(self, model: Any, n: int, block_size: int) -> None:
        from .paged import PagedKVCache

        c = model.config
        self.model = model
        self.cache = PagedKVCache(
            -(-n // block_size),
            block_size,
            num_layers=c.num_hidden_layers,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            dtype="float32",
            device=model.device,
        )
        self.sid = self.cache.add()

    @property
    def nbytes(self) -> int:
        return int(self.cache.nbytes)

    def forward(self, ids: NDArray[np.int64]) -> NDArray[np.float32]:
        out = []
        for t in range(len(ids)):
            step = self.cache.reserve({self.sid: 1})
            out.append(self.model.forward_paged(ids[t : t + 1], self.cache, step))
        return np.concatenate(out)


@dataclass(frozen=True)
class KVSpec:
    """A cache named by the grammar (:data:`GRAMMAR`), and its factory.

    Call it as ``spec(model, n)`` for a fresh :class:`Session` over one window of ``n``
    input positions. Build one with :func:`cache_factory`.

    Attributes
    ----------
    name : str
        The name it was parsed from (``"int4-g32-r64"``).
    kind : {"float", "quantized", "ring", "paged"}
    dtype : str
        Storage dtype of a float cache, and of a quantized cache's residual (float32).
    bits : (int, int) or None
        K and V bits of a quantized cache.
    group_size, residual : int
        A quantized cache's group size and full-precision newest positions.
    window, sinks : int or None, int
        A ring's window and attention sinks.
    block_size : int or None
        A paged cache's block size.

    Examples
    --------
    >>> from nbkv.eval import cache_factory
    >>> spec = cache_factory("k8v4-g32-r0")
    >>> spec.bits, spec.group_size, spec.residual, spec.description
    ((8, 4), 32, 0, 'K int8, V int4, groups of 32, no residual')
    """

    name: str
    kind: str
    dtype: str = "float32"
    bits: tuple[int, int] | None = None
    group_size: int = 64
    residual: int = 128
    window: int | None = None
    sinks: int = 0
    block_size: int | None = None

    @property
    def description(self) -> str:
        """What the cache is, in a few words (the table's second column)."""
        if self.kind == "float":
            return f"{self.dtype}, contiguous"
        if self.kind == "ring":
            return f"ring of {self.window}, {self.sinks} sinks"
        if self.kind == "paged":
            return f"paged, blocks of {self.block_size}"
        k, v = self.bits  # type: ignore[misc]
        bits = f"int{k} K/V" if k == v else f"K int{k}, V int{v}"
        residual = f"residual {self.residual}" if self.residual else "no residual"
        return f"{bits}, groups of {self.group_size}, {residual}"

    def __call__(self, model: Any, n: int) -> Session:
        if self.kind == "paged":
            return _PagedSession(model, n, self.block_size)  # type: ignore[arg-type]
        if self.kind == "ring":
            cache = model.new_cache(1, window=self.window, sinks=self.sinks)
        elif self.kind == "quantized":
            k, v = self.bits  # type: ignore[misc]
            bits = k if k == v else (k, v)
            cache = model.new_cache(
                1, n, bits=bits, group_size=self.group_size, residual=self.residual
            )
        else:
            cache = model.new_cache(1, n, dtype=self.dtype)
        return CacheSession(model, cache)


def _options(opts: str, name: str, argument: str) -> dict[str, int]:
    """``-g32-r64`` as ``{"group_size": 32, "residual": 64}`` (each at most once)."""
    found: dict[str, int] = {}
    for key, digits in re.findall(r"-([a-z])(\d+)", opts):
        field = {"g": "group_size", "r": "residual"}.get(key)
        if field is None or field in found:
            what = "an unknown option" if field is None else "a repeated option"
            raise InvalidArgumentError(
                f"{argument} has {what} -{key}{digits}: a quantized name takes -g<group_size> "
                f"and -r<residual>, each at most once, got {name!r}"
            )
        found[field] = _number(digits, field, name, argument, minimum=1 if key == "g" else 0)
    return found


def _number(digits: str, field: str, name: str, argument: str, minimum: int) -> int:
    value = int(digits)
    if not minimum <= value <= MAX_SIZE:
        raise InvalidArgumentError(
            f"{argument} asks for {field} {value} but it must be in [{minimum}, {MAX_SIZE}], "
            f"got {name!r}"
        )
    return value


def cache_factory(name: str, *, argument: str = "name") -> KVSpec:
    """The cache a name of the grammar describes (:data:`GRAMMAR`), as a :class:`KVSpec`.

    - ``fp32``, ``fp16``, ``bf16``: ``model.new_cache(1, n, dtype=...)`` (the model
      rounds K/V to the cache's dtype as it appends them);
    - ``int8``, ``int4``, ``int2``, and ``k<K>v<V>`` for K and V bits apart, with options
      ``-g<group_size>`` (default 64) and ``-r<residual>`` (default 128):
      ``model.new_cache(1, n, bits=..., group_size=..., residual=...)``, an
      :class:`nbkv.QuantizedKVCache` per layer;
    - ``ring<W>``, ``ring<W>s<S>``: ``model.new_cache(1, window=W, sinks=S)``;
    - ``paged<B>``: an :class:`nbkv.PagedKVCache` of blocks of ``B``, one step per token
      through ``model.forward_paged``.

    Parameters
    ----------
    name : str
        Case and surrounding spaces do not matter.
    argument : str
        What to call ``name`` in an error message (``"kvs[2]"``).

    Raises
    ------
    ArgumentTypeError
        ``name`` is not a str.
    InvalidArgumentError
        It does not match the grammar, or a number in it is out of range (a group size
        of 0, sinks not below the window).

    Examples
    --------
    >>> from nbkv.eval import cache_factory
    >>> cache_factory("ring128s4").description, cache_factory("paged16").block_size
    ('ring of 128, 4 sinks', 16)
    """
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"{argument} must be a str naming a cache ({GRAMMAR}), got {type(name).__name__} "
            f"{name!r:.60}"
        )
    key = name.strip().lower()
    if key in _FLOATS:
        return KVSpec(key, "float", dtype=_FLOATS[key])
    if m := _QUANT.fullmatch(key):
        k, v = (m["bits"], m["bits"]) if m["bits"] else (m["k"], m["v"])
        options = _options(m["opts"], name, argument)
        return KVSpec(key, "quantized", bits=(int(k), int(v)), **options)
    if m := _RING.fullmatch(key):
        window = _number(m["window"], "window", name, argument, minimum=1)
        sinks = _number(m["sinks"] or "0", "sinks", name, argument, minimum=0)
        if sinks >= window:
            raise InvalidArgumentError(
                f"{argument} asks for {sinks} sinks in a ring of {window}: sinks must be "
                f"smaller than the window, got {name!r}"
            )
        return KVSpec(key, "ring", window=window, sinks=sinks)
    if m := _PAGED.fullmatch(key):
        block = _number(m["block"], "block_size", name, argument, minimum=1)
        return KVSpec(key, "paged", block_size=block)
    raise InvalidArgumentError(f"{argument} must name a cache as {GRAMMAR}; got {name!r:.60}")
