"""CUDA launch geometry, as pure functions of sizes: no GPU, no Numba, nothing allocated.

The CUDA backend calls these for every launch; they are public so that a notebook, a
test or your own launch of :mod:`nbkv.kernels.cuda_attention` can compute the same grid
for any device (an H200 has 132 SMs) without one.

>>> from nbkv.launch import attention_grid, launch_config
>>> launch_config(8 * 128)                     # a decode token: 8 heads x head_dim 128
(4, 256)
>>> g = attention_grid(1, 32, 8, 1, 32768, sm_count=132, tile=128)
>>> g, g.blocks                                # batch 1 at 32K: 66 splits of each KV head
(AttentionGrid(splits=66, tasks=8, chunks=1), 528)
>>> resident_blocks(128, registers=128, shared=38_980)  # H200: 4 blocks of 128 threads / SM
4
"""

from __future__ import annotations

import math
from typing import NamedTuple

from . import _config
from ._validate import optional_positive_int, positive_int
from .errors import InvalidArgumentError

__all__ = [
    "launch_config",
    "AttentionGrid",
    "attention_grid",
    "attention_scratch_shapes",
    "resident_blocks",
    "wave_splits",
    "append_config",
    "H200",
]


class SMLimits(NamedTuple):
    """What one streaming multiprocessor holds (the resident-block limits)."""

    registers: int = 65_536
    shared: int = 233_472  # 228 KiB usable by blocks
    shared_per_block_reserved: int = 1024  # the driver's reservation per resident block
    threads: int = 2048
    blocks: int = 32
    register_granule: int = 256  # registers are allocated per warp in units of this


H200 = SMLimits()  # compute capability 9.0 (the same for every Hopper GPU)


def resident_blocks(threads: int, *, registers: int, shared: int, limits: SMLimits = H200) -> int:
    """Blocks of ``threads`` threads, ``registers`` registers a thread and ``shared``
    bytes of static shared memory each, that one SM holds at once (at least 1).

    >>> resident_blocks(128, registers=64, shared=20_000)  # registers limit it
    8
    """
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // limits.register_granule) * limits.register_granule
    by_regs = limits.registers // (per_warp * warps)
    by_shared = limits.shared // (shared + limits.shared_per_block_reserved)
    by_threads = limits.threads // (warps * 32)
    return max(1, min(by_regs, by_shared, by_threads, limits.blocks))


def launch_config(n_elements: int) -> tuple[int, int]:
    """``(blocks, threads_per_block)`` for a grid-stride kernel over ``n_elements``.

    Blocks hold ``THREADS_PER_BLOCK`` threads (fewer, in whole warps, for a small launch
    such as one decode token); the grid is capped at ``MAX_BLOCKS`` (see
    :func:`nbkv.tunables`), beyond which each thread loops.
    """
    n = max(int(n_elements), 1)
    warps = math.ceil(n / _config.WARP)
    threads = min(_config.THREADS_PER_BLOCK, warps * _config.WARP)
    blocks = min(math.ceil(n / threads), _config.MAX_BLOCKS)
    return blocks, threads


_DEFAULT_PER_SM = 4  # blocks per SM when neither the caller nor the tunable says


class AttentionGrid(NamedTuple):
    """The grid of a flash-decoding launch: ``(splits, tasks, chunks)`` blocks.

    ``splits``: contiguous ranges of the visible positions, one per block along x;
    ``tasks``: ``batch * num_kv_heads`` (one KV head of one batch row), along y;
    ``chunks``: groups of up to ``rows`` query rows of one KV head's group, along z.
    """

    splits: int
    tasks: int
    chunks: int

    @property
    def blocks(self) -> int:
        """Blocks launched."""
        return self.splits * self.tasks * self.chunks


