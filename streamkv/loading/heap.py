"""Give the heap that loading freed back to the OS.

Loading a GGUF model allocates large temporaries (the file's blocks unpacked to int32 4-bit
matrices, float32 scales, the packed kernels' inputs) and frees them once the weights are
built. glibc keeps most of that freed memory in its arenas instead of returning it, so a
float32 engine of the embedded model held ~2.0 GB resident where its tensors take ~0.8 GB
(AMD EPYC Zen 3, torch 2.13); ``malloc_trim(0)`` after the build brought it to ~1.0 GB. A
test process that builds many engines grew past 23 GB and was OOM-killed on that machine.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_freed_heap() -> bool:
    """Collect unreachable objects, then return the C heap's free pages to the OS. Returns
    whether the C library could (``malloc_trim`` exists); nothing reachable is touched."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def freeze_loaded_heap() -> int:
    """Collect, then move every surviving object to the permanent generation (``gc.freeze``), so
    that later full collections no longer traverse the loaded model's objects. Returns how many
    objects were frozen.

    A serving process holds ~227k tracked objects once the embedded model and the app are built;
    a full (generation-2) collection of them took 76-158 ms on an AMD EPYC Zen 3, during which
    the engine thread cannot step. After the freeze the same collection took 0.007 ms. Objects
    allocated later are collected as usual; frozen ones are never freed (they live as long as
    the server anyway)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
