"""Model loading: GGUF files and Hugging Face directories onto canonical names.

``load_checkpoint(path)`` returns a :class:`LoadedCheckpoint` holding the
:class:`~streamkv.models.config.ArchConfig`, the canonical weights and the
:class:`Tokenizer`; ``path=None`` loads the embedded SmolLM2-135M-Instruct GGUF.
"""
from __future__ import annotations

from streamkv.loading.architectures import SUPPORTED_ARCHITECTURES
from streamkv.loading.checkpoint import LoadedCheckpoint, default_model_path, load_checkpoint
from streamkv.loading.tokenizer import Tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LoadedCheckpoint",
    "Tokenizer",
    "default_model_path",
    "load_checkpoint",
]
