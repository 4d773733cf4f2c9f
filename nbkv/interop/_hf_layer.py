"""One decoder layer of :class:`~nbkv.interop.hf.NbkvCache`: :class:`NbkvLayer`.

A transformers cache layer over one :class:`nbkv.LayerKVCache` in layout ``"bhsd"``:
torch tensors cross into nbkv's buffers and back as views without a copy, and the batch
operations of generate (``reorder_cache``, ``batch_repeat_interleave``,
``batch_select_indices``) run on nbkv's copy kernel. Import it from
:mod:`nbkv.interop.hf`, which builds one per decoder layer.

Importing this module imports torch and transformers (``pip install "nbkv[hf]"``).
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from .._validate import positive_int
from ..cache import LayerKVCache
from ..errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
)

__all__ = ["NbkvLayer"]

# transformers 5 made crop's argument a count to remove (negative); 4.x took the length
# to keep (or, negative, a count to remove)
_CROP_REMOVES = "tokens_to_remove" in inspect.signature(DynamicLayer.crop).parameters


def _rows(indices: Any, name: str) -> np.ndarray:
    """Batch row indices (a tensor, array or sequence) as a 1-D host array."""
    if isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    try:
        rows = np.asarray(indices)
    except (TypeError, ValueError) as err:
        raise ArgumentTypeError(f"{name} must be 1-D batch row indices ({err})") from None
    if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iub"):
        raise ArgumentTypeError(
            f"{name} must be 1-D integer batch row indices (or a bool mask), got shape "
            f"{rows.shape} of dtype {rows.dtype}"
        )
    return rows


# -- one layer -------------------------------------------------------------------------


class NbkvLayer(CacheLayerMixin):
    """One decoder layer's cache: a transformers cache layer over a :class:`nbkv.LayerKVCache`.

    Built by :class:`nbkv.interop.hf.NbkvCache`; users rarely make one. ``keys`` and
    ``values`` are torch views, shape ``[batch, num_kv_heads, seq_len, head_dim]``, of the
    positions held.

    Parameters
    ----------
    layer : nbkv.LayerKVCache
        An allocated cache in layout "bhsd".
    dtype : torch.dtype
        The torch dtype of ``layer``'s storage dtype.
    device : torch.device
        ``cpu`` or ``cuda``, as ``layer.device``.
    """

    is_compileable = False  # nbkv's kernels are Numba launches torch.compile cannot trace
    is_croppable = True
    is_sliding = False
    supports_early_init = True

    def __init__(self, layer: LayerKVCache, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.nbkv = layer
        self.dtype = dtype
        self.device = device
        self._np_dtype = layer.dtype
        self.max_cache_len = layer.max_seq_len
        self.batch_size = self.max_batch_size = layer.batch
        self.num_heads = layer.num_kv_heads
        self.head_dim = layer.head_dim
        self.is_initialized = True  # the buffers were allocated with the cache
        self._refresh()

    def __repr__(self) -> str:
        return f"NbkvLayer({self.nbkv!r})"

    def __deepcopy__(self, memo: dict) -> NbkvLayer:
        return NbkvLayer(self.nbkv.copy(), self.dtype, self.device)

    # -- torch <-> nbkv, without copies ---------------------------------------------

    def _to_nbkv(self, x: Any, name: str) -> Any:
        """A tensor from the model as an array nbkv's append reads in place."""
        if not isinstance(x, torch.Tensor):
            raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device.type != self.device.type:
            raise DeviceMismatchError(
                f"{name} is on {x.device} but this NbkvCache lives on {self.device}; build "
                f"it with device={x.device.type!r}"
            )
        if x.dtype != self.dtype:
            raise DTypeMismatchError(
                f"{name} has dtype {x.dtype} but this NbkvCache holds {self.dtype}; build it "
                f"with dtype={x.dtype} (the model's dtype)"
            )
        if x.requires_grad:
            raise NotImplementedError(
                f"{name} requires grad, but NbkvCache stores values in nbkv buffers, which "
                f"carry no gradients; run the model under torch.no_grad() or "
                f"torch.inference_mode() (generate does)"
            )
        if self.device.type == "cuda":
            # Numba has no bfloat16 device array: a bf16 cache takes uint16 bit patterns
            return x.view(torch.uint16) if x.dtype == torch.bfloat16 else x
        if x.dtype == torch.bfloat16:
            # NumPy has no bfloat16 either: hand over the bits, seen as ml_dtypes' bfloat16
            return x.view(torch.int16).numpy().view(self._np_dtype)
        return x.numpy()

    def _to_torch(self, x: Any) -> torch.Tensor:
        """A view nbkv's get_kv returned as a torch tensor over the same memory."""
        if self.device.type == "cuda":
            t = torch.as_tensor(x, device=self.device)  # __cuda_array_interface__
            return t.view(torch.bfloat16) if self.dtype == torch.bfloat16 else t
        if self.dtype == torch.bfloat16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)

    def _refresh(self) -> None:
        """Point ``keys`` / ``values`` at the positions now held."""
        kv = self.nbkv.get_kv()
        if kv is None:
            shape = (self.batch_size, self.num_heads, 0, self.head_dim)
            self.keys = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.values = torch.empty(shape, dtype=self.dtype, device=self.device)
        else:
            self.keys, self.values = self._to_torch(kv[0]), self._to_torch(kv[1])

    def _check_batch(self, x: torch.Tensor, name: str) -> None:
        if x.ndim == 4 and x.shape[0] != self.batch_size:
            raise ShapeMismatchError(
                f"{name} has shape {tuple(x.shape)}: batch {x.shape[0]}, but this NbkvCache "
                f"was built with batch_size={self.batch_size}; build it with "
                f"batch_size={x.shape[0]} (generate runs batch x num_beams x "
                f"num_return_sequences rows)"
            )

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        k = self._to_nbkv(key_states, "key_states")
        v = self._to_nbkv(value_states, "value_states")
        self._check_batch(key_states, "key_states")
        self.nbkv.append(k, v)  # validates everything, then writes; raises leave it as it was

    # -- what transformers calls ----------------------------------------------------

    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None
    ) -> None:
        """Nothing to allocate (the buffers exist); check that ``key_states`` would fit."""
        self._to_nbkv(key_states, "key_states")
        self._check_batch(key_states, "key_states")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions; return views ``(keys, values)`` of all positions held.

        Parameters
        ----------
        key_states, value_states : torch.Tensor, shape [batch, num_kv_heads, n, head_dim]
            On the cache's device, in its dtype, any strides. Copied into the buffers.
        *args, **kwargs
            What transformers passes besides (``cache_kwargs``); unused.

        Returns
        -------
        keys, values : torch.Tensor, shape [batch, num_kv_heads, seq_len, head_dim]
            Views of nbkv's buffers (no copy), valid until the cache is cropped, reordered
            or reset.

        Raises
        ------
        CacheOverflowError
            ``seq_len + n > max_cache_len``; nothing is written.
        ShapeMismatchError, DTypeMismatchError, DeviceMismatchError
            Tensors that do not fit the cache; nothing is written.
        NotImplementedError
            Tensors that require grad (nbkv buffers carry no gradients).
        """
        self._write(key_states, value_states)
        self._refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Positions held."""
        return self.nbkv.seq_len

    def get_max_length(self) -> int:
        """Capacity in positions (transformers 5)."""
        return self.nbkv.max_seq_len

    def get_max_cache_shape(self) -> int:
        """Capacity in positions (transformers 4.x's name for it)."""
        return self.nbkv.max_seq_len

    def get_mask_sizes(self, query_length: int | torch.Tensor, *args: Any) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the keys the next ``update`` will return.

        Called before the update, as ``DynamicLayer``'s: the positions held plus the
        ``query_length`` about to be written, from offset 0 (the views hold exactly
        those, never the unused capacity). transformers 4.x passes ``cache_position``.
        """
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.nbkv.seq_len + int(query_length), 0

    def reset(self) -> None:
        """Forget every position; keep the buffers."""
        self.nbkv.clear()
        self._refresh()

    def crop(self, max_length: int) -> None:
        """Drop positions from the end.

        transformers 5: ``crop(-n)`` drops ``n`` positions (``crop(0)`` drops none).
        transformers 4.x: ``crop(n)`` keeps the first ``n``, ``crop(-n)`` drops ``n``.
        No data moves (``LayerKVCache.crop``).
        """
        if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral):
            raise ArgumentTypeError(
                f"crop takes an int, got {type(max_length).__name__} {max_length!r}"
            )
        held = self.nbkv.seq_len
        if max_length < 0:
            keep = max(held + int(max_length), 0)
        elif _CROP_REMOVES and max_length > 0:
            raise InvalidArgumentError(
                f"crop takes a negative number of positions to remove (transformers 5), "
                f"got {max_length}"
            )
        else:
            keep = held if _CROP_REMOVES else min(int(max_length), held)
        self._keep(keep)

    def _keep(self, keep: int) -> None:
        if keep >= self.nbkv.seq_len:
            return
        self.nbkv.crop(keep)
        self._refresh()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Reorder the batch rows for beam search: row ``i`` becomes row ``beam_idx[i]``.

        In place, by nbkv's copy kernel (``LayerKVCache.reorder``: at most one scratch
        batch row); the batch size stays (``batch_select_indices`` changes it).
        """
        if self.nbkv.seq_len == 0:
            return
        index = _rows(beam_idx, "beam_idx")
        if index.shape[0] != self.batch_size:
            raise ShapeMismatchError(
                f"beam_idx must be 1-D of length batch_size = {self.batch_size}, got "
                f"{index.shape[0]} indices"
            )
        self.nbkv.reorder(index)  # checks every index before anything moves
        self._refresh()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times, in place of the row (row ``i`` becomes
        rows ``i * repeats ... i * repeats + repeats - 1``): ``num_return_sequences`` and
        beam search expand a prompt's cache this way. New buffers of ``batch * repeats``
        rows, filled by nbkv's copy kernel (``LayerKVCache.select``)."""
        repeats = positive_int(repeats, "repeats")
        self._select(np.repeat(np.arange(self.batch_size), repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (ints, in that order, repeats allowed; or
        a bool mask over the rows), as contrastive search does. New buffers of that many
        rows, filled by nbkv's copy kernel (``LayerKVCache.select``)."""
        rows = _rows(indices, "indices")
        if rows.dtype == np.bool_:
            if rows.shape[0] != self.batch_size:
                raise ShapeMismatchError(
                    f"a bool mask of indices must have batch_size = {self.batch_size} "
                    f"entries, got {rows.shape[0]}"
                )
            rows = np.flatnonzero(rows)
        self._select(rows)

    def _select(self, rows: np.ndarray) -> None:
        self.nbkv = self.nbkv.select(rows)  # checked first; a new cache of len(rows) rows
        self.batch_size = self.max_batch_size = self.nbkv.batch
        self._refresh()
