"""Numba's and BLAS's threads for a timed run (the demos'): set, reported, restored."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

from ._validate import positive_int
from .errors import InvalidArgumentError


def check_threads(value: object) -> int | None:
    if value is None:
        return None
    import numba

    n = positive_int(value, "threads")
    most = numba.config.NUMBA_NUM_THREADS
    if n > most:
        raise InvalidArgumentError(f"threads must be in [1, {most}] (NUMBA_NUM_THREADS), got {n}")
    return n


def _blas_limits(n: int) -> Any:
    """threadpoolctl's limit of BLAS to ``n`` threads (a context manager), or None
    where threadpoolctl is not installed."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=n, user_api="blas")


BLAS_ENV = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")


class Threads(NamedTuple):
    numba: int  # Numba's threads
    blas: str  # BLAS's threads, short: "1", "2" or "default"
    about: str  # a line on both, with how they were set


@contextlib.contextmanager
def thread_limits(n: int | None) -> Iterator[Threads]:
    """Numba's and BLAS's threads set to ``n`` inside (None: as they are); restored after.

    BLAS is limited through threadpoolctl when it is installed. Without it nothing can
    limit BLAS from here: OpenBLAS reads ``OPENBLAS_NUM_THREADS`` once, when NumPy loads
    it, which ``import nbkv`` has done before this runs; the line says so.
    """
    import numba

    saved = numba.get_num_threads()
    with contextlib.ExitStack() as stack:
        blas_limited = False
        if n is not None:
            numba.set_num_threads(n)
            stack.callback(numba.set_num_threads, saved)
            limits = _blas_limits(n)
            if limits is not None:
                stack.enter_context(limits)
                blas_limited = True
        try:
            from threadpoolctl import threadpool_info
        except ImportError:
            env = [f"{k}={os.environ[k]}" for k in BLAS_ENV if k in os.environ]
            blas = "default"
            how = f"its default ({', '.join(env)} in the environment)" if env else "its default"
            if n is not None:
                how += (
                    f", not limited: threadpoolctl is not installed (pip install threadpoolctl, "
                    f"or start Python with OPENBLAS_NUM_THREADS={n})"
                )
        else:
            pools = [i for i in threadpool_info() if i["user_api"] == "blas"]
            blas = ",".join(str(i["num_threads"]) for i in pools) or "default"
            how = ", ".join(f"{i['internal_api']} {i['num_threads']}" for i in pools)
            how = (how or "none found") + (" (threadpoolctl)" if blas_limited else "")
        yield Threads(numba.get_num_threads(), blas, f"Numba {numba.get_num_threads()}, BLAS {how}")
