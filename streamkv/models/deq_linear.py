"""A float32 model's GGUF-quantized weights, read packed with the dense GEMM's bits (``native/deq_gemm.c``).

A float32 model loaded from a GGUF holds each weight as gguf dequantizes it: ``d * q + m`` in
float32 (Q4_1; Q4_0: ``d * (q - 8)``; Q8_0: ``d * q``), d and m the block's float16 values.
``d * q`` is exact in float32, so that is one rounding, and the kernel rebuilds every weight
bit for bit (``fma(d, q, m)``) before the dense GEMM's own chain. So the packed copy and the dense
panels give the same output bits at every row count: a step takes whichever is faster for its
number of rows (``max_rows``, measured at first start by ``native/tuning.py``), and the outputs
stay batch-invariant. Decode reads 0.625 (4-bit) or 1.06 (8-bit) bytes per weight instead of 4.

::

    pack_deq:   q [T, G, 32, 8] uint8    byte b of row k = q[16t + b, 32g + k] | q[16t + b + 8, 32g + k] << 4
                dm [T, G, 2, 16] float16 d, m of the panel's 16 columns
    pack_deq8:  q [T, G, 32, 16] int8    q[16t + c, 32g + k]
                dm [T, G, 1, 16] float16 d
    pack_deq_bf16 (bf16 models: ``native/deq_bf16.c``, the dense bf16 GEMM's bits)
                q [T, G, 16, 16] uint8   column c's 32 nibbles in the kernel's lookup order (_q4_order)
                dm [T, G, 16, 2] float32 d, m of column c (float16 values)
    pack_deq8_bf16 (a bf16 model's Q8_0 LM head, the same kernel)
                q [T, G, 16, 32] int8    column c's 32 values along k
                dm [T, G, 16] float32    d of column c (float16 values)
"""
from __future__ import annotations

import torch
import torch.nn as nn

from streamkv.loading.q4_blocks import Q4Matrix, Q8Matrix

GROUP = 32


def _half(a: torch.Tensor, what: str) -> torch.Tensor:
    """float32 values that are float16 values, as float16 (ValueError if one is not: then the
    packed weights could not reproduce the dense ones)."""
    h = a.to(torch.float16)
    if not torch.equal(h.float(), a.float()):
        raise ValueError(f"{what} is not exactly a float16 value: the packed weights would not equal the dense ones")
    return h


