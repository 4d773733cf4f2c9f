"""Helpers for ``notebooks/01_kv_cache_basics.ipynb``: one attention layer, decoded three ways.

:class:`AttentionLayer` is a single attention layer with random projection weights (no
norm, no rotary embedding, no output projection: only what makes K and V). Three decoders
run it one token at a time and differ only in how they keep K and V:

- :class:`RecomputeDecoder` keeps no K/V: every step projects K and V of *all* positions
  again from the inputs (what a model without a cache does), so a step's work grows with
  the position and a whole generation is quadratic.
- :class:`ConcatDecoder` keeps K/V in arrays grown by ``np.concatenate`` (through
  :func:`nbkv.reference.append`): no recomputation, but every step copies everything held.
- :class:`NbkvDecoder` appends to a preallocated :class:`nbkv.LayerKVCache`: each step
  writes one position in place.

All three attend with :func:`nbkv.attention`, so their timings differ only by K/V
handling. :func:`step_work` counts each method's FLOPs and K/V bytes written per step,
:func:`time_decode` times a generation step by step, :func:`trace_memory` measures the
memory a generation holds and peaks at (``tracemalloc``, which sees NumPy's buffers).

>>> import numpy as np
>>> layer = AttentionLayer(d_model=16, num_heads=2, num_kv_heads=2, head_dim=8)
>>> xs = layer.inputs(5)
>>> outs = [run_decode(cls(layer, 5), xs) for cls in (RecomputeDecoder, NbkvDecoder)]
>>> bool(np.allclose(outs[0], outs[1], atol=1e-5))
True
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from .. import reference
from ..attention import attention
from ..cache import LayerKVCache

__all__ = [
    "METHODS",
    "AttentionLayer",
    "ConcatDecoder",
    "NbkvDecoder",
    "RecomputeDecoder",
    "make_decoder",
    "run_decode",
    "step_work",
    "time_decode",
    "trace_memory",
]

METHODS = ("recompute", "concatenate", "nbkv")

_F32 = np.dtype(np.float32)


class AttentionLayer:
    """The q/k/v projections of one attention layer, with random float32 weights.

    Parameters
    ----------
    d_model : int
        Width of the token vectors going in.
    num_heads, num_kv_heads, head_dim : int
        Query heads, key/value heads (``num_heads`` a multiple of it) and their width.
    seed : int
        Seed of ``numpy.random.default_rng`` for the weights (scaled by
        ``d_model ** -0.5`` so that q, k, v have entries of order 1).

    Examples
    --------
    >>> layer = AttentionLayer(d_model=32, num_heads=4, num_kv_heads=2, head_dim=8)
    >>> q = layer.project_q(layer.inputs(3))
    >>> k, v = layer.project_kv(layer.inputs(3))
    >>> q.shape, k.shape, layer.kv_nbytes_per_position
    ((1, 4, 3, 8), (1, 2, 3, 8), 128)
    """

    def __init__(
        self,
        d_model: int = 512,
        num_heads: int = 8,
        num_kv_heads: int = 8,
        head_dim: int = 64,
        *,
        batch: int = 1,
        seed: int = 0,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of {num_kv_heads}")
        self.d_model, self.batch = d_model, batch
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        rng = np.random.default_rng(seed)
        scale = d_model**-0.5

        def weight(width: int) -> np.ndarray:
            return (rng.standard_normal((d_model, width)) * scale).astype(_F32)

        self.w_q = weight(num_heads * head_dim)
        self.w_k = weight(num_kv_heads * head_dim)
        self.w_v = weight(num_kv_heads * head_dim)

    def inputs(self, n: int, seed: int = 1) -> np.ndarray:
        """``n`` random token vectors, float32 ``[batch, n, d_model]``: the stand-in for
        the embeddings of a prompt or of generated tokens."""
        rng = np.random.default_rng(seed)
        return rng.standard_normal((self.batch, n, self.d_model), dtype=np.float32)

    def _heads(self, y: np.ndarray, heads: int) -> np.ndarray:
        # [batch, n, heads * head_dim] -> contiguous [batch, heads, n, head_dim] ("bhsd")
        b, n, _ = y.shape
        return np.ascontiguousarray(y.reshape(b, n, heads, self.head_dim).transpose(0, 2, 1, 3))

    def project_q(self, x: np.ndarray) -> np.ndarray:
        """Queries of ``x`` ``[batch, n, d_model]``: ``[batch, num_heads, n, head_dim]``."""
        return self._heads(x @ self.w_q, self.num_heads)

    def project_kv(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of ``x``: each ``[batch, num_kv_heads, n, head_dim]``."""
        return self._heads(x @ self.w_k, self.num_kv_heads), self._heads(
            x @ self.w_v, self.num_kv_heads
        )

    @property
    def kv_nbytes_per_position(self) -> int:
        """Bytes of K and V together for one position (all batch rows and KV heads)."""
        return 2 * self.batch * self.num_kv_heads * self.head_dim * _F32.itemsize

    def new_cache(self, max_seq_len: int) -> LayerKVCache:
        """An empty float32 :class:`nbkv.LayerKVCache` of this layer's shape, allocated."""
        return LayerKVCache(
            max_seq_len,
            batch=self.batch,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=_F32,
        )


