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
    def __init__(self, cache: KVCache, scale: float, kernel: Callable[..., torch.Tensor] | None = None) -> None:
        super().__init__(cache, scale)
        if kernel is None:
            from streamkv.attention.native import decode_attention

            kernel = decode_attention()
        if kernel is None:
            raise RuntimeError("the native decode kernel is unavailable")
        self.kernel = kernel

    def prepare(self, spans: list[SeqSpan], num_tokens: int) -> Any:
        meta = super().prepare(spans, num_tokens)
        native = NativeMeta(**vars(meta))
        decodes = [s for s in spans if s.q_len == 1 and s.start > 0]
        if decodes:
            bs, device = self.cache.block_size, self.cache.k.device
            from streamkv.attention.torch_ref import span_slots

            parts = [span_slots(s.block_table, s.ctx_len, bs, device) for s in decodes]
            native.dec_flat = torch.cat(parts)
            lengths = torch.tensor([0] + [p.numel() for p in parts], dtype=torch.int64)
            native.dec_offsets = torch.cumsum(lengths, 0)
        return native

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: Any) -> torch.Tensor:
        qd = q if meta.all_decode else q.index_select(0, meta.dec_rows)
        out = self.kernel(qd, kc, vc, meta.dec_flat, meta.dec_offsets, self.scale)
        return out.to(q.dtype)
