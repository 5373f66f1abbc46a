"""Sequence operations and the engine interface that sessions and input streams depend on.

::

    engine/  ──builds──▶ SeqOps(scheduler, kv, kv_ops)      (this package)
    sessions/ ──uses──▶ EngineCore + SeqOps  ◀──uses── inputs/
                         (neither imports engine/)
"""
from __future__ import annotations

from streamkv.ops.core import EngineCore
from streamkv.ops.seq_ops import SeqOps

__all__ = ["EngineCore", "SeqOps"]
