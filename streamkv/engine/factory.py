"""Builds the model-side parts of an engine from its config."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from streamkv.attention.backend import KVCache, make_backend
from streamkv.config import EngineConfig
from streamkv.engine.dtype import resolve_dtype
from streamkv.models.registry import model_class
from streamkv.runner.model_runner import ModelRunner
from streamkv.sampling.sampler import Sampler
from streamkv.sched.plan import StepOutput, StepPlan

log = logging.getLogger(__name__)


class Runner(Protocol):
    def execute(self, plan: StepPlan) -> StepOutput: ...


class TokenizerLike(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...


@dataclass
class ModelBundle:
    """Everything the engine needs from a model; tests build one around a fake runner."""

    runner: Runner
    tokenizer: TokenizerLike
    max_model_len: int
    vocab_size: int
    num_blocks: int
    dtype: torch.dtype = torch.float32
    model_name: str = "model"
    decode_weights: str = "dense"  # resolved: "dense" or "q4"


def _decode_q4(config: EngineConfig, source: str, arch: Any, dtype: torch.dtype,
               device: torch.device) -> dict[str, Any] | None:
    """Packed 4-bit decode weights, when asked for (or ``auto``) and available."""
    mode = config.model.decode_weights
    usable = source.endswith(".gguf") and dtype == torch.bfloat16 and device.type == "cpu"
    if mode == "dense" or (mode == "auto" and not usable):
        return None
    if not usable:
        raise ValueError("decode_weights=q4 needs a GGUF model with Q4_0/Q4_1 weights, dtype bfloat16, on CPU")
    if config.runtime.numerics == "invariant":
        from streamkv.native import invariant_gemm_bf16_path, q4_gemm

        if q4_gemm() is None:  # torch's int4 kernel is not batch-invariant
            if mode == "q4":
                raise ValueError("decode_weights=q4 with numerics=invariant needs the native 4-bit kernel "
                                 "(AVX512-BF16 CPUs); use numerics=fast or decode_weights=dense")
            return None
        if mode == "auto" and invariant_gemm_bf16_path() == "amx":
            # Measured on a 2-core Intel Xeon with AMX (benchmarks/invariant_kernels.py): the dense
            # bf16 tile GEMM takes 0.05 / 0.05 / 0.09 / 5.7 ms at 1 / 8 / 32 / 2048 rows of the
            # 576->1536 projection vs 0.05 / 0.16 / 0.55 / 33 ms for the 4-bit kernel.
            return None
    from streamkv.loading.q4_blocks import read_q4_matrices, read_q8_lm_head

    q4: dict[str, Any] = dict(read_q4_matrices(
        source, arch, permuted_qk=arch.architecture in ("LlamaForCausalLM", "MistralForCausalLM")))
    if not q4:
        if mode == "q4":
            raise ValueError(f"{source} has no Q4_0/Q4_1 linear weights for decode_weights=q4")
        return None
    head = read_q8_lm_head(source, arch.tie_word_embeddings)
    if head is not None:
        q4["lm_head.q8"] = head
    return q4


def _backend_name(config: EngineConfig, device: torch.device) -> str:
    name = config.runtime.attention_backend
    if name == "cpu" and device.type != "cpu":
        raise ValueError("attention_backend=cpu needs device=cpu")
    if config.runtime.numerics == "invariant":
        from streamkv.native import invariant_attention

        if invariant_attention() is None:
            raise ValueError("numerics=invariant needs the native kernels (a C compiler; STREAMKV_NATIVE unset): "
                             "use numerics=fast for pure PyTorch")
        return "cpu_invariant"
    if name != "auto":
        return name
    if device.type != "cpu":
        return "torch"
    from streamkv.native import decode_attention

    return "cpu" if decode_attention() is not None else "torch"


def build_bundle(config: EngineConfig, show_progress: bool = False) -> ModelBundle:
    from streamkv.loading import load_checkpoint

    device = torch.device(config.runtime.device)
    torch.set_num_threads(config.runtime.threads or os.cpu_count() or 1)
    dtype = resolve_dtype(config.model.dtype, device)
    ckpt = load_checkpoint(config.model.model, dtype=dtype, show_progress=show_progress)
    arch = ckpt.arch
    max_len = arch.max_position_embeddings
    if config.model.max_model_len is not None:
        if config.model.max_model_len > max_len:
            raise ValueError(f"max_model_len {config.model.max_model_len} exceeds the model's "
                             f"trained context ({max_len})")
        max_len = config.model.max_model_len
    weights = {k: v.to(device) for k, v in ckpt.weights.items()}
    q4 = _decode_q4(config, ckpt.source, arch, dtype, device)
    model = model_class(arch)(arch, weights, max_positions=max_len, q4=q4, numerics=config.runtime.numerics).eval()
    cc = config.cache
    kv_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cc.kv_cache_dtype, dtype)
    per_block = KVCache.bytes_per_block(arch.num_layers, cc.block_size, arch.num_kv_heads, arch.head_dim, kv_dtype)
    num_blocks = cc.num_blocks or max(1, cc.kv_cache_memory // per_block)
    cache = KVCache(arch.num_layers, num_blocks, cc.block_size, arch.num_kv_heads, arch.head_dim, kv_dtype, device)
    backend = make_backend(_backend_name(config, device), cache, arch.head_dim ** -0.5)
    if config.runtime.numerics == "invariant":
        model.attach_native(backend)  # every layer of a step in one native call
    log.info("model %s (%s, %s, numerics %s): %d KV blocks x %d tokens = %.0f MiB", arch.architecture,
             ckpt.source, dtype, config.runtime.numerics, num_blocks, cc.block_size, cache.nbytes / 2 ** 20)
    runner = ModelRunner(model, backend, Sampler(device), device)
    name = os.path.basename(ckpt.source.rstrip("/")) or "model"
    return ModelBundle(runner, ckpt.tokenizer, max_len, arch.vocab_size, num_blocks, dtype, name,
                       "q4" if q4 else "dense")
