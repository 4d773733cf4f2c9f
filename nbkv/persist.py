"""Saving a cache to a file and loading it back: :func:`save`, :func:`load`, :func:`load_state`.

A thin layer: a cache exports its state through the cache protocol
(:mod:`nbkv.protocol`), :mod:`nbkv._format` writes it as a pickle-free safetensors file
and reads it back, and the class the file names builds the cache. The file holds only
the positions each layer holds, never the capacity; its format is described in
:mod:`nbkv._format`. Every cache type saves: a :class:`~nbkv.LayerKVCache`, a
:class:`~nbkv.RotatingKVCache` (window, sinks and ``offset`` with it) and a
:class:`~nbkv.KVCache` of either or both.

Examples
--------
>>> import os, tempfile
>>> import numpy as np, nbkv
>>> cache = nbkv.KVCache(2, 4096, batch=1, num_kv_heads=2, head_dim=4, dtype="float32")
>>> k = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
>>> for layer in cache:
...     layer.append(k, -k)
>>> path = os.path.join(tempfile.mkdtemp(), "cache.safetensors")
>>> nbkv.save(path, cache)
>>> cache.nbytes, os.path.getsize(path) < 4096  # 3 positions held, not the capacity
(524288, True)
>>> back = nbkv.load(path)
>>> back.seq_len, back.max_seq_len, bool((back[1].get_kv()[1] == -k).all())
(3, 4096, True)
"""

from __future__ import annotations

import os
from typing import Any

from . import _format
from ._format import FORMAT, FORMAT_VERSION
from .backends import get_backend
from .errors import ArgumentTypeError, CacheFormatError, InvalidArgumentError
from .protocol import cache_class, cache_type_of

__all__ = ["FORMAT", "FORMAT_VERSION", "save", "load", "load_state"]


def _exporter(cache: Any):
    if not hasattr(type(cache), "export_state"):
        raise ArgumentTypeError(
            f"cache must be an nbkv cache (LayerKVCache, RotatingKVCache, or a KVCache of "
            f"them), got {type(cache).__name__}"
        )
    cache_type_of(cache)
    return cache.export_state


def save(path: str | os.PathLike, cache: Any) -> None:
    """Write ``cache`` to a safetensors file at ``path``, atomically.

    Only the positions held are written (``seq_len`` per layer, not the capacity),
    bit-exact, with the cache's configuration, a CRC32 of every tensor and one of the
    header. The write goes to a temporary file in the same folder, flushed and fsync'ed,
    then ``os.replace``'d onto ``path``; on any error the target is untouched and the
    temporary file removed.

    Parameters
    ----------
    path : str or os.PathLike
        Where to write (conventionally ``*.safetensors``); an existing file is replaced.
    cache : LayerKVCache, RotatingKVCache or KVCache
        On any device: CUDA data are gathered on the device and copied to the host once,
        one layer at a time.

    Raises
    ------
    ArgumentTypeError
        ``path`` is not a path, or ``cache`` is not a cache of a registered type (a
        subclass must register: :func:`nbkv.protocol.register_cache_type`).
    OSError
        The folder does not exist or cannot be written.

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np, nbkv
    >>> cache = nbkv.LayerKVCache(64, batch=1, num_kv_heads=2, head_dim=8, dtype="float16")
    >>> cache.append(np.ones((1, 2, 5, 8), np.float16), np.zeros((1, 2, 5, 8), np.float16))
    >>> path = os.path.join(tempfile.mkdtemp(), "layer.safetensors")
    >>> nbkv.save(path, cache)
    >>> nbkv.load(path).seq_len
    5
    """
    _format.file_path(path)
    _format.write_file(path, _exporter(cache)())


