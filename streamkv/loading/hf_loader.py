"""Load a Hugging Face model directory (config.json + safetensors) onto canonical names."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from streamkv.errors import ModelLoadError, UnsupportedArchitectureError
from streamkv.loading.architectures import HF_MODEL_TYPES, SUPPORTED_ARCHITECTURES, check_supported
from streamkv.loading.names import canonical_from_hf, validate_weights
from streamkv.loading.rope import normalize_hf_rope
from streamkv.loading.tokenizer import Tokenizer
from streamkv.loading.tokenizer_hf import read_json, tokenizer_from_hf_dir
from streamkv.models.config import ArchConfig


def load_hf_dir(directory: Path, dtype: torch.dtype, show_progress: bool = False,
                ) -> tuple[ArchConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a Hugging Face directory and return architecture, canonical weights, tokenizer."""
    config = read_json(directory / "config.json")
    architecture = _architecture(config, directory)
    tokenizer = tokenizer_from_hf_dir(directory, config)
    weights = _load_weights(directory, dtype, show_progress)
    arch = _arch_config(config, architecture, weights, tokenizer, directory)
    if arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    validate_weights(weights, arch, str(directory))
    return arch, weights, tokenizer


def _architecture(config: dict[str, Any], directory: Path) -> str:
    """``architectures[0]``, or the architecture implied by ``model_type``."""
    names = config.get("architectures")
    if isinstance(names, list) and names and isinstance(names[0], str):
        return check_supported(names[0], str(directory))
    model_type = config.get("model_type")
    if model_type in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[model_type]
    raise UnsupportedArchitectureError(
        f"{directory}: config.json names no supported architecture (model_type={model_type!r}); "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _int(config: dict[str, Any], key: str, directory: Path, default: int | None = None) -> int:
    """An integer config value (``default`` when absent or null)."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"{directory}: config.json has no {key!r}")
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelLoadError(f"{directory}: config.json {key!r} must be an integer, got {value!r}")
    return value


def _arch_config(config: dict[str, Any], architecture: str, weights: dict[str, torch.Tensor],
                 tokenizer: Tokenizer, directory: Path) -> ArchConfig:
    """Build the :class:`ArchConfig`; bias/qk-norm presence is read from the weights."""
    hidden = _int(config, "hidden_size", directory)
    heads = _int(config, "num_attention_heads", directory)
    theta, scaling = normalize_hf_rope(config)
    max_pos = _int(config, "max_position_embeddings", directory, 2048)
    window = config.get("sliding_window")
    if isinstance(window, int) and window > 0 and config.get("use_sliding_window", True):
        max_pos = min(max_pos, window)  # exact only while the context fits in the window
    try:
        return ArchConfig(
            architecture=architecture,
            vocab_size=_int(config, "vocab_size", directory),
            hidden_size=hidden,
            intermediate_size=_int(config, "intermediate_size", directory),
            num_layers=_int(config, "num_hidden_layers", directory),
            num_heads=heads,
            num_kv_heads=_int(config, "num_key_value_heads", directory, heads),
            head_dim=_int(config, "head_dim", directory, hidden // heads if heads else 0),
            rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias="layers.0.q_proj.bias" in weights,
            qk_norm="layers.0.q_norm.weight" in weights,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
        )
    except (ValueError, TypeError, ZeroDivisionError) as exc:
        raise ModelLoadError(f"{directory}: invalid config.json: {exc}") from exc


def _shard_files(directory: Path) -> list[Path]:
    """The safetensors files holding the weights (single file or indexed shards)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no weight_map")
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
    elif (directory / "model.safetensors").is_file():
        files = [directory / "model.safetensors"]
    else:
        raise ModelLoadError(f"{directory}: no model.safetensors or model.safetensors.index.json "
                             "(PyTorch .bin checkpoints are not supported)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{directory}: missing safetensors shards: {', '.join(missing)}")
    return files


def _load_weights(directory: Path, dtype: torch.dtype, show_progress: bool) -> dict[str, torch.Tensor]:
    """Every tensor with a canonical name, converted to ``dtype`` and made contiguous."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for shard in _shard_files(directory):
        try:
            with safe_open(str(shard), framework="pt") as handle:
                keys = list(handle.keys())
                for key in tqdm(keys, desc=f"loading {shard.name}", unit="tensor", file=sys.stderr,
                                disable=not show_progress, leave=False):
                    name = canonical_from_hf(key)
                    if name is None:
                        continue  # e.g. rotary_emb.inv_freq buffers in old checkpoints
                    if name in weights:
                        raise ModelLoadError(f"{directory}: tensor {key!r} appears twice")
                    weights[name] = handle.get_tensor(key).to(dtype).contiguous()
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises SafetensorError, OSError, ...
            raise ModelLoadError(
                f"{shard}: not a readable safetensors file (corrupt or truncated?): {exc}") from exc
    return weights
