"""Rotary position embeddings (NeoX / rotate-half layout), incl. Llama-3 scaling."""
from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """``inv_freq`` [head_dim // 2] (float32) and the attention scaling factor for cos/sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0  # type: ignore[index]
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0  # type: ignore[arg-type]
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables indexed by position; keys are stored after rotation.

    Moving a cached key from position p to p' is a rotation by (p' - p): see
    :meth:`rotate`, used for re-positioning evicted / re-used KV.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_positions: int, device: torch.device | str = "cpu") -> None:
        self.head_dim = head_dim
        self.inv_freq, self.scale = inverse_frequencies(head_dim, theta, scaling)
        self.inv_freq = self.inv_freq.to(device)
        self.max_positions = max_positions
        pos = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, self.inv_freq)
        cos, sin = freqs.cos() * self.scale, freqs.sin() * self.scale
        # full-width tables with the rotate-half sign folded into sin: [max_positions, D]
        self.cos_table = torch.cat([cos, cos], dim=-1)
        self.sin_table = torch.cat([-sin, sin], dim=-1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables: positions [T] -> cos, signed sin [T, 1, head_dim] in ``dtype``."""
        cos = self.cos_table.index_select(0, positions).unsqueeze(1)
        sin = self.sin_table.index_select(0, positions).unsqueeze(1)
        return cos.to(dtype), sin.to(dtype)

    def rotation_table(self, delta: torch.Tensor) -> torch.Tensor:
        """(cos, sin) of a rotation by ``delta`` [N] positions: [N, head_dim // 2, 2] float32
        (what :meth:`rotate` applies; the native KV mover takes this table)."""
        freqs = delta.to(torch.float32).reshape(-1, 1) * self.inv_freq.cpu()
        return torch.stack([freqs.cos(), freqs.sin()], dim=-1)

    def rotate(self, x: torch.Tensor, delta: torch.Tensor | int) -> torch.Tensor:
        """Rotate already-embedded keys x [N, n_heads, D] by ``delta`` positions ([N] or scalar, may be < 0)."""
        d = torch.as_tensor(delta, dtype=torch.float32, device=x.device).reshape(-1, 1)
        freqs = (d * self.inv_freq).unsqueeze(1)
        cos, sin = freqs.cos(), freqs.sin()
        return apply_rope(x, torch.cat([cos, cos], -1).to(x.dtype), torch.cat([-sin, sin], -1).to(x.dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, n_heads, D]; cos, signed sin broadcastable to [T, n_heads, D].

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` equals
    ``x * cos + roll(x, D/2) * cat(-sin, sin)``: three kernels instead of nine, same bits.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