def _panels(a: torch.Tensor, n: int) -> torch.Tensor:
    """[N, G] -> [T, G, 16] (columns of each 16-wide panel last; padding zero)."""
    t = -(-n // 16)
    out = torch.zeros(t * 16, a.shape[1], dtype=a.dtype)
    out[:n] = a
    return out.view(t, 16, -1).permute(0, 2, 1)


def _groups(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [N, K] -> [T, G, 32, 16] in ``dtype`` (k within the group, then the panel's columns)."""
    n, k = q.shape
    if k % GROUP:
        raise ValueError(f"packed weights need a multiple of {GROUP} input features, got {k}")
    t = -(-n // 16)
    qp = torch.zeros(t * 16, k, dtype=dtype)
    qp[:n] = q.to(dtype)
    return qp.view(t, 16, k // GROUP, GROUP).permute(0, 2, 3, 1)


def pack_deq(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] in 0..15, d and m [N, K / 32] (float16 values) -> the 4-bit layout above."""
    g = _groups(q, torch.uint8)  # 0..15: the high nibble's shift stays within a byte
    qp = (g[..., :8] | (g[..., 8:] << 4)).contiguous()
    return qp, _scales(d, m, q.shape[0])


def _scales(d: torch.Tensor, m: torch.Tensor, n: int) -> torch.Tensor:
    """d, m [N, G] (float16 values) -> [T, G, 2, 16] float16."""
    return torch.stack([_panels(_half(d, "a scale"), n), _panels(_half(m, "an offset"), n)], dim=2).contiguous()


def _q4_order() -> tuple[torch.Tensor, torch.Tensor]:
    """For byte b (0..15) of a column's group: the k of its low nibble and of its high one, in the
    order ``native/nibbles.h``'s control reads them (qword i of the broadcast reads half i % 2;
    its words 4i .. 4i + 3 are the low and high nibbles of bytes b, b + 1 there, b = i - i % 2)."""
    k = torch.arange(32)
    i, j = k // 4, k % 4
    byte = 8 * (i % 2) + (i - i % 2) + j // 2
    low, high = torch.empty(16, dtype=torch.long), torch.empty(16, dtype=torch.long)
    low[byte[j % 2 == 0]], high[byte[j % 2 == 1]] = k[j % 2 == 0], k[j % 2 == 1]
    return low, high


def pack_deq_bf16(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] in 0..15, d and m [N, K / 32] (float16 values) -> the bf16 kernel's 4-bit layout above."""
    g = _groups(q, torch.uint8).transpose(2, 3)  # [T, G, 16 columns, 32 k], one byte per value
    low, high = _q4_order()
    packed = g[..., low] | (g[..., high] << 4)
    dm = _scales(d, m, q.shape[0]).transpose(2, 3)  # [T, G, 16 columns, (d, m)]
    return packed.contiguous(), dm.float().contiguous()


def pack_deq8_bf16(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, d [N, K / 32] (float16 values) -> the bf16 kernel's 8-bit layout above."""
    qp = _groups(q, torch.int8).transpose(2, 3).contiguous()  # [T, G, 16 columns, 32 k]
    return qp, _panels(_half(d, "a scale"), q.shape[0]).float().contiguous()


def pack_deq8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, d [N, K / 32] (float16 values) -> the 8-bit layout above."""
    qp = _groups(q, torch.int8).contiguous()
    return qp, _panels(_half(d, "a scale"), q.shape[0]).unsqueeze(2).contiguous()


class DeqWeights(nn.Module):
    """One GGUF matrix packed for ``deq_gemm.c`` (float32 models: x [M, K] float32 -> [M, N] with the
    bits of the dense float32 GEMM over the loader's weights) or ``deq_bf16.c`` (bf16 models, 4-bit
    layers or the Q8_0 head: x [M, K] bf16 -> the bits of the dense bf16 GEMM, ``tiles`` and ``fma`` alike);
    serves steps of at most ``max_rows`` rows."""

    def __init__(self, packed: torch.Tensor, dm: torch.Tensor, out_features: int, max_rows: int,
                 bf16: bool = False, tiles: bool = False, fma: bool = False) -> None:
        super().__init__()
        from streamkv.native import deq_gemm, deq_gemm_bf16

        kernel = deq_gemm_bf16() if bf16 else deq_gemm()
        if kernel is None:
            raise RuntimeError("packed weights with the dense bits need the native kernels (a C compiler; "
                               "bf16: an AVX512-BF16 CPU with VBMI)")
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.kernel = kernel
        self.out_features = out_features
        self.max_rows = max_rows
        self.bf16, self.tiles, self.fma = bf16, tiles, fma
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("dm", dm, persistent=False)

    @property
    def bits(self) -> int:
        return 4 if self.packed.dtype == torch.uint8 else 8

    @classmethod
    def from_q4(cls, w: Q4Matrix, max_rows: int, bf16: bool = False, tiles: bool = False,
                fma: bool = False) -> DeqWeights:
        if w.m is None:
            raise ValueError("this 4-bit matrix has no stored offset (m): it cannot reproduce the dense weights")
        pack = pack_deq_bf16 if bf16 else pack_deq
        return cls(*pack(w.q, w.scale, w.m), w.q.shape[0], max_rows, bf16, tiles, fma)

    @classmethod
    def from_q8(cls, w: Q8Matrix, max_rows: int, bf16: bool = False, tiles: bool = False,
                fma: bool = False) -> DeqWeights:
        pack = pack_deq8_bf16 if bf16 else pack_deq8
        return cls(*pack(w.q, w.d), w.q.shape[0], max_rows, bf16, tiles, fma)

    def serves(self, rows: int) -> bool:
        return rows <= self.max_rows

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.bf16:
            return self.kernel(x.to(torch.bfloat16), self.packed, self.dm, self.out_features,
                               out_dtype or torch.bfloat16, self.tiles, self.fma)
        return self.kernel(x.float(), self.packed, self.dm, self.out_features, out_dtype or torch.float32)
