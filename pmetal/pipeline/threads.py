"""How many threads numpy's BLAS uses in this process.

A pipeline stage process on a 2-core machine shares the cores with the
other stage: two processes each running a 2-thread OpenBLAS oversubscribe
the cores and spin against each other, so a stage sets its BLAS to one
thread. Environment variables (``OPENBLAS_NUM_THREADS``) work only before
numpy is imported; :func:`set_compute_threads` works at any time, by
calling the thread-count function of the OpenBLAS that numpy bundles
(found by symbol in the shared libraries of numpy's wheel: no threadpoolctl
dependency). Where numpy uses another BLAS (Accelerate on macOS) there is
nothing to set and the functions say so by returning ``None``.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from collections.abc import Callable

__all__ = ["compute_threads", "set_compute_threads"]

# Symbol names of OpenBLAS builds, newest numpy wheels (scipy-openblas,
# 64-bit integers) first.
_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
            "openblas_get_num_threads64_", "openblas_get_num_threads")

_lock = threading.Lock()
_found: tuple[Callable[[int], None], Callable[[], int]] | None | bool = False


def _candidate_libraries() -> list[str]:
    """OpenBLAS shared libraries that numpy's wheel ships (``numpy.libs``
    on Linux, ``numpy/.dylibs`` on macOS), then the ones this process has
    mapped (a numpy built against a system OpenBLAS)."""
    import numpy as np
    here = os.path.dirname(os.path.abspath(np.__file__))
    paths: list[str] = []
    for pattern in (os.path.join(here, os.pardir, "numpy.libs", "*openblas*"),
                    os.path.join(here, ".dylibs", "*openblas*")):
        paths.extend(sorted(glob.glob(pattern)))
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "openblas" in os.path.basename(path) and path not in paths:
                    paths.append(path)
    except OSError:  # not Linux
        pass
    return paths


def _functions() -> tuple[Callable[[int], None], Callable[[], int]] | None:
    global _found
    with _lock:
        if _found is not False:
            return _found  # type: ignore[return-value]
        _found = None
        for path in _candidate_libraries():
            try:
                lib = ctypes.CDLL(path)  # already loaded by numpy: the same handle
            except OSError:
                continue
            setter = next((getattr(lib, n) for n in _SETTERS if hasattr(lib, n)), None)
            getter = next((getattr(lib, n) for n in _GETTERS if hasattr(lib, n)), None)
            if setter is not None and getter is not None:
                setter.argtypes, setter.restype = [ctypes.c_int], None
                getter.argtypes, getter.restype = [], ctypes.c_int
                _found = (setter, getter)
                break
        return _found


def set_compute_threads(n: int) -> int | None:
    """Make numpy's BLAS use ``n`` threads from now on, in this process.
    Returns the count now in effect, or ``None`` when numpy's BLAS is not
    an OpenBLAS this module can reach (nothing was changed)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        from pmetal.errors import PMetalValueError
        raise PMetalValueError(f"compute threads must be a positive integer, got {n!r}")
    functions = _functions()
    if functions is None:
        return None
    setter, getter = functions
    setter(n)
    return int(getter())


def compute_threads() -> int | None:
    """How many threads numpy's BLAS uses, or ``None`` when unknown."""
    functions = _functions()
    return None if functions is None else int(functions[1]())
