"""Paged KV cache: block pool, prefix cache and the per-sequence manager."""
from __future__ import annotations

from streamkv.kv.block_pool import BlockPool
from streamkv.kv.manager import KVManager
from streamkv.kv.prefix import hash_block_tokens

__all__ = ["BlockPool", "KVManager", "hash_block_tokens"]
