"""Mapping of file-format parameter names onto streamkv's canonical names.

The canonical names are listed in :mod:`streamkv.models.config`. Every loader maps its
tensors through one of the functions here and then calls :func:`validate_weights`.
"""
from __future__ import annotations

import re

import torch

from streamkv.errors import ModelLoadError
from streamkv.models.config import ArchConfig

_GGUF_GLOBAL: dict[str, str] = {
    "token_embd": "embed",
    "output_norm": "norm",
    "output": "lm_head",
}

_GGUF_LAYER: dict[str, str] = {
    "attn_norm": "attn_norm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}

_HF_GLOBAL: dict[str, str] = {
    "embed_tokens": "embed",
    "norm": "norm",
    "lm_head": "lm_head",
}

_HF_LAYER: dict[str, str] = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "mlp_norm",
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj",
    "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
    "mlp.gate_proj": "gate_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "down_proj",
}

_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_HF_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(.+)\.(weight|bias)$")


def canonical_from_gguf(name: str) -> str | None:
    """Canonical name of a GGUF tensor, or ``None`` if it has no canonical counterpart."""
    layer = _GGUF_LAYER_RE.match(name)
    if layer:
        index, part, kind = layer.groups()
        mapped = _GGUF_LAYER.get(part)
        return None if mapped is None else f"layers.{index}.{mapped}.{kind}"
    top = _GLOBAL_RE.match(name)
    if top and top.group(1) in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[top.group(1)]}.{top.group(2)}"
    return None


def canonical_from_hf(name: str) -> str | None:
    """Canonical name of a Hugging Face tensor, or ``None`` if it has no counterpart."""
    if name.startswith("model."):
        name = name[len("model."):]
    layer = _HF_LAYER_RE.match(name)
    if layer:
        index, part, kind = layer.groups()
        mapped = _HF_LAYER.get(part)
        return None if mapped is None else f"layers.{index}.{mapped}.{kind}"
    top = _GLOBAL_RE.match(name)
    if top and top.group(1) in _HF_GLOBAL:
        return f"{_HF_GLOBAL[top.group(1)]}.{top.group(2)}"
    return None


def expected_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Required canonical tensors and their shapes for ``arch`` (optional biases excluded)."""
    h, q_rows = arch.hidden_size, arch.num_heads * arch.head_dim
    kv_rows, inter = arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (arch.vocab_size, h), "norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm.weight": (h,), p + "mlp_norm.weight": (h,),
            p + "q_proj.weight": (q_rows, h), p + "k_proj.weight": (kv_rows, h),
            p + "v_proj.weight": (kv_rows, h), p + "o_proj.weight": (h, q_rows),
            p + "gate_proj.weight": (inter, h), p + "up_proj.weight": (inter, h),
            p + "down_proj.weight": (h, inter),
        })
        if arch.attention_bias:
            shapes.update({p + "q_proj.bias": (q_rows,), p + "k_proj.bias": (kv_rows,),
                           p + "v_proj.bias": (kv_rows,)})
        if arch.qk_norm:
            shapes.update({p + "q_norm.weight": (arch.head_dim,), p + "k_norm.weight": (arch.head_dim,)})
    return shapes


def _optional_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Canonical tensors a checkpoint may carry beyond the required ones."""
    h, q_rows, inter = arch.hidden_size, arch.num_heads * arch.head_dim, arch.intermediate_size
    kv_rows = arch.num_kv_heads * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "o_proj.bias": (h,), p + "gate_proj.bias": (inter,),
                       p + "up_proj.bias": (inter,), p + "down_proj.bias": (h,),
                       p + "q_proj.bias": (q_rows,), p + "k_proj.bias": (kv_rows,),
                       p + "v_proj.bias": (kv_rows,)})
    return shapes


def validate_weights(weights: dict[str, torch.Tensor], arch: ArchConfig, source: str) -> None:
    """Raise :class:`ModelLoadError` unless ``weights`` has every tensor ``arch`` needs.

    Checks presence and shapes; names outside the canonical set are rejected too, so a
    loader bug cannot silently hand a model unused tensors.
    """
    required = expected_shapes(arch)
    allowed = {**_optional_shapes(arch), **required}
    missing = sorted(set(required) - set(weights))
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ModelLoadError(f"{source}: checkpoint is missing tensors: {shown}")
    for name, tensor in weights.items():
        if name not in allowed:
            raise ModelLoadError(f"{source}: unexpected tensor {name!r} for this architecture")
        if tuple(tensor.shape) != allowed[name]:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {allowed[name]} from the model configuration")
