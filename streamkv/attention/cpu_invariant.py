"""Batch-invariant CPU backend: every row of a step through one kernel (``native/inv_attn.c``).

Decode rows and prefill-chunk rows are the same thing here: a row at context index i reads
keys [0, i] in fixed 512-key chunks merged in order, so its output does not depend on what
else is in the step, on how its prompt was chunked, or on whether it is a decode or a
recomputed prompt row (see the kernel's header for the arithmetic).

::

    step rows   [a0 a1 a2 a3 a4][b40][c7]          spans: A chunk (start 0), B and C decodes
    seqs        (0, 5, 0, 5) (5, 1, 5, 41) (6, 1, 46, 8)     (row0, nq, offset, ctx_len)
    slots       [A's 5 slots | B's 41 slots | C's 8 slots]
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from streamkv.attention.backend import KVCache, Observation, SeqSpan, register_backend
from streamkv.attention.torch_ref import RefMeta, TorchReferenceBackend


@dataclass
class InvariantMeta(RefMeta):
    seqs: torch.Tensor | None = None   # [B, 4] int64 (row0, q_len, offset in slots, ctx_len)
    slots: torch.Tensor | None = None  # [sum of ctx_len] int64


@register_backend("cpu_invariant")
class InvariantCpuBackend(TorchReferenceBackend):
    meta_type = InvariantMeta

    def __init__(self, cache: KVCache, scale: float, bf16: bool | None = None, tiles: bool = False,
                 fma: bool = False, gather: str = "stage") -> None:
        """``bf16``: the bf16 dot-product kernel (the measured ``attention`` choice); None = it
        wherever it fits (bf16 cache, head_dim a multiple of 16 up to 128, AVX512-BF16).
        ``tiles``: that kernel on AMX tiles (the ``amx`` path; its own bits). ``fma``: its products
        as float32 fmas (the ``bf16f`` path). ``gather``: ``direct`` has the bf16 kernels' few-row
        items transpose each head's blocks straight from the pool instead of staging the rows first
        (the measured ``attention_gather``; the same bits)."""
        super().__init__(cache, scale)
        from streamkv.native import (invariant_attention, invariant_attention_amx, invariant_attention_bf16,
                                     invariant_attention_bf16f)

        kernel, bf16_kernel = invariant_attention(), invariant_attention_bf16()
        if kernel is None:
            raise RuntimeError("the native invariant attention kernel is unavailable (no C compiler?)")
        d = cache.k.shape[-1]
        fits = bf16_kernel is not None and cache.k.dtype == torch.bfloat16 and d % 16 == 0 and d <= 128
        if bf16 and not fits:
            raise ValueError("the bf16 attention kernel needs a bf16 cache, head_dim a multiple of 16 up to 128 "
                             "and an AVX512-BF16 CPU")
        self.bf16 = fits if bf16 is None else bf16
        self.kernel = bf16_kernel if self.bf16 else kernel
        if fma and (tiles or not self.bf16):
            raise ValueError("the bf16f attention path is the bf16 kernel's chain as float32 fmas: it needs what "
                             "that kernel needs and excludes tiles")
        if tiles:
            amx = invariant_attention_amx()
            if not self.bf16 or amx is None:
                raise ValueError("the amx attention path needs what the bf16 kernel needs and a CPU with AMX")
            self.kernel = amx
        if fma:
            self.kernel = invariant_attention_bf16f()
        if gather not in ("stage", "direct"):
            raise ValueError(f"attention gather must be 'stage' or 'direct', not {gather!r}")
        if gather == "direct":
            if not self.bf16:
                raise ValueError("attention_gather=direct applies to the bf16 attention kernels (attention=bf16, "
                                 "bf16f or amx), not to attention=f32")
            self.kernel = functools.partial(self.kernel, direct=True)
        self.gather = gather
        # the native layers take the same
        self.path = "amx" if tiles else "bf16f" if fma else "bf16" if self.bf16 else "f32"

    def _build(self, spans: list[SeqSpan], slots: list[torch.Tensor], mapping: torch.Tensor) -> InvariantMeta:
        offsets = accumulate((span.ctx_len for span in spans), initial=0)
        seqs = torch.tensor([(span.q_start, span.q_len, off, span.ctx_len) for span, off in zip(spans, offsets)],
                            dtype=torch.int64)
        flat = torch.cat(slots) if len(slots) > 1 else slots[0]
        return InvariantMeta(slot_mapping=mapping, seqs=seqs, slots=flat)

    def layer_meta(self, layer: int, q: torch.Tensor, meta: InvariantMeta) -> InvariantMeta:
        """The step's metadata for one layer: with a read policy, each selecting span's context
        compacted to the pages that layer's queries q [T, H, D] pick (and the observed rows'
        queries copied out)."""
        Observation.record(meta.observe, layer, q)
        if meta.selector is None:
            return meta
        return self._build(*meta.selector.for_layer(layer, q), meta.slot_mapping)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc.index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        meta = self.layer_meta(layer, q, meta)
        return self.kernel(q, kc, vc, meta.seqs, meta.slots, self.scale).to(q.dtype)
