"""Pure-PyTorch reference backend: mixed prefill chunks + decodes over block tables.

Per step (built once, shared by all layers):

* ``slot_mapping`` [T]: where each new token's K/V goes;
* each prefill chunk (q_len > 1): fresh chunks (start == 0) attend to their own K/V with a
  causal mask; chunks with earlier context gather [ctx_len] slots and use an offset mask;
* all single-token rows (decodes) are batched: gather [B, Lmax] slots with a padding mask
  and run one SDPA call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from streamkv.attention.backend import AttentionBackend, KVCache, Observation, SeqSpan, register_backend
from streamkv.attention.picks import step_count
from streamkv.attention.selection import LayerSelector, Picks
from streamkv.policies.read import ReadCount


@dataclass
class _Prefill:
    q0: int
    q1: int
    ctx_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class RefMeta:
    slot_mapping: torch.Tensor
    prefills: list[_Prefill] = field(default_factory=list)
    dec_rows: torch.Tensor | None = None
    dec_slots: torch.Tensor | None = None
    dec_mask: torch.Tensor | None = None
    all_decode: bool = False  # every row is a decode, rows 0..B-1 in order
    selector: Any = None      # LayerSelector when a span's read policy leaves pages out
    observe: tuple[Observation, ...] = ()  # rows whose queries each layer copies out
    reads: dict[int, ReadCount] = field(default_factory=dict)  # read-policy spans: what they read


def span_slots(block_table: tuple[int, ...], length: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Slots of positions [0, length) of a sequence: [length] int64."""
    nb = -(-length // block_size)
    bt = torch.tensor(block_table[:nb], dtype=torch.int64, device=device)
    offs = torch.arange(block_size, dtype=torch.int64, device=device)
    return (bt[:, None] * block_size + offs).reshape(-1)[:length]


@register_backend("torch")
class TorchReferenceBackend(AttentionBackend):
    """The oracle: plain SDPA calls, float32 accumulation for decode."""

    meta_type: type[RefMeta] = RefMeta

    def __init__(self, cache: KVCache, scale: float) -> None:
        super().__init__(cache, scale)
        self.picks: dict[int, Picks] = {}  # pages each read-policy sequence's question picked

    def release(self, seq_ids: Sequence[int]) -> None:
        for sid in seq_ids:
            self.picks.pop(sid, None)

    def prepare(self, spans: list[SeqSpan], num_tokens: int, observe: Sequence[Observation] = ()) -> RefMeta:
        device = self.cache.k.device
        slots = [span_slots(span.block_table, span.ctx_len, self.cache.block_size, device) for span in spans]
        mapping = torch.cat([s[span.write_from:span.write_from + span.q_len] for span, s in zip(spans, slots)]) \
            if spans else torch.empty(0, dtype=torch.int64, device=device)
        meta = self._build(spans, slots, mapping)
        meta.observe = tuple(observe)
        self.cache.written(mapping)
        if any(span.read is not None for span in spans):
            meta.selector = LayerSelector.build(spans, slots, self.cache, self.scale, self.picks)
            meta.reads = {span.seq_id: step_count(span) for span in spans if span.read}
            if meta.selector is not None:
                meta.selector.counts = meta.reads
        return meta

    def read_counts(self, meta: RefMeta) -> dict[int, ReadCount]:
        """Per sequence with a read policy: what its rows read in the step ``meta`` ran."""
        return {sid: count.close() for sid, count in meta.reads.items()}

    def _build(self, spans: list[SeqSpan], slots: list[torch.Tensor], mapping: torch.Tensor) -> RefMeta:
        """Metadata for ``spans`` whose context slots are ``slots`` (one [ctx_len] tensor each)."""
        device = self.cache.k.device
        meta = self.meta_type(slot_mapping=mapping)
        decodes: list[tuple[SeqSpan, torch.Tensor]] = []
        prefills: list[tuple[SeqSpan, torch.Tensor]] = []
        for span, s in zip(spans, slots):
            (decodes if span.is_decode else prefills).append((span, s))
        if prefills:
            self._prepare_prefills(meta, prefills, device)
        if decodes:
            meta.all_decode = not prefills
            if prefills:  # decode rows are picked out of (and written back into) the step's rows
                meta.dec_rows = torch.tensor([s.q_start for s, _ in decodes], dtype=torch.int64, device=device)
            self._prepare_decodes(meta, decodes, device)
        return meta

    def _prepare_prefills(self, meta: RefMeta, prefills: list[tuple[SeqSpan, torch.Tensor]],
                          device: torch.device) -> None:
        """Prefill chunks with their context slots [ctx_len] (per-chunk SDPA calls)."""
        for span, slots in prefills:
            if span.start == 0:
                meta.prefills.append(_Prefill(span.q_start, span.q_start + span.q_len, None, None))
            else:
                pos = torch.arange(span.start, span.ctx_len, device=device)
                mask = torch.arange(span.ctx_len, device=device)[None, :] <= pos[:, None]
                meta.prefills.append(_Prefill(span.q_start, span.q_start + span.q_len, slots, mask))

    def _prepare_decodes(self, meta: RefMeta, decodes: list[tuple[SeqSpan, torch.Tensor]],
                         device: torch.device) -> None:
        lengths = [s.ctx_len for s, _ in decodes]
        lmax = max(lengths)
        if len(decodes) == 1:
            meta.dec_slots = decodes[0][1][None, :]
            return
        slots = torch.zeros(len(decodes), lmax, dtype=torch.int64, device=device)
        for i, (_, s) in enumerate(decodes):
            slots[i, : s.numel()] = s
        meta.dec_slots = slots
        if min(lengths) != lmax:
            lens = torch.tensor(lengths, device=device)
            meta.dec_mask = (torch.arange(lmax, device=device)[None, :] < lens[:, None])[:, None, None, :]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: RefMeta) -> torch.Tensor:
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc.index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        Observation.record(meta.observe, layer, q)
        if meta.selector is not None:
            meta = self._build(*meta.selector.for_layer(layer, q), meta.slot_mapping)
        if meta.all_decode:
            return self._decode(q, kc, vc, meta)
        out = self._prefill(q, k, v, kc, vc, meta)
        if meta.dec_rows is not None:
            out.index_copy_(0, meta.dec_rows, self._decode(q, kc, vc, meta))
        return out

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                 meta: RefMeta) -> torch.Tensor:
        """[T, H, D] with every prefill chunk's rows filled (decode rows are written after)."""
        out = torch.empty_like(q)
        # SDPA takes [1, heads, len, dim] views; 3-D inputs fall back to the slow math kernel.
        for p in meta.prefills:
            qs = q[p.q0:p.q1].transpose(0, 1)[None]
            if p.ctx_slots is None:
                ks, vs = k[p.q0:p.q1].transpose(0, 1)[None], v[p.q0:p.q1].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                ks = kc.index_select(0, p.ctx_slots).transpose(0, 1)[None].to(q.dtype)
                vs = vc.index_select(0, p.ctx_slots).transpose(0, 1)[None].to(q.dtype)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, scale=self.scale, enable_gqa=True)
            out[p.q0:p.q1] = o[0].transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: RefMeta) -> torch.Tensor:
        # CPU SDPA is ~3x slower in bfloat16 than float32 for one query row: use float32.
        b, length = meta.dec_slots.shape
        flat = meta.dec_slots.view(-1)
        qd = (q if meta.all_decode else q.index_select(0, meta.dec_rows)).unsqueeze(2).float()  # [B, H, 1, D]
        ks = kc.index_select(0, flat).view(b, length, *kc.shape[1:]).transpose(1, 2).float()  # [B, Hkv, L, D]
        vs = vc.index_select(0, flat).view(b, length, *vc.shape[1:]).transpose(1, 2).float()
        o = F.scaled_dot_product_attention(qd, ks, vs, attn_mask=meta.dec_mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(2).to(q.dtype)                                    # [B, H, D]
