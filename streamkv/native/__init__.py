"""Small C kernels for CPU hot spots (attention over the paged cache, 4-bit GEMM), compiled on first use (gcc, OpenMP) and loaded with ctypes.

Only a C compiler is needed (no torch headers; the sources compile in parallel, a few seconds). The
library links the process' ``libgomp.so.1`` (the one torch already loaded), so its threads
are torch's threads. Anything missing or failing -> :func:`decode_attention` is None and
callers use the pure-PyTorch path. ``STREAMKV_NATIVE=0`` disables the kernels.
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
from typing import Callable

import torch

from streamkv.native.cpu import cpu_flags, cpu_model, usable_cores

log = logging.getLogger(__name__)
_HERE = Path(__file__).parent
_SOURCES = [_HERE / n for n in ("decode_attn.c", "paged_attn.c", "page_select.c")]
# The batch-invariant kernels are compiled without -ffast-math: each output element's chain of
# roundings is written out in the source and the compiler may not reassociate or contract it.
_EXACT_SOURCES = [_HERE / n for n in ("inv_gemm.c", "inv_attn.c", "inv_attn_bf16.c", "q4_gemm.c", "deq_gemm.c",
                                      "deq_bf16.c", "layer.c", "kv_move.c", "gguf_deq.c")]
_HEADERS = [_HERE / n for n in ("simd.h", "vec16.h", "transpose16.h", "attn_bf16_rows.h", "attn_amx_rows.h", "amx.h",
                                 "nibbles.h")]
# STREAMKV_NATIVE_FLAGS adds compiler flags (e.g. -mno-avx512vbmi to build a fallback path on a
# CPU that would not take it; tests do this in a subprocess with their own cache directory)
_COMMON = ["-O3", "-march=native", "-fopenmp", "-fPIC", *os.environ.get("STREAMKV_NATIVE_FLAGS", "").split()]
_FLAGS = [*_COMMON, "-ffast-math"]
_EXACT_FLAGS = [*_COMMON, "-fno-fast-math", "-ffp-contract=off"]


def _cache_dir() -> Path:
    root = os.environ.get("STREAMKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "streamkv")
    return Path(root) / "native"


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
    fn = lib.streamkv_decode_attn
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                          ctypes.c_float, ctypes.c_int64, ctypes.c_void_p]
    fn = lib.streamkv_paged_attn
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_float, ctypes.c_int64, ctypes.c_void_p]
    lib.streamkv_paged_attn_available.restype = ctypes.c_int
    fn = lib.streamkv_q4_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int]
    lib.streamkv_q4_available.restype = ctypes.c_int
    fn = lib.streamkv_q8_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_void_p]
    fn = lib.streamkv_page_select
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                            ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                                            ctypes.c_void_p]
    fn = lib.streamkv_inv_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    fn = lib.streamkv_deq_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    fn = lib.streamkv_deq_gemm_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.streamkv_deq_bf16_available.restype = ctypes.c_int
    lib.streamkv_inv_gemm_bf16_dot.restype = ctypes.c_int
    lib.streamkv_inv_gemm_bf16_path.restype = ctypes.c_char_p
    fn = lib.streamkv_inv_attn
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p]
    fn = lib.streamkv_inv_attn_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.streamkv_inv_attn_bf16_available.restype = ctypes.c_int
    lib.streamkv_inv_attn_amx_available.restype = ctypes.c_int
    lib.streamkv_inv_isa.restype = ctypes.c_char_p
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    signatures = {  # native/layer.c (the model struct is passed by reference)
        "streamkv_fwd": [p, p, i64, p, p, p, i32, p, p],
        "streamkv_fwd_sel": [p, p, i64, p, p, p, i32, p, p, p, i32, p, i64, i32, i32, p],
        "streamkv_fwd_pre": [p, i32, p, i64, p, p, p, p],
        "streamkv_fwd_attn": [p, i32, p, p, i32, p, p],
        "streamkv_fwd_post": [p, i32, p, i64, p, p],
        "streamkv_rms_norm": [p, i64, i32, p, ctypes.c_float, p, i32],
    }
    for name, args in signatures.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int
    lib.streamkv_fwd_workspace.argtypes = [p, i64]
    lib.streamkv_fwd_workspace.restype = ctypes.c_size_t
    fn = lib.streamkv_kv_move_ordered
    fn.restype = ctypes.c_int
    fn.argtypes = [i32, p, p, i32, i64, i32, i32, p, p, i64, p]
    fn = lib.streamkv_kv_move_between
    fn.restype = ctypes.c_int
    fn.argtypes = [i32, p, p, i64, p, p, i64, i32, i32, i32, p, p, i64, p]
    lib.streamkv_gguf_dequant.restype = ctypes.c_int
    lib.streamkv_gguf_dequant.argtypes = [i32, p, i64, p]
    fn = lib.streamkv_page_bounds
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
    return lib


def decode_attention() -> Callable[..., torch.Tensor] | None:
    """The native kernel wrapped for tensors, or None when it is unavailable."""
    lib = _library()
    return None if lib is None else functools.partial(_decode, lib.streamkv_decode_attn)


def _decode(fn: ctypes._CFuncPtr, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor,
            offsets: torch.Tensor, scale: float, chunk_len: int = 512) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D] float32 over the cache slots of each row.

    kc, vc [S, Hk, D] (bfloat16 or float32, contiguous, CPU); slots [N] int64 and offsets
    [B + 1] int64 (row b attends to slots[offsets[b]:offsets[b+1]]).
    """
    if kc.dtype not in (torch.bfloat16, torch.float32) or kc.dtype != vc.dtype:
        raise TypeError(f"native decode attention supports bfloat16/float32 caches, got {kc.dtype}")
    if not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    q = q.float().contiguous()
    slots = slots.contiguous()
    offsets = offsets.contiguous()
    b, h, d = q.shape
    out = torch.empty(b, h, d, dtype=torch.float32)
    rc = fn(int(kc.dtype == torch.bfloat16), q.data_ptr(), kc.data_ptr(), vc.data_ptr(), slots.data_ptr(),
            offsets.data_ptr(), b, h, kc.shape[1], d, float(scale), int(chunk_len), out.data_ptr())
    if rc != 0:
        raise ValueError(f"native decode attention rejected shapes q={tuple(q.shape)} kv={tuple(kc.shape)}")
    return out


