"""Tunables read at call time, so tests and users can patch them.

``THREADS_PER_BLOCK`` is the CUDA block size of the copy kernels (a multiple of the
32-thread warp); ``MAX_BLOCKS`` caps the grid, beyond which each thread loops.
"""

THREADS_PER_BLOCK = 256
MAX_BLOCKS = 65_535
WARP = 32
