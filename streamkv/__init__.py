"""streamkv: an LLM inference server for streaming and stateful workloads."""
from __future__ import annotations

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from streamkv.engine import LLM, Engine, RequestOutput
from streamkv.sampling.params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CacheConfig", "Engine", "EngineConfig", "ModelConfig", "RequestOutput",
           "RuntimeConfig", "SamplingParams", "SchedulerConfig", "__version__"]