def load(path: str | os.PathLike, *, device: str = "cpu", layout: str | None = None) -> Any:
    """Load a cache written by :func:`save`: a new cache of the type saved.

    The file is opened once; its header is checked in full (structure, its checksum,
    every field, tensor shapes against the bytes the file holds) before a cache is
    built, and each tensor's CRC32 as it is read straight into the new buffers. A bad
    file raises before the cache is returned: nothing half filled escapes.

    Parameters
    ----------
    path : str or os.PathLike
    device : {"cpu", "cuda"}
        Where the new cache lives, whatever device the saved one lived on.
    layout : {"bhsd", "bshd"}, optional
        The layout of the new cache; default the file's. Another layout than the file's
        is a transposing copy, still bit-exact.

    Returns
    -------
    LayerKVCache, RotatingKVCache or KVCache
        As saved: type, layers, sizes, dtype, capacities and policies, counters
        (``offset`` of a ring), positions held and their bits; lazy layers stay lazy.

    Raises
    ------
    ArgumentTypeError
        ``path`` is not a path.
    FileNotFoundError
        No file at ``path``.
    CacheFormatError
        A truncated or corrupted file (a CRC mismatch of a tensor or of the header), one
        of another format, version or cache type, or metadata that does not describe a
        cache; the message names what is wrong.
    InvalidArgumentError, BackendUnavailableError
        An unknown ``device`` or ``layout``, or a device that cannot be used here.
    MemoryError
        The capacity the file records (not only the positions it holds) does not fit.

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np, nbkv
    >>> cache = nbkv.LayerKVCache(32, batch=1, num_kv_heads=2, head_dim=4, dtype="float32")
    >>> k = np.arange(16, dtype=np.float32).reshape(1, 2, 2, 4)
    >>> cache.append(k, k + 1)
    >>> path = os.path.join(tempfile.mkdtemp(), "c.safetensors")
    >>> nbkv.save(path, cache)
    >>> back = nbkv.load(path, layout="bshd")  # transposed on the way in
    >>> back.layout, back.get_kv()[0].shape, bool((back.get_kv()[0][0, :, 1] == k[0, 1]).all())
    ('bshd', (1, 2, 2, 4), True)
    """
    _format.file_path(path)
    get_backend(device, "bhsd" if layout is None else layout)  # the arguments, checked first
    with _format.open_file(path) as state:  # tensors read straight into the new buffers
        cls = cache_class(state.type, state.where)
        try:
            return cls.from_state(state, device=device, layout=layout)
        except (ArgumentTypeError, InvalidArgumentError) as err:
            if isinstance(err, CacheFormatError):
                raise
            # the arguments were checked above: what is left is the file's
            raise CacheFormatError(f"{state.where}: {err}") from None


def load_state(cache: Any, path: str | os.PathLike) -> None:
    """Replace the contents of ``cache`` with those saved at ``path``, or change nothing.

    The cache keeps its own device, layout, capacity and policy; the file supplies the
    positions held (and a ring's counters). A file in the other layout is transposed on
    the way in. Layers the file holds unallocated (a lazy cache) are cleared; their
    buffers are kept. Same as ``cache.load_state(path)``.

    Everything is read and checked before anything is written: the file (as
    :func:`load`), then type, number of layers, sizes, dtype and capacity against the
    cache, for every layer of a KVCache, and every tensor's CRC32. The data are held in
    host memory meanwhile (the positions held, K and V, every layer).

    Raises
    ------
    ArgumentTypeError
        ``cache`` is not an nbkv cache, or ``path`` not a path.
    FileNotFoundError
        No file at ``path``.
    CacheFormatError
        A file :func:`load` would refuse, or one holding another cache type, number of
        layers or ring than ``cache``.
    ShapeMismatchError, DTypeMismatchError
        The file's batch, num_kv_heads, head_dim or dtype differ from the cache's.
    CacheOverflowError
        A layer of the file holds more positions than the cache's capacity, unless the
        cache was built with ``on_overflow="grow"`` (it then grows).

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np, nbkv
    >>> cache = nbkv.LayerKVCache(8, batch=1, num_kv_heads=1, head_dim=2, dtype="float32")
    >>> cache.append(np.ones((1, 1, 3, 2), np.float32), np.ones((1, 1, 3, 2), np.float32))
    >>> path = os.path.join(tempfile.mkdtemp(), "c.safetensors")
    >>> nbkv.save(path, cache)
    >>> cache.trim(2)
    2
    >>> nbkv.load_state(cache, path)
    >>> cache.seq_len
    3
    """
    _exporter(cache)
    cache.load_state(path)
