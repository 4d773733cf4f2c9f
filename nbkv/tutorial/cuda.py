"""Helpers for ``notebooks/05_cuda_kernels.ipynb``: the flash-decoding kernel, launched by hand.

:func:`launch_attention` does what nbkv's CUDA backend does for ``nbkv.attention``, in
the open: it sizes the grid with :func:`nbkv.attention_grid`, allocates the scratch that
:func:`nbkv.launch.attention_scratch_shapes` names, launches
``nbkv.kernels.cuda_attention.attend_kernel`` and returns everything on the host,
the per-split partial results included, so that a reader can look inside the combine.
It needs a GPU or the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` before Numba is
imported).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..backends import to_host
from ..errors import InvalidArgumentError, ShapeMismatchError
from ..launch import AttentionGrid, attention_grid, attention_scratch_shapes

__all__ = ["Launch", "launch_attention"]


class Launch(NamedTuple):
    """One hand-made launch: its grid, the output and the scratch, on the host."""

    grid: AttentionGrid
    threads: int  # per block
    out: np.ndarray  # [batch, num_heads, n_q, head_dim] float32
    part_acc: np.ndarray  # [batch, num_heads, n_q, splits, head_dim]: each split's sum
    part_stats: np.ndarray  # [batch, num_heads, n_q, splits, 2]: (running max, sum)
    counters: np.ndarray  # [tasks, chunks]: back at zero after the launch


def launch_attention(
    q: np.ndarray,
    K: np.ndarray,
    V: np.ndarray,
    *,
    causal: bool = True,
    window: int | None = None,
    splits: int | None = None,
    sm_count: int = 1,
) -> Launch:
    """Launch ``attend_kernel`` over float32 host arrays, as nbkv's backend would.

    ``q``: [batch, num_heads, n_q, head_dim]; ``K``, ``V``: [batch, num_kv_heads,
    seq_len, head_dim] ("bhsd"), every position held. ``splits`` forces the number of
    splits (None: as the backend chooses for ``sm_count`` SMs).

    Raises
    ------
    ShapeMismatchError, InvalidArgumentError
        Arrays that are not float32 4-D of agreeing sizes, a window that is not positive.
    """
    from numba import cuda

    from ..kernels import cuda_attention

    q, K, V = (np.ascontiguousarray(x) for x in (q, K, V))
    if not all(x.ndim == 4 and x.dtype == np.float32 for x in (q, K, V)):
        raise ShapeMismatchError("q, K and V must be float32 4-D arrays")
    batch, num_heads, n_q, dim = q.shape
    if K.shape != V.shape or K.shape[0] != batch or K.shape[3] != dim:
        raise ShapeMismatchError(f"K {K.shape} and V {V.shape} do not fit q {q.shape}")
    seq_len, kv_heads = K.shape[2], K.shape[1]
    if window is not None and window < 1:
        raise InvalidArgumentError(f"window must be None or a positive int, got {window}")
    win = 0 if window is None or window >= seq_len else int(window)
    span = seq_len - (max(0, seq_len - n_q - win + 1) if win else 0)
    grid = attention_grid(
        batch, num_heads, kv_heads, n_q, span, sm_count=sm_count, tile=cuda_attention.TILE,
        splits=splits,
    )  # fmt: skip
    acc_shape, stats_shape, counters_shape = attention_scratch_shapes(
        grid, batch, num_heads, n_q, dim
    )
    part_acc = cuda.device_array(acc_shape, np.float32)
    part_stats = cuda.device_array(stats_shape, np.float32)
    counters = cuda.to_device(np.zeros(counters_shape, np.int32))  # must start at zero
    out = cuda.device_array(q.shape, np.float32)
    table = cuda.to_device(np.empty(0, np.float32))  # float32 K/V: no widening table
    cuda_attention.attend_kernel[tuple(grid), cuda_attention.THREADS](
        cuda.to_device(q), cuda.to_device(K), cuda.to_device(V), seq_len,
        1.0 / math.sqrt(dim), bool(causal), win, table, part_acc, part_stats, counters, out,
    )  # fmt: skip
    return Launch(
        grid,
        cuda_attention.THREADS,
        to_host(out),
        to_host(part_acc),
        to_host(part_stats),
        to_host(counters),
    )
