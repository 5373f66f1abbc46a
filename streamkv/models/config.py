"""Canonical architecture description shared by every loader and model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ArchConfig:
    """Architecture hyper-parameters, independent of the file format.

    Loaders (GGUF, Hugging Face directories) fill this in; models read only this.
    ``architecture`` is the Hugging Face architecture name used for the model registry
    (e.g. ``"LlamaForCausalLM"``, ``"Qwen2ForCausalLM"``, ``"Qwen3ForCausalLM"``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ArchConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")


# Canonical parameter names (every loader maps onto exactly these):
#   embed.weight                               [vocab, hidden]
#   layers.{i}.attn_norm.weight                [hidden]
#   layers.{i}.q_proj.weight / .bias           [num_heads*head_dim, hidden] (bias optional)
#   layers.{i}.k_proj.weight / .bias           [num_kv_heads*head_dim, hidden]
#   layers.{i}.v_proj.weight / .bias           [num_kv_heads*head_dim, hidden]
#   layers.{i}.o_proj.weight                   [hidden, num_heads*head_dim]
#   layers.{i}.q_norm.weight, k_norm.weight    [head_dim]            (qk_norm models)
#   layers.{i}.mlp_norm.weight                 [hidden]
#   layers.{i}.gate_proj.weight, up_proj.weight [intermediate, hidden]
#   layers.{i}.down_proj.weight                [hidden, intermediate]
#   norm.weight                                [hidden]
#   lm_head.weight                             [vocab, hidden]        (absent when tied)
# Q and K rows are in Hugging Face (rotate-half / NeoX) order.
