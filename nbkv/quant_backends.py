"""The quantized half of the backends: what :class:`nbkv.QuantizedKVCache` asks of a
device, for the CPU (:mod:`nbkv.kernels.cpu_quant`) and CUDA (:mod:`nbkv.quant_cuda`).

A quantized layer's storage (:class:`QStorage`) is eight arrays on the device, in kernel
form, always ``[batch, num_kv_heads, ...]`` whatever the cache's layout (see
:mod:`nbkv.kernels.cpu_quant` for each array's shape and meaning). :func:`quant_backend`
gives the object that runs the kernels over it for a plain backend
(:func:`nbkv.backends.get_backend`), chosen once, when the cache is built.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

from . import _config
from .kernels import cpu_quant

__all__ = ["QStorage", "QuantBackend", "CPUQuant", "CodesReader", "quant_backend"]


class QStorage(NamedTuple):
    """One quantized layer's arrays on its device (kernel form)."""

    k_codes: Any  # uint8 [batch, heads, n_groups * G, k_row]
    k_scale: Any  # uint16 bits [batch, heads, n_groups, head_dim]
    k_zero: Any
    v_codes: Any  # uint8 [batch, heads, n_groups * G, v_row]
    v_scale: Any  # uint16 bits [batch, heads, n_groups * G, head_dim // Gv]
    v_zero: Any
    k_win: Any  # [batch, heads, W, head_dim], the cache's dtype (16-bit as uint16)
    v_win: Any


class QuantBackend(Protocol):
    """What a quantized cache asks of its device. ``st`` is a :class:`QStorage`; ``k``,
    ``v``, ``k_out``, ``v_out`` are kernel-form arrays on the device in the cache's
    layout (``[batch, heads, n, head_dim]`` for "bhsd", ``[batch, n, heads, head_dim]``
    for "bshd"); ``bits`` is ``(k_bits, v_bits)``; ``kind`` the 16-bit type of the scales
    (0 float16, 1 bfloat16) and ``table`` its widening table on the device."""

    name: str

    def append(self, k, v, held, q_len, new_q, bits, group, v_group, kind, table, st) -> None:
        """Quantize the groups ``[q_len, new_q)``, then put the new positions past
        ``new_q`` in the window (:func:`nbkv.kernels.cpu_quant.quant_append`)."""

    def dequantize(self, st, q_len, p0, p1, bits, kind, table, k_out, v_out, layout) -> None:
        """Positions ``[p0, p1)`` as ``get_kv`` gives them, into ``k_out``, ``v_out``
        (:func:`nbkv.kernels.cpu_quant.dequantize`), which are in ``layout`` ("bhsd"
        when they are views of the window itself, as a crop writes)."""

    def attend(self, q, st, q_len, seq_len, bits, scale, causal, window, table, out) -> None:
        """Attention of ``q`` [batch, num_heads, n_q, head_dim] over the codes and the
        window; writes ``out`` (:func:`nbkv.kernels.cpu_quant.attend_quant`)."""

    def copy_row(self, src: Any, r: int, dst: Any, i: int) -> None:
        """``dst[i] = src[r]`` along the leading (batch) axis, on the device."""


def _bhsd(x, bshd: bool):
    return x.transpose(0, 2, 1, 3) if bshd else x


class CPUQuant:
    """The ``@njit`` kernels of :mod:`nbkv.kernels.cpu_quant` on host arrays."""

    name = "cpu"

    def __init__(self, layout: str) -> None:
        self._bshd = layout == "bshd"  # the kernels read any strides: a transposed view

    def append(self, k, v, held, q_len, new_q, bits, group, v_group, kind, table, st) -> None:
        k, v = _bhsd(k, self._bshd), _bhsd(v, self._bshd)
        cpu_quant.quant_append(
            k, v, held, q_len, new_q, bits[0], bits[1], group, v_group, kind, table, *st
        )

    def dequantize(self, st, q_len, p0, p1, bits, kind, table, k_out, v_out, layout) -> None:
        bshd = layout == "bshd"
        k_out, v_out = _bhsd(k_out, bshd), _bhsd(v_out, bshd)
        cpu_quant.dequantize(
            *st, q_len, p0, p1, bits[0], bits[1], kind, table, k_out, v_out
        )  # fmt: skip

    def attend(self, q, st, q_len, seq_len, bits, scale, causal, window, table, out) -> None:
        batch, num_heads, n_q, dim = q.shape
        # the work to split, as contiguous attention counts it: small work stays serial
        span = seq_len if window <= 0 else min(seq_len, window + n_q - 1)
        parallel = batch * num_heads * n_q * span * dim >= _config.ATTENTION_PARALLEL_MIN
        kernel = cpu_quant.attend_quant if parallel else cpu_quant.attend_quant_serial
        kernel(
            q, *st, q_len, seq_len, bits[0], bits[1], scale, causal, window, table, out
        )  # fmt: skip

    @staticmethod
    def copy_row(src: np.ndarray, r: int, dst: np.ndarray, i: int) -> None:
        dst[i] = src[r]


def quant_backend(backend: Any) -> QuantBackend:
    """The quantized kernels for ``backend``'s device (CPU, or CUDA / its simulator)
    and layout."""
    if backend.name == "cpu":
        return CPUQuant(backend.layout)
    from .quant_cuda import CUDAQuant

    return CUDAQuant(backend)


class CodesReader:
    """What attention sees as a quantized cache's backend: the plain backend in all but
    ``attend``, which reads the codes (``k_cache`` is the :class:`QStorage`, ``v_cache``
    None), and ``attention_table``, the scales' widening table."""

    def __init__(self, backend, qbe, q_len: int, bits: tuple[int, int], table) -> None:
        self._be, self._qbe, self._q_len, self._bits, self._table = (
            backend, qbe, q_len, bits, table,
        )  # fmt: skip

    def __getattr__(self, name: str):
        return getattr(self._be, name)  # checks, arrays, adopt, finish: the plain ones

    def attention_table(self, dtype: np.dtype):
        return self._table

    def attend(self, q, k_cache, v_cache, seq_len, scale, causal, window, table, out) -> None:
        self._qbe.attend(
            q, k_cache, self._q_len, seq_len, self._bits, scale, causal, window, table, out
        )  # fmt: skip