class RecomputeDecoder:
    """No cache: keeps the inputs and projects K/V of every position again each step."""

    name = "recompute"

    def __init__(self, layer: AttentionLayer, max_seq_len: int) -> None:
        self.layer = layer
        self._xs = np.empty((layer.batch, max_seq_len, layer.d_model), _F32)
        self.seq_len = 0

    def step(self, x: np.ndarray) -> np.ndarray:
        """Decode the token ``x`` ``[batch, 1, d_model]``: its attention output
        ``[batch, num_heads, 1, head_dim]`` over every position so far, its own included."""
        t = self.seq_len
        self._xs[:, t : t + 1] = x
        self.seq_len = t + 1
        K, V = self.layer.project_kv(self._xs[:, : t + 1])  # all t + 1 positions, again
        return attention(self.layer.project_q(x), (K, V))

    def get_kv(self) -> tuple[np.ndarray, np.ndarray] | None:
        """K and V of the positions seen (recomputed: this decoder keeps none)."""
        return self.layer.project_kv(self._xs[:, : self.seq_len]) if self.seq_len else None

    @property
    def kv_nbytes(self) -> int:
        """K/V bytes kept between steps: none."""
        return 0


class ConcatDecoder:
    """K/V grown by ``np.concatenate`` (:func:`nbkv.reference.append`): new arrays each step."""

    name = "concatenate"

    def __init__(self, layer: AttentionLayer, max_seq_len: int | None = None) -> None:
        self.layer = layer
        self._K, self._V = reference.empty_kv(layer.batch, layer.num_kv_heads, layer.head_dim, _F32)

    @property
    def seq_len(self) -> int:
        return self._K.shape[2]

    def step(self, x: np.ndarray) -> np.ndarray:
        """As :meth:`RecomputeDecoder.step`; projects only ``x`` and copies all K/V held."""
        k, v = self.layer.project_kv(x)
        self._K, self._V = reference.append(self._K, self._V, k, v)
        return attention(self.layer.project_q(x), (self._K, self._V))

    def get_kv(self) -> tuple[np.ndarray, np.ndarray] | None:
        return (self._K, self._V) if self.seq_len else None

    @property
    def kv_nbytes(self) -> int:
        """K/V bytes kept between steps: exactly the positions held."""
        return self._K.nbytes + self._V.nbytes


class NbkvDecoder:
    """K/V appended in place to a preallocated :class:`nbkv.LayerKVCache`."""

    name = "nbkv"

    def __init__(self, layer: AttentionLayer, max_seq_len: int) -> None:
        self.layer = layer
        self.cache = layer.new_cache(max_seq_len)

    @property
    def seq_len(self) -> int:
        return self.cache.seq_len

    def step(self, x: np.ndarray) -> np.ndarray:
        """As :meth:`RecomputeDecoder.step`; projects only ``x`` and writes one position."""
        k, v = self.layer.project_kv(x)
        self.cache.append(k, v)
        return attention(self.layer.project_q(x), self.cache)

    def get_kv(self) -> tuple[np.ndarray, np.ndarray] | None:
        return self.cache.get_kv()

    @property
    def kv_nbytes(self) -> int:
        """K/V bytes kept between steps: the whole capacity, from the start."""
        return self.cache.nbytes


