"""What a cache transform does to a model's next-token distributions: ``python -m nbkv eval --kv``.

Teacher-forced over held-out text, as llama.cpp's KL-divergence tables are made. The text
is cut into the windows :mod:`nbkv.models.evaluate` scores
(:func:`nbkv.models.train.held_out_windows`): each window starts a fresh cache, its first
``prefill`` bytes go in as chunks of ``chunk``, the rest one byte per decode step (where
a quantized cache's attention path runs). The reference, a float32 contiguous cache,
gives each window's logits once; every cache under test runs the same window, and for
each byte after the first of its window the harness compares the two next-byte
distributions, in float64 from the float32 logits:

- ``KL(p_ref || p)`` in nats: its mean, 99th percentile and maximum over the bytes;
- top-1 agreement: the fraction of bytes whose argmax equals the reference's;
- bits per byte of the cache under test, and its change against the reference's.

float16 storage ("fp16") is the noise floor: rounding K/V to 16 bits and nothing more.
It is always measured, first after the reference, so that every other row reads against
it.

A cache is named by a short grammar (:data:`GRAMMAR`, :func:`cache_factory`), or given as
a factory of your own: a callable ``factory(model, n)`` that returns, for one window of
``n`` input positions, either a fresh :class:`nbkv.KVCache` (driven through
``model.forward``) or any object with ``forward(ids) -> logits`` (a :class:`Session`).

>>> import numpy as np
>>> from nbkv.models import Llama
>>> from nbkv.eval import compare, format_table
>>> text = np.frombuffer(b"def f(x):\\n    return x + 1\\n" * 2, np.uint8)
>>> rows = compare(Llama.default(), ["fp32", "ring16"], [text], context=32, prefill=8,
...                chunk=4, progress=None)
>>> [r.name for r in rows]
['reference', 'fp16', 'fp32', 'ring16']
>>> rows[2].kl_mean, rows[2].top1  # the reference against itself
(0.0, 1.0)
>>> 0 < rows[1].kl_mean < 1e-3 < rows[3].kl_mean  # 16-bit rounding; a ring of 16 forgets
True
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TextIO, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from ._units import human_bytes
from ._validate import MAX_SIZE, optional_positive_int, positive_int
from .errors import ArgumentTypeError, InvalidArgumentError, ShapeMismatchError

__all__ = [
    "GRAMMAR",
    "DEFAULT_KVS",
    "KVSpec",
    "Session",
    "Factory",
    "Row",
    "cache_factory",
    "compare",
    "format_table",
]

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


class _CacheSession:
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
        return _CacheSession(model, cache)


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


# -- the comparison ------------------------------------------------------------------


class Row(NamedTuple):
    """One cache's line of the table; the KL and top-1 are against the reference."""

    name: str
    description: str
    kl_mean: float  # KL(p_ref || p), nats, mean over the bytes scored
    kl_p99: float  # its 99th percentile
    kl_max: float
    top1: float  # fraction of bytes whose argmax equals the reference's
    bits_per_byte: float
    delta_bits_per_byte: float  # bits_per_byte minus the reference's
    bytes: int  # bytes scored
    nbytes: int | None  # the cache's bytes after its largest window (None: not told)
    seconds: float  # in its forward passes


class _Entry(NamedTuple):
    name: str
    description: str
    factory: Factory


def _entry(name: str, value: Any, argument: str) -> _Entry:
    if isinstance(value, str):
        value = cache_factory(value, argument=argument)
    if isinstance(value, KVSpec):
        return _Entry(name or value.name, value.description, value)
    if not callable(value):
        raise ArgumentTypeError(
            f"{argument} must be a cache name or a factory(model, n) returning a KVCache or "
            f"a Session, got {type(value).__name__} {value!r:.60}"
        )
    if not name:
        raise ArgumentTypeError(
            f"{argument} is a factory without a name: pass kvs as a mapping, "
            f"{{'mine': factory, ...}}"
        )
    words = getattr(value, "description", None)
    return _Entry(name, words if isinstance(words, str) else "your factory", value)


