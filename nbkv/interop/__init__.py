"""Adapters that let other libraries use nbkv caches.

Each adapter lives in its own module and imports its library only when that module is
imported, so ``import nbkv`` never pulls in torch or transformers:

- :mod:`nbkv.interop.hf`: :class:`~nbkv.interop.hf.NbkvCache`, a ``transformers`` Cache
  whose keys and values live in nbkv buffers (``pip install "nbkv[hf]"``).
"""
