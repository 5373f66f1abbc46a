"""Model implementations, one file per architecture family."""
from __future__ import annotations

from streamkv.models.config import ArchConfig
from streamkv.models.registry import MODEL_REGISTRY, model_class, register_model

__all__ = ["ArchConfig", "MODEL_REGISTRY", "model_class", "register_model"]
