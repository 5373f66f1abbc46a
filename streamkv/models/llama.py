"""Llama family (Llama 2/3.x, SmolLM2, TinyLlama, Mistral): pre-norm decoder with GQA.

Weights are held as plain tensors and applied with ``F.linear``; Q/K/V and gate/up are
fused into one matrix each so a layer is four matmuls.

Precision: matmuls and attention run in the weights' dtype, but the residual stream and
the RMSNorm weights stay float32. Small models carry "massive activations" (SmolLM2's
residual reaches ~25,000 on the first token) that a bfloat16 residual rounds by ~100,
which visibly flattens next-token distributions; a float32 residual costs two casts per
sub-layer and keeps bfloat16 logits within ~1e-2 of float32.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from streamkv.attention.backend import AttentionBackend
from streamkv.models.config import ArchConfig
from streamkv.models.q4_linear import DENSE, PackedQ4, RowSplit, split_linear, split_rows
from streamkv.models.registry import register_model
from streamkv.models.rope import RotaryEmbedding, apply_rope




def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. Same values as ``F.rms_norm``, which on CPU (torch 2.13)
    is ~13x slower at prefill sizes (3.2 ms vs 0.25 ms for 2048 x 576 float32)."""
    out = x * torch.rsqrt((x * x).mean(-1, keepdim=True).add_(eps))
    return out if weight is None else out.mul_(weight)


def _optional(weights: dict[str, torch.Tensor], name: str) -> nn.Parameter | None:
    return nn.Parameter(weights[name], requires_grad=False) if name in weights else None


def _pack(q4: dict[str, Any] | None, names: list[str]) -> PackedQ4 | None:
    """Row-concatenate the Q4 matrices ``names`` (all must be present) into one PackedQ4."""
    if not q4 or not all(n in q4 for n in names):
        return None
    parts = [q4[n] for n in names]
    return PackedQ4(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                    torch.cat([p.zero for p in parts]))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], prefix: str,
                 q4: dict[str, Any] | None = None) -> None:
        super().__init__()
        w = lambda name: weights[prefix + name]  # noqa: E731
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.eps = arch.rms_norm_eps
        self.attn_norm = nn.Parameter(w("attn_norm.weight").float(), requires_grad=False)
        self.mlp_norm = nn.Parameter(w("mlp_norm.weight").float(), requires_grad=False)
        self.qkv = nn.Parameter(torch.cat([w("q_proj.weight"), w("k_proj.weight"), w("v_proj.weight")]),
                                requires_grad=False)
        bias = None
        if prefix + "q_proj.bias" in weights:
            bias = torch.cat([w("q_proj.bias"), w("k_proj.bias"), w("v_proj.bias")])
        self.qkv_bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.o_proj = nn.Parameter(w("o_proj.weight"), requires_grad=False)
        self.gate_up = nn.Parameter(torch.cat([w("gate_proj.weight"), w("up_proj.weight")]), requires_grad=False)
        self.down = nn.Parameter(w("down_proj.weight"), requires_grad=False)
        self.o_bias = _optional(weights, prefix + "o_proj.bias")
        self.down_bias = _optional(weights, prefix + "down_proj.bias")
        gate_up_bias = None
        if prefix + "gate_proj.bias" in weights:
            gate_up_bias = torch.cat([w("gate_proj.bias"), w("up_proj.bias")])
        self.gate_up_bias = nn.Parameter(gate_up_bias, requires_grad=False) if gate_up_bias is not None else None
        self.intermediate = arch.intermediate_size
        self.q4_qkv = _pack(q4, [prefix + n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight")])
        self.q4_o = _pack(q4, [prefix + "o_proj.weight"])
        self.q4_gate_up = _pack(q4, [prefix + "gate_proj.weight", prefix + "up_proj.weight"])
        self.q4_down = _pack(q4, [prefix + "down_proj.weight"])

    def qk_transform(self, qk: torch.Tensor) -> torch.Tensor:
        """Hook before RoPE on the joint q|k heads [T, H + Hkv, D] (identity; Qwen3 normalises)."""
        return qk

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                backend: AttentionBackend, meta: Any, rows: RowSplit = DENSE) -> torch.Tensor:
        """x [T, hidden] float32 residual -> [T, hidden] float32; ``rows``: which rows take the
        packed 4-bit weights (``models/q4_linear.py``)."""
        t, dt = x.shape[0], self.qkv.dtype
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = split_linear(rms_norm(x, self.attn_norm, self.eps).to(dt), self.qkv, self.qkv_bias, self.q4_qkv, rows)
        # q and k heads are adjacent in the fused projection: one RoPE call rotates both.
        qk = apply_rope(self.qk_transform(qkv[:, :(h + hk) * d].view(t, h + hk, d)), cos, sin)
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, (h + hk) * d:].view(t, hk, d)
        attn = backend.forward(layer, q, k, v, meta)
        x = x + split_linear(attn.reshape(t, h * d), self.o_proj, self.o_bias, self.q4_o, rows)
        gu = split_linear(rms_norm(x, self.mlp_norm, self.eps).to(dt), self.gate_up, self.gate_up_bias,
                          self.q4_gate_up, rows)
        act = F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate:]
        return x + split_linear(act, self.down, self.down_bias, self.q4_down, rows)


@register_model("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(nn.Module):
    """Causal LM over the canonical parameter names of ``models/config.py``."""

    layer_cls: type[DecoderLayer] = DecoderLayer

    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 q4: dict[str, Any] | None = None) -> None:
        """``q4``: optional canonical name -> Q4Matrix (``loading/q4_blocks.py``) for small batches."""
        super().__init__()
        self.arch = arch
        self.embed = nn.Parameter(weights["embed.weight"], requires_grad=False)
        self.layers = nn.ModuleList(
            self.layer_cls(arch, weights, f"layers.{i}.", q4) for i in range(arch.num_layers))
        self.norm = nn.Parameter(weights["norm.weight"].float(), requires_grad=False)
        head = self.embed if arch.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = head if isinstance(head, nn.Parameter) else nn.Parameter(head, requires_grad=False)
        halves = (q4 or {}).get("lm_head.q8_halves")
        self.q4_lm_head = nn.ModuleList(PackedQ4(h.q, h.scale, h.zero) for h in halves) if halves else None
        self.rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling, max_positions,
                                    device=self.embed.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def q4_max_rows(self) -> int:
        """Most decode rows a step may have for them to take the packed 4-bit weights (0: none)."""
        first = self.layers[0].q4_qkv if len(self.layers) else None
        return first.max_rows if first is not None else 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: Any, rows: RowSplit = DENSE) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (before the last norm)."""
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        x = F.embedding(input_ids, self.embed).float()
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, cos, sin, i, backend, meta, rows)  # no hooks: skip Module.__call__
        return x

    def compute_logits(self, hidden: torch.Tensor, rows: RowSplit = DENSE) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32; ``rows`` indexes the N rows."""
        h = rms_norm(hidden, self.norm, self.arch.rms_norm_eps).to(self.lm_head.dtype)
        q4 = None
        if self.q4_lm_head is not None:
            hi, lo = self.q4_lm_head
            q4 = lambda x: hi.forward_f32(x).add_(lo.forward_f32(x))  # noqa: E731
        return split_rows(h, rows, q4, lambda x: F.linear(x, self.lm_head).float())
