"""Llama family (Llama 2/3.x, SmolLM2, TinyLlama, Mistral): pre-norm decoder with GQA.

Each projection is a ``models/linear.py`` op chosen by the numerics mode (one batch-invariant
kernel for every row, or torch's GEMMs split by row kind); Q/K/V and gate/up are fused into
one matrix each so a layer is four matmuls.

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
from streamkv.loading.q4_blocks import Q4Matrix
from streamkv.models.linear import NO_OPTIONS, KernelOptions, Linear, LogitsHead, make_linear
from streamkv.models.native_layers import NativeLayers
from streamkv.models.q4_linear import DENSE, RowSplit
from streamkv.models.registry import register_model
from streamkv.models.rope import RotaryEmbedding, apply_rope


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim [..., n] -> [..., 1] in a fixed pairwise tree (zero-padded to a
    power of two; adding 0 is exact). Each output is the same chain of elementwise adds for any
    leading shape, unlike torch's reductions, whose order can depend on it (measured: a bf16
    ``mean`` over 16 columns changes with the number of rows)."""
    n = x.shape[-1]
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in float32, returned in x's dtype; row-invariant (``row_sum``).
    Same values as ``F.rms_norm`` up to rounding, which on CPU (torch 2.13) is ~13x slower at
    prefill sizes (3.2 ms vs 0.25 ms for 2048 x 576 float32)."""
    xf = x.float()
    out = xf * torch.rsqrt(row_sum(xf * xf).div_(x.shape[-1]).add_(eps))
    out = out if weight is None else out.mul_(weight)
    return out.to(x.dtype)


def _pack(q4: dict[str, Any] | None, names: list[str]) -> Q4Matrix | None:
    """Row-concatenate the Q4 matrices ``names`` (all must be present) into one."""
    if not q4 or not all(n in q4 for n in names):
        return None
    return Q4Matrix.cat([q4[n] for n in names])


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], prefix: str,
                 q4: dict[str, Any] | None = None, numerics: str = "invariant",
                 options: KernelOptions = NO_OPTIONS) -> None:
        super().__init__()
        w = lambda name: weights[prefix + name]  # noqa: E731

        def cat(names: list[str], kind: str) -> torch.Tensor | None:
            if prefix + names[0] + "." + kind not in weights:
                return None
            return torch.cat([w(n + "." + kind) for n in names])

        def linear(names: list[str]) -> Linear:
            packed = _pack(q4, [prefix + n + ".weight" for n in names])
            return make_linear(numerics, cat(names, "weight"), cat(names, "bias"), packed, options)

        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.eps = arch.rms_norm_eps
        self.attn_norm = nn.Parameter(w("attn_norm.weight").float(), requires_grad=False)
        self.mlp_norm = nn.Parameter(w("mlp_norm.weight").float(), requires_grad=False)
        self.dtype = w("q_proj.weight").dtype
        # Q/K/V and gate/up are fused into one matrix each: a layer is four matmuls.
        self.qkv = linear(["q_proj", "k_proj", "v_proj"])
        self.o_proj = linear(["o_proj"])
        self.gate_up = linear(["gate_proj", "up_proj"])
        self.down = linear(["down_proj"])
        self.intermediate = arch.intermediate_size

    def qk_transform(self, qk: torch.Tensor) -> torch.Tensor:
        """Hook before RoPE on the joint q|k heads [T, H + Hkv, D] (identity; Qwen3 normalises)."""
        return qk

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                backend: AttentionBackend, meta: Any, rows: RowSplit = DENSE) -> torch.Tensor:
        """x [T, hidden] float32 residual -> [T, hidden] float32; ``rows``: which rows take the
        packed 4-bit weights (``models/q4_linear.py``)."""
        t, dt = x.shape[0], self.dtype
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv.forward(rms_norm(x, self.attn_norm, self.eps).to(dt), rows)
        # q and k heads are adjacent in the fused projection: one RoPE call rotates both.
        qk = apply_rope(self.qk_transform(qkv[:, :(h + hk) * d].view(t, h + hk, d)), cos, sin)
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, (h + hk) * d:].view(t, hk, d)
        attn = backend.forward(layer, q, k, v, meta)
        x = x + self.o_proj.forward(attn.reshape(t, h * d).to(dt), rows)
        gu = self.gate_up.forward(rms_norm(x, self.mlp_norm, self.eps).to(dt), rows)
        act = F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate:]
        return x + self.down.forward(act, rows)


@register_model("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(nn.Module):
    """Causal LM over the canonical parameter names of ``models/config.py``."""

    layer_cls: type[DecoderLayer] = DecoderLayer

    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 q4: dict[str, Any] | None = None, numerics: str = "invariant",
                 options: KernelOptions = NO_OPTIONS) -> None:
        """``q4``: optional canonical name -> Q4Matrix, and ``lm_head.q8`` -> Q8Matrix
        (``loading/q4_blocks.py``); ``numerics``: ``invariant`` or ``fast`` (see ``models/linear.py``);
        ``options``: the measured kernel choice (AMX tiles, packed float32 weights for small steps)."""
        super().__init__()
        self.arch = arch
        self.numerics = numerics
        self.embed = nn.Parameter(weights["embed.weight"], requires_grad=False)
        self.layers = nn.ModuleList(
            self.layer_cls(arch, weights, f"layers.{i}.", q4, numerics, options) for i in range(arch.num_layers))
        self.norm = nn.Parameter(weights["norm.weight"].float(), requires_grad=False)
        head = self.embed if arch.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = LogitsHead(head, (q4 or {}).get("lm_head.q8"), numerics, options)
        self.rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling, max_positions,
                                    device=self.embed.device)
        self.native: NativeLayers | None = None

    def attach_native(self, backend: AttentionBackend) -> None:
        """Run every layer of a step in one native call (``models/native_layers.py``) over the
        invariant backend's cache, with the attention kernel that backend chose."""
        from streamkv.native import layer_library

        lib = layer_library()
        if self.numerics != "invariant" or lib is None:
            raise ValueError("native layers need numerics=invariant and the native kernels")
        self.native = NativeLayers(lib, self, backend.cache, backend.scale, backend.path, backend.gather)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def q4_max_rows(self) -> int:
        """Most decode rows a step may have for them to take the packed 4-bit weights (0: none)."""
        first = self.layers[0].qkv.q4 if len(self.layers) and self.numerics == "fast" else None
        return first.max_rows if first is not None else 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: Any, rows: RowSplit = DENSE) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (before the last norm)."""
        if self.native is not None:
            return self.native.forward(input_ids, positions, backend, meta)
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        x = F.embedding(input_ids, self.embed).float()
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, cos, sin, i, backend, meta, rows)  # no hooks: skip Module.__call__
        return x

    def compute_logits(self, hidden: torch.Tensor, rows: RowSplit = DENSE) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32; ``rows`` indexes the N rows."""
        if self.native is not None:
            return self.lm_head.forward(self.native.norm(hidden, self.norm), rows)
        return self.lm_head.forward(rms_norm(hidden, self.norm, self.arch.rms_norm_eps).to(self.dtype), rows)
