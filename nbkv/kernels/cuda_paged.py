"""CUDA (``@cuda.jit``) kernels of the paged cache: the twins of
:mod:`nbkv.kernels.cpu_paged`, over the same pools and int32 tables.

- ``write_paged_kernel[blocks, threads](k, v, slot_mapping, k_pool, v_pool)`` (and
  ``write_paged_hnd_kernel``): grid-stride over every element of the new rows; a negative
  slot is skipped (vLLM's padding). :func:`nbkv.launch.launch_config` of ``k.size`` sizes it.
- ``copy_blocks_kernel[blocks, threads](src, dst, k_pool, v_pool)``: whole blocks
  ``src[i]`` to ``dst[i]`` in both pools, either layout (copy-on-write: every copy of a
  step in one launch); ``launch_config(len(src) * block_elements)``.
- ``paged_attend_kernel[grid, THREADS](q, k_pool, v_pool, q_indptr, kv_indptr,
  kv_indices, seq_lens, scale, window, table, part_acc, part_stats, counters, out)`` (and
  ``_hnd``): flash-decoding over page tables, as :mod:`nbkv.kernels.cuda_attention` over a
  contiguous cache. Grid ``(splits, num_seqs * num_kv_heads, chunks)``: a block takes one
  KV head of one sequence, up to ``ROWS`` query rows of its group and one split of the
  positions its queries see (split-K: one long sequence still fills the GPU); the last
  block of a (sequence, KV head, chunk) to finish combines the splits. Position ``j`` of
  sequence ``s`` is row ``j % block_size`` of page ``kv_indices[kv_indptr[s] + j //
  block_size]``. :func:`nbkv.launch.attention_grid` of ``(num_seqs, num_heads,
  num_kv_heads, longest new run, longest visible span)`` sizes the grid, and
  :func:`paged_scratch_shapes` the scratch (``counters`` zero before the launch; the
  kernel leaves them at zero). Blocks of a chunk a shorter sequence lacks, or of a split
  past its end, do no tile work but still write an empty partial (maximum -inf, sum 0)
  and count in, so that the last block's combine runs.
- ``paged_append_attend_kernel`` (and ``_hnd``), the same with ``k, v, slot_mapping``
  after ``q``: it writes the step's new rows as it attends, in one launch. A sequence's
  new positions are its last ``n`` (its queries); the chunk-0 block whose split holds one
  reads it from ``k``/``v`` and stores it at its slot, so no grid-wide barrier is needed
  between the write and the reads (no other block reads it: sequences of one step never
  share a block that is written, copy-on-write saw to that).

16-bit storage as in :mod:`nbkv.kernels.cuda_attention`: float16 read as float16 and
converted, bfloat16 as ``uint16`` bits widened by a 16-bit shift (a non-empty ``table``,
what the backend passes for bfloat16, marks them: one entry is read, once a block, to
tell it from float16's, which hand launches storing float16 as ``uint16`` bits may pass
and which is then looked up). float32 arithmetic throughout, the exponentials in base 2
with ``log2 e`` folded into one FMA a score (as the contiguous kernel: scores beyond
about +-2.3e38, where ``s * log2 e`` overflows float32, give NaN); the output has q's
dtype. NaN and infinities follow IEEE arithmetic. Each step of
a block is a device function (:func:`_tile_steps`, ``_tile_softmax``, ``_combine``, ...),
inlined at Numba IR level.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .cuda_attention import MAX_HEAD_DIM, ROWS, THREADS, TILE
from .cuda_attention_steps import LOG2E, last_to_finish, scaled_log2, split_span
from .cuda_vec import widener

__all__ = [
    "write_paged_kernel",
    "write_paged_hnd_kernel",
    "copy_blocks_kernel",
    "paged_attend_kernel",
    "paged_attend_hnd_kernel",
    "paged_append_attend_kernel",
    "paged_append_attend_hnd_kernel",
    "paged_scratch_shapes",
]

# the per-row arrays of these kernels are sized for the most rows and dimensions (they
# are not specialised like nbkv.kernels.cuda_attention's)
_DIMS_PER_THREAD = -(-MAX_HEAD_DIM // THREADS)
_ACC_SIZE = ROWS * _DIMS_PER_THREAD  # local arrays need a constant size
# float32 constants: a Python float would make the arithmetic around it float64
_NEG_INF = np.float32(-np.inf)
_NAN = np.float32(np.nan)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_convert = widener(np.float32)  # float16, float32, float64: by conversion
_bf16 = widener(np.uint16)  # bfloat16 bits: by a 16-bit shift


@cuda.jit(device=True, inline=True)
def _widen_mode(table):
    """How a block widens its pool's values, from ``table`` (one read, once a block): 0
    converts (floats: an empty table), 1 shifts bfloat16 bits (a bfloat16 table, what
    the backend passes), 2 looks 16-bit bits up in the table (float16 stored as
    ``uint16`` bits with its table, the CPU's convention, for hand launches)."""
    if table.shape[0] == 0:
        return 0
    if table[0x3C00] == _ONE:  # float16's 1.0; as bfloat16 these bits are 2 ** -7
        return 2
    return 1


@cuda.jit(device=True, inline=True)
def _widen(x, table, mode):
    """A stored value as float32, as :func:`_widen_mode` said."""
    if mode == 0:
        return _convert(x)
    if mode == 1:
        return _bf16(x)
    return table[np.int32(x)]


@cuda.jit(device=True, inline=True)
def _tile_softmax(s, m, den, corr, t):
    """Step 2 of a tile, for query row ``t``: raise its running maximum ``m[t]`` to the
    tile's, rescale its sum ``den[t]`` (the factor left in ``corr[t]`` for the
    accumulators) and turn its scores ``s[t, :]`` into weights, in base 2 with ``log2 e``
    folded into one FMA a score. A row with nothing finite in the tile gets weights 0
    (and NaN throughout if a score was NaN)."""
    tile_max = _NEG_INF
    for i in range(TILE):
        tile_max = max(tile_max, s[t, i])
    if tile_max == _NEG_INF:  # nothing finite in this row of the tile
        poisoned = False
        for i in range(TILE):
            poisoned = poisoned or s[t, i] != s[t, i]
            s[t, i] = _ZERO
        corr[t] = _ONE
        if poisoned:  # a NaN score (max() drops NaN): the row's output is NaN
            m[t] = _NAN
            den[t] = _NAN
            corr[t] = _NAN
    else:
        m_new = max(m[t], tile_max)
        shift = scaled_log2(m_new)
        c = math.exp2(scaled_log2(m[t]) - shift)  # 2 ** -inf = 0 on the first tile
        total = den[t] * c
        for i in range(TILE):
            w = math.exp2(cuda.fma(s[t, i], LOG2E, -shift))
            s[t, i] = w
            total += w
        den[t] = total
        m[t] = m_new
        corr[t] = c


def paged_scratch_shapes(total: int, num_heads: int, head_dim: int, grid) -> tuple:
    """``(part_acc, part_stats, counters)`` shapes of a paged attention launch of ``grid``
    (an :class:`nbkv.launch.AttentionGrid`) over ``total`` packed queries: float32
    ``[total, num_heads, splits, head_dim]``, float32 ``[total, num_heads, splits, 2]``
    and int32 ``[tasks, chunks]``.

    >>> from nbkv.launch import AttentionGrid
    >>> paged_scratch_shapes(5, 8, 16, AttentionGrid(3, 4, 1))
    ((5, 8, 3, 16), (5, 8, 3, 2), (4, 1))
    """
    return (
        (total, num_heads, grid.splits, head_dim),
        (total, num_heads, grid.splits, 2),
        (grid.tasks, grid.chunks),
    )


def _make_write(hnd: bool):
    @cuda.jit
    def write_paged(k, v, slot_mapping, k_pool, v_pool):
        """Rows k, v [total, num_kv_heads, head_dim] into the pools at their slots."""
        bs = k_pool.shape[2] if hnd else k_pool.shape[1]
        heads, dim = k.shape[1], k.shape[2]
        per = heads * dim
        for idx in range(cuda.grid(1), k.shape[0] * per, cuda.gridsize(1)):
            t = idx // per
            rem = idx - t * per
            h = rem // dim
            d = rem - h * dim
            slot = slot_mapping[t]
            if slot >= 0:
                b = slot // bs
                o = slot - b * bs
                if hnd:
                    k_pool[b, h, o, d] = k[t, h, d]
                    v_pool[b, h, o, d] = v[t, h, d]
                else:
                    k_pool[b, o, h, d] = k[t, h, d]
                    v_pool[b, o, h, d] = v[t, h, d]

    return write_paged


write_paged_kernel = _make_write(False)
write_paged_hnd_kernel = _make_write(True)


@cuda.jit
def copy_blocks_kernel(src, dst, k_pool, v_pool):
    """Blocks ``src[i]`` copied to ``dst[i]`` in both pools (either layout); the two
    lists must not overlap."""
    n1, n2, n3 = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    per = n1 * n2 * n3
    for idx in range(cuda.grid(1), src.shape[0] * per, cuda.gridsize(1)):
        i = idx // per
        rem = idx - i * per
        x = rem // (n2 * n3)
        rem -= x * n2 * n3
        y = rem // n3
        z = rem - y * n3
        k_pool[dst[i], x, y, z] = k_pool[src[i], x, y, z]
        v_pool[dst[i], x, y, z] = v_pool[src[i], x, y, z]


def _pool_access(hnd: bool):
    """``(load, store)``: one element of a pool of the layout, by page and offset, or by
    slot (``store``)."""

    @cuda.jit(device=True, inline=True)
    def load(pool, page, h, off, d):
        if hnd:
            return pool[page, h, off, d]
        return pool[page, off, h, d]

    @cuda.jit(device=True, inline=True)
    def store(pool, slot, bs, h, d, value):
        page = slot // bs
        off = slot - page * bs
        if hnd:
            pool[page, h, off, d] = value
        else:
            pool[page, off, h, d] = value

    return load, store


@cuda.jit(device=True, inline=True)
def _load_queries(q, qs, m, den, acc, scale, q0, n_q, kvh, group, r0, rows, t):
    """The chunk's queries into ``qs``, scale folded in; running state empty."""
    qscale = np.float32(scale)
    dim = q.shape[2]
    for idx in range(t, rows * dim, THREADS):
        r = idx // dim
        d = idx - r * dim
        row = r0 + r
        qs[r, d] = np.float32(q[q0 + row % n_q, kvh * group + row // n_q, d]) * qscale
    if t < rows:
        m[t] = _NEG_INF
        den[t] = _ZERO
    for i in range(_ACC_SIZE):
        acc[i] = _ZERO


def _tile_steps(hnd: bool):
    """``(score_tile, value_tile)``: steps 1 and 3 of a tile, for pools of the layout."""
    load, store = _pool_access(hnd)

    @cuda.jit(device=True, inline=True)
    def score_tile(
        q, qs, s, dots, k, v, slot_mapping, fused, k_pool, v_pool, table, mode, kv_indices,
        base, bs, q0, n_q, kvh, r0, rows, first, window, chunk, j0, end, t,
    ):  # fmt: skip
        """Step 1: thread ``t`` scores position ``j0 + t`` for every row into ``s[:, t]``
        (-inf where a row does not see it); a fused launch's chunk-0 block also stores a
        new row at its slot."""
        j = j0 + t
        if j < end:
            for r in range(rows):
                dots[r] = _ZERO
            page = kv_indices[base + j // bs]
            off = j % bs
            for d in range(q.shape[2]):
                if fused and j >= first:  # a new row: from k, and into the pool
                    raw = k[q0 + j - first, kvh, d]
                    if chunk == 0:
                        slot = slot_mapping[q0 + j - first]
                        store(k_pool, slot, bs, kvh, d, raw)
                        store(v_pool, slot, bs, kvh, d, v[q0 + j - first, kvh, d])
                else:
                    raw = load(k_pool, page, kvh, off, d)
                kd = _widen(raw, table, mode)
                for r in range(rows):
                    dots[r] += qs[r, d] * kd
            for r in range(rows):
                p = first + (r0 + r) % n_q
                if j > p or (window > 0 and j <= p - window):
                    s[r, t] = _NEG_INF
                else:
                    s[r, t] = dots[r]
        else:
            for r in range(rows):
                s[r, t] = _NEG_INF

    @cuda.jit(device=True, inline=True)
    def value_tile(
        s, corr, acc, v, fused, v_pool, table, mode, kv_indices, base, bs, dim, q0, kvh,
        rows, first, j0, end, t,
    ):  # fmt: skip
        """Step 3: thread ``t`` owns dimensions ``t, t + THREADS, ...``: its accumulators
        rescaled by ``corr``, then the tile's weighted V rows added (coalesced reads)."""
        n_tile = min(TILE, end - j0)
        for k_i in range(_DIMS_PER_THREAD):
            d = t + k_i * THREADS
            if d < dim:
                for r in range(rows):
                    acc[r * _DIMS_PER_THREAD + k_i] *= corr[r]
                for i in range(n_tile):
                    jv = j0 + i
                    if fused and jv >= first:
                        vd = _widen(v[q0 + jv - first, kvh, d], table, mode)
                    else:
                        vd = _widen(
                            load(v_pool, kv_indices[base + jv // bs], kvh, jv % bs, d), table, mode
                        )
                    for r in range(rows):
                        acc[r * _DIMS_PER_THREAD + k_i] += s[r, i] * vd

    return score_tile, value_tile


@cuda.jit(device=True, inline=True)
def _write_partial(
    part_acc, part_stats, acc, m, den, dim, q0, n_q, kvh, group, r0, rows, split, t,
):  # fmt: skip
    """The split's accumulators, maxima and sums to scratch."""
    for r in range(rows):
        row = r0 + r
        h = kvh * group + row // n_q
        i = q0 + row % n_q
        for k_i in range(_DIMS_PER_THREAD):
            d = t + k_i * THREADS
            if d < dim:
                part_acc[i, h, split, d] = acc[r * _DIMS_PER_THREAD + k_i]
        if t == 0:
            part_stats[i, h, split, 0] = m[r]
            part_stats[i, h, split, 1] = den[r]


@cuda.jit(device=True, inline=True)
def _combine(part_acc, part_stats, out, dim, q0, n_q, kvh, group, r0, rows, num_splits, t):
    """Every split's partial result, weighed by ``2 ** (scaled_log2(m_s) -
    scaled_log2(M))``, into the output: one (row, dimension) pair a thread at a time."""
    for idx in range(t, rows * dim, THREADS):
        r = idx // dim
        d = idx - r * dim
        row = r0 + r
        h = kvh * group + row // n_q
        i = q0 + row % n_q
        top = _NEG_INF
        for sp in range(num_splits):
            top = max(top, part_stats[i, h, sp, 0])
        shift = scaled_log2(top)
        num = _ZERO
        total = _ZERO
        for sp in range(num_splits):
            mx = part_stats[i, h, sp, 0]
            if mx != _NEG_INF:
                w = math.exp2(scaled_log2(mx) - shift)
                num += w * part_acc[i, h, sp, d]
                total += w * part_stats[i, h, sp, 1]
        out[i, h, d] = num / total if total != _ZERO else _NAN


def _paged_block(hnd: bool):
    """The block body both attention kernels of one pool layout call (inlined, as in
    cuda_attention); ``attend`` passes ``fused=False`` and views of the pools as ``k``,
    ``v``, never read."""
    score_tile, value_tile = _tile_steps(hnd)

    @cuda.jit(device=True, inline=True)
    def block(
        q, k, v, slot_mapping, fused, k_pool, v_pool, q_indptr, kv_indptr, kv_indices,
        seq_lens, scale, window, table, part_acc, part_stats, counters, out,
    ):  # fmt: skip
        t = cuda.threadIdx.x
        split = cuda.blockIdx.x
        num_splits = cuda.gridDim.x
        task = cuda.blockIdx.y
        chunk = cuda.blockIdx.z
        dim = q.shape[2]
        num_kv_heads = k_pool.shape[1] if hnd else k_pool.shape[2]
        bs = k_pool.shape[2] if hnd else k_pool.shape[1]
        group = q.shape[1] // num_kv_heads
        s_id = task // num_kv_heads
        kvh = task - s_id * num_kv_heads
        q0 = q_indptr[s_id]
        n_q = q_indptr[s_id + 1] - q0
        r0 = chunk * ROWS
        rows = min(ROWS, group * n_q - r0)
        if rows <= 0:  # a chunk this sequence does not have (the whole block returns)
            return
        seq_len = seq_lens[s_id]
        first = seq_len - n_q  # position of the first query, and of the first new row
        _, start, end = split_span(seq_len, first, window, split, num_splits)
        base = kv_indptr[s_id]

        qs = cuda.shared.array((ROWS, MAX_HEAD_DIM), np.float32)
        s = cuda.shared.array((ROWS, TILE), np.float32)
        m = cuda.shared.array(ROWS, np.float32)
        den = cuda.shared.array(ROWS, np.float32)
        corr = cuda.shared.array(ROWS, np.float32)
        last = cuda.shared.array(1, np.int32)
        acc = cuda.local.array(_ACC_SIZE, np.float32)
        dots = cuda.local.array(ROWS, np.float32)

        _load_queries(q, qs, m, den, acc, scale, q0, n_q, kvh, group, r0, rows, t)
        mode = _widen_mode(table)
        cuda.syncthreads()
        for j0 in range(start, end, TILE):
            score_tile(
                q, qs, s, dots, k, v, slot_mapping, fused, k_pool, v_pool, table, mode,
                kv_indices, base, bs, q0, n_q, kvh, r0, rows, first, window, chunk, j0, end, t,
            )  # fmt: skip
            cuda.syncthreads()
            # 2. online softmax: thread r rescales row r and turns scores into weights
            if t < rows:
                _tile_softmax(s, m, den, corr, t)
            cuda.syncthreads()
            value_tile(
                s, corr, acc, v, fused, v_pool, table, mode, kv_indices, base, bs, dim, q0,
                kvh, rows, first, j0, end, t,
            )  # fmt: skip
            cuda.syncthreads()

        _write_partial(
            part_acc, part_stats, acc, m, den, dim, q0, n_q, kvh, group, r0, rows, split, t,
        )  # fmt: skip
        if last_to_finish(counters, last, task, chunk, num_splits, t):
            _combine(part_acc, part_stats, out, dim, q0, n_q, kvh, group, r0, rows, num_splits, t)
            if t == 0:
                counters[task, chunk] = 0  # ready for the next launch

    return block


def _make_attend(hnd: bool):
    """The two attention kernels of one pool layout (``hnd`` a compile-time constant)."""
    block = _paged_block(hnd)

    @cuda.jit
    def paged_attend(
        q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens, scale, window, table,
        part_acc, part_stats, counters, out,
    ):  # fmt: skip
        """Attention of the packed queries q [total, num_heads, head_dim] over the pages.
        Mutates part_acc, part_stats, counters (left at zero) and out."""
        # k, v, slot_mapping are never read (fused=False): views of the right types
        block(
            q, k_pool[0], v_pool[0], q_indptr, False, k_pool, v_pool, q_indptr, kv_indptr,
            kv_indices, seq_lens, scale, window, table, part_acc, part_stats, counters, out,
        )  # fmt: skip

    @cuda.jit
    def paged_append_attend(
        q, k, v, slot_mapping, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, seq_lens,
        scale, window, table, part_acc, part_stats, counters, out,
    ):  # fmt: skip
        """Write the new rows k, v [total, num_kv_heads, head_dim] at their slots and
        attend, in one launch. Mutates the pools, the scratch and out."""
        block(
            q, k, v, slot_mapping, True, k_pool, v_pool, q_indptr, kv_indptr, kv_indices,
            seq_lens, scale, window, table, part_acc, part_stats, counters, out,
        )  # fmt: skip

    return paged_attend, paged_append_attend


paged_attend_kernel, paged_append_attend_kernel = _make_attend(False)
paged_attend_hnd_kernel, paged_append_attend_hnd_kernel = _make_attend(True)
