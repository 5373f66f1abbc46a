"""Thin, error-checked access to a GGUF file: metadata values and dequantized tensors."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamkv.errors import ModelLoadError
from streamkv.loading.gguf_decode import dequantize
from streamkv.loading.gguf_parse import GGUFFormatError, parse_gguf

#: Tensor types streamkv is tested with; any other type ``gguf.quants`` can dequantize
#: (e.g. the IQ* types) loads too, anything else raises :class:`ModelLoadError`.
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor entry of a GGUF file (data not yet dequantized)."""

    name: str
    type_name: str
    shape: tuple[int, ...]  # numpy order (GGML order reversed)
    raw: np.ndarray
    type_id: Any  # gguf.GGMLQuantizationType


class GGUFFile:
    """A parsed GGUF file. Construction raises :class:`ModelLoadError` on corrupt input."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._parsed = parse_gguf(path)
        except (GGUFFormatError, OSError) as exc:
            raise ModelLoadError(
                f"{path}: not a readable GGUF file (corrupt or truncated?): "
                f"{type(exc).__name__}: {exc}") from exc

    def has(self, key: str) -> bool:
        """Whether the metadata key ``key`` is present."""
        return key in self._parsed.metadata

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value of ``key`` (str, int, float, bool or list), or ``default``."""
        return self._parsed.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """Metadata value of ``key``; :class:`ModelLoadError` if it is missing."""
        if not self.has(key):
            raise ModelLoadError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return self.get(key)

    def tensor_names(self) -> list[str]:
        """Names of every tensor in file order."""
        return [t.name for t in self._parsed.tensors]

    def tensors(self) -> Iterator[GGUFTensor]:
        """Iterate over the tensor entries (raw data, not dequantized)."""
        for t in self._parsed.tensors:
            yield GGUFTensor(t.name, t.type_name, tuple(reversed(t.dims)), t.data, t.type_id)

    def dequantize(self, tensor: GGUFTensor) -> np.ndarray:
        """Float32 numpy array of ``tensor`` in numpy (row-major) shape (gguf-py's bits)."""
        try:
            values = dequantize(tensor.raw, tensor.type_name)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{self.path}: tensor {tensor.name!r} has unsupported GGML type {tensor.type_name}; "
                f"supported types include {', '.join(SUPPORTED_TENSOR_TYPES)}") from exc
        except Exception as exc:
            raise self._corrupt(tensor, exc) from exc
        try:
            out = np.asarray(values, dtype=np.float32).reshape(tensor.shape)
        except ValueError as exc:
            raise self._corrupt(tensor, exc) from exc
        # F32 data comes back as a view of the read-only memory map: copy it out.
        return out.copy() if np.may_share_memory(out, tensor.raw) else out

    def _corrupt(self, tensor: GGUFTensor, exc: Exception) -> ModelLoadError:
        return ModelLoadError(
            f"{self.path}: cannot decode tensor {tensor.name!r} ({tensor.type_name}, shape "
            f"{tensor.shape}); the file is corrupt or truncated: {exc}")
