"""Sampling parameters, the batched sampler and incremental detokenization."""
from __future__ import annotations

from streamkv.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
