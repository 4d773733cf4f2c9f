"""The plain loops of the CPU attention's passes, where the vector IR of
:mod:`nbkv.kernels.cpu_simd` does not apply (float64, head_dim not a multiple of 16,
strided rows): a 4 x 4 tile of scores and a 4 x 8 update of the accumulators, which LLVM
vectorises along head_dim. Used by :mod:`nbkv.kernels.cpu_attention`; checked against
the vector paths by ``tests/test_cpu_simd.py``.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.core import types
from numba.extending import overload

from .. import _config
from .cpu_math import widen16

__all__ = ["accumulate_4x8", "scores_4x4", "value_of"]


def value_of(x, kind):
    """A stored element as the arithmetic sees it: 16-bit bits widened by
    :func:`nbkv.kernels.cpu_math.widen16` (``kind`` 0 float16, 1 bfloat16), 8-bit codes as
    float32, floats as they are."""
    raise NotImplementedError  # pragma: no cover - only called from compiled code


@overload(value_of, jit_options={"cache": True})
def _value_of_impl(x, kind):
    if x == types.uint16:
        return lambda x, kind: widen16(x, kind)
    if x == types.uint8:  # 8-bit codes: their integer values
        return lambda x, kind: np.float32(x)
    return lambda x, kind: x


@njit(cache=True, fastmath=_config.FASTMATH)
def scores_4x4(qs, kb, s, c0, kind, r, j):
    """The plain loop's pass of :func:`nbkv.kernels.cpu_attention._scores`: query rows
    ``r .. r + 3`` against K rows ``j .. j + 3``, sixteen sums in flight, vectorised by
    LLVM along head_dim."""
    dim = qs.shape[1]
    q0, q1, q2, q3 = qs[r], qs[r + 1], qs[r + 2], qs[r + 3]
    ka, kc, ke, kg = kb[j], kb[j + 1], kb[j + 2], kb[j + 3]
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = qs.dtype.type(0.0)
    c_0 = c_1 = c_2 = c_3 = e0 = e1 = e2 = e3 = qs.dtype.type(0.0)
    for d in range(dim):
        x, y, z, u = (
            value_of(ka[d], kind),
            value_of(kc[d], kind),
            value_of(ke[d], kind),
            value_of(kg[d], kind),
        )
        p0, p1, p2, p3 = q0[d], q1[d], q2[d], q3[d]
        a0 += p0 * x
        a1 += p1 * x
        a2 += p2 * x
        a3 += p3 * x
        b0 += p0 * y
        b1 += p1 * y
        b2 += p2 * y
        b3 += p3 * y
        c_0 += p0 * z
        c_1 += p1 * z
        c_2 += p2 * z
        c_3 += p3 * z
        e0 += p0 * u
        e1 += p1 * u
        e2 += p2 * u
        e3 += p3 * u
    j_ = c0 + j
    s[r, j_], s[r + 1, j_], s[r + 2, j_], s[r + 3, j_] = a0, a1, a2, a3
    s[r, j_ + 1], s[r + 1, j_ + 1], s[r + 2, j_ + 1], s[r + 3, j_ + 1] = b0, b1, b2, b3
    s[r, j_ + 2], s[r + 1, j_ + 2], s[r + 2, j_ + 2], s[r + 3, j_ + 2] = c_0, c_1, c_2, c_3
    s[r, j_ + 3], s[r + 1, j_ + 3], s[r + 2, j_ + 3], s[r + 3, j_ + 3] = e0, e1, e2, e3


@njit(cache=True, fastmath=_config.FASTMATH)
def accumulate_4x8(s, vb, acc, c0, kind, r, j):
    """The plain loop's pass of :func:`nbkv.kernels.cpu_attention._accumulate`: V rows
    ``j .. j + 7`` weighted into accumulator rows ``r .. r + 3``."""
    dim = acc.shape[1]
    a0, a1, a2, a3 = acc[r], acc[r + 1], acc[r + 2], acc[r + 3]
    s0, s1, s2, s3 = s[r], s[r + 1], s[r + 2], s[r + 3]
    v0, v1, v2, v3 = vb[j], vb[j + 1], vb[j + 2], vb[j + 3]
    v4, v5, v6, v7 = vb[j + 4], vb[j + 5], vb[j + 6], vb[j + 7]
    k = c0 + j
    w00, w01, w02, w03 = s0[k], s0[k + 1], s0[k + 2], s0[k + 3]
    w04, w05, w06, w07 = s0[k + 4], s0[k + 5], s0[k + 6], s0[k + 7]
    w10, w11, w12, w13 = s1[k], s1[k + 1], s1[k + 2], s1[k + 3]
    w14, w15, w16, w17 = s1[k + 4], s1[k + 5], s1[k + 6], s1[k + 7]
    w20, w21, w22, w23 = s2[k], s2[k + 1], s2[k + 2], s2[k + 3]
    w24, w25, w26, w27 = s2[k + 4], s2[k + 5], s2[k + 6], s2[k + 7]
    w30, w31, w32, w33 = s3[k], s3[k + 1], s3[k + 2], s3[k + 3]
    w34, w35, w36, w37 = s3[k + 4], s3[k + 5], s3[k + 6], s3[k + 7]
    for d in range(dim):
        # four running sums, each a chain of eight fused multiply-adds (one
        # expression per row was 18% slower: a multiply and an add more)
        t0, t1, t2, t3 = a0[d], a1[d], a2[d], a3[d]
        x = value_of(v0[d], kind)
        t0 += w00 * x
        t1 += w10 * x
        t2 += w20 * x
        t3 += w30 * x
        x = value_of(v1[d], kind)
        t0 += w01 * x
        t1 += w11 * x
        t2 += w21 * x
        t3 += w31 * x
        x = value_of(v2[d], kind)
        t0 += w02 * x
        t1 += w12 * x
        t2 += w22 * x
        t3 += w32 * x
        x = value_of(v3[d], kind)
        t0 += w03 * x
        t1 += w13 * x
        t2 += w23 * x
        t3 += w33 * x
        x = value_of(v4[d], kind)
        t0 += w04 * x
        t1 += w14 * x
        t2 += w24 * x
        t3 += w34 * x
        x = value_of(v5[d], kind)
        t0 += w05 * x
        t1 += w15 * x
        t2 += w25 * x
        t3 += w35 * x
        x = value_of(v6[d], kind)
        t0 += w06 * x
        t1 += w16 * x
        t2 += w26 * x
        t3 += w36 * x
        x = value_of(v7[d], kind)
        t0 += w07 * x
        t1 += w17 * x
        t2 += w27 * x
        t3 += w37 * x
        a0[d], a1[d], a2[d], a3[d] = t0, t1, t2, t3
