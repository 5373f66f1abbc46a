"""Measurement-backed dtype choice.

Measured on the reference CPU (AMD EPYC Zen 4, 2 threads, torch 2.13): ``F.linear`` at
prefill shapes runs at ~190 GFLOP/s in float32 and ~420 in bfloat16, and batch-1 decode
shapes are bandwidth-bound (bfloat16 moves half the bytes). So bfloat16 is the default
where the CPU has native bf16 dot products (AVX512_BF16 / AMX); elsewhere float32, since
emulated bf16 matmuls are slower than float32.
"""
from __future__ import annotations

import torch

from streamkv.native.cpu import has_flag


def cpu_has_native_bf16() -> bool:
    return has_flag("avx512_bf16") or has_flag("amx_bf16")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if name != "auto":
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {name!r}")
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
