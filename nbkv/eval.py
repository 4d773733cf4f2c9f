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
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TextIO

import numpy as np

from ._kvspec import (
    DEFAULT_KVS,
    GRAMMAR,
    NOISE_FLOOR,
    REFERENCE,
    CacheSession,
    Factory,
    KVSpec,
    Session,
    cache_factory,
)
from ._units import human_bytes
from ._validate import optional_positive_int, positive_int
from .errors import ArgumentTypeError, InvalidArgumentError, ShapeMismatchError
from .models.evaluate import progress_bar

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
        return CacheSession(model, made)
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
    progress_bar(stream, done, total, f"{caches} caches", t0)


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
    entries = _entries(kvs)
    context = positive_int(context, "context")
    prefill = positive_int(prefill, "prefill")
    chunk = positive_int(chunk, "chunk")
    if prefill > context:
        raise InvalidArgumentError(f"prefill ({prefill}) must be at most context ({context})")
    limit_bytes = optional_positive_int(limit_bytes, "limit_bytes")
    stream = _stream(progress)
    model, windows = _model_and_windows(model, files, limit_bytes, context)
    longest = max(len(w) - 1 for w in windows)
    for e in entries:  # every cache is built and run on a few bytes, before the windows:
        warm = windows[0][: min(3, longest)]  # errors come now, and compiling
        _run(_open(e, model, longest), warm, 2, 2, e, model.config.vocab_size)
    return _measure(model, entries, windows, prefill, chunk, stream)


def _model_and_windows(model, files, limit_bytes, context) -> tuple[Any, list]:
    """:func:`compare`'s model (checked; default ``Llama.default()``) and the windows of
    its files (at least one)."""
    from .models.train import held_out_windows

    if model is None:
        from .models import Llama

        model = Llama.default()
    if not all(hasattr(model, a) for a in ("forward", "new_cache", "config")):
        raise ArgumentTypeError(f"model must be an nbkv.models.Llama, got {type(model).__name__}")
    windows = list(held_out_windows(_files(files, limit_bytes, model.config.vocab_size), context))
    if not windows:
        raise InvalidArgumentError("files hold no byte to score (each needs at least 2)")
    return model, windows


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