_DECODERS = {d.name: d for d in (RecomputeDecoder, ConcatDecoder, NbkvDecoder)}


def make_decoder(method: str, layer: AttentionLayer, max_seq_len: int):
    """A fresh decoder of ``method`` (one of :data:`METHODS`) for ``max_seq_len`` tokens."""
    if method not in _DECODERS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return _DECODERS[method](layer, max_seq_len)


def run_decode(decoder, xs: np.ndarray) -> np.ndarray:
    """Feed the tokens ``xs`` ``[batch, n, d_model]`` one at a time; the outputs stacked,
    ``[batch, num_heads, n, head_dim]``."""
    outs = [decoder.step(xs[:, t : t + 1]) for t in range(xs.shape[1])]
    return np.concatenate(outs, axis=2)


def step_work(layer: AttentionLayer, method: str, pos: int) -> tuple[int, int]:
    """FLOPs and K/V bytes written by the decode step of the token at ``pos`` (0-based).

    FLOPs count the projections (``2 * rows * d_model * width``: the recompute method
    projects K and V for all ``pos + 1`` rows, the others for one) and attention (scores
    and the weighted sum of V: ``4 * num_heads * (pos + 1) * head_dim``), per batch row
    times ``batch``. Bytes written are K/V bytes stored: all ``pos + 1`` positions for
    recompute (fresh arrays) and concatenate (a new array, the old positions copied), one
    position for nbkv.

    >>> layer = AttentionLayer(d_model=16, num_heads=2, num_kv_heads=2, head_dim=8)
    >>> [step_work(layer, m, 9) for m in METHODS]
    [(11392, 1280), (2176, 1280), (2176, 128)]
    """
    if method not in _DECODERS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    n = pos + 1
    L = layer
    kv_rows = n if method == "recompute" else 1
    q_width, kv_width = L.num_heads * L.head_dim, 2 * L.num_kv_heads * L.head_dim
    proj = 2 * L.d_model * (q_width + kv_rows * kv_width)
    attend = 4 * L.num_heads * n * L.head_dim
    written = (1 if method == "nbkv" else n) * L.kv_nbytes_per_position
    return L.batch * (proj + attend), written


def time_decode(make: Callable[[], object], xs: np.ndarray, repeats: int = 3) -> np.ndarray:
    """Nanoseconds of each decode step, ``[repeats, n]``: ``repeats`` whole generations
    of the tokens ``xs``, each on a fresh decoder from ``make()``. Warm up (JIT) first:
    every step is timed, the first included."""
    n = xs.shape[1]
    ns = np.empty((repeats, n), np.int64)
    clock = time.perf_counter_ns
    for r in range(repeats):
        decoder = make()
        step = decoder.step
        for t in range(n):
            x = xs[:, t : t + 1]
            t0 = clock()
            step(x)
            ns[r, t] = clock() - t0
    return ns


def trace_memory(make: Callable[[], object], xs: np.ndarray) -> dict[str, np.ndarray]:
    """Memory of a generation of the tokens ``xs``, step by step, in bytes.

    Returns ``held`` (K/V bytes the decoder keeps after each step: its ``kv_nbytes``)
    and ``peak`` (during each step: what was held before it plus the most the step
    allocated on top, measured by ``tracemalloc``, which counts NumPy's buffers; the
    step's own temporaries, such as the query and the output, are included). Run it
    apart from timing: tracing slows every allocation.
    """
    n = xs.shape[1]
    held, peak = np.empty(n, np.int64), np.empty(n, np.int64)
    decoder = make()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        for t in range(n):
            x = xs[:, t : t + 1]
            before = decoder.kv_nbytes
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            decoder.step(x)
            peak[t] = before + tracemalloc.get_traced_memory()[1] - base
            held[t] = decoder.kv_nbytes
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return {"held": held, "peak": peak}
