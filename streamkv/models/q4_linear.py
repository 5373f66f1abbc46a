"""Linear layers over GGUF 4-bit blocks, kept packed for small batches (decode).

``w = (q - 8) * scale + zero`` with 32-column groups (``loading/q4_blocks.py`` builds q, scale
and zero from Q4_0 / Q4_1 blocks without requantizing), applied with torch's int4 CPU kernel
(``_weight_int4pack_mm_for_cpu``). A hand-written AVX512-BF16 kernel (nibbles expanded to
exact bf16 pairs, vdpbf16ps over 16 output rows) measured no faster: 0.90 ms vs 0.78 ms for
the 49152 x 576 LM head at batch 1, 25 vs 21 us at 960 x 576, level at batch 8; the
expansion, not memory, bounds it.
"""
from __future__ import annotations

import torch
import torch.nn as nn

GROUP = 32


class PackedQ4(nn.Module):
    """One linear layer's weight in torch's int4 CPU layout: x [M, K] -> [M, N] in x's dtype
    (N a multiple of 16)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1),
                             persistent=False)
        sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]
        self.register_buffer("scales_zeros", sz, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)
