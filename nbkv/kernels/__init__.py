"""Numba kernels that write K/V into preallocated caches, for use in your own ``@njit`` code.

The CPU kernels here are ordinary ``numba.njit`` functions: call them from Python or from
inside your own ``@njit`` decode loop. They are pure functions over arrays: they never
allocate, never validate, return nothing, and write only the arrays named last.

Layouts: ``write_kv`` / ``write_cache`` take ``[batch, num_kv_heads, seq, head_dim]``
arrays ("bhsd"); the ``_bshd`` twins take ``[batch, seq, num_kv_heads, head_dim]``. Inputs
may have any strides (a transposed view works without a copy).

16-bit floats: Numba's CPU target has no float16 type, so pass 16-bit data (float16,
bfloat16) as ``uint16`` bit patterns, ``x.view(np.uint16)``; the copy is bit-exact.

No bounds are checked (kernels never validate): ``pos + seq`` must not exceed the cache's
capacity. Set ``NUMBA_BOUNDSCHECK=1`` while developing to catch mistakes.

Example
-------
>>> import numpy as np
>>> from numba import njit
>>> from nbkv.kernels import write_kv
>>> k_cache = np.zeros((1, 2, 16, 4), np.float32)
>>> v_cache = np.zeros((1, 2, 16, 4), np.float32)
>>> @njit
... def decode(ks, vs, start, k_cache, v_cache):
...     for t in range(ks.shape[2]):  # one position per step, as a decoder would
...         write_kv(ks[:, :, t : t + 1], vs[:, :, t : t + 1], start + t, k_cache, v_cache)
...     return start + ks.shape[2]
>>> ks = np.ones((1, 2, 3, 4), np.float32)
>>> decode(ks, 2 * ks, 5, k_cache, v_cache)
8
>>> float(v_cache[0, 1, 7, 0])
2.0

Attention: ``attend(q, k_cache, v_cache, seq_len, scale, causal, window, table, out)``
(parallel over batch rows and KV heads) and ``append_attend`` (write, then attend, in one
call); ``table`` is :func:`nbkv.dtypes.widen_table` of the cache's dtype (empty unless
16-bit). See :mod:`nbkv.kernels.cpu_attention`.

The CUDA twins (``write_kv_kernel``, ``attend_kernel`` ...) live in
:mod:`nbkv.kernels.cuda` and :mod:`nbkv.kernels.cuda_attention`, imported only on demand
since they need numba-cuda.
"""

from .cpu import write_cache, write_cache_bshd, write_kv, write_kv_bshd
from .cpu_attention import append_attend, append_attend_bshd, attend, attend_bshd
from .cpu_paged import (
    copy_blocks,
    paged_attend,
    paged_attend_hnd,
    paged_attend_hnd_serial,
    paged_attend_serial,
    write_paged,
    write_paged_hnd,
)

__all__ = [
    "write_kv",
    "write_kv_bshd",
    "write_cache",
    "write_cache_bshd",
    "attend",
    "attend_bshd",
    "append_attend",
    "append_attend_bshd",
    "write_paged",
    "write_paged_hnd",
    "paged_attend",
    "paged_attend_hnd",
    "paged_attend_serial",
    "paged_attend_hnd_serial",
    "copy_blocks",
]
