"""CPU (``@njit``) kernels: strided copies of new K/V positions into a cache.

Array parameters carry their shape; ``n`` is the number of new positions. Every kernel
mutates only its last argument(s), named in its docstring.
"""

from __future__ import annotations

from numba import njit

__all__ = ["write_cache", "write_cache_bshd", "write_kv", "write_kv_bshd"]

# elements per K (or V) write below which write_kv copies K and V head by head in one
# pass (decode steps); above it, one pass per array streams faster (prefill)
_SMALL_WRITE = 4096


@njit(cache=True, nogil=True)
def write_cache(x, pos, cache):
    """Copy ``x`` into ``cache`` at positions ``[pos, pos + n)``; layout "bhsd".

    x: shape [batch, num_kv_heads, n, head_dim], any strides, any dtype.
    pos: first position written.
    cache: shape [batch, num_kv_heads, max_seq_len, head_dim], same dtype. Mutated.
    """
    batch, heads, n, dim = x.shape
    for b in range(batch):
        for h in range(heads):
            # 2-D views of one head: [n, head_dim] in, [n, head_dim] of the cache out;
            # looping over them (not the 4-D arrays) lets LLVM vectorise the copy
            src = x[b, h]
            dst = cache[b, h, pos : pos + n]
            for s in range(n):
                for d in range(dim):
                    dst[s, d] = src[s, d]


@njit(cache=True, nogil=True)
def write_cache_bshd(x, pos, cache):
    """Copy ``x`` into ``cache`` at positions ``[pos, pos + n)``; layout "bshd".

    x: shape [batch, n, num_kv_heads, head_dim], any strides, any dtype.
    pos: first position written.
    cache: shape [batch, max_seq_len, num_kv_heads, head_dim], same dtype. Mutated.
    """
    batch, n, heads, dim = x.shape
    for b in range(batch):
        # 3-D views of one batch row: [n, num_kv_heads, head_dim] in and out; in "bshd"
        # the new positions of one row are a single contiguous block of the cache
        src = x[b]
        dst = cache[b, pos : pos + n]
        for s in range(n):
            for h in range(heads):
                for d in range(dim):
                    dst[s, h, d] = src[s, h, d]


@njit(cache=True, nogil=True)
def write_kv(k, v, pos, k_cache, v_cache):
    """Write new keys and values at positions ``[pos, pos + n)``; layout "bhsd".

    k, v: shape [batch, num_kv_heads, n, head_dim], any strides.
    pos: first position written.
    k_cache, v_cache: shape [batch, num_kv_heads, max_seq_len, head_dim]. Mutated.
    """
    batch, heads, n, dim = k.shape
    if n * dim > _SMALL_WRITE:
        # prefill-sized: one streaming pass over K, then one over V (measured faster
        # than alternating between the two streams head by head)
        write_cache(k, pos, k_cache)
        write_cache(v, pos, v_cache)
        return
    # decode-sized: one pass over the heads, each head's K and V rows together
    for b in range(batch):
        for h in range(heads):
            k_src, v_src = k[b, h], v[b, h]
            k_dst, v_dst = k_cache[b, h, pos : pos + n], v_cache[b, h, pos : pos + n]
            for s in range(n):
                for d in range(dim):
                    k_dst[s, d] = k_src[s, d]
                for d in range(dim):
                    v_dst[s, d] = v_src[s, d]


@njit(cache=True, nogil=True)
def write_kv_bshd(k, v, pos, k_cache, v_cache):
    """Write new keys and values at positions ``[pos, pos + n)``; layout "bshd".

    k, v: shape [batch, n, num_kv_heads, head_dim], any strides.
    pos: first position written.
    k_cache, v_cache: shape [batch, max_seq_len, num_kv_heads, head_dim]. Mutated.
    """
    batch, n, heads, dim = k.shape
    if n * heads * dim > _SMALL_WRITE:
        write_cache_bshd(k, pos, k_cache)
        write_cache_bshd(v, pos, v_cache)
        return
    for b in range(batch):
        k_src, v_src = k[b], v[b]
        k_dst, v_dst = k_cache[b, pos : pos + n], v_cache[b, pos : pos + n]
        for s in range(n):
            for h in range(heads):
                for d in range(dim):
                    k_dst[s, h, d] = k_src[s, h, d]
                for d in range(dim):
                    v_dst[s, h, d] = v_src[s, h, d]
