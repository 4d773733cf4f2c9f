"""One attention launch signature of the CUDA backend on one thread, typed once.

:class:`KernelPlan` holds the kernel specialised for the signature (Numba's type
inference runs once, not per call), how many of its blocks one wave of the GPU holds,
and per split count a configured launch (its parameter list prepared once,
:mod:`nbkv.cuda_launch`) with its scratch. :class:`nbkv.cuda_backend.CUDABackend` keeps
a thread's plans by signature and launches through :meth:`KernelPlan.run`.
"""

from __future__ import annotations

import numpy as np

from . import _config, cuda_launch
from .launch import AttentionGrid, attention_scratch_shapes, resident_blocks, wave_splits

__all__ = ["KernelPlan"]


class KernelPlan:
    """One attention launch signature on one thread: the kernel specialised for it and
    typed once (no type inference per call), the blocks one wave of it holds, and per
    split count a configured launch with its scratch (``grids``)."""

    def __init__(self, dev, family, head, tail, out, bshd: bool) -> None:
        attn = dev.attention_kernels()
        fused = family.fused
        q, k_cache, v_cache = head[0], head[4 if fused else 1], head[5 if fused else 2]
        self.spec = family.spec(q, k_cache, v_cache)
        kernel = family.specialise(self.spec)
        batch, num_heads, n_q, dim = (int(x) for x in q.shape)
        kv_heads = int(k_cache.shape[2 if bshd else 1])
        self.sizes = (batch, num_heads, n_q, dim)
        self.tasks = batch * kv_heads
        self.chunks = -(-(num_heads // kv_heads) * n_q // self.spec.rows)
        self.sms = dev.sm_count()
        self.threads, self.tile = attn.THREADS, attn.TILE
        specialize = getattr(kernel, "specialize", None)  # the simulator has none
        self.compiled = None  # the compiled kernel (Numba's _Kernel), on a GPU
        if specialize is not None:
            kernel = specialize(*head, *tail, *dev.dummy_scratch(), out)
            self.compiled = next(iter(getattr(kernel, "overloads", {}).values()), None)
        self.kernel = kernel
        self.per_sm = self._occupancy(attn)
        self._cuda = dev.cuda
        self.grids: dict[int, tuple] = {}

    def _occupancy(self, attn) -> int:
        """Resident blocks per SM: the driver's figure for the compiled kernel on a GPU,
        else from its shared memory and its launch bound's register cap."""
        try:
            blocks = self.compiled.max_cooperative_grid_blocks(self.threads)
            return max(1, blocks // self.sms)
        except Exception:  # the simulator, or a driver without the query
            cap = 65_536 // (self.threads * attn.min_blocks_per_sm(self.spec))
            return resident_blocks(self.threads, registers=cap, shared=attn.shared_bytes(self.spec))

    def splits(self, span: int) -> int:
        """The split count for ``span`` visible positions (tunables read per call)."""
        per_sm = _config.ATTENTION_BLOCKS_PER_SM
        return wave_splits(
            (self.per_sm if per_sm is None else per_sm) * self.sms,
            self.tasks * self.chunks,
            span,
            self.tile,
            _config.ATTENTION_SPLITS,
        )

    def grid(self, splits: int) -> tuple:
        grid = AttentionGrid(splits, self.tasks, self.chunks)
        acc, stats, counters = attention_scratch_shapes(grid, *self.sizes)
        scratch = (
            self._cuda.device_array(acc, np.float32),
            self._cuda.device_array(stats, np.float32),
            self._cuda.to_device(np.zeros(counters, np.int32)),  # zero before a launch
        )
        launch = self.kernel[tuple(grid), self.threads]
        if self.compiled is not None:  # the parameter list prepared once (cuda_launch)
            launch = cuda_launch.Launch(self.compiled, launch)
        elif launch is self.kernel:  # the simulator configures the kernel itself, in place:
            # a launch kept for one split count would run with the last one configured
            dims, threads, kernel = tuple(grid), self.threads, self.kernel

            def launch(*args):
                kernel[dims, threads](*args)

        self.grids[splits] = entry = (launch, scratch)
        return entry

    def run(self, span: int, head: tuple, tail: tuple, out, own: dict | None = None) -> None:
        """Launch the grid for ``span`` (configured and its scratch made on first use); if
        the launch fails, forget the scratch. ``own``, a bound step's: its own copy of
        each grid's launch (per split count, made again when the grid is made again), so
        that its cache's buffers stay filled in while other caches use this plan
        (:meth:`nbkv.cuda_launch.PreparedLaunch.copy`)."""
        splits = self.splits(span)
        grid = self.grids.get(splits)
        if grid is None:
            grid = self.grid(splits)
        launch, scratch = grid
        if own is not None:  # keyed by the launch, which holds no scratch
            mine = own.get(splits)
            if mine is None or mine[0] is not launch:
                mine = own[splits] = (launch, cuda_launch.own_copy(launch))
            launch = mine[1]
        try:
            launch(*head, *tail, *scratch, out)
        except BaseException:
            self.grids.clear()  # counters may be left part-way: fresh ones next time
            raise
