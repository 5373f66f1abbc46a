"""Micro-benchmark: the batch-invariant kernels against torch's at SmolLM2-135M's shapes.

    .venv/bin/python benchmarks/invariant_kernels.py [--threads 2]

Prints the CPU (model, vector flags) and, per kernel, ms per call and GFLOP/s for:

* linears: the invariant dense GEMM (``native/inv_gemm.c``) and, where built, the native 4-bit
  GEMM (``native/q4_gemm.c``, invariant too) vs torch's ``F.linear`` (not row-invariant), at
  1 / 8 / 32 / 2048 rows for the 576 -> 1536 projection, and the 49,152-row LM head;
* attention: the invariant kernel (``native/inv_attn.c``) vs torch's SDPA for a 2048-token
  causal prefill and a batch-1 decode over 512 and 6,500 tokens (9 heads, 3 kv heads, D 64).

Each row also checks invariance on the spot (a row's bits alone equal its bits in the batch).
Needs only torch and a C compiler (no model files), so it runs on any machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamkv import native  # noqa: E402
from streamkv.models.linear import pack_dense  # noqa: E402
from streamkv.models.q4_linear import PackedQ4  # noqa: E402


def cpu() -> str:
    model, flags = platform.processor() or "?", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = next(l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("model name"))
        flags = set(next(l for l in text.splitlines() if l.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        pass
    keep = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    return f"{model} ({os.cpu_count()} cpus; {' '.join(keep) or 'no AVX2/AVX-512 flags'})"


def timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def linears(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    q4 = native.q4_gemm() is not None and dtype == torch.bfloat16
    for n, k, label in ((1536, 576, "gate_up 576->1536"), (49152, 576, "LM head 576->49152")):
        w = torch.randn(n, k, generator=g).to(dtype) * 0.05
        wp = pack_dense(w)
        packed = PackedQ4(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 32, generator=g) * 0.01,
                          torch.rand(n, k // 32, generator=g) * 0.01) if q4 else None
        inv = native.invariant_gemm()
        for m in ((1, 8, 32, 2048) if n < 10000 else (1, 8, 32)):
            x = torch.randn(m, k, generator=g).to(dtype)
            reps = 3 if m >= 2048 else 20
            flop = 2 * m * n * k
            row = [f"{label:20s} M={m:5d}"]
            full = inv(x, wp, n, torch.float32)
            same = torch.equal(inv(x[-1:], wp, n, torch.float32), full[-1:])
            cases = [("invariant", lambda: inv(x, wp, n, dtype)), ("torch", lambda: F.linear(x, w))]
            if packed is not None:
                cases.insert(1, ("q4 native", lambda: packed.forward(x)))
            for name, fn in cases:
                s = timed(fn, reps)
                row.append(f"{name} {s * 1e3:8.3f} ms {flop / s / 1e9:6.1f} GF/s")
            print(" | ".join(row) + f" | row-invariant: {same}")


def attention(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    kern = native.invariant_attention()
    h, hk, d = 9, 3, 64
    for nq, length in ((2048, 2048), (1, 512), (1, 6500)):
        kc = torch.randn(length, hk, d, generator=g).to(dtype)
        vc = torch.randn(length, hk, d, generator=g).to(dtype)
        q = torch.randn(nq, h, d, generator=g)
        seqs, slots = torch.tensor([(0, nq, 0, length)]), torch.arange(length)
        flop = 4 * nq * length * d * h / (2 if nq > 1 else 1)
        reps = 3 if nq > 1 else 50
        s_inv = timed(lambda: kern(q, kc, vc, seqs, slots, d ** -0.5), reps)
        qs = q.to(dtype).transpose(0, 1)[None]
        ks, vs = kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]
        s_t = timed(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=nq > 1, enable_gqa=True), reps)
        print(f"attention nq={nq:5d} ctx={length:5d} | invariant {s_inv * 1e3:8.3f} ms {flop / s_inv / 1e9:6.1f} GF/s"
              f" | torch SDPA {s_t * 1e3:8.3f} ms {flop / s_t / 1e9:6.1f} GF/s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if native.invariant_gemm() is None:
        sys.exit("the native kernels did not build (no C compiler?)")
    print(f"CPU: {cpu()}; torch {torch.__version__}, {args.threads} threads; invariant kernels built for "
          f"{native.invariant_isa()} (bf16 weights on: {native.invariant_gemm_bf16_path()}); "
          f"native q4 GEMM: {native.q4_gemm() is not None}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        print(f"\n## {name}")
        linears(dtype)
        attention(dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