def attention_grid(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    n_q: int,
    span: int,
    *,
    sm_count: int,
    tile: int | None = None,
    rows: int | None = None,
    blocks_per_sm: int | None = None,
    splits: int | None = None,
) -> AttentionGrid:
    """The grid flash-decoding launches for these sizes on a device of ``sm_count`` SMs.

    The sequence is split into as many splits as fit one wave of resident blocks
    (``blocks_per_sm * sm_count`` blocks in all, rounded down: a second, part-filled wave
    would double the time of the first), but never into more splits than there are
    tiles of ``tile`` positions in the ``span`` of visible positions, nor more than
    ``span``.

    Parameters
    ----------
    batch, num_heads, num_kv_heads, n_q : int
        The query's sizes (``num_heads`` a multiple of ``num_kv_heads``).
    span : int
        Positions the queries can see (``seq_len``, or fewer under a window).
    sm_count : int
        Streaming multiprocessors of the device (132 on an H200).
    tile, rows, blocks_per_sm, splits : int, optional
        Default: the tunables ``ATTENTION_THREADS``, ``ATTENTION_ROWS``,
        ``ATTENTION_BLOCKS_PER_SM`` and ``ATTENTION_SPLITS`` (None: automatic). The
        backend passes the kernel's occupancy (:func:`resident_blocks`) as
        ``blocks_per_sm`` unless the tunable is set; without either, 4.

    Raises
    ------
    ArgumentTypeError, InvalidArgumentError
        A size that is not a positive int; heads that do not divide.

    >>> attention_grid(16, 32, 8, 1, 32768, sm_count=132, tile=128)  # 512 of 528 slots
    AttentionGrid(splits=4, tasks=128, chunks=1)
    >>> attention_grid(1, 8, 2, 5, 100, sm_count=1, splits=3)  # forced
    AttentionGrid(splits=3, tasks=2, chunks=2)
    """
    batch, num_heads = positive_int(batch, "batch"), positive_int(num_heads, "num_heads")
    num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
    n_q, span = positive_int(n_q, "n_q"), positive_int(span, "span")
    sm_count = positive_int(sm_count, "sm_count")
    tile = positive_int(_config.ATTENTION_THREADS if tile is None else tile, "tile")
    rows = positive_int(_config.ATTENTION_ROWS if rows is None else rows, "rows")
    per_sm = _config.ATTENTION_BLOCKS_PER_SM if blocks_per_sm is None else blocks_per_sm
    per_sm = positive_int(_DEFAULT_PER_SM if per_sm is None else per_sm, "blocks_per_sm")
    forced = optional_positive_int(_config.ATTENTION_SPLITS if splits is None else splits, "splits")
    if num_heads % num_kv_heads:
        raise InvalidArgumentError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    tasks = batch * num_kv_heads
    chunks = math.ceil(num_heads // num_kv_heads * n_q / rows)
    return AttentionGrid(
        wave_splits(per_sm * sm_count, tasks * chunks, span, tile, forced), tasks, chunks
    )


def wave_splits(blocks: int, work: int, span: int, tile: int, forced: int | None = None) -> int:
    """Splits of each of ``work`` (task, chunk) pairs so that they fill one wave of
    ``blocks`` resident blocks (rounded down), at most one per ``tile`` positions of the
    ``span`` and at least 1; ``forced`` (a positive int) instead, at most ``span``.

    No validation: the hot path of every attention launch calls it.

    >>> wave_splits(528, 8, 32768, 128), wave_splits(528, 128, 32768, 128)
    (66, 4)
    """
    if forced is not None:
        return max(1, min(forced, span))
    want = min(blocks // work, -(-span // tile))
    return max(1, min(want, span))


def attention_scratch_shapes(
    grid: AttentionGrid, batch: int, num_heads: int, n_q: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int]]:
    """Shapes of the scratch a flash-decoding launch of ``grid`` needs.

    ``(part_acc, part_stats, counters)``: float32 ``[batch, num_heads, n_q, splits,
    head_dim]`` partial accumulators, float32 ``[batch, num_heads, n_q, splits, 2]``
    partial (maximum, sum) pairs, and int32 ``[tasks, chunks]`` counters, which must be
    zero before a launch (the kernel leaves them at zero).

    >>> attention_scratch_shapes(AttentionGrid(3, 2, 1), 1, 8, 1, 16)
    ((1, 8, 1, 3, 16), (1, 8, 1, 3, 2), (2, 1))
    """
    return (
        (batch, num_heads, n_q, grid.splits, head_dim),
        (batch, num_heads, n_q, grid.splits, 2),
        (grid.tasks, grid.chunks),
    )


def append_config(rows: int, head_dim: int, vec: int) -> tuple[int, tuple[int, int]]:
    """``(blocks, (lanes, rows_per_block))`` for :func:`nbkv.kernels.cuda.write_rows_kernel`
    over ``rows`` rows of ``head_dim`` elements, ``vec`` a lane: ``THREADS_PER_BLOCK``
    threads a block, lanes a power of two covering a row's ``head_dim / vec`` pieces.

    >>> append_config(8, 128, 8)      # one decode token, 8 KV heads, fp16: 16 lanes a row
    (1, (16, 16))
    """
    pieces = max(1, head_dim // vec)
    lanes = 1
    while lanes < pieces and lanes < _config.THREADS_PER_BLOCK:
        lanes *= 2
    per_block = max(1, _config.THREADS_PER_BLOCK // lanes)
    blocks = min(max(1, math.ceil(rows / per_block)), _config.MAX_BLOCKS)
    return blocks, (lanes, per_block)
