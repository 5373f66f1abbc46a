"""Wrappers of the kernels built without fast math (each output's rounding chain is in the
source): 4-bit / 8-bit GEMMs, GGUF dequantization, KV row moves, the batch-invariant GEMM and
attention, and whole decoder layers."""
from __future__ import annotations

import ctypes
import functools
from typing import Callable

import torch

from streamkv.native import loader  # ``loader._library()`` at call time (tests replace it)


def q4_gemm() -> Callable[..., torch.Tensor] | None:
    """The AVX512-BF16 4-bit-weight GEMM (see ``q4_gemm.c``), or None when unavailable."""
    lib = loader._library()
    if lib is None or not lib.streamkv_q4_available():
        return None
    return functools.partial(_q4, lib.streamkv_q4_gemm)


def _q4(fn: ctypes._CFuncPtr, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor, n: int,
        out_dtype: torch.dtype = torch.float32, fma: bool = False) -> torch.Tensor:
    """x [M, K] bf16 @ the packed [n, K] weight -> [M, n] float32 or bfloat16 (layout in ``q4_gemm.c``);
    ``fma``: its float32 fma chain instead of vdpbf16ps (``linear=q4f``, its own bits)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise TypeError(f"q4 GEMM needs a 2-D bfloat16 input, got {x.dtype} {tuple(x.shape)}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"q4 GEMM writes float32 or bfloat16, not {out_dtype}")
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=out_dtype)
    rc = fn(x.data_ptr(), m, k, w.data_ptr(), sz.data_ptr(), n, out.data_ptr(), int(out_dtype == torch.bfloat16),
            int(fma))
    check_rc(rc, f"q4 GEMM of x {tuple(x.shape)} for {n} outputs")
    return out


def check_rc(rc: int, what: str) -> None:
    """The GEMM and attention kernels' return codes: 0 done, 3 no memory for their buffers (the
    output not written: ``MemoryError``), any other a rejected call (``ValueError``)."""
    if rc == 3:
        raise MemoryError(f"{what}: the kernel could not allocate its buffers")
    if rc != 0:
        raise ValueError(f"{what}: rejected (rc={rc})")


def q8_gemm() -> Callable[..., torch.Tensor] | None:
    """The Q8_0 GEMM of ``q4_gemm.c`` (AVX512-BF16; float32 output), or None when unavailable."""
    lib = loader._library()
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
    if m:
        check_rc(fn(x.data_ptr(), m, k, w.data_ptr(), d.data_ptr(), n, out.data_ptr()),
                 f"q8 GEMM of x {tuple(x.shape)} for {n} outputs")
    return out


def gguf_dequant() -> Callable[[int, int, int, int], int] | None:
    """``fn(kind, raw_ptr, blocks, out_ptr)`` of ``gguf_deq.c`` (kind 0 Q8_0, 1 Q4_0, 2 Q4_1),
    or None without the kernels."""
    lib = loader._library()
    return None if lib is None else lib.streamkv_gguf_dequant


def kv_move() -> Callable[..., None] | None:
    """The native KV row mover with key rotation (``kv_move.c``), or None without the kernels."""
    lib = loader._library()
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


def invariant_isa() -> str | None:
    """The vector ISA the batch-invariant kernels were built for (avx512f | avx2 | scalar), or None."""
    lib = loader._library()
    return None if lib is None else lib.streamkv_inv_isa().decode()


def invariant_gemm() -> Callable[..., torch.Tensor] | None:
    """The batch-invariant dense GEMM (``inv_gemm.c``) wrapped for tensors, or None."""
    lib = loader._library()
    return None if lib is None else functools.partial(_inv_gemm, lib.streamkv_inv_gemm)


def gemm_path(tiles: bool = False, fma: bool = False) -> int:
    """inv_gemm.c's ``path`` for bf16 weights: 1 AMX tiles (``gemm=amx``), 2 vdpbf16ps's chain on
    float32 fmas (``gemm=fma``: the same bits where the CPU's vdpbf16ps adds as documented), else 0."""
    if tiles and fma:
        raise ValueError("the dense GEMM runs on AMX tiles or on the fma chain, not both")
    return 1 if tiles else 2 if fma else 0


def _gemm_out(x: torch.Tensor, n: int, out_dtype: torch.dtype, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x contiguous and the [M, n] output of a GEMM writing ``out_dtype`` (float32 or bfloat16)."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{what} writes float32 or bfloat16, not {out_dtype}")
    x = x.contiguous()
    return x, torch.empty(x.shape[0], n, dtype=out_dtype)


def deq_gemm() -> Callable[..., torch.Tensor] | None:
    """The float32 GEMM over packed 4-bit / 8-bit GGUF weights with the dense float32 GEMM's bits
    (``deq_gemm.c``), or None without the native kernels."""
    lib = loader._library()
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
    check_rc(rc, f"deq GEMM of x {tuple(x.shape)} for {n} outputs")
    return out


def deq_gemm_bf16() -> Callable[..., torch.Tensor] | None:
    """The bf16 GEMM over packed 4-bit / 8-bit GGUF weights with the dense bf16 GEMM's bits
    (``deq_bf16.c``; AVX512-BF16 CPUs with VBMI), or None where it cannot run."""
    lib = loader._library()
    if lib is None or not lib.streamkv_deq_bf16_available():
        return None
    return functools.partial(_deq_gemm_bf16, lib.streamkv_deq_gemm_bf16)


def _deq_gemm_bf16(fn: ctypes._CFuncPtr, x: torch.Tensor, q: torch.Tensor, dm: torch.Tensor, n: int,
                   out_dtype: torch.dtype = torch.bfloat16, tiles: bool = False, fma: bool = False) -> torch.Tensor:
    """x [M, K] bf16 @ the packed [n, K] weight (``models/deq_linear.py``: ``pack_deq_bf16``, 4-bit when q
    is uint8; ``pack_deq8_bf16``, 8-bit when int8) -> [M, n] in ``out_dtype``, the bits of
    ``invariant_gemm`` over the dense bf16 weights (``tiles`` and ``fma`` alike)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise TypeError(f"bf16 deq GEMM needs a 2-D bfloat16 input, got {x.dtype} {tuple(x.shape)}")
    if q.dtype not in (torch.uint8, torch.int8) or dm.dtype != torch.float32 or not (q.is_contiguous()
                                                                                       and dm.is_contiguous()):
        raise TypeError(f"bf16 deq GEMM needs contiguous uint8 / int8 values and float32 scales, got {q.dtype}, {dm.dtype}")
    x, out = _gemm_out(x, n, out_dtype, "bf16 deq GEMM")
    m, k = x.shape
    t, g = -(-n // 16), k // 32
    bits = 4 if q.dtype == torch.uint8 else 8
    want = ((t, g, 16, 16), (t, g, 16, 2)) if bits == 4 else ((t, g, 16, 32), (t, g, 16))
    if k % 32 or (tuple(q.shape), tuple(dm.shape)) != want:  # the kernel reads what these say
        raise ValueError(f"bf16 deq GEMM: packed weights {tuple(q.shape)} / {tuple(dm.shape)} do not hold "
                         f"[{n}, {k}] (expected {want[0]} / {want[1]})")
    if m == 0:
        return out
    rc = fn(x.data_ptr(), m, k, q.data_ptr(), dm.data_ptr(), bits, n, out.data_ptr(),
            int(out_dtype == torch.bfloat16), gemm_path(tiles, fma))
    check_rc(rc, f"bf16 deq GEMM of x {tuple(x.shape)} for {n} outputs")
    return out


def invariant_gemm_uses_bf16_dot() -> bool:
    lib = loader._library()
    return lib is not None and bool(lib.streamkv_inv_gemm_bf16_dot())


def invariant_gemm_bf16_path() -> str | None:
    """What the invariant GEMM can run bf16 weights on here: ``amx`` (tiles, when asked per call;
    K a multiple of 32), else ``avx512bf16`` or ``fma``; None without the native kernels."""
    lib = loader._library()
    return None if lib is None else lib.streamkv_inv_gemm_bf16_path().decode()


def _inv_gemm(fn: ctypes._CFuncPtr, x: torch.Tensor, wp: torch.Tensor, n: int,
              out_dtype: torch.dtype, tiles: bool = False, fma: bool = False) -> torch.Tensor:
    """x [M, K] @ the packed weight (``models/linear.py: pack_dense``) -> [M, n] in ``out_dtype``.

    x float32 with float32 panels, or bfloat16 with bfloat16 panels; out float32 or bfloat16;
    ``tiles``: bf16 on AMX tiles where the CPU has them (ignored elsewhere); ``fma``: bf16 on the fma
    chain of vdpbf16ps (AVX512-BF16 builds; ignored elsewhere).
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
            gemm_path(tiles, fma))
    check_rc(rc, f"invariant GEMM of x {tuple(x.shape)} for {n} outputs")
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
    lib = loader._library()
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
    check_rc(rc, f"invariant attention of q={tuple(q.shape)} over kv={tuple(kc.shape)}")
    return out


