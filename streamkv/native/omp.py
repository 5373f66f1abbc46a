"""One OpenMP thread team per process: a thread hands its team back before another takes over.

libgomp (torch's OpenMP runtime, which the native kernels share) keeps a team of worker threads
for every thread that has started a parallel region, and keeps it while that thread lives. The
server builds the engine in one thread (weight packing, the kernel measurements) and steps it in
another (``AsyncEngine``'s engine thread), so two teams stand::

    main thread  + its worker   (idle since the build)
    engine thread + its worker  (every parallel region of every step)

With more OpenMP threads than cores, libgomp lets a waiting worker spin only ~100 times before
it sleeps in the kernel (its "throttled" wait), so each of a step's many parallel regions pays a
wake-up. On the 2-core AMD EPYC Zen 4 a batch-1 decode step (context 500) ran 14.6-17.8 ms in
the engine thread against 7.2-8.8 ms once the builder's team was handed back, and 8.0-8.6 ms in
the building thread itself (``benchmarks/engine_thread.py`` and scratch runs, 2026-12-02).
:func:`release_thread_team` hands the calling thread's team back (``omp_pause_resource_all``,
OpenMP 5.0); a later parallel region in that thread builds a new one, so it changes no result,
only who waits how.
"""
from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's), or None (another runtime, not Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = sorted({line.split()[-1] for line in f if "/libgomp" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            return lib
    return None


def release_thread_team() -> bool:
    """Hand the calling thread's OpenMP worker threads back (not from inside a parallel
    region). True if libgomp released them; False where there is nothing to call."""
    lib = _libgomp()
    if lib is None:
        log.debug("no libgomp with omp_pause_resource_all in this process: OpenMP teams left as they are")
        return False
    return lib.omp_pause_resource_all(1) == 0  # omp_pause_soft
