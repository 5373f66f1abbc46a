"""The kernels library: its sources, build tag, compile (on first use) and load.

Only a C compiler is needed (no torch headers; the sources compile in parallel, a few seconds). The
library links the process' ``libgomp.so.1`` (the one torch already loaded), so its threads
are torch's threads. Anything missing or failing -> :func:`_library` is None, every wrapper
(``exact_ops.py``, ``fast_ops.py``) returns None and callers use the pure-PyTorch path. ``STREAMKV_NATIVE=0`` disables the kernels.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch  # noqa: F401  (loads libgomp.so.1 first: the library links that one, so its threads are torch's)

from streamkv.native.cpu import cache_dir, cpu_flags, cpu_model, usable_cores
from streamkv.native.signatures import declare

log = logging.getLogger(__name__)
_HERE = Path(__file__).parent
_SOURCES = [_HERE / n for n in ("decode_attn.c", "paged_attn.c", "page_select.c")]
# The batch-invariant kernels are compiled without -ffast-math: each output element's chain of
# roundings is written out in the source and the compiler may not reassociate or contract it.
_EXACT_SOURCES = [_HERE / n for n in ("inv_gemm.c", "inv_attn.c", "inv_attn_bf16.c", "q4_gemm.c", "deq_gemm.c",
                                      "deq_bf16.c", "layer.c", "kv_move.c", "gguf_deq.c")]
_HEADERS = [_HERE / n for n in ("simd.h", "vec16.h", "transpose16.h", "attn_bf16_rows.h", "attn_amx_rows.h", "amx.h",
                                 "nibbles.h", "page_tiles.h", "q4_fma_rows.h",
                                 "attn_fma_rows.h", "gemm_amx.h", "units.h")]
# STREAMKV_NATIVE_FLAGS adds compiler flags (e.g. -mno-avx512vbmi to build a fallback path on a
# CPU that would not take it; tests do this in a subprocess with their own cache directory)
_COMMON = ["-O3", "-march=native", "-fopenmp", "-fPIC", *os.environ.get("STREAMKV_NATIVE_FLAGS", "").split()]
_FLAGS = [*_COMMON, "-ffast-math"]
_EXACT_FLAGS = [*_COMMON, "-fno-fast-math", "-ffp-contract=off"]


def _cache_dir() -> Path:
    return cache_dir("native")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")


@functools.lru_cache(maxsize=1)
def build_tag() -> str:
    """A hash of the kernels' sources, the compiler, the flags and the CPU (``-march=native``
    builds for this one: a cache directory shared with another CPU must not hand it this
    library, whose instructions may not run there or give other bits): names the built library."""
    source = b"".join(src.read_bytes() for src in [*_SOURCES, *_EXACT_SOURCES, *_HEADERS])
    cc = _compiler()
    machine = [cpu_model(), *cpu_flags(), _native_target(cc)]
    return hashlib.sha256(source + " ".join([str(cc), *_FLAGS, *_EXACT_FLAGS, *machine]).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=4)
def _native_target(cc: str | None) -> str:
    """What ``-march=native`` expands to for ``cc`` here (every ISA extension it enables or
    not): two CPUs alike in model name and VECTOR_FLAGS (VMs often say just "AMD EPYC") may
    still differ in what the compiler emits for them. Empty where the compiler does not say."""
    if cc is None:
        return ""
    try:
        proc = subprocess.run([cc, "-march=native", "-E", "-v", "-x", "c", os.devnull, "-o", os.devnull],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    line = next((ln for ln in proc.stderr.splitlines() if " -march=" in ln and "cc1" in ln), "")
    return line.split(" -march=", 1)[1] if line else ""


def object_files(tmp: Path) -> list[tuple[Path, Path]]:
    """(source, object file in ``tmp``) of every kernel source."""
    return [(src, tmp / f"{src.stem}.o") for src in [*_SOURCES, *_EXACT_SOURCES]]


def compile_steps(cc: str, tmp: Path, march: str = "native") -> list[list[str]]:
    """The compiler command of each source, objects into ``tmp``; ``march`` other than native
    builds for another CPU (a test compiles the AMX paths that this CPU cannot run)."""
    arch = lambda flags: [f"-march={march}" if f == "-march=native" else f for f in flags]  # noqa: E731
    return [[cc, *arch(_EXACT_FLAGS if src in _EXACT_SOURCES else _FLAGS), "-c", str(src), "-o", str(obj)]
            for src, obj in object_files(tmp)]


def _build() -> Path | None:
    cc = _compiler()
    if cc is None:
        log.info("no C compiler found: native CPU kernels disabled")
        return None
    target = _cache_dir() / f"kernels-{build_tag()}.so"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return _compile(cc, target)
    except OSError as exc:  # the cache cannot hold it: build for this process only
        log.warning("native kernel cache %s not writable (%s): building into a temporary directory",
                    target.parent, exc)
        here = Path(tempfile.mkdtemp(prefix="streamkv-kernels-"))
        atexit.register(shutil.rmtree, here, ignore_errors=True)
        return _compile(cc, here / target.name)


def _compile(cc: str, target: Path) -> Path | None:
    """Compile and link the kernels into ``target`` (through a temporary directory beside it)."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        link = [cc, "-shared", "-fopenmp", *(str(o) for _, o in object_files(Path(tmp))), "-o", str(out), "-lm"]
        for step in (compile_steps(cc, Path(tmp)), [link]):  # the link only after every compile succeeded
            failed = [proc for proc in run_all(step) if proc.returncode != 0]
            if failed:
                log.warning("building the native kernels failed; using PyTorch:\n%s", failed[0].stderr[-2000:])
                return None
        os.replace(out, target)
    return target


def run_all(commands: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Run independent commands (the per-source compiles), one per usable core at a time."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(commands), usable_cores()))) as pool:
        return list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), commands))


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("STREAMKV_NATIVE", "1") == "0":
        return None
    try:
        path = _build()
        if path is None:
            return None
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:  # a damaged cached build (truncated, another file): build it again
            log.warning("the cached native kernels %s do not load (%s): building them again", path, exc)
            path.unlink(missing_ok=True)
            path = _build()
            if path is None:
                return None
            lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native kernels unavailable (%s); using PyTorch", exc)
        return None
    declare(lib)
    return lib
