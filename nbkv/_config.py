"""Tunables read at call time, so tests and users can patch them.

``THREADS_PER_BLOCK`` is the CUDA block size of the copy kernels (a multiple of the
32-thread warp); ``MAX_BLOCKS`` caps the grid, beyond which each thread loops.
"""

# floating-point licences for the attention kernels: reassociation lets LLVM vectorise the
# dot products and sums; no "nnan"/"ninf", since masked scores are -inf by design. Read
# when a kernel module is first imported (Numba fixes it at compile time).
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

THREADS_PER_BLOCK = 256
MAX_BLOCKS = 65_535
WARP = 32
