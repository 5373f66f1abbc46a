"""Model architectures registered by Hugging Face architecture name."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch.nn as nn

from streamkv.errors import UnsupportedArchitectureError
from streamkv.models.config import ArchConfig

MODEL_REGISTRY: dict[str, type[nn.Module]] = {}
T = TypeVar("T", bound=type[nn.Module])


def register_model(*names: str) -> Callable[[T], T]:
    def wrap(cls: T) -> T:
        for name in names:
            MODEL_REGISTRY[name] = cls
        return cls
    return wrap


def model_class(arch: ArchConfig) -> type[nn.Module]:
    import streamkv.models.llama  # noqa: F401  (registration side effects)
    import streamkv.models.qwen  # noqa: F401

    try:
        return MODEL_REGISTRY[arch.architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {arch.architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}") from None
