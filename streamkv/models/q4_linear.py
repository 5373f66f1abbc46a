"""Linear layers over GGUF 4-bit blocks, kept packed for small batches (decode).

``w = (q - 8) * scale + zero`` with 32-column groups (``loading/q4_blocks.py`` builds q, scale
and zero from Q4_0 / Q4_1 blocks without requantizing). Two kernels:

* ``native`` (AVX512-BF16 CPUs with gcc): ``native/q4_gemm.c``, weights re-laid out once as
  [tile of 16 rows][group][pair][row] nibble bytes plus bf16 scale/zero per (tile, group);
  its inner sums are exact products accumulated in float32;
* ``torch``: torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``), elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

GROUP = 32


# the row held by byte j of a pair's 16 bytes (native/q4_gemm.c expands them with one
# 128-bit broadcast: qword i of it must hold rows 2i and 2i + 1)
PAIR_ROWS = (0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)


def pack_native(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int (0..15), scale/zero [N, K/32] -> (w [T, G, 16, 16] uint8, sz [T, G, 2, 16] bf16).

    ::

        w[t, g, p, j]  = q[16t + r, 32g + 2p] | q[16t + r, 32g + 2p + 1] << 4,   r = PAIR_ROWS[j]
        sz[t, g, 0, r] = scale[16t + r, g]      sz[t, g, 1, r] = zero[16t + r, g]

    Rows past N (the last tile's padding) are zero and never written out.
    """
    n, k = q.shape
    if k % GROUP != 0:
        raise ValueError(f"4-bit weights need a multiple of {GROUP} columns, got {k}")
    t, g = -(-n // 16), k // GROUP
    qp = torch.zeros(t * 16, k, dtype=torch.uint8)  # 0..15: the high nibble's shift stays within a byte
    qp[:n] = q
    pairs = qp.view(t, 16, g, 16, 2)
    w = (pairs[..., 0] | (pairs[..., 1] << 4)).permute(0, 2, 3, 1)[..., list(PAIR_ROWS)].contiguous()
    sz = torch.zeros(2, t * 16, g, dtype=torch.float32)
    sz[0, :n], sz[1, :n] = scale, zero
    sz = sz.view(2, t, 16, g).permute(1, 3, 0, 2).to(torch.bfloat16).contiguous()
    return w, sz


class PackedQ4(nn.Module):
    """One linear layer's weight as 4-bit groups: x [M, K] -> [M, N] in x's dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, native: bool = True,
                 fma: bool = False) -> None:
        """``fma``: the native kernel's float32 fma chain (``linear=q4f``; its own bits, every row)."""
        super().__init__()
        self.out_features = q.shape[0]
        self.fma = fma
        kernel: Callable[..., torch.Tensor] | None = None
        if native:
            from streamkv.native import q4_gemm

            kernel = q4_gemm()
        self.kernel = kernel
        if kernel is not None:
            w, sz = pack_native(q, scale, zero)
        else:
            w = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]
        self.register_buffer("packed", w, persistent=False)
        self.register_buffer("scales_zeros", sz, persistent=False)

    @property
    def native(self) -> bool:
        return self.kernel is not None

    @property
    def max_rows(self) -> int:
        """Largest batch of decode rows this serves (beyond it the dense bf16 GEMM is faster).
        Measured on the 2-core EPYC at SmolLM2's shapes, per token step of 30 layers: native
        5.8 / 11.4 / 20.3 / 39.6 ms vs dense 10.4 / 14.3 / 22.2 / 39.2 ms at 8 / 16 / 32 / 64
        rows; torch's kernel 10.8 ms at 8 rows and 21 ms at 16."""
        return 64 if self.kernel is not None else 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return self._torch(x)
        if x.dtype == torch.bfloat16:
            return self.kernel(x, self.packed, self.scales_zeros, self.out_features, torch.bfloat16, self.fma)
        return self.forward_f32(x).to(x.dtype)

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """Like :meth:`forward`, with a float32 result (the native kernel's own precision)."""
        if self.kernel is not None:
            return self.kernel(x.to(torch.bfloat16), self.packed, self.scales_zeros, self.out_features,
                               fma=self.fma)
        return self._torch(x).float()

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, d [N, K/32] -> (w [T, G, 16, 32] int8, d [T, G, 16] float32) for the Q8
    path of ``native/q4_gemm.c``: ``w[t, g, p, 2r + e] = q[16t + r, 32g + 2p + e]``."""
    n, k = q.shape
    if k % GROUP != 0:
        raise ValueError(f"Q8 weights need a multiple of {GROUP} columns, got {k}")
    t, g = -(-n // 16), k // GROUP
    qp = torch.zeros(t * 16, k, dtype=torch.int8)
    qp[:n] = q
    w = qp.view(t, 16, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(t, g, 16, 32).contiguous()
    dp = torch.zeros(t * 16, g, dtype=torch.float32)
    dp[:n] = d
    return w, dp.view(t, 16, g).permute(0, 2, 1).contiguous()


class PackedQ8(nn.Module):
    """A Q8_0 matrix for the native kernel (exact int8 -> bf16 pairs, float32 scales):
    x [M, K] -> [M, N] float32."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor) -> None:
        super().__init__()
        from streamkv.native import q8_gemm

        self.kernel = q8_gemm()
        if self.kernel is None:
            raise RuntimeError("the native Q8 kernel needs an AVX512-BF16 CPU and a C compiler")
        self.out_features = q.shape[0]
        w, dp = pack_q8(q, d)
        self.register_buffer("packed", w, persistent=False)
        self.register_buffer("scales", dp, persistent=False)

    native = True

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x.to(torch.bfloat16), self.packed, self.scales, self.out_features)


