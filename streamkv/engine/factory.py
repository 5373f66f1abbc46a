"""Builds the model-side parts of an engine from its config."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from streamkv.attention.backend import KVCache, make_backend
from streamkv.config import EngineConfig
from streamkv.engine.dtype import resolve_dtype
from streamkv.loading.checkpoint import LoadedCheckpoint
from streamkv.loading.gguf_file import GGUFFile
from streamkv.loading.q4_blocks import quant_summary
from streamkv.native.cpu import usable_cores
from streamkv.native.choice import KernelChoice, ModelShapes, dense_gemm, parse_kernels
from streamkv.native.tuning import choose
from streamkv.models.linear import KernelOptions
from streamkv.models.registry import model_class
from streamkv.runner.model_runner import ModelRunner
from streamkv.sampling.grammar import Grammars
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
    decode_weights: str = "dense"  # resolved: "dense", "q4" or "deq" (4-bit blocks for small steps, dense bits)
    kernels: KernelChoice = field(default_factory=KernelChoice)  # what was measured / forced (``streamkv info``)


def kernel_choice(config: EngineConfig, ckpt: LoadedCheckpoint, dtype: torch.dtype, device: torch.device,
                  retune: bool = False) -> KernelChoice:
    """The kernel paths for this model on this CPU: forced by ``--kernels`` / ``--decode-weights``,
    else measured once and cached (``native/tuning.py``; ``retune`` measures again)."""
    forced = parse_kernels(config.runtime.kernels)
    mode = config.model.decode_weights
    asked = f"decode_weights={mode}" if mode != "auto" else "kernels linear=q4"  # who asked for q4, in errors
    if mode != "auto":
        if forced.get("linear", mode) != mode:
            raise ValueError(f"decode_weights={mode} contradicts kernels linear={forced['linear']}")
        forced["linear"] = mode
    if device.type != "cpu":
        if forced:
            raise ValueError("kernels and decode_weights choose CPU kernels: use them with device=cpu")
        return KernelChoice()
    backend = _backend_name(config, device)  # a ValueError where invariant numerics have no native kernels
    arch, bf16 = ckpt.arch, dtype == torch.bfloat16
    q4, q8 = quant_summary(ckpt.gguf, arch.tie_word_embeddings) if ckpt.gguf is not None else (False, False)
    if forced.get("linear") == "q4" and not q4:
        raise ValueError(f"{asked} needs a GGUF model with Q4_0/Q4_1 weights, on CPU")
    shapes = ModelShapes(arch.hidden_size, arch.intermediate_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                         arch.vocab_size, arch.num_layers, config.runtime.numerics, bf16, q4, q8,
                         cache_bf16=kv_dtype(config, dtype) == torch.bfloat16,
                         backend=backend if config.runtime.numerics == "fast" else "cpu_invariant")
    try:
        return choose(shapes, forced, retune)
    except ValueError as exc:
        if (forced.get("linear") == "q4" and config.runtime.numerics == "invariant"
                and str(exc).startswith("kernels: linear=")):  # (another kind's refusal names that kind)
            raise ValueError(f"{asked} with numerics=invariant needs the native 4-bit kernel "
                             "(AVX512-BF16 CPUs for bfloat16; float32 on any CPU with a C compiler); "
                             "use numerics=fast or decode_weights=dense") from exc
        for kind, what in (("linear", "Q4_0/Q4_1 layers"), ("lm_head", "a Q8_0 LM head")):
            if forced.get(kind) == "deq" and str(exc).startswith(f"kernels: {kind}=deq"):
                raise ValueError(f"kernels {kind}=deq needs a bfloat16 GGUF model with {what}, numerics=invariant "
                                 f"and a CPU with AVX512-BF16 and VBMI ({exc})") from exc
        if mode != "auto" and str(exc).startswith("kernels: linear="):  # the flag the user passed
            raise ValueError(str(exc).replace("kernels: linear=", "decode_weights=", 1)) from exc
        raise


def _packed_weights(kernels: KernelChoice, gguf: GGUFFile | None, arch: Any) -> dict[str, Any] | None:
    """The GGUF's own 4-bit layers and int8 LM head, where the kernel choice takes them."""
    from streamkv.loading.q4_blocks import read_q4_matrices, read_q8_lm_head

    if gguf is None:
        return None
    out: dict[str, Any] = {}
    if kernels.get("linear") in ("q4", "q4f", "deq"):
        out.update(read_q4_matrices(gguf, arch,
                                    permuted_qk=arch.architecture in ("LlamaForCausalLM", "MistralForCausalLM")))
    if kernels.get("lm_head") in ("q8", "deq"):
        head = read_q8_lm_head(gguf, arch.tie_word_embeddings)
        if head is not None:
            out["lm_head.q8"] = head
    return out or None


