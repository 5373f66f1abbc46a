"""Linear layers and the LM head, per numerics mode.

Two modes (``RuntimeConfig.numerics``):

* ``invariant`` (default): every row of a step goes through ONE kernel whose per-element
  reduction order does not depend on the batch: a row's result is bit-identical whatever
  shares its step (decodes, prefill chunks, 1 or 64 other sequences) and whatever its kind
  (a token recomputed after preemption equals its original decode). Dense weights use
  ``native/inv_gemm.c``; GGUF 4-bit weights (bfloat16 models on AVX512-BF16 CPUs) use
  ``native/q4_gemm.c`` for every row, prompt chunks included.
* ``fast``: torch's GEMMs for prompt chunks and the 4-bit kernel for decode rows
  (:class:`RowSplit`): faster where oneDNN has a better kernel for the shape, but a row's
  numerics depend on M (torch's blocking) and on its kind.

The LM head writes float32 logits for every sampled row in both modes: products exact, sums
and output in float32 (never rounded to 16 bits).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from streamkv.loading.q4_blocks import Q4Matrix, Q8Matrix
from streamkv.models.deq_linear import DeqWeights
from streamkv.models.q4_linear import DENSE, PackedQ4, PackedQ8, Q4Halves, RowSplit, split_linear, split_rows

NUMERICS = ("invariant", "fast")


@dataclass(frozen=True)
class KernelOptions:
    """The measured kernel choice as the layers see it (``native/tuning.py``).

    ``tiles``: dense bf16 GEMMs on AMX tiles; ``gemm_fma``: on vdpbf16ps's chain as float32 fmas
    (``gemm=fma``; never both). ``q4_fma``: bf16 4-bit layers on the q4 kernel's
    float32 fma chain (``linear=q4f``). ``deq_rows`` / ``head_deq_rows``: a float32 model's
    GGUF 4-bit layers / Q8_0 LM head (a bf16 model's 4-bit layers: ``linear=deq``) are also kept
    packed, and steps of at most that many rows read them (``models/deq_linear.py``: the same bits
    as the dense weights); 0: never.
    """

    tiles: bool = False
    q4_fma: bool = False
    deq_rows: int = 0
    head_deq_rows: int = 0
    gemm_fma: bool = False

    def __post_init__(self) -> None:
        if self.tiles and self.gemm_fma:
            raise ValueError("the dense GEMM runs on AMX tiles or on the fma chain, not both")
        if self.deq_rows < 0 or self.head_deq_rows < 0:
            raise ValueError(f"deq rows must be >= 0, got {self.deq_rows} and {self.head_deq_rows}")


NO_OPTIONS = KernelOptions()


def pack_dense(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] float32 or bfloat16 -> panels of 16 output columns (layout in ``inv_gemm.c``).

    float32: [T, K, 16];  bfloat16: [T, K/2, 16, 2]  (T = ceil(N / 16), padding columns zero).
    """
    n, k = w.shape
    if w.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"invariant GEMM weights are float32 or bfloat16, got {w.dtype}")
    if w.dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"bfloat16 invariant GEMM needs an even number of input features, got {k}")
    t, full = -(-n // 16), n // 16
    pairs = 1 if w.dtype == torch.float32 else 2
    out = torch.empty(t, k // pairs, 16, pairs, dtype=w.dtype)
    # one strided copy into the panels (no padded staging copy); only a ragged last panel is staged
    _scatter_panels(out[:full], w[:full * 16])
    if full < t:
        tail = torch.zeros(16, k, dtype=w.dtype)
        tail[:n - full * 16] = w[full * 16:]
        _scatter_panels(out[full:], tail)
    return out.squeeze(3) if pairs == 1 else out


def _scatter_panels(out: torch.Tensor, rows: torch.Tensor) -> None:
    """rows [16 T, K] -> out [T, K / p, 16, p] (p values of one column adjacent)."""
    t, kp, _, p = out.shape
    out.permute(0, 2, 1, 3).copy_(rows.reshape(t, 16, kp, p))


def _invariant_kernel() -> Callable[..., torch.Tensor]:
    from streamkv.native import invariant_gemm

    kernel = invariant_gemm()
    if kernel is None:
        raise RuntimeError("numerics=invariant needs the native kernels (a C compiler, STREAMKV_NATIVE unset); "
                           "use numerics=fast for pure PyTorch")
    return kernel


class DensePanels(nn.Module):
    """A dense weight in the invariant GEMM's panel layout: x [M, K] -> [M, N] in ``out_dtype``;
    ``tiles``: bf16 on AMX tiles where the CPU has them; ``fma``: bf16 on vdpbf16ps's chain as float32
    fmas (AVX512-BF16 builds); one path for every M either way."""

    def __init__(self, weight: torch.Tensor, tiles: bool = False, fma: bool = False) -> None:
        super().__init__()
        self.kernel = _invariant_kernel()
        self.out_features = weight.shape[0]
        self.tiles, self.fma = tiles, fma
        self.register_buffer("panels", pack_dense(weight.detach()), persistent=False)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.kernel(x.to(self.panels.dtype), self.panels, self.out_features, out_dtype or self.panels.dtype,
                           self.tiles, self.fma)


class Linear(nn.Module, ABC):
    """One projection: x [T, K] -> [T, N] in the weights' dtype; ``rows`` says which rows are
    decodes (only the fast mode looks at it)."""

    @abstractmethod
    def forward(self, x: torch.Tensor, rows: RowSplit = DENSE) -> torch.Tensor: ...


class SplitLinear(Linear):
    """Fast mode: torch's dense GEMM for prompt rows, the 4-bit kernel for decode rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, q4: Q4Matrix | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.q4 = None if q4 is None else PackedQ4(q4.q, q4.scale, q4.zero)

    def forward(self, x: torch.Tensor, rows: RowSplit = DENSE) -> torch.Tensor:
        return split_linear(x, self.weight, self.bias, self.q4, rows)


class InvariantLinear(Linear):
    """Invariant mode: one batch-invariant chain per output element for every row.

    Weights with 4-bit blocks (``q4``) and ``options.deq_rows``: dense panels plus the packed copy,
    which steps of at most that many rows read (the same bits; float32: ``deq_gemm.c``, bf16:
    ``deq_bf16.c``). bf16 weights with 4-bit blocks otherwise: the native q4 kernel for every row.
    Otherwise the dense panels (``options.tiles``: bf16 on AMX tiles; ``gemm_fma``: on the fma chain)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, q4: Q4Matrix | None,
                 options: KernelOptions = NO_OPTIONS) -> None:
        super().__init__()
        self.dtype = weight.dtype
        self.q4: PackedQ4 | None = None
        self.deq: DeqWeights | None = None
        bf16 = weight.dtype == torch.bfloat16
        if q4 is not None and (not bf16 or options.deq_rows):
            self.deq = (DeqWeights.from_q4(q4, options.deq_rows, bf16, options.tiles, options.gemm_fma)
                        if options.deq_rows else None)
        elif q4 is not None:
            self.q4 = PackedQ4(q4.q, q4.scale, q4.zero, fma=options.q4_fma)
            if not self.q4.native:
                raise ValueError("numerics=invariant takes 4-bit bf16 weights only through the native q4 kernel")
        self.dense = DensePanels(weight, options.tiles, options.gemm_fma) if self.q4 is None else None
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor, rows: RowSplit = DENSE) -> torch.Tensor:
        if self.q4 is not None:
            out = self.q4.forward(x)
        elif self.deq is not None and self.deq.serves(x.shape[0]):
            out = self.deq.forward(x)
        else:
            out = self.dense.forward(x)
        return out if self.bias is None else out + self.bias


