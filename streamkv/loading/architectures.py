"""Which checkpoint architectures the loaders accept, and how file formats name them."""
from __future__ import annotations

from streamkv.errors import UnsupportedArchitectureError

#: Hugging Face architecture names the loaders can map onto canonical parameters.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

#: ``general.architecture`` values of GGUF files -> Hugging Face architecture names.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

#: ``model_type`` values of ``config.json`` (used when ``architectures`` is absent).
HF_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

#: GGUF architectures whose Q/K rows llama.cpp's converter permuted for interleaved RoPE.
GGUF_PERMUTED_QK: frozenset[str] = frozenset({"llama", "mistral"})


def check_supported(architecture: str, source: str) -> str:
    """Return ``architecture`` if the loaders support it, else raise a typed error."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{source}: architecture {architecture!r} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return architecture


def architecture_from_gguf(gguf_arch: str, source: str) -> str:
    """Map a GGUF ``general.architecture`` value onto a supported HF architecture name."""
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{source}: GGUF architecture {gguf_arch!r} is not supported; supported GGUF "
            f"architectures: {', '.join(GGUF_ARCHITECTURES)} "
            f"(i.e. {', '.join(SUPPORTED_ARCHITECTURES)})")
    return GGUF_ARCHITECTURES[gguf_arch]
