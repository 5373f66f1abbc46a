"""Tensor side of the KV manager's block operations: copy, re-position, export, import.

All operations address the paged cache by *slots* (``block * block_size + offset``) and
act on every layer at once. Keys are stored after RoPE, so moving a key from position p to
p + shift is a rotation by ``shift`` (DESIGN.md section 3, "Positions").
"""
from __future__ import annotations

from typing import Sequence

import torch

from streamkv.attention.backend import KVCache
from streamkv.models.rope import RotaryEmbedding


def slots_of(block_table: Sequence[int], start: int, count: int, block_size: int) -> torch.Tensor:
    """Slot indices [count] of token positions ``start .. start+count-1`` under ``block_table``."""
    pos = torch.arange(start, start + count, dtype=torch.int64)
    table = torch.as_tensor(list(block_table), dtype=torch.int64)
    return table[pos // block_size] * block_size + pos % block_size


class KVOps:
    """Executes KV moves on one cache; ``rope`` rotates keys when a move changes positions."""

    def __init__(self, cache: KVCache, rope: RotaryEmbedding | None) -> None:
        self.cache = cache
        self.rope = rope

    @torch.inference_mode()
    def copy(self, src: torch.Tensor, dst: torch.Tensor, shift: int = 0) -> None:
        """Copy K/V from slots ``src`` [N] to slots ``dst`` [N] in every layer.

        A non-zero ``shift`` re-positions the keys (rotation by ``shift`` positions); values
        carry no position. ``src`` and ``dst`` must not overlap.
        """
        if src.numel() == 0:
            return
        k = self.cache.k.index_select(1, src)
        v = self.cache.v.index_select(1, src)
        if shift:
            if self.rope is None:
                raise RuntimeError("re-positioning keys needs the model's rotary embedding")
            layers, n, heads, dim = k.shape
            k = self.rope.rotate(k.reshape(layers * n, heads, dim).float(),
                                 shift).to(k.dtype).reshape(layers, n, heads, dim)
        self.cache.k.index_copy_(1, dst, k)
        self.cache.v.index_copy_(1, dst, v)
        self.cache.written(dst)

    @torch.inference_mode()
    def export(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` as contiguous host tensors [layers, N, kv_heads, head_dim]."""
        return (self.cache.k.index_select(1, slots).to("cpu"),
                self.cache.v.index_select(1, slots).to("cpu"))

    @torch.inference_mode()
    def load(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write exported K/V back into ``slots`` (any free slots: positions are in the keys)."""
        expect = (self.cache.k.shape[0], slots.numel(), *self.cache.k.shape[2:])
        if tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise ValueError(f"saved KV has shape {tuple(k.shape)}, this model's cache needs {expect}")
        self.cache.k.index_copy_(1, slots.to(self.cache.k.device), k.to(self.cache.k.device, self.cache.k.dtype))
        self.cache.v.index_copy_(1, slots.to(self.cache.v.device), v.to(self.cache.v.device, self.cache.v.dtype))
        self.cache.written(slots)
