"""Llama family (Llama 2/3.x, SmolLM2, TinyLlama, Mistral): pre-norm decoder with GQA.

Weights are held as plain tensors and applied with ``F.linear``; Q/K/V and gate/up are
fused into one matrix each so a layer is four matmuls.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from streamkv.attention.backend import AttentionBackend
from streamkv.models.config import ArchConfig
from streamkv.models.registry import register_model
from streamkv.models.rope import RotaryEmbedding, apply_rope


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        w = lambda name: weights[prefix + name]  # noqa: E731
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.eps = arch.rms_norm_eps
        self.attn_norm = nn.Parameter(w("attn_norm.weight"), requires_grad=False)
        self.mlp_norm = nn.Parameter(w("mlp_norm.weight"), requires_grad=False)
        self.qkv = nn.Parameter(torch.cat([w("q_proj.weight"), w("k_proj.weight"), w("v_proj.weight")]),
                                requires_grad=False)
        bias = None
        if prefix + "q_proj.bias" in weights:
            bias = torch.cat([w("q_proj.bias"), w("k_proj.bias"), w("v_proj.bias")])
        self.qkv_bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.o_proj = nn.Parameter(w("o_proj.weight"), requires_grad=False)
        self.gate_up = nn.Parameter(torch.cat([w("gate_proj.weight"), w("up_proj.weight")]), requires_grad=False)
        self.down = nn.Parameter(w("down_proj.weight"), requires_grad=False)
        self.intermediate = arch.intermediate_size

    def qk_transform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before RoPE (identity here; Qwen3 normalises each head)."""
        return q, k

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                backend: AttentionBackend, meta: Any) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        t = x.shape[0]
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(F.rms_norm(x, (x.shape[-1],), self.attn_norm, self.eps), self.qkv, self.qkv_bias)
        q = qkv[:, : h * d].view(t, h, d)
        k = qkv[:, h * d:(h + hk) * d].view(t, hk, d)
        v = qkv[:, (h + hk) * d:].view(t, hk, d)
        q, k = self.qk_transform(q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = backend.forward(layer, q, k, v, meta)
        x = x + F.linear(attn.reshape(t, h * d), self.o_proj)
        gu = F.linear(F.rms_norm(x, (x.shape[-1],), self.mlp_norm, self.eps), self.gate_up)
        return x + F.linear(F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate:], self.down)


@register_model("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(nn.Module):
    """Causal LM over the canonical parameter names of ``models/config.py``."""

    layer_cls: type[DecoderLayer] = DecoderLayer

    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed = nn.Parameter(weights["embed.weight"], requires_grad=False)
        self.layers = nn.ModuleList(
            self.layer_cls(arch, weights, f"layers.{i}.") for i in range(arch.num_layers))
        self.norm = nn.Parameter(weights["norm.weight"], requires_grad=False)
        head = self.embed if arch.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = head if isinstance(head, nn.Parameter) else nn.Parameter(head, requires_grad=False)
        self.rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling, max_positions,
                                    device=self.embed.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: Any) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (before the last norm)."""
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        x = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, backend, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        h = F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.arch.rms_norm_eps)
        return F.linear(h, self.lm_head).float()
