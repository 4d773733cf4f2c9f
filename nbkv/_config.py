"""Tunables read at call time, so tests and users can patch them.

``THREADS_PER_BLOCK`` is the CUDA block size of the copy kernels (a multiple of the
32-thread warp); ``MAX_BLOCKS`` caps the grid, beyond which each thread loops.
"""

import os

# floating-point licences for the attention kernels: reassociation lets LLVM vectorise the
# dot products and sums; no "nnan"/"ninf", since masked scores are -inf by design. Read
# when a kernel module is first imported (Numba fixes it at compile time).
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

# CPU attention runs on the thread pool from this much work (query rows x K/V elements
# read) up; below it, on the calling thread (waking the pool costs more than it saves for
# a small model's decode step, and much more on a busy machine)
ATTENTION_PARALLEL_MIN = 1 << 21

THREADS_PER_BLOCK = 256
MAX_BLOCKS = 65_535
WARP = 32

# CUDA attention (nbkv.kernels.cuda_attention): threads per block, which is also the
# number of positions per tile; the query rows one block handles; the largest head_dim.
# The simulator runs every thread as a Python thread, so it gets a 32-thread block.
# Read when the kernel module is first imported (they size shared and local arrays).
ATTENTION_THREADS = 32 if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else 128
ATTENTION_ROWS = 16
ATTENTION_MAX_HEAD_DIM = 256
# blocks per SM that flash-decoding aims for when it splits the sequence; read per call
ATTENTION_BLOCKS_PER_SM = 4
# force the number of splits (tests use it to exercise the combine); None: automatic
ATTENTION_SPLITS = None
