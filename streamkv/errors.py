"""Typed errors raised at streamkv's user-facing boundaries."""
from __future__ import annotations


class StreamKVError(Exception):
    """Base class of every error streamkv raises on purpose."""


class ModelLoadError(StreamKVError, ValueError):
    """The model path is missing, corrupt, or names an unsupported format."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture has no registered implementation."""


class InvalidRequestError(StreamKVError, ValueError):
    """A request (prompt or sampling parameters) is invalid; nothing was scheduled."""


class EngineDeadError(StreamKVError, RuntimeError):
    """The engine loop stopped and cannot serve requests any more."""