class Q4Halves(nn.Module):
    """A Q8_0 matrix as two 4-bit halves (torch's int4 kernel, or the native one): their sum."""

    def __init__(self, halves: tuple, native: bool) -> None:
        super().__init__()
        self.parts = nn.ModuleList(PackedQ4(h.q, h.scale, h.zero, native=native) for h in halves)

    @property
    def native(self) -> bool:
        return self.parts[0].native

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        hi, lo = self.parts
        return hi.forward_f32(x).add_(lo.forward_f32(x))


@dataclass(frozen=True)
class RowSplit:
    """Which rows of a step's batch take the packed 4-bit weights.

    Decode rows (a sequence's single new token) do, prompt-chunk rows take the dense weights,
    whatever else shares the step: a row's numerics depend on its own kind, not on the batch
    (a flash evaluation batch and a lone query give the same answer). Past ``max_rows`` decode
    rows every row is dense.
    """

    q4: torch.Tensor | None     # [n] row indices, None when no row takes the 4-bit weights
    dense: torch.Tensor | None  # [m] row indices, None when every row or no row takes them

    @staticmethod
    def build(decode_rows: list[int], num_rows: int, max_rows: int) -> RowSplit:
        if not decode_rows or len(decode_rows) > max_rows:
            return RowSplit(None, None)
        if len(decode_rows) == num_rows:
            return RowSplit(torch.arange(num_rows), None)
        q4 = torch.tensor(decode_rows, dtype=torch.int64)
        dense = torch.ones(num_rows, dtype=torch.bool)
        dense[q4] = False
        return RowSplit(q4, dense.nonzero().squeeze(1))


DENSE = RowSplit(None, None)  # every row dense (no 4-bit weights, or a caller without a split)


def split_rows(x: torch.Tensor, rows: RowSplit, q4: Callable[[torch.Tensor], torch.Tensor] | None,
               dense: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, K] -> [T, N]: the rows ``rows.q4`` through ``q4``, the others through ``dense``
    (both map [n, K] -> [n, N] in the same dtype)."""
    if q4 is None or rows.q4 is None:
        return dense(x)
    if rows.dense is None:
        return q4(x)
    part = q4(x.index_select(0, rows.q4))
    out = part.new_empty(x.shape[0], part.shape[1])
    out.index_copy_(0, rows.q4, part)
    out.index_copy_(0, rows.dense, dense(x.index_select(0, rows.dense)))
    return out


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedQ4 | None,
                 rows: RowSplit) -> torch.Tensor:
    """A linear layer with dense ``weight`` and optional 4-bit ``packed`` copy, split by ``rows``."""
    def q4(h: torch.Tensor) -> torch.Tensor:
        out = packed.forward(h)  # no hooks: skip Module.__call__
        return out if bias is None else out + bias

    return split_rows(x, rows, None if packed is None else q4, lambda h: F.linear(h, weight, bias))
