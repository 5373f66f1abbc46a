"""The CPU this process runs on, as /proc/cpuinfo tells it (model name, vector / matrix flags)."""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vbmi", "avx512_bf16", "avx512_vnni", "amx_tile",
                "amx_bf16", "amx_int8")


def cache_dir(kind: str) -> Path:
    """Where this machine's builds and measurements of ``kind`` live (``native``, ``kernels``,
    ``profiles``): ``$STREAMKV_CACHE_DIR/kind``, by default ``~/.cache/streamkv/kind``."""
    root = os.environ.get("STREAMKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "streamkv")
    return Path(root) / kind


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(the first processor's model name, its flags); the model falls back to ``platform``."""
    model, flags = None, frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return model or platform.processor() or "unknown", flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def cpu_flags() -> list[str]:
    """The flags of VECTOR_FLAGS this CPU has (what decides which kernels can run)."""
    have = _cpuinfo()[1]
    return [f for f in VECTOR_FLAGS if f in have]


def has_flag(flag: str) -> bool:
    return flag in _cpuinfo()[1]


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a container's cpuset),
    not every core of the machine as ``os.cpu_count()`` says; the default thread count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (not Linux)
        return os.cpu_count() or 1
