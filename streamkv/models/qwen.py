"""Qwen2 / Qwen2.5 (q/k/v bias) and Qwen3 (per-head RMSNorm on q and k before RoPE)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from streamkv.models.config import ArchConfig
from streamkv.models.linear import NO_OPTIONS, KernelOptions
from streamkv.models.llama import DecoderLayer, LlamaForCausalLM, rms_norm
from streamkv.models.registry import register_model


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same graph as Llama; the q/k/v biases are picked up from the weights."""


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], prefix: str,
                 q4: dict[str, Any] | None = None, numerics: str = "invariant",
                 options: KernelOptions = NO_OPTIONS) -> None:
        super().__init__(arch, weights, prefix, q4, numerics, options)
        q_norm, k_norm = weights[prefix + "q_norm.weight"], weights[prefix + "k_norm.weight"]
        # one weight row per head of the joint q|k tensor: [H + Hkv, D]
        self.qk_norm = nn.Parameter(torch.cat([q_norm.expand(self.num_heads, -1),
                                               k_norm.expand(self.num_kv_heads, -1)]), requires_grad=False)

    def qk_transform(self, qk: torch.Tensor) -> torch.Tensor:
        return rms_norm(qk, None, self.eps) * self.qk_norm


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
