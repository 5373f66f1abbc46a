"""Wrappers of the fast-math kernels (``decode_attn.c``, ``paged_attn.c``, ``page_select.c``):
attention for the non-invariant numerics and Quest page ranking."""
from __future__ import annotations

import ctypes
import functools
from typing import Callable

import torch

from streamkv.native import loader  # ``loader._library()`` at call time (tests replace it)
from streamkv.native.exact_ops import check_rc


def decode_attention() -> Callable[..., torch.Tensor] | None:
    """The native kernel wrapped for tensors, or None when it is unavailable."""
    lib = loader._library()
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
    check_rc(rc, f"native decode attention of q={tuple(q.shape)} over kv={tuple(kc.shape)}")
    return out


def paged_attention() -> Callable[..., torch.Tensor] | None:
    """The AVX512-BF16 mixed-batch kernel (bf16 cache, head_dim 64), or None when this CPU or
    build lacks it."""
    lib = loader._library()
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
    check_rc(rc, f"paged attention of q={tuple(q.shape)} over kv={tuple(kc.shape)}")
    return out


def page_select() -> Callable[..., torch.Tensor] | None:
    """Quest-style page ranking in C (see ``page_select.c``), or None when unavailable."""
    lib = loader._library()
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
    q, bounds, candidates = _scoring_inputs("page selection", q, bounds, candidates)
    pos = torch.empty(keep, dtype=torch.int64)
    out = None
    if slots is not None:
        slots = slots.contiguous()
        out = torch.empty(sink_len + keep * block_size + slots.numel() - tail_from, dtype=torch.int64)
    rc = fn(q.data_ptr(), int(q.dtype == torch.bfloat16), r, kvh, g, d, bounds.data_ptr(), candidates.data_ptr(),
            candidates.numel(), keep, float(scale), pos.data_ptr(), slots.data_ptr() if slots is not None else None,
            sink_len, tail_from, slots.numel() if slots is not None else 0, block_size,
            out.data_ptr() if out is not None else None)
    check_rc(rc, f"page selection of keep={keep} of {candidates.numel()} pages, head_dim {d}")
    return pos, out


def _scoring_inputs(what: str, q: torch.Tensor, bounds: torch.Tensor,
                    candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The page scorers' inputs, checked (ValueError) and contiguous: q [R, kvh, g, D] float32
    or bfloat16, bounds [blocks, kvh, 2D] bfloat16, candidates [P] int64."""
    _, kvh, _, d = q.shape
    if q.dtype not in (torch.float32, torch.bfloat16) or bounds.dtype != torch.bfloat16 \
            or tuple(bounds.shape[1:]) != (kvh, 2 * d):
        raise ValueError(f"{what} got q {tuple(q.shape)} {q.dtype}, bounds {tuple(bounds.shape)} {bounds.dtype}")
    return q.contiguous(), bounds.contiguous(), candidates.contiguous()


def page_shares() -> Callable[..., torch.Tensor] | None:
    """Each query row's own Quest page shares in C (see ``page_select.c``), or None when unavailable."""
    lib = loader._library()
    return None if lib is None else functools.partial(_shares, lib.streamkv_page_shares)


def _shares(fn: ctypes._CFuncPtr, q: torch.Tensor, bounds: torch.Tensor, candidates: torch.Tensor, scale: float,
            keep: int = 0, slots: torch.Tensor | None = None, sink_len: int = 0, tail_from: int = 0, first: int = 0,
            block_size: int = 1) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """q [R, kvh, g, D] float32 or bfloat16; bounds [blocks, kvh, 2D] bfloat16 (one layer);
    candidates [P] int64 block ids -> (shares [R, P] float32: each row's largest softmax share
    of each page over its heads, the same bits whatever the other rows; with ``keep`` > 0 each
    row's best pages [R, keep] ascending; with ``slots`` [ctx_len] the rows' compacted slots
    back to back: row r = ``slots[:sink_len]``, its pages, ``slots[tail_from:][:first + r]``)."""
    r, kvh, g, d = q.shape
    if not candidates.numel():
        raise ValueError("page shares got 0 candidates")
    q, bounds, candidates = _scoring_inputs("page shares", q, bounds, candidates)
    out = torch.empty(r, candidates.numel(), dtype=torch.float32)
    pos = torch.empty(r, keep, dtype=torch.int64) if keep > 0 else None
    flat = None
    if slots is not None and pos is not None:
        slots = slots.contiguous()
        flat = torch.empty(r * (sink_len + keep * block_size) + r * first + r * (r - 1) // 2, dtype=torch.int64)
    rc = fn(q.data_ptr(), int(q.dtype == torch.bfloat16), r, kvh, g, d, bounds.data_ptr(), candidates.data_ptr(),
            candidates.numel(), float(scale), out.data_ptr(), keep, pos.data_ptr() if pos is not None else None,
            slots.data_ptr() if flat is not None else None, sink_len, tail_from, first, block_size,
            flat.data_ptr() if flat is not None else None)
    check_rc(rc, f"page shares of keep={keep} of {candidates.numel()} pages, head_dim {d}")
    return out, pos, flat


def page_bounds() -> Callable[..., None] | None:
    """Per-block key max/min of a bfloat16 or float32 cache in C (see ``page_select.c``), or None."""
    lib = loader._library()
    return None if lib is None else functools.partial(_bounds, lib.streamkv_page_bounds)


def _bounds(fn: ctypes._CFuncPtr, k: torch.Tensor, block_size: int, blocks: torch.Tensor, out: torch.Tensor) -> None:
    """k [layers, slots, kvh, D] bf16 or float32 (contiguous) -> out[:, blocks] = [max | min] over each
    block's keys (from float32, rounded outward to bf16); out [layers, slots // block_size, kvh, 2D] bf16
    (contiguous)."""
    layers, slots, kvh, d = k.shape
    if k.dtype not in (torch.bfloat16, torch.float32) or out.dtype != torch.bfloat16 \
            or not (k.is_contiguous() and out.is_contiguous()) or kvh * d > 1024:
        raise ValueError(f"page bounds need a contiguous bf16 or float32 cache, bf16 bounds and kv_heads * head_dim "
                         f"<= 1024, got {k.dtype} -> {out.dtype}")
    blocks = blocks.contiguous()
    fn(k.data_ptr(), int(k.dtype == torch.float32), layers, slots, kvh, d, block_size, blocks.data_ptr(),
       blocks.numel(), out.data_ptr(), out.shape[1])
