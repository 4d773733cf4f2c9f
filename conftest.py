"""Collection rules for the whole repository (pytest runs doctests over nbkv/ too)."""

import importlib.util
import os

# the transformers adapter imports torch and transformers: only where the "hf" extra is in
collect_ignore = []
if not all(importlib.util.find_spec(name) for name in ("torch", "transformers")):
    collect_ignore += ["nbkv/interop/hf.py", "nbkv/interop/_hf_layer.py"]
# numba-cuda's launch code over fake device memory: not the simulator's numba.cuda
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or not importlib.util.find_spec("numba_cuda"):
    collect_ignore += ["nbkv/cuda_offline.py"]
