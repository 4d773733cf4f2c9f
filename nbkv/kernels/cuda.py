"""CUDA (``@cuda.jit``) twins of :mod:`nbkv.kernels.cpu`.

Same stems and argument order as the CPU kernels, with ``_kernel`` appended. One thread
copies one element of K and the matching element of V (so one launch writes both), in a
grid-stride loop. Consecutive threads take consecutive elements in the cache's memory
order (``head_dim`` fastest), so the reads of a C-contiguous input and the writes into the
cache are coalesced. 16-bit floats travel as ``uint16`` bit patterns, as on the CPU.

Launch them with :func:`nbkv.backends.launch_config`, or any 1-D grid: the loop covers
every element whatever the grid size.
"""

from __future__ import annotations

from numba import cuda

__all__ = [
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