def make_linear(numerics: str, weight: torch.Tensor, bias: torch.Tensor | None, q4: Q4Matrix | None,
                options: KernelOptions = NO_OPTIONS) -> Linear:
    """``q4``: the GGUF's 4-bit blocks of this (fused) weight, if the kernel choice reads them."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if numerics == "invariant":
        return InvariantLinear(weight, bias, q4, options)
    return SplitLinear(weight, bias, q4)


class LogitsHead(nn.Module):
    """hidden [N, d] (already normed, in the model dtype) -> float32 logits [N, vocab].

    Dense rows go through the invariant GEMM with a float32 result (products of the weights'
    dtype are exact in float32). Without native kernels (fast mode only) a float32 copy of the
    weight is multiplied in float32. A Q8_0 head from a GGUF (``q8``) is read as int8 by the
    native kernel (exact products, float32 sums and scales; every row in invariant mode, the
    decode rows in fast mode), or without it (fast mode) as two exact int4 halves through
    torch's int4 kernel. With ``head_deq_rows`` (a float32 model's exact ``lm_head=q8``, a bf16
    model's ``lm_head=deq``) steps of at most that many rows read the int8 copy with the dense
    head's bits (``models/deq_linear.py``), larger ones the dense weight.
    """

    def __init__(self, weight: torch.Tensor, q8: Q8Matrix | None, numerics: str,
                 options: KernelOptions = NO_OPTIONS) -> None:
        super().__init__()
        from streamkv.native import invariant_gemm, q8_gemm

        self.numerics = numerics
        self.packed: nn.Module | None = None
        self.deq: DeqWeights | None = None
        if q8 is not None and numerics == "invariant" and (weight.dtype == torch.float32 or options.head_deq_rows):
            if options.head_deq_rows:  # the int8 copy for small steps, the dense head's bits (bf16: lm_head=deq)
                bf16 = weight.dtype == torch.bfloat16
                self.deq = DeqWeights.from_q8(q8, options.head_deq_rows, bf16=bf16, tiles=bf16 and options.tiles,
                                              fma=bf16 and options.gemm_fma)
        elif q8 is not None and q8_gemm() is not None:
            self.packed = PackedQ8(q8.q, q8.d)
        elif q8 is not None and numerics == "fast":
            self.packed = Q4Halves(q8.halves(), native=False)
        self.dense: DensePanels | None = None
        self.weight32: torch.Tensor | None = None
        if numerics == "invariant" and self.packed is not None:
            return
        if numerics == "invariant" or invariant_gemm() is not None:
            self.dense = DensePanels(weight, options.tiles, options.gemm_fma)
        else:
            self.weight32 = weight.detach().float()

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.deq is not None and self.deq.serves(x.shape[0]):
            return self.deq.forward(x, torch.float32)
        if self.dense is not None:
            return self.dense.forward(x, torch.float32)
        return F.linear(x.float(), self.weight32)

    def forward(self, h: torch.Tensor, rows: RowSplit = DENSE) -> torch.Tensor:
        if self.numerics == "invariant":
            return self.packed.forward_f32(h) if self.packed is not None else self._dense(h)
        return split_rows(h, rows, self.packed.forward_f32 if self.packed is not None else None, self._dense)