def _entries(kvs: Any) -> list[_Entry]:
    """The reference, the noise floor, then each cache asked for (once each)."""
    if isinstance(kvs, (str, KVSpec)):
        kvs = [kvs]
    if isinstance(kvs, Mapping):
        items = []
        for name, value in kvs.items():
            if not isinstance(name, str) or not name.strip():
                raise ArgumentTypeError(f"kvs keys must be non-empty str names, got {name!r:.60}")
            if name in (REFERENCE, NOISE_FLOOR) and not (
                isinstance(value, str) and value.strip().lower() == name
            ):
                raise InvalidArgumentError(
                    f"kvs[{name!r}] is a name the harness keeps for its own row; call your "
                    "factory something else"
                )
            items.append(_entry(name, value, f"kvs[{name!r}]"))
    elif isinstance(kvs, Sequence):
        items = [_entry("", v, f"kvs[{i}]") for i, v in enumerate(kvs)]
    else:
        raise ArgumentTypeError(
            f"kvs must be a sequence of cache names or a mapping of name -> factory, got "
            f"{type(kvs).__name__}"
        )
    fp32, fp16 = cache_factory("fp32"), cache_factory(NOISE_FLOOR)
    out = [
        _Entry(REFERENCE, fp32.description + " (reference)", fp32),
        _Entry(NOISE_FLOOR, fp16.description + " (noise floor)", fp16),
    ]
    for e in items:
        if e.name not in {o.name for o in out}:
            out.append(e)
    return out


def _files(files: Any, limit_bytes: int | None, vocab: int) -> list[np.ndarray]:
    """The texts as int64 arrays, cut to ``limit_bytes`` in all (None: the held-out split)."""
    if files is None:
        from .models.train import load_corpus

        files = load_corpus().held_out
    if isinstance(files, (str, bytes, np.ndarray)) or not isinstance(files, Sequence):
        raise ArgumentTypeError(
            f"files must be a sequence of 1-D integer arrays (or bytes), got {type(files).__name__}"
        )
    out, size = [], 0
    for i, f in enumerate(files):
        arr = np.frombuffer(f, np.uint8) if isinstance(f, (bytes, bytearray)) else np.asarray(f)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ArgumentTypeError(
                f"files[{i}] must be a 1-D integer array, got {arr.dtype} {arr.shape}"
            )
        if arr.size and (arr.min() < 0 or arr.max() >= vocab):
            raise InvalidArgumentError(f"files[{i}] holds ids outside [0, {vocab})")
        if limit_bytes is not None:
            arr = arr[: limit_bytes - size]
        out.append(arr.astype(np.int64))
        size += len(arr)
        if limit_bytes is not None and size >= limit_bytes:
            break
    return out


def _stream(progress: Any) -> TextIO | None:
    if progress == "stderr":
        return sys.stderr
    if progress is None or callable(getattr(progress, "write", None)):
        return progress
    raise ArgumentTypeError(
        f'progress must be "stderr", None or a writable file, got {type(progress).__name__}'
    )


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p of each row of float32 logits [n, vocab], in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _open(entry: _Entry, model: Any, n: int) -> Session:
    from .kvcache import KVCache

    made = entry.factory(model, n)
    if isinstance(made, KVCache):
        return _CacheSession(model, made)
    if callable(getattr(made, "forward", None)):
        return made
    raise ArgumentTypeError(
        f"the factory of {entry.name!r} must return an nbkv.KVCache or an object with "
        f"forward(ids) -> logits, got {type(made).__name__}"
    )


def _run(session: Session, inputs: np.ndarray, prefill: int, chunk: int, e: _Entry, vocab: int):
    """Logits [n, vocab] of a window: prefill in chunks, then one decode step a byte."""
    head = min(prefill, len(inputs))
    parts = [session.forward(inputs[a : min(a + chunk, head)]) for a in range(0, head, chunk)]
    parts += [session.forward(inputs[t : t + 1]) for t in range(head, len(inputs))]
    logits = np.concatenate([np.asarray(p) for p in parts])
    if logits.shape != (len(inputs), vocab):
        raise ShapeMismatchError(
            f"the session of {e.name!r} must answer forward(ids [k]) with logits [k, "
            f"{vocab}]; over {len(inputs)} ids it gave {logits.shape}"
        )
    return logits.astype(np.float32, copy=False)