def paged_attention() -> Callable[..., torch.Tensor] | None:
    """The AVX512-BF16 mixed-batch kernel (bf16 cache, head_dim 64), or None when this CPU or
    build lacks it."""
    lib = _library()
    if lib is None or not lib.streamkv_paged_attn_available():
        return None
    return functools.partial(_paged, lib.streamkv_paged_attn)


def _paged(fn: ctypes._CFuncPtr, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seqs: torch.Tensor,
           slots: torch.Tensor, scale: float, chunk_len: int = 512) -> torch.Tensor:
    """q [T, H, 64] bf16 -> out [T, H, 64] float32, every row of a step in one call.

    kc, vc [S, Hk, 64] bf16 (contiguous, CPU); seqs [B, 4] int64 rows (row0, nq, off, L):
    sequence b's query rows [row0, row0 + nq) sit at context indices [L - nq, L) of its
    context slots ``slots[off:off + L]`` and attend causally.
    """
    if q.dtype != torch.bfloat16 or kc.dtype != torch.bfloat16 or vc.dtype != torch.bfloat16:
        raise TypeError("the paged kernel needs bfloat16 queries and cache")
    if q.shape[-1] != 64 or kc.shape[-1] != 64:
        raise ValueError(f"the paged kernel needs head_dim 64, got {q.shape[-1]}")
    if not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    q = q.contiguous()
    seqs = seqs.contiguous()
    slots = slots.contiguous()
    t, h, d = q.shape
    out = torch.empty(t, h, d, dtype=torch.float32)
    rc = fn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), seqs.data_ptr(), seqs.shape[0], slots.data_ptr(),
            h, kc.shape[1], float(scale), int(chunk_len), out.data_ptr())
    if rc != 0:
        raise ValueError(f"paged attention rejected shapes q={tuple(q.shape)} kv={tuple(kc.shape)} (rc={rc})")
    return out


