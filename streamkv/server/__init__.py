"""OpenAI- and Anthropic-compatible HTTP server over the async engine."""
from __future__ import annotations
