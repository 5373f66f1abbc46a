"""Engine: the step loop, its outputs and the offline LLM API."""
from __future__ import annotations

from streamkv.engine.engine import Engine
from streamkv.engine.llm import LLM
from streamkv.engine.outputs import RequestOutput

__all__ = ["Engine", "LLM", "RequestOutput"]
