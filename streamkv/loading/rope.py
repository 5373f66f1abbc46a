"""RoPE scaling descriptions, normalized to one dict format for :class:`ArchConfig`.

``ArchConfig.rope_scaling`` is ``None`` (plain RoPE) or a dict with a ``"rope_type"`` key
(``"linear"``, ``"dynamic"``, ``"yarn"``, ``"llama3"``, ...) plus that type's Hugging Face
parameters (``factor``, ``low_freq_factor``, ``high_freq_factor``,
``original_max_position_embeddings``, ...). ``rope_theta`` is never inside it.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from streamkv.errors import ModelLoadError


def normalize_hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from a ``config.json`` dict.

    Handles both the classic keys (``rope_theta`` + ``rope_scaling`` with ``type`` or
    ``rope_type``) and transformers >= 5's ``rope_parameters``.
    """
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    if rope_type in (None, "default"):
        return theta, None
    return theta, {"rope_type": str(rope_type), **scaling}


def gguf_rope_scaling(get: Any, arch: str, source: str) -> dict[str, Any] | None:
    """Rope scaling from ``{arch}.rope.scaling.*`` metadata (``get`` is a metadata getter)."""
    kind = get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = get(f"{arch}.rope.scaling.factor")
    original = get(f"{arch}.rope.scaling.original_context_length")
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"{source}: unsupported RoPE scaling type {kind!r}")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor or 1.0)}
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for key in ("beta_fast", "beta_slow"):
        value = get(f"{arch}.rope.scaling.yarn_{key}")
        if value is not None:
            scaling[key] = float(value)
    return scaling


def _llama3_factors(theta: float, rot_dim: int, factor: float, low: float, high: float,
                    original: float) -> np.ndarray:
    """Per-frequency divisors of Llama-3 RoPE scaling (llama.cpp's ``rope_freqs``)."""
    freqs = 1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original / high, 1.0, out)
    return np.where(wavelen > original / low, factor, out)


def llama3_from_freq_factors(factors: np.ndarray, theta: float, rot_dim: int,
                             source: str) -> dict[str, Any]:
    """Recover Llama-3 scaling parameters from a GGUF ``rope_freqs`` tensor.

    llama.cpp stores the per-frequency divisors instead of the parameters. The smooth
    region is linear in 1/wavelength, which gives the parameters assuming
    ``low_freq_factor == 1`` (true for every released Llama 3.x; with a single point in the
    smooth region ``high_freq_factor == 4`` is assumed too); the result is checked by
    recomputing the divisors.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    factor = float(factors.max())
    candidates = [(1.0, 4.0, 8192.0)]
    freqs = 1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    inv_wavelen = freqs / (2 * math.pi)
    mid = (factors > 1 + 1e-4) & (factors < factor - 1e-4)
    smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor) if factor > 1 else np.zeros(0)
    if smooth.size >= 2:
        slope, intercept = np.polyfit(inv_wavelen[mid], smooth, 1)
        if intercept < 0:
            candidates.insert(0, (1.0, float(1 - 1 / intercept), float(-slope / intercept)))
    elif smooth.size == 1:  # one point: assume the released high_freq_factor of 4
        candidates.insert(0, (1.0, 4.0, float((3 * smooth[0] + 1) / inv_wavelen[mid][0])))
    for low, high, original in candidates:
        if factors.shape == freqs.shape and np.allclose(
                _llama3_factors(theta, rot_dim, factor, low, high, original), factors, rtol=1e-3):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": round(high, 4),
                    "original_max_position_embeddings": int(round(original))}
    raise ModelLoadError(f"{source}: cannot interpret the rope_freqs tensor as Llama-3 RoPE scaling")
