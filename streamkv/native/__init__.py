"""Small C kernels for CPU hot spots (attention over the paged cache, 4-bit GEMM), compiled on first use (gcc, OpenMP) and loaded with ctypes.

Only a C compiler is needed (no torch headers; the sources compile in parallel, a few seconds). The
library links the process' ``libgomp.so.1`` (the one torch already loaded), so its threads
are torch's threads. Anything missing or failing -> :func:`decode_attention` is None and
callers use the pure-PyTorch path. ``STREAMKV_NATIVE=0`` disables the kernels.

    loader.py      sources, build tag, compile into the cache, load (``_library()``, once)
    signatures.py  the C functions' ctypes signatures
    fast_ops.py    fast-math kernels: attention for ``--numerics fast``, Quest page ranking
    exact_ops.py   kernels built without fast math: 4/8-bit and invariant GEMMs, invariant
                   attention, GGUF dequantization, KV row moves, whole decoder layers
"""
from __future__ import annotations

from streamkv.native.exact_ops import (deq_gemm, deq_gemm_bf16, gemm_path, gguf_dequant, invariant_attention,
                                       invariant_attention_amx, invariant_attention_bf16, invariant_attention_bf16f,
                                       invariant_gemm, invariant_gemm_bf16_path, invariant_gemm_uses_bf16_dot,
                                       invariant_isa, kv_move, layer_library, q4_gemm, q8_gemm)
from streamkv.native.fast_ops import decode_attention, page_bounds, page_select, page_shares, paged_attention
from streamkv.native.loader import build_tag, compile_steps, object_files, run_all

__all__ = ["build_tag", "compile_steps", "decode_attention", "deq_gemm", "deq_gemm_bf16", "gemm_path", "gguf_dequant",
           "invariant_attention", "invariant_attention_amx", "invariant_attention_bf16", "invariant_attention_bf16f",
           "invariant_gemm", "invariant_gemm_bf16_path", "invariant_gemm_uses_bf16_dot", "invariant_isa", "kv_move",
           "layer_library", "object_files", "page_bounds", "page_select", "page_shares", "paged_attention", "q4_gemm",
           "q8_gemm", "run_all"]
