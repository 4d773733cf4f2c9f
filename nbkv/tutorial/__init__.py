"""Helpers for the tutorial notebooks in ``notebooks/``: small, tested, NumPy-only.

Each notebook imports from its own module here (``nbkv.tutorial.shapes``, ...), so that
no logic lives only in a notebook.
"""
