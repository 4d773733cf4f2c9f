"""CUDA flash-decoding: attention over a K/V cache, split across blocks, in one launch.

Grid ``(num_splits, batch * num_kv_heads, row_chunks)``, one block of ``THREADS`` threads
each. A block takes one KV head of one batch row, one chunk of up to ``R`` query rows of
that head's group (row ``r = g * n_q + i``: query ``i`` of group member ``g``), and one
contiguous split of the visible positions, so that batch 1 at long context still fills
the GPU. The kernels are *specialised*: :func:`attention_kernel` compiles one per
:class:`Spec` (rows per block ``R``, ``head_dim``, storage dtype, vector width, layout,
fused or not), so every per-row array has a constant size and every loop over rows,
dimensions or vector elements a constant trip count: accumulators live in registers.
A block walks its split in tiles of ``TILE`` positions:

1. stage: the block copies the tile's K rows into shared memory, neighbouring threads on
   neighbouring 16-byte pieces of a row (coalesced vector loads; the row pitch is an odd
   number of pieces, so the reads in step 2 hit distinct banks);
2. scores: thread ``t`` takes position ``j0 + t`` and computes its dot product with every
   query row (queries sit in shared memory, scale folded in); masked scores are -inf;
3. online softmax, spread over the block: each row's tile maximum is reduced by warp
   shuffles (shared memory under the simulator); every thread turns its own scores into
   weights ``2 ** (s * log2 e - m * log2 e)`` (one fused multiply-add and ``exp2``) and
   keeps its own partial sums, rescaled when the maximum rises;
4. values: thread ``t`` owns ``VV`` consecutive dimensions of one of ``PG`` position
   groups; a warp reads whole V rows with vector loads, and each thread keeps ``R * VV``
   accumulators in registers.

Each block writes its partial result (maximum, sum, accumulator; the partial sums and the
position groups reduced over the block) to scratch; the last block of a (KV head, row
chunk) to finish (an atomic counter, after a memory fence) combines the splits, with the
block's threads spread over splits and then over (row, dimension) pairs, writes the
output, and resets the counter for the next launch. A launch of one split writes the
output directly. No second launch is needed. The block's body is built in
:mod:`nbkv.kernels.cuda_attention_steps`, one device function per step.

``append_attend`` kernels also write the ``n`` new positions: the chunk-0 block whose
split holds position ``j >= pos`` copies it from ``k``/``v`` into the cache while staging
it, and every block reads it from ``k``/``v`` itself, so the write needs no grid-wide
barrier before the attention reads it. New positions that no query can see (before a
``window``) are copied by the task's chunk-0 blocks, split-strided, since no split holds
them.

NaN and infinities flow through as IEEE arithmetic says: a NaN score makes its row's
output NaN, a ``-inf`` score gets weight 0, a row with nothing finite gives NaN.

16-bit storage: float16 caches are read as float16 and widened by the hardware
conversion; bfloat16 caches arrive as ``uint16`` bit patterns and are widened by a
16-bit shift and a bit cast (:mod:`nbkv.kernels.cuda_vec`). ``table`` stays in the
signature for compatibility and is not read. Arithmetic is float32 throughout; the
output has q's dtype (float16, float32 or float64). ``part_stats[..., 0]`` holds each
split's running maximum of the scores in natural units, ``part_stats[..., 1]`` its sum
of ``exp(score - maximum)``.

``attend_kernel`` and its siblings are :class:`KernelFamily` objects: ``kernel[grid,
THREADS](...)`` picks the specialisation from the arguments (what a hand-made launch, as
in :mod:`nbkv.tutorial.cuda`, wants); :meth:`KernelFamily.specialise` returns the
compiled kernel of one :class:`Spec` (what the backend caches in its launch plan).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda

from .. import _config
from .cuda_attention_steps import RED_WIDTH, THREADS, TILE, build_block
from .cuda_vec import SIMULATOR, vector_width

__all__ = [
    "attend_kernel",
    "attend_bshd_kernel",
    "append_attend_kernel",
    "append_attend_bshd_kernel",
    "attention_kernel",
    "rows_per_block",
    "shared_bytes",
    "Spec",
    "KernelFamily",
    "THREADS",
    "TILE",
    "ROWS",
    "MAX_HEAD_DIM",
]

ROWS = _config.ATTENTION_ROWS  # the most query rows per block
MAX_HEAD_DIM = _config.ATTENTION_MAX_HEAD_DIM
# registers a thread spends on value accumulators (rows x dimensions) at most
_ACC_BUDGET = 16
# static shared memory one block may use (the hardware limit is 48 KiB)
_SHARED_BUDGET = 46 * 1024


class Spec(NamedTuple):
    """What one compiled attention kernel is specialised on (all compile-time)."""

    rows: int  # query rows per block (R): accumulators per thread are R x VV
    head_dim: int
    dtype: str  # the cache's kernel dtype: float16, uint16 (bfloat16 bits), float32, float64
    vec: int  # elements per vector access of the cache (1: element by element)
    bshd: bool  # layout [batch, seq, kv_heads, head_dim] (else [batch, kv_heads, seq, ...])
    fused: bool  # append_attend (k, v, pos after q) or attend


class _Geometry(NamedTuple):
    vv: int  # value dimensions per thread
    lanes: int  # head_dim // vv
    groups: int  # position groups in step 4 (PG)
    per_thread: int  # dimension lanes per thread when lanes > THREADS
    chunk: int  # head dimensions staged at a time (DC)
    pitch: int  # shared row pitch of the K tile, in elements
    shared: int  # bytes of static shared memory


def rows_per_block(group: int, n_q: int) -> int:
    """Query rows one block takes: the power of two holding ``group * n_q``, at most ROWS
    (so the number of row chunks is ``ceil(group * n_q / ROWS)`` whatever it is).

    >>> rows_per_block(4, 1), rows_per_block(6, 1), rows_per_block(8, 5)
    (4, 8, 16)
    """
    need = group * n_q
    r = 1
    while r < need and r < ROWS:
        r *= 2
    return r


def _geometry(spec: Spec) -> _Geometry:
    rows, dim, vec = spec.rows, spec.head_dim, spec.vec
    itemsize = np.dtype(spec.dtype).itemsize
    vv = vec
    while vv > 1 and rows * vv > _ACC_BUDGET:
        vv //= 2
    lanes = dim // vv
    if lanes >= THREADS:
        groups, per_thread = 1, -(-lanes // THREADS)
    else:
        groups, per_thread = THREADS // lanes, 1
    fixed = 4 * (rows * dim + TILE * rows + rows * RED_WIDTH + 2 * rows) + 64
    chunk, pitch = vec, vec  # the fallback: one piece at a time
    for dc in range(dim, 0, -vec):
        if dim % dc or dc % vec:
            continue
        units = dc // vec
        p = (units + 1 - units % 2) * vec  # an odd number of vector pieces per row
        if TILE * p * itemsize <= _SHARED_BUDGET - fixed:
            chunk, pitch = dc, p
            break
    shared = fixed + TILE * pitch * itemsize
    return _Geometry(vv, lanes, groups, per_thread, chunk, pitch, shared)


def shared_bytes(spec: Spec) -> int:
    """Static shared memory of one block of ``spec``'s kernel, in bytes."""
    return _geometry(spec).shared


