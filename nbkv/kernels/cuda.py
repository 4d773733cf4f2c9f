"""CUDA (``@cuda.jit``) twins of :mod:`nbkv.kernels.cpu`.

Same stems and argument order as the CPU kernels, with ``_kernel`` appended. One thread
copies one element of K and the matching element of V (so one launch writes both), in a
grid-stride loop. Consecutive threads take consecutive elements in the cache's memory
order (``head_dim`` fastest), so the reads of a C-contiguous input and the writes into the
cache are coalesced. 16-bit floats travel as ``uint16`` bit patterns, as on the CPU.

Launch them with :func:`nbkv.launch_config`, or any 1-D grid: the loop covers
every element whatever the grid size.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

__all__ = [
    "write_rows_kernel",
    "unravel",
    "write_cache_kernel",
    "write_cache_bshd_kernel",
    "write_kv_kernel",
    "write_kv_bshd_kernel",
]


@cuda.jit(device=True, inline=True)
def unravel(i, n1, n2, n3):
    """Split a flat index over [n0, n1, n2, n3] (C order) into its four indices.

    A device function: callable from your own ``@cuda.jit`` kernels."""
    i3 = i % n3
    rest = i // n3
    i2 = rest % n2
    rest = rest // n2
    i1 = rest % n1
    return rest // n1, i1, i2, i3


@cuda.jit
def write_cache_kernel(x, pos, cache):
    """Copy ``x`` into ``cache`` at positions ``[pos, pos + n)``; layout "bhsd".

    x: shape [batch, num_kv_heads, n, head_dim], any strides.
    cache: shape [batch, num_kv_heads, max_seq_len, head_dim]. Mutated.
    """
    batch, heads, n, dim = x.shape
    for i in range(cuda.grid(1), batch * heads * n * dim, cuda.gridsize(1)):
        b, h, s, d = unravel(i, heads, n, dim)
        cache[b, h, pos + s, d] = x[b, h, s, d]


@cuda.jit
def write_cache_bshd_kernel(x, pos, cache):
    """Copy ``x`` into ``cache`` at positions ``[pos, pos + n)``; layout "bshd".

    x: shape [batch, n, num_kv_heads, head_dim], any strides.
    cache: shape [batch, max_seq_len, num_kv_heads, head_dim]. Mutated.
    """
    batch, n, heads, dim = x.shape
    for i in range(cuda.grid(1), batch * n * heads * dim, cuda.gridsize(1)):
        b, s, h, d = unravel(i, n, heads, dim)
        cache[b, pos + s, h, d] = x[b, s, h, d]


@cuda.jit
def write_kv_kernel(k, v, pos, k_cache, v_cache):
    """Write new keys and values at positions ``[pos, pos + n)``; layout "bhsd".

    k, v: shape [batch, num_kv_heads, n, head_dim], any strides.
    k_cache, v_cache: shape [batch, num_kv_heads, max_seq_len, head_dim]. Mutated.
    """
    batch, heads, n, dim = k.shape
    for i in range(cuda.grid(1), batch * heads * n * dim, cuda.gridsize(1)):
        b, h, s, d = unravel(i, heads, n, dim)
        k_cache[b, h, pos + s, d] = k[b, h, s, d]
        v_cache[b, h, pos + s, d] = v[b, h, s, d]


@cuda.jit
def write_kv_bshd_kernel(k, v, pos, k_cache, v_cache):
    """Write new keys and values at positions ``[pos, pos + n)``; layout "bshd".

    k, v: shape [batch, n, num_kv_heads, head_dim], any strides.
    k_cache, v_cache: shape [batch, max_seq_len, num_kv_heads, head_dim]. Mutated.
    """
    batch, n, heads, dim = k.shape
    for i in range(cuda.grid(1), batch * n * heads * dim, cuda.gridsize(1)):
        b, s, h, d = unravel(i, n, heads, dim)
        k_cache[b, pos + s, h, d] = k[b, s, h, d]
        v_cache[b, pos + s, h, d] = v[b, s, h, d]


# -- the append, row by row: no division per element, vector accesses ------------------
#
# The kernels above divide a flat index into four per element (64-bit divisions, tens of
# instructions each). The backend's append uses these instead: a 2-D block of
# (ROW_LANES, rows) threads; each row (one position of one KV head of one batch row) is
# found by two 32-bit divisions, and its lanes copy ``vec`` consecutive elements each as
# one vector access (16 bytes where alignment allows), neighbouring lanes on
# neighbouring addresses. Launch them with :func:`nbkv.launch.append_config`.

_ROW_KERNELS: dict[tuple, object] = {}


def write_rows_kernel(vec: int, bshd: bool, pair: bool):
    """The row-wise copy kernel: ``kernel[append_config(...)](k, v, pos, k_cache,
    v_cache)`` (``pair``) or ``(x, pos, cache)``, copying ``vec`` elements a lane.

    Shapes as :func:`write_kv_kernel` (``bshd``: as :func:`write_kv_bshd_kernel`);
    ``head_dim`` a multiple of ``vec``, and every array aligned to ``vec`` elements
    (:func:`nbkv.kernels.cuda_vec.vector_width` checks); fewer than 2**32 rows.
    """
    key = (vec, bshd, pair)
    if key in _ROW_KERNELS:
        return _ROW_KERNELS[key]
    from .cuda_vec import copier

    copy = copier(vec)

    @cuda.jit(device=True, inline=True)
    def row_of(x, row):
        """(batch, the first index after it, the second) of a row, and the position."""
        n1, n2 = np.uint32(x.shape[1]), np.uint32(x.shape[2])
        rest = row // n2
        i2 = row - rest * n2
        i0 = rest // n1
        return i0, rest - i0 * n1, i2

    @cuda.jit(device=True, inline=True)
    def rows_of(x):
        return np.uint32(x.shape[0] * x.shape[1] * x.shape[2])

    @cuda.jit(device=True, inline=True)
    def start():
        return np.uint32(cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y)

    @cuda.jit(device=True, inline=True)
    def stride():
        return np.uint32(cuda.gridDim.x * cuda.blockDim.y)

    if pair:

        def kernel(k, v, pos, k_cache, v_cache):
            lanes = np.uint32(k.shape[3] // vec)
            rows = rows_of(k)
            row = start()
            while row < rows:
                i0, i1, i2 = row_of(k, row)
                lane = np.uint32(cuda.threadIdx.x)
                while lane < lanes:
                    d = lane * np.uint32(vec)
                    if bshd:  # (batch, position, head)
                        src, dst = (i0, i1, i2, d), (i0, pos + i1, i2, d)
                    else:  # (batch, head, position)
                        src, dst = (i0, i1, i2, d), (i0, i1, pos + i2, d)
                    copy(k, src, k_cache, dst)
                    copy(v, src, v_cache, dst)
                    lane += np.uint32(cuda.blockDim.x)
                row += stride()

    else:

        def kernel(x, pos, cache):
            lanes = np.uint32(x.shape[3] // vec)
            rows = rows_of(x)
            row = start()
            while row < rows:
                i0, i1, i2 = row_of(x, row)
                lane = np.uint32(cuda.threadIdx.x)
                while lane < lanes:
                    d = lane * np.uint32(vec)
                    if bshd:
                        src, dst = (i0, i1, i2, d), (i0, pos + i1, i2, d)
                    else:
                        src, dst = (i0, i1, i2, d), (i0, i1, pos + i2, d)
                    copy(x, src, cache, dst)
                    lane += np.uint32(cuda.blockDim.x)
                row += stride()

    kernel.__doc__ = write_rows_kernel.__doc__
    compiled = cuda.jit(kernel)
    _ROW_KERNELS[key] = compiled
    return compiled
