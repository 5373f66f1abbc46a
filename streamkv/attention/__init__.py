"""Attention backends over the paged KV cache."""
from __future__ import annotations

from streamkv.attention.backend import AttentionBackend, KVCache, SeqSpan, make_backend

__all__ = ["AttentionBackend", "KVCache", "SeqSpan", "make_backend"]