def min_blocks_per_sm(spec: Spec) -> int:
    """The resident blocks per SM ``spec``'s kernel is compiled to allow (its launch
    bound caps registers at ``65536 / (THREADS * this)``): ``ATTENTION_MIN_BLOCKS_PER_SM``
    for decode attention, fewer where more per-row state or the fused write's arrays
    would spill at that cap."""
    base = _config.ATTENTION_MIN_BLOCKS_PER_SM
    if spec.rows > 8:
        return max(1, base // 2)
    if spec.fused or spec.rows > 4:
        return max(1, base - 1)
    return base


def launch_bounds(spec: Spec) -> tuple[int, int]:
    """``(threads, min_blocks_per_sm)``, as ``numba.cuda.jit(launch_bounds=...)`` takes."""
    return (THREADS, min_blocks_per_sm(spec))


_KERNELS: dict[Spec, object] = {}


def attention_kernel(spec: Spec):
    """The compiled (lazily, per signature) kernel of one :class:`Spec`, cached.

    ``attend``: ``kernel[grid, THREADS](q, k_cache, v_cache, seq_len, scale, causal,
    window, table, part_acc, part_stats, counters, out)``; ``append_attend``: ``(q, k, v,
    pos, k_cache, v_cache, scale, causal, window, table, part_acc, part_stats, counters,
    out)``. Mutates the scratch, the counters (left at zero), out, and for
    ``append_attend`` the caches.
    """
    kernel = _KERNELS.get(spec)
    if kernel is not None:
        return kernel
    block = build_block(spec, _geometry(spec))
    if spec.fused:

        def append_attend(
            q, k, v, pos, k_cache, v_cache, scale, causal, window, table, part_acc,
            part_stats, counters, out,
        ):  # fmt: skip
            """Write k, v (n new positions) at pos, then attend over the pos + n held, in
            one launch. Mutates k_cache, v_cache, part_acc, part_stats, counters, out."""
            n = k.shape[1] if spec.bshd else k.shape[2]
            block(
                q, k, v, pos, k_cache, v_cache, pos + n, scale, causal, window, part_acc,
                part_stats, counters, out,
            )  # fmt: skip

        fn = append_attend
    else:

        def attend(
            q, k_cache, v_cache, seq_len, scale, causal, window, table, part_acc,
            part_stats, counters, out,
        ):  # fmt: skip
            """Attention of q [batch, num_heads, n_q, head_dim] over the first seq_len
            positions of the cache. Mutates part_acc, part_stats, counters, out."""
            block(
                q, k_cache, v_cache, seq_len, k_cache, v_cache, seq_len, scale, causal,
                window, part_acc, part_stats, counters, out,
            )  # fmt: skip

        fn = attend
    kernel = cuda.jit(fn) if SIMULATOR else cuda.jit(launch_bounds=launch_bounds(spec))(fn)
    _KERNELS[spec] = kernel
    return kernel


def spec_for(q, k_cache, v_cache, *, bshd: bool, fused: bool) -> Spec:
    """The :class:`Spec` a launch over these arrays takes (vector width from alignment)."""
    num_kv_heads = k_cache.shape[2] if bshd else k_cache.shape[1]
    group = q.shape[1] // num_kv_heads
    head_dim = int(q.shape[3])
    dtype = np.dtype(k_cache.dtype)
    vec = vector_width(dtype.itemsize, head_dim, (k_cache, v_cache))
    return Spec(rows_per_block(group, int(q.shape[2])), head_dim, dtype.name, vec, bshd, fused)


class KernelFamily:
    """One of ``attend_kernel``, ``attend_bshd_kernel``, ``append_attend_kernel``,
    ``append_attend_bshd_kernel``: every specialisation of one layout and kind.

    ``family[grid, threads](*args)`` launches the specialisation the arguments need (its
    grid must have ``ceil(group * n_q / ROWS)`` chunks along z, as
    :func:`nbkv.launch.attention_grid` gives); :meth:`specialise` returns the kernel of
    one :class:`Spec`. ``py_func`` is the main case's (group 4, head_dim 128, float16),
    for ``numba.cuda.compile_ptx``.
    """

    def __init__(self, bshd: bool, fused: bool) -> None:
        self.bshd, self.fused = bshd, fused

    def spec(self, q, k_cache, v_cache) -> Spec:
        return spec_for(q, k_cache, v_cache, bshd=self.bshd, fused=self.fused)

    def specialise(self, spec: Spec):
        if (spec.bshd, spec.fused) != (self.bshd, self.fused):
            raise ValueError(f"{spec} is not a specialisation of {self!r}")
        return attention_kernel(spec)

    @property
    def py_func(self):
        return attention_kernel(Spec(4, 128, "float16", 8, self.bshd, self.fused)).py_func

    def __getitem__(self, config):
        def launch(*args):
            if self.fused:
                q, k_cache, v_cache = args[0], args[4], args[5]
            else:
                q, k_cache, v_cache = args[0], args[1], args[2]
            kernel = self.specialise(self.spec(q, k_cache, v_cache))
            scale_at = 6 if self.fused else 4
            args = list(args)
            args[scale_at] = np.float32(args[scale_at])
            kernel[config](*args)

        return launch

    def __repr__(self) -> str:
        kind = "append_attend" if self.fused else "attend"
        return f"<KernelFamily {kind}{'_bshd' if self.bshd else ''}_kernel>"


attend_kernel = KernelFamily(False, False)
append_attend_kernel = KernelFamily(False, True)
attend_bshd_kernel = KernelFamily(True, False)
append_attend_bshd_kernel = KernelFamily(True, True)
