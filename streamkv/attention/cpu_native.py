"""CPU backend: the reference backend, with decode rows computed by the native C kernel.

Decode attention reads every cached key and value of the context once per token; at long
contexts (sessions) that dominates a step. The kernel reads the paged cache in place (no
gather copy, no float32 conversion copy) and splits each context into chunks across threads.
Prefill chunks keep the reference path (torch's flash SDPA).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from streamkv.attention.backend import KVCache, SeqSpan, register_backend
from streamkv.attention.torch_ref import RefMeta, TorchReferenceBackend


@dataclass
class NativeMeta(RefMeta):
    dec_flat: torch.Tensor | None = None     # [sum of context lengths] slots
    dec_offsets: torch.Tensor | None = None  # [B + 1]


@register_backend("cpu")
class CpuNativeBackend(TorchReferenceBackend):
    meta_type = NativeMeta

    def __init__(self, cache: KVCache, scale: float, kernel: Callable[..., torch.Tensor] | None = None) -> None:
        super().__init__(cache, scale)
        if kernel is None:
            from streamkv.attention.native import decode_attention

            kernel = decode_attention()
        if kernel is None:
            raise RuntimeError("the native decode kernel is unavailable")
        self.kernel = kernel

    def _prepare_decodes(self, meta: Any, decodes: list[tuple[SeqSpan, torch.Tensor]],
                         device: torch.device) -> None:
        """Decode rows' context slots back to back (no padded [B, Lmax] gather table)."""
        meta.dec_rows = torch.tensor([s.q_start for s, _ in decodes], dtype=torch.int64, device=device)
        meta.dec_flat = torch.cat([slots for _, slots in decodes])
        lengths = torch.tensor([0] + [slots.numel() for _, slots in decodes], dtype=torch.int64)
        meta.dec_offsets = torch.cumsum(lengths, 0)

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: Any) -> torch.Tensor:
        qd = q if meta.all_decode else q.index_select(0, meta.dec_rows)
        out = self.kernel(qd, kc, vc, meta.dec_flat, meta.dec_offsets, self.scale)
        return out.to(q.dtype)
