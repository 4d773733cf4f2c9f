"""Held-out bits per byte of a model, measured through an nbkv cache: ``python -m nbkv eval``.

The held-out files are those :mod:`nbkv.models.train` never trains on (the standard
library's ``.py`` files whose path hashes into the held-out 2%). Each is cut into windows
of ``context`` bytes (:func:`nbkv.models.train.held_out_windows`); a window starts a fresh
cache, its first ``prefill`` bytes go in as prefill chunks of ``chunk``, the rest one
byte per decode step, and every byte after the first of its window is scored:
``-log2 p(byte | the bytes before it in the window)``. The mean is the model's bits per
byte: 8 for a model that knows nothing, less the more it predicts.

That is the quantity the training run reports (there, one causal forward per window):
the two agree to float32 rounding, which also checks that cached decoding is the full
forward pass.

>>> import numpy as np
>>> from nbkv.models import Llama
>>> from nbkv.models.evaluate import bits_per_byte
>>> text = np.frombuffer(b"def f(x):\\n    return x + 1\\n", np.uint8)
>>> r = bits_per_byte(Llama.default(), [text], context=16, prefill=8, chunk=4, progress=None)
>>> r.bytes, 0 < r.bits_per_byte < 8  # every byte after the first is predicted
(26, True)
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple, TextIO

import numpy as np

from .._validate import positive_int
from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["EvalResult", "bits_per_byte", "held_out_bits_per_byte"]


class EvalResult(NamedTuple):
    bits_per_byte: float
    bytes: int  # bytes scored
    windows: int
    files: int
    seconds: float


def _log2_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log2 p(target) for each row of float32 logits [n, vocab], in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=-1))
    return (z[np.arange(len(targets)), targets] - log_norm) / math.log(2)


def progress_bar(stream: TextIO | None, done: int, total: int, note: str, t0: float) -> None:
    """Redraw a one-line progress bar of ``done`` of ``total`` bytes on ``stream`` (None:
    nothing), with ``note`` and the throughput since ``t0`` (``time.perf_counter``)."""
    if stream is None:
        return
    filled = int(30 * done / max(total, 1))
    rate = done / max(time.perf_counter() - t0, 1e-9)
    stream.write(
        f"\r[{'#' * filled}{'.' * (30 - filled)}] {done:,}/{total:,} bytes  "
        f"{note}  {rate:,.0f} bytes/s"
    )
    stream.flush()


def _bar(stream: TextIO | None, done: int, total: int, bits: float, n: int, t0: float) -> None:
    progress_bar(stream, done, total, f"{bits / max(n, 1):.3f} bits/byte so far", t0)


def bits_per_byte(
    model,
    files: Sequence[np.ndarray],
    *,
    context: int = 512,
    prefill: int = 256,
    chunk: int = 64,
    device: str | None = None,
    progress: TextIO | None | str = "stderr",
) -> EvalResult:
    """Mean bits per byte of ``model`` over ``files`` (arrays of byte ids), through the cache.

    Parameters
    ----------
    model : nbkv.models.Llama
    files : sequence of 1-D integer arrays
        The texts, as token ids (bytes for the default model).
    context, prefill, chunk : int
        Window length; bytes of each window fed as prefill, in chunks of ``chunk``
        (the rest are decode steps).
    progress : file, None or "stderr"

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError
        Sizes that are not positive ints, ``prefill > context``, files that are not 1-D
        integer arrays or hold ids outside the vocabulary.
    """
    from .train import held_out_windows

    context = positive_int(context, "context")
    prefill = positive_int(prefill, "prefill")
    chunk = positive_int(chunk, "chunk")
    if prefill > context:
        raise InvalidArgumentError(f"prefill ({prefill}) must be at most context ({context})")
    vocab = model.config.vocab_size
    checked = []
    for i, f in enumerate(files):
        arr = np.asarray(f)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ArgumentTypeError(
                f"files[{i}] must be a 1-D integer array, got {arr.dtype} {arr.shape}"
            )
        if arr.size and (arr.min() < 0 or arr.max() >= vocab):
            raise InvalidArgumentError(f"files[{i}] holds ids outside [0, {vocab})")
        checked.append(arr.astype(np.int64))
    stream = sys.stderr if progress == "stderr" else progress
    total = sum(max(len(f) - 1, 0) for f in checked)
    bits, n, windows = 0.0, 0, 0
    t0 = time.perf_counter()
    for w in held_out_windows(checked, context):
        inputs, targets = w[:-1], w[1:]
        cache = model.new_cache(1, len(inputs))
        logits = []
        head = min(prefill, len(inputs))
        for start in range(0, head, chunk):  # prefill, in chunks
            logits.append(model.forward(inputs[None, start : min(start + chunk, head)], cache)[0])
        for t in range(head, len(inputs)):  # then one decode step per byte
            logits.append(model.forward(inputs[None, t : t + 1], cache)[0])
        scores = _log2_softmax_at(np.concatenate(logits), targets)
        bits -= float(scores.sum())
        n += len(targets)
        windows += 1
        _bar(stream, n, total, bits, n, t0)
    if stream is not None:
        stream.write("\n")
    return EvalResult(bits / max(n, 1), n, windows, len(checked), time.perf_counter() - t0)


def held_out_bits_per_byte(model=None, *, limit_bytes: int | None = None, **kwargs) -> EvalResult:
    """:func:`bits_per_byte` of ``model`` (default: ``Llama.default()``) over the held-out
    split of this interpreter's standard library; ``limit_bytes`` stops after the files
    that reach that many bytes (a quick look)."""
    from .llama import Llama
    from .train import load_corpus

    model = Llama.default() if model is None else model
    files = load_corpus().held_out
    if limit_bytes is not None:
        limit_bytes = positive_int(limit_bytes, "limit_bytes")
        kept, size = [], 0
        for f in files:
            if size >= limit_bytes:
                break
            kept.append(f)
            size += len(f)
        files = kept
    return bits_per_byte(model, files, **kwargs)