def q4_gemm() -> Callable[..., torch.Tensor] | None:
    """The AVX512-BF16 4-bit-weight GEMM (see ``q4_gemm.c``), or None when unavailable."""
    lib = _library()
    if lib is None or not lib.streamkv_q4_available():
        return None
    return functools.partial(_q4, lib.streamkv_q4_gemm)


def _q4(fn: ctypes._CFuncPtr, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor, n: int,
        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] bf16 @ the packed [n, K] weight -> [M, n] float32 or bfloat16 (layout in ``q4_gemm.c``)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise TypeError(f"q4 GEMM needs a 2-D bfloat16 input, got {x.dtype} {tuple(x.shape)}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"q4 GEMM writes float32 or bfloat16, not {out_dtype}")
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=out_dtype)
    rc = fn(x.data_ptr(), m, k, w.data_ptr(), sz.data_ptr(), n, out.data_ptr(), int(out_dtype == torch.bfloat16))
    if rc != 0:
        raise ValueError(f"q4 GEMM rejected x {tuple(x.shape)} for {n} outputs (rc={rc})")
    return out


def q8_gemm() -> Callable[..., torch.Tensor] | None:
    """The Q8_0 GEMM of ``q4_gemm.c`` (AVX512-BF16; float32 output), or None when unavailable."""
    lib = _library()
    if lib is None or not lib.streamkv_q4_available():
        return None
    return functools.partial(_q8, lib.streamkv_q8_gemm)


