"""Collection rules for the whole repository (pytest runs doctests over nbkv/ too)."""

import importlib.util

# the transformers adapter imports torch and transformers: only where the "hf" extra is in
collect_ignore = []
if not all(importlib.util.find_spec(name) for name in ("torch", "transformers")):
    collect_ignore += ["nbkv/interop/hf.py", "nbkv/interop/_hf_layer.py"]
