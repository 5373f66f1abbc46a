"""Model runner: turns a StepPlan into one forward pass and sampled tokens."""
from __future__ import annotations

from streamkv.runner.model_runner import ModelRunner

__all__ = ["ModelRunner"]