def _q8(fn: ctypes._CFuncPtr, x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] bf16 @ the packed [n, K] int8 weight -> [M, n] float32 (layout in ``q4_gemm.c``)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise TypeError(f"q8 GEMM needs a 2-D bfloat16 input, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    if m and fn(x.data_ptr(), m, k, w.data_ptr(), d.data_ptr(), n, out.data_ptr()) != 0:
        raise ValueError(f"q8 GEMM rejected x {tuple(x.shape)} for {n} outputs")
    return out


def gguf_dequant() -> Callable[[int, int, int, int], int] | None:
    """``fn(kind, raw_ptr, blocks, out_ptr)`` of ``gguf_deq.c`` (kind 0 Q8_0, 1 Q4_0, 2 Q4_1),
    or None without the kernels."""
    lib = _library()
    return None if lib is None else lib.streamkv_gguf_dequant


def kv_move() -> Callable[..., None] | None:
    """The native KV row mover with key rotation (``kv_move.c``), or None without the kernels."""
    lib = _library()
    return None if lib is None else functools.partial(_kv_move, lib.streamkv_kv_move_between,
                                                      lib.streamkv_kv_move_ordered)


def _kv_move(fn: ctypes._CFuncPtr, ordered: ctypes._CFuncPtr, k: torch.Tensor, v: torch.Tensor, src: torch.Tensor,
             dst: torch.Tensor, cos_sin: torch.Tensor | None) -> None:
    """Rows ``src`` [N] -> ``dst`` [N] of caches k, v [L, S, H, D]; ``cos_sin`` [N, D/2, 2] float32
    rotates the keys (None: plain copy). When a destination slot is also a source slot (an
    in-place eviction moving rows down), threads must never read a row another thread already
    overwrote: where every such slot is read by a row no later than the one that writes it, the
    rows go in index order within each layer (``streamkv_kv_move_ordered``); otherwise the
    source rows are staged first (an exact copy). The arithmetic is the same on every path."""
    if k.dtype not in (torch.bfloat16, torch.float32) or v.dtype != k.dtype:
        raise TypeError(f"native kv_move supports bfloat16/float32 caches, got {k.dtype}")
    if not (k.is_contiguous() and v.is_contiguous()) or k.device.type != "cpu":
        raise ValueError("native kv_move needs contiguous CPU caches")
    src, dst = src.to(torch.int64).contiguous(), dst.to(torch.int64).contiguous()
    cs = None if cos_sin is None else cos_sin.to(torch.float32).contiguous()
    cs_ptr = None if cs is None else cs.data_ptr()
    layers, slots, heads, dim = k.shape
    ks, vs, src_slots = k, v, slots
    if bool(torch.isin(dst, src).any()):
        if _reads_first(src, dst):
            rc = ordered(int(k.dtype == torch.bfloat16), k.data_ptr(), v.data_ptr(), layers, slots, heads, dim,
                         src.data_ptr(), dst.data_ptr(), src.numel(), cs_ptr)
            if rc != 0:
                raise ValueError(f"native kv_move rejected the move (code {rc})")
            return
        if bool(((src < 0) | (src >= slots)).any()):
            raise ValueError("native kv_move rejected the move (code 2)")
        ks, vs, src_slots = k.index_select(1, src), v.index_select(1, src), src.numel()
        src = torch.arange(src.numel(), dtype=torch.int64)
    rc = fn(int(k.dtype == torch.bfloat16), ks.data_ptr(), vs.data_ptr(), src_slots, k.data_ptr(), v.data_ptr(),
            slots, layers, heads, dim, src.data_ptr(), dst.data_ptr(), src.numel(), cs_ptr)
    if rc != 0:
        raise ValueError(f"native kv_move rejected the move (code {rc})")


def _reads_first(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether moving rows in index order reads every slot before writing it: the sources
    [N] are distinct, and a destination slot ``dst[i]`` that is a source ``src[j]`` has
    ``j <= i`` (true of an eviction's downward move, rows in position order)."""
    order = torch.argsort(src)
    ranked = src[order]
    if bool((ranked[1:] == ranked[:-1]).any()):
        return False
    at = torch.searchsorted(ranked, dst).clamp(max=src.numel() - 1)
    hit = ranked[at] == dst
    return bool((order[at][hit] <= torch.arange(dst.numel())[hit]).all())


def page_select() -> Callable[..., torch.Tensor] | None:
    """Quest-style page ranking in C (see ``page_select.c``), or None when unavailable."""
    lib = _library()
    return None if lib is None else functools.partial(_select, lib.streamkv_page_select)


def _select(fn: ctypes._CFuncPtr, q: torch.Tensor, bounds: torch.Tensor, candidates: torch.Tensor, keep: int,
            scale: float, slots: torch.Tensor | None = None, sink_len: int = 0, tail_from: int = 0,
            block_size: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick ``keep`` of the candidate pages (and optionally compact the context slots).

    q [R, kvh, g, D] float32 or bfloat16; bounds [blocks, kvh, 2D] bfloat16 (one layer);
    candidates [P] int64 block ids. Returns (positions in ``candidates`` [keep], ascending;
    with ``slots`` [ctx_len], the compacted slots ``slots[:sink_len]`` + the picked pages'
    slots (page p = ``slots[sink_len + p * block_size:][:block_size]``) + ``slots[tail_from:]``).
    """
    r, kvh, g, d = q.shape
    if q.dtype not in (torch.float32, torch.bfloat16) or bounds.dtype != torch.bfloat16 \
            or tuple(bounds.shape[1:]) != (kvh, 2 * d):
        raise ValueError(f"page selection got q {tuple(q.shape)} {q.dtype}, bounds {tuple(bounds.shape)} {bounds.dtype}")
    q, bounds, candidates = q.contiguous(), bounds.contiguous(), candidates.contiguous()
    pos = torch.empty(keep, dtype=torch.int64)
    out = None
    if slots is not None:
        slots = slots.contiguous()
        out = torch.empty(sink_len + keep * block_size + slots.numel() - tail_from, dtype=torch.int64)
    rc = fn(q.data_ptr(), int(q.dtype == torch.bfloat16), r, kvh, g, d, bounds.data_ptr(), candidates.data_ptr(),
            candidates.numel(), keep, float(scale), pos.data_ptr(), slots.data_ptr() if slots is not None else None,
            sink_len, tail_from, slots.numel() if slots is not None else 0, block_size,
            out.data_ptr() if out is not None else None)
    if rc != 0:
        raise ValueError(f"page selection rejected keep={keep} of {candidates.numel()} pages, head_dim {d}")
    return pos, out


def page_bounds() -> Callable[..., None] | None:
    """Per-block key max/min of a bfloat16 cache in C (see ``page_select.c``), or None."""
    lib = _library()
    return None if lib is None else functools.partial(_bounds, lib.streamkv_page_bounds)


def _bounds(fn: ctypes._CFuncPtr, k: torch.Tensor, block_size: int, blocks: torch.Tensor, out: torch.Tensor) -> None:
    """k [layers, slots, kvh, D] bf16 (contiguous) -> out[:, blocks] = [max | min] over each
    block's keys; out [layers, slots // block_size, kvh, 2D] bf16 (contiguous)."""
    layers, slots, kvh, d = k.shape
    if k.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or not (k.is_contiguous() and out.is_contiguous()) \
            or kvh * d > 1024:
        raise ValueError(f"page bounds need contiguous bf16 tensors and kv_heads * head_dim <= 1024, got {k.dtype}")
    blocks = blocks.contiguous()
    fn(k.data_ptr(), layers, slots, kvh, d, block_size, blocks.data_ptr(), blocks.numel(), out.data_ptr(),
       out.shape[1])


def invariant_isa() -> str | None:
    """The vector ISA the batch-invariant kernels were built for (avx512f | avx2 | scalar), or None."""
    lib = _library()
    return None if lib is None else lib.streamkv_inv_isa().decode()


def invariant_gemm() -> Callable[..., torch.Tensor] | None:
    """The batch-invariant dense GEMM (``inv_gemm.c``) wrapped for tensors, or None."""
    lib = _library()
    return None if lib is None else functools.partial(_inv_gemm, lib.streamkv_inv_gemm)


def _gemm_out(x: torch.Tensor, n: int, out_dtype: torch.dtype, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x contiguous and the [M, n] output of a GEMM writing ``out_dtype`` (float32 or bfloat16)."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{what} writes float32 or bfloat16, not {out_dtype}")
    x = x.contiguous()
    return x, torch.empty(x.shape[0], n, dtype=out_dtype)


def deq_gemm() -> Callable[..., torch.Tensor] | None:
    """The float32 GEMM over packed 4-bit / 8-bit GGUF weights with the dense float32 GEMM's bits
    (``deq_gemm.c``), or None without the native kernels."""
    lib = _library()
    return None if lib is None else functools.partial(_deq_gemm, lib.streamkv_deq_gemm)


def _deq_gemm(fn: ctypes._CFuncPtr, x: torch.Tensor, q: torch.Tensor, dm: torch.Tensor, n: int,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] float32 @ the packed [n, K] weight (``models/q4_linear.py: pack_deq``; 4-bit when q is
    uint8, 8-bit when int8) -> [M, n] in ``out_dtype`` (float32 or bfloat16)."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise TypeError(f"deq GEMM needs a 2-D float32 input, got {x.dtype} {tuple(x.shape)}")
    if q.dtype not in (torch.uint8, torch.int8) or dm.dtype != torch.float16:
        raise TypeError(f"deq GEMM needs uint8 / int8 values and float16 scales, got {q.dtype}, {dm.dtype}")
    x, out = _gemm_out(x, n, out_dtype, "deq GEMM")
    m, k = x.shape
    if m == 0:
        return out
    rc = fn(x.data_ptr(), m, k, q.data_ptr(), dm.data_ptr(), 4 if q.dtype == torch.uint8 else 8, n, out.data_ptr(),
            int(out_dtype == torch.bfloat16))
    if rc != 0:
        raise ValueError(f"deq GEMM rejected x {tuple(x.shape)} for {n} outputs (rc={rc})")
    return out


def deq_gemm_bf16() -> Callable[..., torch.Tensor] | None:
    """The bf16 GEMM over packed 4-bit GGUF weights with the dense bf16 GEMM's bits (``deq_bf16.c``;
    AVX512-BF16 CPUs with VBMI), or None where it cannot run."""
    lib = _library()
    if lib is None or not lib.streamkv_deq_bf16_available():
        return None
    return functools.partial(_deq_gemm_bf16, lib.streamkv_deq_gemm_bf16)


def _deq_gemm_bf16(fn: ctypes._CFuncPtr, x: torch.Tensor, q: torch.Tensor, dm: torch.Tensor, n: int,
                   out_dtype: torch.dtype = torch.bfloat16, tiles: bool = False) -> torch.Tensor:
    """x [M, K] bf16 @ the packed [n, K] weight (``models/deq_linear.py: pack_deq_bf16``) -> [M, n] in
    ``out_dtype``, the bits of ``invariant_gemm`` over the dense bf16 weights (``tiles`` alike)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise TypeError(f"bf16 deq GEMM needs a 2-D bfloat16 input, got {x.dtype} {tuple(x.shape)}")
    if q.dtype != torch.uint8 or dm.dtype != torch.float32 or not (q.is_contiguous() and dm.is_contiguous()):
        raise TypeError(f"bf16 deq GEMM needs contiguous uint8 values and float32 scales, got {q.dtype}, {dm.dtype}")
    x, out = _gemm_out(x, n, out_dtype, "bf16 deq GEMM")
    m, k = x.shape
    t, g = -(-n // 16), k // 32
    if k % 32 or q.shape != (t, g, 16, 16) or dm.shape != (t, g, 16, 2):  # the kernel reads what these say
        raise ValueError(f"bf16 deq GEMM: packed weights {tuple(q.shape)} / {tuple(dm.shape)} do not hold "
                         f"[{n}, {k}] (expected ({t}, {g}, 16, 16) / ({t}, {g}, 16, 2))")
    if m == 0:
        return out
    rc = fn(x.data_ptr(), m, k, q.data_ptr(), dm.data_ptr(), n, out.data_ptr(), int(out_dtype == torch.bfloat16),
            int(tiles))
    if rc != 0:
        raise ValueError(f"bf16 deq GEMM rejected x {tuple(x.shape)} for {n} outputs (rc={rc})")
    return out


def invariant_gemm_uses_bf16_dot() -> bool:
    lib = _library()
    return lib is not None and bool(lib.streamkv_inv_gemm_bf16_dot())


def invariant_gemm_bf16_path() -> str | None:
    """What the invariant GEMM can run bf16 weights on here: ``amx`` (tiles, when asked per call;
    K a multiple of 32), else ``avx512bf16`` or ``fma``; None without the native kernels."""
    lib = _library()
    return None if lib is None else lib.streamkv_inv_gemm_bf16_path().decode()


def _inv_gemm(fn: ctypes._CFuncPtr, x: torch.Tensor, wp: torch.Tensor, n: int,
              out_dtype: torch.dtype, tiles: bool = False) -> torch.Tensor:
    """x [M, K] @ the packed weight (``models/linear.py: pack_dense``) -> [M, n] in ``out_dtype``.

    x float32 with float32 panels, or bfloat16 with bfloat16 panels; out float32 or bfloat16;
    ``tiles``: bf16 on AMX tiles where the CPU has them (ignored elsewhere).
    """
    wbf16 = wp.dtype == torch.bfloat16
    if x.dim() != 2 or x.dtype != wp.dtype or wp.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"invariant GEMM needs 2-D input in the weights' dtype {wp.dtype}, got {x.dtype} "
                        f"{tuple(x.shape)}")
    x, out = _gemm_out(x, n, out_dtype, "invariant GEMM")
    m, k = x.shape
    if m == 0:
        return out
    rc = fn(x.data_ptr(), m, k, wp.data_ptr(), int(wbf16), n, out.data_ptr(), int(out_dtype == torch.bfloat16),
            int(tiles))
    if rc != 0:
        raise ValueError(f"invariant GEMM rejected x {tuple(x.shape)} for {n} outputs (rc={rc})")
    return out


def _attn_args(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seqs: torch.Tensor, slots: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The invariant attention kernels' arguments: q [T, H, D] as contiguous float32, seqs and slots
    contiguous, and the output [T, H, D] float32 to fill. The cache must already be contiguous."""
    if not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    q = q.float().contiguous()
    return q, seqs.contiguous(), slots.contiguous(), torch.empty(q.shape, dtype=torch.float32)


def invariant_attention() -> Callable[..., torch.Tensor] | None:
    """The batch-invariant paged attention kernel (``inv_attn.c``) wrapped for tensors, or None."""
    lib = _library()
    return None if lib is None else functools.partial(_inv_attn, lib.streamkv_inv_attn)


def _inv_attn(fn: ctypes._CFuncPtr, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seqs: torch.Tensor,
              slots: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D] -> out [T, H, D] float32 (see ``inv_attn.c`` for seqs [B, 4] and slots).

    kc, vc [S, Hk, D] bfloat16 or float32, contiguous; D a multiple of 16, at most 256.
    """
    if kc.dtype not in (torch.bfloat16, torch.float32) or kc.dtype != vc.dtype:
        raise TypeError(f"invariant attention supports bfloat16/float32 caches, got {kc.dtype}")
    q, seqs, slots, out = _attn_args(q, kc, vc, seqs, slots)
    t, h, d = q.shape
    rc = fn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), int(kc.dtype == torch.bfloat16), seqs.data_ptr(),
            seqs.shape[0], slots.data_ptr(), h, kc.shape[1], d, float(scale), out.data_ptr())
    if rc != 0:
        raise ValueError(f"invariant attention rejected q={tuple(q.shape)} kv={tuple(kc.shape)} (rc={rc})")
    return out


def invariant_attention_bf16() -> Callable[..., torch.Tensor] | None:
    """The batch-invariant attention with bf16 dot products (``inv_attn_bf16.c``: bf16 cache, head_dim a
    multiple of 16 up to 128, AVX512-BF16 CPUs), or None where it is not built."""
    lib = _library()
    if lib is None or not lib.streamkv_inv_attn_bf16_available():
        return None
    return functools.partial(_inv_attn_bf16, lib.streamkv_inv_attn_bf16)


def invariant_attention_amx() -> Callable[..., torch.Tensor] | None:
    """The same kernel with every dot product on AMX tiles (``attn_amx_rows.h``; its own bits,
    a separate path), or None where the CPU or the build has no AMX."""
    lib = _library()
    if lib is None or not lib.streamkv_inv_attn_bf16_available() or not lib.streamkv_inv_attn_amx_available():
        return None
    return functools.partial(_inv_attn_bf16, lib.streamkv_inv_attn_bf16, tiles=True)


def _inv_attn_bf16(fn: ctypes._CFuncPtr, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seqs: torch.Tensor,
                   slots: torch.Tensor, scale: float, tiles: bool = False) -> torch.Tensor:
    """q [T, H, D] -> out [T, H, D] float32 over a bf16 cache (contract of ``inv_attn_bf16.c``;
    ``tiles``: on AMX tiles, only where ``invariant_attention_amx()`` exists)."""
    if kc.dtype != torch.bfloat16 or vc.dtype != torch.bfloat16:
        raise TypeError(f"bf16 invariant attention needs a bfloat16 cache, got {kc.dtype}")
    q, seqs, slots, out = _attn_args(q, kc, vc, seqs, slots)
    t, h, d = q.shape
    rc = fn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), seqs.data_ptr(), seqs.shape[0], slots.data_ptr(), h,
            kc.shape[1], d, float(scale), out.data_ptr(), int(tiles))
    if rc != 0:
        raise ValueError(f"bf16 invariant attention rejected q={tuple(q.shape)} kv={tuple(kc.shape)} (rc={rc})")
    return out


def layer_library() -> ctypes.CDLL | None:
    """The library with ``native/layer.c`` (whole decoder layers, see ``models/native_layers.py``), or None."""
    return _library()