def kv_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: ``kv_cache_dtype``, or the model's (auto)."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(config.cache.kv_cache_dtype, dtype)


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


def _backend_options(kernels: KernelChoice) -> dict[str, Any]:
    """The attention kernels the choice names, as backend constructor options."""
    if "attention" in kernels.paths:
        path = kernels.paths["attention"]
        gather = kernels.paths.get("attention_gather", "stage")  # the bf16 kernels' only: f32 never stages
        return {"bf16": path in ("bf16", "amx", "bf16f"), "tiles": path == "amx", "fma": path == "bf16f",
                "gather": gather if path != "f32" else "stage"}
    if "prefill_attention" in kernels.paths:
        return {"paged": kernels.paths["prefill_attention"] == "native"}
    return {}


def set_threads(config: EngineConfig) -> None:
    """torch's thread count: ``--threads``, else the cores this process may run on."""
    torch.set_num_threads(config.runtime.threads or usable_cores())


def build_bundle(config: EngineConfig, show_progress: bool = False) -> ModelBundle:
    from streamkv.loading import load_checkpoint

    device = torch.device(config.runtime.device)
    if device.type == "cuda" and not torch.cuda.is_available():  # (torch asserted deep in the first copy)
        raise ValueError(f"device={config.runtime.device}: this torch {torch.__version__} sees no CUDA device")
    set_threads(config)
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
    kernels = kernel_choice(config, ckpt, dtype, device)
    log.info("kernels: %s", kernels.describe())
    q4 = _packed_weights(kernels, ckpt.gguf, arch)
    tiles, gemm_fma = dense_gemm(kernels.paths)
    options = KernelOptions(tiles=tiles, gemm_fma=gemm_fma, q4_fma=kernels.get("linear") == "q4f",
                            deq_rows=kernels.packed_rows("linear"),
                            head_deq_rows=kernels.packed_rows("lm_head"))
    model = model_class(arch)(arch, weights, max_positions=max_len, q4=q4, numerics=config.runtime.numerics,
                              options=options).eval()
    cc = config.cache
    cache_dtype = kv_dtype(config, dtype)
    per_block = KVCache.bytes_per_block(arch.num_layers, cc.block_size, arch.num_kv_heads, arch.head_dim, cache_dtype)
    num_blocks = cc.num_blocks or max(1, cc.kv_cache_memory // per_block)
    cache = KVCache(arch.num_layers, num_blocks, cc.block_size, arch.num_kv_heads, arch.head_dim, cache_dtype, device)
    backend = make_backend(_backend_name(config, device), cache, arch.head_dim ** -0.5, **_backend_options(kernels))
    if config.runtime.numerics == "invariant":
        model.attach_native(backend)  # every layer of a step in one native call
    log.info("model %s (%s, %s, numerics %s): %d KV blocks x %d tokens = %.0f MiB", arch.architecture,
             ckpt.source, dtype, config.runtime.numerics, num_blocks, cc.block_size, cache.nbytes / 2 ** 20)
    grammars = Grammars(ckpt.tokenizer, arch.vocab_size)  # structured outputs (compiled on first use)
    runner = ModelRunner(model, backend, Sampler(device, grammars), device)
    name = os.path.basename(ckpt.source.rstrip("/")) or "model"
    linear_q4 = any(k.endswith("proj.weight") for k in (q4 or {}))
    return ModelBundle(runner, ckpt.tokenizer, max_len, arch.vocab_size, num_blocks, dtype, name,
                       kernels.get("linear", "q4") if linear_q4 else "dense", kernels)
