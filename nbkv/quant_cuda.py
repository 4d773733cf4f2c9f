"""The quantized cache's kernels on CUDA: the host side of :mod:`nbkv.kernels.cuda_quant`.

:class:`CUDAQuant` implements :class:`nbkv.quant_backends.QuantBackend` for a
:class:`nbkv.cuda_backend.CUDABackend`: every array it is given is a device array in kernel
form (16-bit floats as uint16 bits); it sizes each launch, picks the kernel of the
backend's layout once, and never copies between host and device.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import InvalidArgumentError
from .launch import launch_config

__all__ = ["CUDAQuant"]

_GRID_X = 2**31 - 1  # CUDA's limits on gridDim.x and on gridDim.y
_GRID_Y = 65_535
_INDEX = 2**31  # the kernels index positions and elements in 32 bits


def _check_grid(tasks: int, y: int, what: str) -> None:
    if tasks > _GRID_X:
        raise InvalidArgumentError(
            f"batch x heads = {tasks} is more blocks than CUDA's grid allows ({_GRID_X})"
        )
    if y > _GRID_Y:
        raise InvalidArgumentError(
            f"{what} = {y} is more blocks than CUDA allows in a grid's y ({_GRID_Y}); "
            "attend with fewer queries at a time"
        )


def _check_index(st: Any) -> None:
    """Positions and row elements the kernels count in unsigned 32-bit ints."""
    batch, heads, coded, _ = (int(x) for x in st.k_codes.shape)
    w, dim = int(st.k_win.shape[2]), int(st.k_win.shape[3])
    if (coded + w) * max(dim, 1) >= _INDEX:
        raise InvalidArgumentError(
            f"a quantized layer of {coded} coded positions, a window of {w} and head_dim "
            f"{dim} is beyond the CUDA kernels' 32-bit indices (positions x head_dim < 2**31)"
        )


class CUDAQuant:
    """The ``@cuda.jit`` kernels of :mod:`nbkv.kernels.cuda_quant` for one
    :class:`nbkv.cuda_backend.CUDABackend` (its ``layout`` picks the append kernel).

    Launch geometry: ``append`` runs ``(batch * heads, splits)`` blocks of
    :data:`~nbkv.kernels.cuda_quant.THREADS`, one split per group to quantize (one if
    none); ``dequantize`` a grid-stride launch (:func:`nbkv.launch.launch_config`);
    ``attend`` ``(batch * num_kv_heads, ceil(group * n_q / ROWS))`` blocks.
    """

    name = "cuda"

    def __init__(self, backend: Any) -> None:
        from numba import cuda

        from .kernels import cuda_quant  # compiled on first use

        self._k = cuda_quant
        self._cuda = cuda
        self._bshd = backend.layout == "bshd"
        self._append = (
            cuda_quant.quant_append_bshd_kernel if self._bshd else cuda_quant.quant_append_kernel
        )
        self._dequantize = {
            "bhsd": cuda_quant.dequantize_kernel,
            "bshd": cuda_quant.dequantize_bshd_kernel,
        }

    def append(self, k, v, held, q_len, new_q, bits, group, v_group, kind, table, st) -> None:
        """Quantize the groups ``[q_len, new_q)``, then put the new positions past
        ``new_q`` in the window (one launch)."""
        batch, heads = int(st.k_codes.shape[0]), int(st.k_codes.shape[1])
        n = int(k.shape[1] if self._bshd else k.shape[2])
        if n == 0 and new_q == q_len:
            return
        _check_index(st)
        # one split per group to quantize; more than the grid's y take turns in a block
        splits = min(max(1, (new_q - q_len) // group), _GRID_Y)
        _check_grid(batch * heads, 1, "splits")
        self._append[(batch * heads, splits), self._k.THREADS](
            k, v, held, q_len, new_q, bits[0], bits[1], group, v_group, kind, table, *st
        )  # fmt: skip

    def dequantize(self, st, q_len, p0, p1, bits, kind, table, k_out, v_out, layout) -> None:
        """Positions ``[p0, p1)`` as ``get_kv`` gives them into ``k_out``, ``v_out`` (in
        ``layout``), one grid-stride launch."""
        if p1 <= p0:
            return
        _check_index(st)
        batch, heads, dim = (int(x) for x in (st.k_codes.shape[0], st.k_codes.shape[1],
                                               st.k_win.shape[3]))  # fmt: skip
        blocks, threads = launch_config(batch * heads * (p1 - p0) * dim)
        self._dequantize[layout][blocks, threads](
            *st, q_len, p0, p1, bits[0], bits[1], kind, table, k_out, v_out
        )  # fmt: skip

    def attend(self, q, st, q_len, seq_len, bits, scale, causal, window, table, out) -> None:
        """Attention of ``q`` [batch, num_heads, n_q, head_dim] (float16, float32 or
        float64, on the device) over the codes and the window; writes ``out``.

        Raises
        ------
        InvalidArgumentError
            head_dim past ``MAX_HEAD_DIM``, or more query rows per KV head than one
            launch's grid holds.
        """
        batch, num_heads, n_q, dim = (int(x) for x in q.shape)
        kv_heads = int(st.k_codes.shape[1])
        if dim > self._k.MAX_HEAD_DIM:
            raise InvalidArgumentError(
                f"head_dim {dim} is larger than the CUDA quantized attention kernel's "
                f"{self._k.MAX_HEAD_DIM} (the tunable ATTENTION_MAX_HEAD_DIM)"
            )
        _check_index(st)
        chunks = math.ceil(num_heads // kv_heads * n_q / self._k.ROWS)
        _check_grid(batch * kv_heads, chunks, "query-row chunks (group x n_q / ROWS)")
        # a float32 scale keeps float64 out of the kernel
        self._k.attend_quant_kernel[(batch * kv_heads, chunks), self._k.THREADS](
            q, *st, q_len, seq_len, bits[0], bits[1], np.float32(scale), bool(causal),
            int(window), table, out,
        )  # fmt: skip

    def copy_row(self, src: Any, r: int, dst: Any, i: int) -> None:
        """``dst[i] = src[r]`` along the batch axis: one device-to-device copy (storage
        rows are contiguous), or the copy kernel for a strided pair."""
        a, b = src[r], dst[i]
        if a.is_c_contiguous() and b.is_c_contiguous():
            b.copy_to_device(a)
            return
        from .kernels import cuda as copy_kernels

        a, b = src[r : r + 1], dst[i : i + 1]
        blocks, threads = launch_config(int(np.prod(a.shape)))
        copy_kernels.write_cache_kernel[blocks, threads](a, 0, b)
