"""The 4-bit blocks of a GGUF's Q4_0 / Q4_1 matrices, kept packed for decode kernels.

GGML blocks cover 32 consecutive input columns of one row::

    Q4_1: d (f16) | m (f16) | 16 bytes: element j in the low nibble of byte j, j+16 in the high
          w = d * q + m
    Q4_0: d (f16) | 16 bytes (same nibble order),  w = d * (q - 8)

Both are returned as ``w = (q - 8) * scale + zero`` (the layout of torch's int4 CPU kernel):
Q4_1 -> scale d, zero m + 8d; Q4_0 -> scale d, zero 0; and with the file's own offset ``m``
(Q4_0: -8d), for which ``w = d * q + m`` is the loader's float32 weight to the bit (``d * q`` is
exact, so one rounding: ``native/deq_gemm.c``).

A Q8_0 LM head (``d (f16) | 32 x int8``, ``w = d * q``) is kept as int8 + float32 scales for the
native kernel, or split exactly into two 4-bit matrices for torch's int4 kernel: with
``q + 128 = 16 h + l`` (h, l in 0..15), ``w = [(h - 8) * 16d] + [(l - 8) * d + 8d]``, so ``x @ w.T``
is the sum of two int4 products.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from streamkv.loading.gguf_decode import split_blocks
from streamkv.loading.gguf_file import GGUFFile
from streamkv.loading.gguf_loader import unpermute_qk
from streamkv.loading.names import canonical_from_gguf
from streamkv.models.config import ArchConfig

GROUP = 32
_Q4_TYPES = ("Q4_0", "Q4_1")


@dataclass(frozen=True)
class Q4Matrix:
    """q [N, K] integers in 0..15 (uint8 as read from a file: each consumer widens as its kernel
    needs); scale, zero [N, K // 32] float32; m [N, K // 32] float32, the file's offset
    (``w = scale * q + m`` in one rounding), where known."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    m: torch.Tensor | None = None

    @staticmethod
    def cat(parts: list[Q4Matrix]) -> Q4Matrix:
        """The row-concatenation of ``parts`` (fused projections)."""
        ms = [p.m for p in parts]
        return Q4Matrix(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                        torch.cat([p.zero for p in parts]), None if any(m is None for m in ms) else torch.cat(ms))

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = (self.q.float() - 8).view(n, k // GROUP, GROUP) * self.scale[..., None] + self.zero[..., None]
        return w.view(n, k)


def _parsed(gguf: GGUFFile | str) -> GGUFFile:
    """A parsed file (parsing the metadata of a model with a large vocabulary takes seconds: callers
    that read several things from one file pass it parsed)."""
    return GGUFFile(gguf) if isinstance(gguf, str) else gguf


def quant_summary(gguf: GGUFFile | str, tied: bool) -> tuple[bool, bool]:
    """(any Q4_0 / Q4_1 linear weight, a Q8_0 LM head) in a GGUF file, from its tensor table only."""
    head = "token_embd.weight" if tied else "output.weight"
    q4 = q8 = False
    for tensor in _parsed(gguf).tensors():
        name = canonical_from_gguf(tensor.name)
        q4 = q4 or (tensor.type_name in _Q4_TYPES and name is not None and name.endswith("proj.weight"))
        q8 = q8 or (tensor.name == head and tensor.type_name == "Q8_0")
    return q4, q8


def read_q4_matrices(gguf: GGUFFile | str, arch: ArchConfig, permuted_qk: bool) -> dict[str, Q4Matrix]:
    """Canonical name -> Q4Matrix for every Q4_0 / Q4_1 linear weight of a GGUF file."""
    gguf = _parsed(gguf)
    out: dict[str, Q4Matrix] = {}
    for tensor in gguf.tensors():
        name = canonical_from_gguf(tensor.name)
        if name is None or tensor.type_name not in _Q4_TYPES or not name.endswith("proj.weight"):
            continue
        q, scale, zero, m = _unpack(tensor.raw, tensor.type_name, tensor.shape)
        if permuted_qk and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            heads = arch.num_heads if name.endswith("q_proj.weight") else arch.num_kv_heads
            q, scale, zero, m = (unpermute_qk(a, heads, gguf.path, tensor.name) for a in (q, scale, zero, m))
        q, scale, zero, m = (a.contiguous() for a in (q, scale, zero, m))
        out[name] = Q4Matrix(q, scale, zero, m)
    return out


@dataclass(frozen=True)
class Q8Matrix:
    """q [N, K] int8; d [N, K // 32] float32 (the file's f16 scales, exact): w = d * q."""

    q: torch.Tensor
    d: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.float().view(n, k // GROUP, GROUP) * self.d[..., None]).view(n, k)

    def halves(self) -> tuple[Q4Matrix, Q4Matrix]:
        """Two 4-bit matrices whose sum is exactly this one (see the module docstring)."""
        n, k = self.q.shape
        q = self.q.to(torch.int32) + 128
        return (Q4Matrix(q >> 4, 16 * self.d, torch.zeros(n, k // GROUP), -128 * self.d),
                Q4Matrix(q & 15, self.d.clone(), 8 * self.d, torch.zeros(n, k // GROUP)))


def read_q8_lm_head(gguf: GGUFFile | str, tied: bool) -> Q8Matrix | None:
    """The LM head (or the tied embedding), if it is stored as Q8_0."""
    wanted = "token_embd.weight" if tied else "output.weight"
    for tensor in _parsed(gguf).tensors():
        if tensor.name == wanted and tensor.type_name == "Q8_0":
            n, k = tensor.shape
            d, _, q = split_blocks(tensor.raw, "Q8_0")
            return Q8Matrix(q.reshape(n, k), d.reshape(n, k // GROUP))
    return None


def _unpack(raw: np.ndarray, kind: str, shape: tuple[int, ...]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] 0..15, scale d, zero, offset m) of a Q4_0 / Q4_1 tensor; the last three [N, K / 32] float32."""
    n, k = shape
    d, m, q = split_blocks(raw, kind)
    d = d.reshape(n, k // GROUP)
    if m is None:  # Q4_0
        return q.reshape(n, k), d, torch.zeros_like(d), -8 * d
    m = m.reshape(n, k // GROUP)
    return q.reshape(n, k), d, m + 8 * d, m
