"""Load a GGUF file (llama.cpp format) onto canonical names and an :class:`ArchConfig`."""
from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from streamkv.errors import ModelLoadError
from streamkv.loading.architectures import GGUF_PERMUTED_QK, architecture_from_gguf
from streamkv.loading.gguf_file import GGUFFile, GGUFTensor
from streamkv.loading.names import canonical_from_gguf, validate_weights
from streamkv.loading.rope import gguf_rope_scaling, llama3_from_freq_factors
from streamkv.loading.tokenizer import Tokenizer
from streamkv.loading.tokenizer_gguf import tokenizer_from_gguf
from streamkv.models.config import ArchConfig


def load_gguf(gguf: GGUFFile, dtype: torch.dtype, show_progress: bool = False,
              ) -> tuple[ArchConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a parsed GGUF file: its architecture, canonical weights and tokenizer."""
    path = gguf.path
    gguf_arch = str(gguf.require("general.architecture"))
    architecture = architecture_from_gguf(gguf_arch, path)
    tensors = {t.name: t for t in gguf.tensors()}
    tokenizer = tokenizer_from_gguf(gguf)
    arch = _arch_config(gguf, gguf_arch, architecture, tensors, tokenizer)
    weights = _load_weights(gguf, gguf_arch, arch, list(tensors.values()), dtype, show_progress)
    validate_weights(weights, arch, path)
    return arch, weights, tokenizer


def _scalar(gguf: GGUFFile, key: str, default: Any = None) -> Any:
    """A metadata value that must be one number (per-layer arrays must be uniform)."""
    value = gguf.get(key, default)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ModelLoadError(f"{gguf.path}: per-layer values of {key!r} are not supported")
        value = value[0]
    return value


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _arch_config(gguf: GGUFFile, ga: str, architecture: str, tensors: dict[str, GGUFTensor],
                 tokenizer: Tokenizer) -> ArchConfig:
    """Build the :class:`ArchConfig` from ``{arch}.*`` metadata and the tensor list."""
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{gguf.path}: checkpoint is missing tensors: token_embd.weight")
    hidden = int(_scalar(gguf, f"{ga}.embedding_length") or 0)
    heads = int(_scalar(gguf, f"{ga}.attention.head_count") or 0)
    for key, value in (("embedding_length", hidden), ("attention.head_count", heads)):
        if value <= 0:
            raise ModelLoadError(f"{gguf.path}: GGUF metadata key {ga}.{key!r} is missing")
    theta = _f32(_scalar(gguf, f"{ga}.rope.freq_base", 10000.0))
    head_dim = int(_scalar(gguf, f"{ga}.attention.key_length", hidden // heads))
    try:
        return ArchConfig(
            architecture=architecture,
            vocab_size=tensors["token_embd.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=int(_scalar(gguf, f"{ga}.feed_forward_length", 0)),
            num_layers=int(_scalar(gguf, f"{ga}.block_count", 0)),
            num_heads=heads,
            num_kv_heads=int(_scalar(gguf, f"{ga}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=_f32(_scalar(gguf, f"{ga}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=theta,
            rope_scaling=_rope_scaling(gguf, ga, tensors, theta, head_dim),
            max_position_embeddings=int(_scalar(gguf, f"{ga}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
        )
    except ValueError as exc:
        raise ModelLoadError(f"{gguf.path}: invalid model metadata: {exc}") from exc


def _rope_scaling(gguf: GGUFFile, ga: str, tensors: dict[str, GGUFTensor], theta: float,
                  head_dim: int) -> dict[str, Any] | None:
    """Rope scaling from metadata, or Llama-3 scaling recovered from ``rope_freqs``."""
    scaling = gguf_rope_scaling(gguf.get, ga, gguf.path)
    if scaling is None and "rope_freqs.weight" in tensors:
        rot_dim = int(_scalar(gguf, f"{ga}.rope.dimension_count", head_dim))
        factors = gguf.dequantize(tensors["rope_freqs.weight"])
        scaling = llama3_from_freq_factors(factors, theta, rot_dim, gguf.path)
    return scaling


def unpermute_qk(w: np.ndarray, n_head: int, source: str, name: str) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row permutation (back to HF rotate-half order).

    llama.cpp applies ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)``;
    this is its inverse. Works for weights (2-D) and biases (1-D).
    """
    rows = w.shape[0]
    if rows % (2 * n_head) != 0:
        raise ModelLoadError(f"{source}: tensor {name!r} has {rows} rows, not divisible by 2*{n_head} heads")
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _load_weights(gguf: GGUFFile, ga: str, arch: ArchConfig, tensors: list[GGUFTensor],
                  dtype: torch.dtype, show_progress: bool) -> dict[str, torch.Tensor]:
    """Dequantize every mapped tensor, undo Q/K permutation, convert to ``dtype``."""
    permuted = ga in GGUF_PERMUTED_QK
    weights: dict[str, torch.Tensor] = {}
    bar = tqdm(tensors, desc="loading weights", unit="tensor", file=sys.stderr,
               disable=not show_progress, leave=False)
    for tensor in bar:
        name = canonical_from_gguf(tensor.name)
        if name is None:
            continue  # e.g. rope_freqs.weight (folded into ArchConfig.rope_scaling)
        if name in weights:
            raise ModelLoadError(f"{gguf.path}: tensor {tensor.name!r} appears twice")
        values = gguf.dequantize(tensor)
        if permuted and (".q_proj." in name or ".k_proj." in name):
            heads = arch.num_heads if ".q_proj." in name else arch.num_kv_heads
            values = unpermute_qk(values, heads, gguf.path, tensor.name)
        weights[name] = torch.from_numpy(np.ascontiguousarray(values)).to(dtype).contiguous()
    return weights