def invariant_attention_bf16() -> Callable[..., torch.Tensor] | None:
    """The batch-invariant attention with bf16 dot products (``inv_attn_bf16.c``: bf16 cache, head_dim a
    multiple of 16 up to 128, AVX512-BF16 CPUs), or None where it is not built."""
    lib = loader._library()
    if lib is None or not lib.streamkv_inv_attn_bf16_available():
        return None
    return functools.partial(_inv_attn_bf16, lib.streamkv_inv_attn_bf16)


def invariant_attention_amx() -> Callable[..., torch.Tensor] | None:
    """The same kernel with every dot product on AMX tiles (``attn_amx_rows.h``; its own bits,
    a separate path), or None where the CPU or the build has no AMX."""
    lib = loader._library()
    if lib is None or not lib.streamkv_inv_attn_bf16_available() or not lib.streamkv_inv_attn_amx_available():
        return None
    return functools.partial(_inv_attn_bf16, lib.streamkv_inv_attn_bf16, mode=1)


def invariant_attention_bf16f() -> Callable[..., torch.Tensor] | None:
    """The same kernel with each bf16 dot product as two float32 fmas (``attn_bf16_rows.h``'s fma
    chain, the ``bf16f`` path: its own bits, those of vdpbf16ps wherever no denormal shows), or None
    where the bf16 kernel is not built."""
    lib = loader._library()
    if lib is None or not lib.streamkv_inv_attn_bf16_available():
        return None
    return functools.partial(_inv_attn_bf16, lib.streamkv_inv_attn_bf16, mode=2)


