"""Qwen2 / Qwen2.5 (q/k/v bias) and Qwen3 (per-head RMSNorm on q and k before RoPE)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from streamkv.models.config import ArchConfig
from streamkv.models.llama import DecoderLayer, LlamaForCausalLM
from streamkv.models.registry import register_model


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same graph as Llama; the q/k/v biases are picked up from the weights."""


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__(arch, weights, prefix)
        self.q_norm = nn.Parameter(weights[prefix + "q_norm.weight"], requires_grad=False)
        self.k_norm = nn.Parameter(weights[prefix + "k_norm.weight"], requires_grad=False)

    def qk_transform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = (self.head_dim,)
        return F.rms_norm(q, d, self.q_norm, self.eps), F.rms_norm(k, d, self.k_norm, self.eps)


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