class _Tally:
    """One cache's sums over the windows."""

    def __init__(self) -> None:
        self.kl: list[np.ndarray] = []
        self.agree = self.n = 0
        self.nats = self.seconds = 0.0
        self.nbytes: int | None = None

    def add(self, ref: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> None:
        logp = _log_softmax(logits)
        # rounding can leave the KL of two equal distributions a hair below 0
        self.kl.append(np.maximum((np.exp(ref) * (ref - logp)).sum(axis=-1), 0.0))
        self.agree += int((logp.argmax(-1) == ref.argmax(-1)).sum())
        self.nats -= float(logp[np.arange(len(targets)), targets].sum())
        self.n += len(targets)

    def row(self, entry: _Entry, ref_bpb: float | None) -> Row:
        kl = np.concatenate(self.kl)
        bpb = self.nats / self.n / math.log(2)
        delta = 0.0 if ref_bpb is None else bpb - ref_bpb
        p99 = float(np.percentile(kl, 99))
        return Row(
            entry.name, entry.description, float(kl.mean()), p99, float(kl.max()),
            self.agree / self.n, bpb, delta, self.n, self.nbytes, self.seconds,
        )  # fmt: skip


def _bar(stream: TextIO | None, done: int, total: int, caches: int, t0: float) -> None:
    if stream is None:
        return
    filled = int(30 * done / max(total, 1))
    rate = done / max(time.perf_counter() - t0, 1e-9)
    stream.write(
        f"\r[{'#' * filled}{'.' * (30 - filled)}] {done:,}/{total:,} bytes  "
        f"{caches} caches  {rate:,.0f} bytes/s"
    )
    stream.flush()


def compare(
    model: Any = None,
    kvs: Any = DEFAULT_KVS,
    files: Sequence[Any] | None = None,
    *,
    context: int = 512,
    prefill: int = 256,
    chunk: int = 64,
    limit_bytes: int | None = None,
    progress: TextIO | None | str = "stderr",
) -> list[Row]:
    """Each cache's next-token distributions against the float32 reference's, teacher-forced.

    Parameters
    ----------
    model : nbkv.models.Llama, optional
        Default: ``Llama.default()``.
    kvs : sequence of names or KVSpecs, or mapping of name -> name or factory
        The caches to measure (:func:`cache_factory` for names). A factory is a callable
        ``factory(model, n)`` that returns, for one window of ``n`` input positions, a
        fresh :class:`nbkv.KVCache` (fed through ``model.forward``) or a :class:`Session`
        (``forward(ids [k]) -> logits [k, vocab]``; an ``nbytes`` attribute is reported);
        a ``description`` attribute on it fills the table's second column. A single name
        is taken as a list of one.
    files : sequence of 1-D integer arrays or bytes, optional
        The texts. Default: the held-out split :mod:`nbkv.models.train` never trains on.
    context, prefill, chunk : int
        Window length; bytes of each window fed as prefill, in chunks of ``chunk`` (the
        rest are decode steps).
    limit_bytes : int, optional
        Only the first ``limit_bytes`` bytes of ``files``, in order (the last file cut).
    progress : "stderr", None or a file
        Where a progress bar goes (one bar over all windows).

    Returns
    -------
    list of Row
        The reference (``"reference"``), the noise floor (``"fp16"``), then each cache
        asked for, in order, once each.

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError
        Before any window runs: a bad name or factory, sizes that are not positive ints,
        ``prefill > context``, files that are not 1-D integer arrays, hold ids outside the
        vocabulary or no byte to score. A cache that cannot be built (bfloat16 without
        ml_dtypes) raises its typed error then too: every factory is tried on a few
        bytes before the first window (which also keeps compilation out of the seconds
        reported).

    Examples
    --------
    >>> import numpy as np
    >>> from nbkv.models import Llama
    >>> from nbkv.eval import compare
    >>> model = Llama.default()
    >>> mine = lambda model, n: model.new_cache(1, n, dtype="bfloat16")
    >>> rows = compare(model, {"mine": mine}, [b"import os\\nimport sys\\n"], context=16,
    ...                prefill=4, chunk=4, progress=None)
    >>> [(r.name, r.bytes, r.kl_mean < 1e-2) for r in rows]
    [('reference', 20, True), ('fp16', 20, True), ('mine', 20, True)]
    """
    from .models.train import held_out_windows

    entries = _entries(kvs)
    context = positive_int(context, "context")
    prefill = positive_int(prefill, "prefill")
    chunk = positive_int(chunk, "chunk")
    if prefill > context:
        raise InvalidArgumentError(f"prefill ({prefill}) must be at most context ({context})")
    limit_bytes = optional_positive_int(limit_bytes, "limit_bytes")
    stream = _stream(progress)
    if model is None:
        from .models import Llama

        model = Llama.default()
    if not all(hasattr(model, a) for a in ("forward", "new_cache", "config")):
        raise ArgumentTypeError(f"model must be an nbkv.models.Llama, got {type(model).__name__}")
    windows = list(held_out_windows(_files(files, limit_bytes, model.config.vocab_size), context))
    if not windows:
        raise InvalidArgumentError("files hold no byte to score (each needs at least 2)")
    longest = max(len(w) - 1 for w in windows)
    for e in entries:  # every cache is built and run on a few bytes, before the windows:
        warm = windows[0][: min(3, longest)]  # errors come now, and compiling
        _run(_open(e, model, longest), warm, 2, 2, e, model.config.vocab_size)
    return _measure(model, entries, windows, prefill, chunk, stream)


def _measure(model, entries, windows, prefill, chunk, stream) -> list[Row]:
    total = sum(len(w) - 1 for w in windows)
    tallies = [_Tally() for _ in entries]
    done, t0 = 0, time.perf_counter()
    for w in windows:
        inputs, targets = w[:-1], w[1:]
        ref = None
        for e, tally in zip(entries, tallies, strict=True):
            start = time.perf_counter()
            session = _open(e, model, len(inputs))
            logits = _run(session, inputs, prefill, chunk, e, model.config.vocab_size)
            tally.seconds += time.perf_counter() - start
            size = getattr(session, "nbytes", None)
            if isinstance(size, (int, np.integer)):
                tally.nbytes = max(int(size), tally.nbytes or 0)
            if ref is None:  # the reference comes first: its logits, once per window
                ref = _log_softmax(logits)
            tally.add(ref, logits, targets)
        done += len(targets)
        _bar(stream, done, total, len(entries), t0)
    if stream is not None:
        stream.write("\n")
    ref_row = tallies[0].row(entries[0], None)
    rows = [ref_row._replace(kl_mean=0.0, kl_p99=0.0, kl_max=0.0, top1=1.0)]
    rows += [t.row(e, ref_row.bits_per_byte) for e, t in zip(entries[1:], tallies[1:], strict=True)]
    return rows


# -- the table -----------------------------------------------------------------------


def _kl(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a plain-text table, one line a cache, under a header.

    Examples
    --------
    >>> from nbkv.eval import Row, format_table
    >>> row = Row("fp16", "float16, contiguous", 1e-6, 5e-6, 1e-5, 0.999, 2.0, 1e-4, 100,
    ...           2048, 0.5)
    >>> lines = format_table([row]).splitlines()
    >>> lines[0].split()[:4], lines[2].split()[3:8]
    (['kv', 'cache', 'KL', 'mean'], ['1.00e-06', '5.00e-06', '1.00e-05', '0.9990', '2.0000'])
    """
    head = ("kv", "cache", "KL mean", "KL p99", "KL max", "top-1", "bits/byte", "Δ bpb",
            "bytes", "cache bytes", "s")  # fmt: skip
    lines = [head]
    for r in rows:
        size = "-" if r.nbytes is None else human_bytes(r.nbytes)
        delta = f"{round(r.delta_bits_per_byte, 4) + 0.0:+.4f}"  # +0.0000, never -0.0000
        lines.append((
            r.name, r.description, _kl(r.kl_mean), _kl(r.kl_p99), _kl(r.kl_max),
            f"{r.top1:.4f}", f"{r.bits_per_byte:.4f}", delta,
            f"{r.bytes:,}", size, f"{r.seconds:.1f}",
        ))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for j, line in enumerate(lines):
        pairs = enumerate(zip(line, widths, strict=True))
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in pairs]
        out.append("  ".join(cells).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