def _inv_attn_bf16(fn: ctypes._CFuncPtr, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seqs: torch.Tensor,
                   slots: torch.Tensor, scale: float, mode: int = 0, direct: bool = False) -> torch.Tensor:
    """q [T, H, D] -> out [T, H, D] float32 over a bf16 cache (contract of ``inv_attn_bf16.c``;
    ``mode``: 0 vdpbf16ps, 1 AMX tiles (only where ``invariant_attention_amx()`` exists), 2 the fma
    chain; ``direct``: few-row items gather each head's blocks from the pool instead of staging the
    rows, the same bits)."""
    if kc.dtype != torch.bfloat16 or vc.dtype != torch.bfloat16:
        raise TypeError(f"bf16 invariant attention needs a bfloat16 cache, got {kc.dtype}")
    q, seqs, slots, out = _attn_args(q, kc, vc, seqs, slots)
    t, h, d = q.shape
    rc = fn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), seqs.data_ptr(), seqs.shape[0], slots.data_ptr(), h,
            kc.shape[1], d, float(scale), out.data_ptr(), mode | (4 if direct else 0))
    check_rc(rc, f"bf16 invariant attention of q={tuple(q.shape)} over kv={tuple(kc.shape)}")
    return out


def layer_library() -> ctypes.CDLL | None:
    """The library with ``native/layer.c`` (whole decoder layers, see ``models/native_layers.py``), or None."""
    return loader._library()
