"""Tensor side of the KV manager's block operations: copy, re-position, export, import.

All operations address the paged cache by *slots* (``block * block_size + offset``) and
act on every layer at once. Keys are stored after RoPE, so moving a key from position p to
p + shift is a rotation by ``shift`` (DESIGN.md section 3, "Positions").
"""
from __future__ import annotations

import math

from typing import Sequence

import torch

from streamkv import native
from streamkv.attention.backend import KVCache
from streamkv.models.rope import RotaryEmbedding


def slots_of(block_table: Sequence[int], start: int, count: int, block_size: int) -> torch.Tensor:
    """Slot indices [count] of token positions ``start .. start+count-1`` under ``block_table``."""
    return slots_at(block_table, torch.arange(start, start + count, dtype=torch.int64), block_size)


def slots_at(block_table: Sequence[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot indices [N] of token ``positions`` [N] (int64) under ``block_table``."""
    table = torch.as_tensor(list(block_table), dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size


class KVOps:
    """Executes KV moves on one cache; ``rope`` rotates keys when a move changes positions."""

    def __init__(self, cache: KVCache, rope: RotaryEmbedding | None) -> None:
        self.cache = cache
        self.rope = rope
        self.host_k: torch.Tensor | None = None  # swap space [layers, host_blocks * bs, kv_heads, head_dim]
        self.host_v: torch.Tensor | None = None
        self.swap_bytes = 0
        # one pass over the rows in C (gather, rotate, scatter) where the kernels exist
        self._move = native.kv_move() if cache.k.device.type == "cpu" and cache.k.is_contiguous() else None
        # deferred moves (src [N], dst [N], shift [N]), done together by flush(): a step's splices
        # of every span query in one call. Any other KV operation flushes first.
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.moves = 0  # calls that moved rows (tests count them)

    @property
    def bytes_per_block(self) -> int:
        k = self.cache.k
        return 2 * k.element_size() * k.shape[0] * self.cache.block_size * k.shape[2] * k.shape[3]

    def attach_host(self, num_blocks: int) -> None:
        """Allocate the host swap space (``num_blocks`` blocks, the cache's layout and dtype)."""
        k = self.cache.k
        shape = (k.shape[0], num_blocks * self.cache.block_size, *k.shape[2:])
        try:
            self.host_k = torch.zeros(shape, dtype=k.dtype, device="cpu")
            self.host_v = torch.zeros(shape, dtype=k.dtype, device="cpu")
        except (RuntimeError, MemoryError) as exc:  # torch's allocator reports failure as RuntimeError
            self.host_k = self.host_v = None
            size = 2 * math.prod(shape) * k.dtype.itemsize
            raise ValueError(f"cannot allocate {size:,} bytes of swap space ({type(exc).__name__} from the "
                             "allocator): lower swap_space") from None

    @torch.inference_mode()
    def swap(self, out: Sequence[tuple[int, int]], into: Sequence[tuple[int, int]]) -> None:
        """Copy ``out`` (device block, host block) pairs to the host, then ``into`` (host block,
        device block) pairs back: whole blocks, every layer."""
        if not out and not into:
            return
        self.flush()
        if self.host_k is None or self.host_v is None:
            raise RuntimeError("swap without swap space (attach_host)")
        bs = self.cache.block_size
        for pairs, src_k, src_v, dst_k, dst_v in ((out, self.cache.k, self.cache.v, self.host_k, self.host_v),
                                                  (into, self.host_k, self.host_v, self.cache.k, self.cache.v)):
            if not pairs:
                continue
            src = slots_of([p[0] for p in pairs], 0, len(pairs) * bs, bs).to(src_k.device)
            dst = slots_of([p[1] for p in pairs], 0, len(pairs) * bs, bs).to(dst_k.device)
            dst_k.index_copy_(1, dst, src_k.index_select(1, src).to(dst_k.device))
            dst_v.index_copy_(1, dst, src_v.index_select(1, src).to(dst_v.device))
            self.swap_bytes += len(pairs) * self.bytes_per_block
        if into:
            self.cache.written(slots_of([p[1] for p in into], 0, len(into) * bs, bs))

    def flush(self) -> None:
        """Do every deferred move, in one call (before anything reads or writes the cache)."""
        if not self._pending:
            return
        src, dst, shift = (torch.cat(t) for t in zip(*self._pending))
        self._pending = []
        self.copy(src, dst, shift)

    @torch.inference_mode()
    def copy(self, src: torch.Tensor, dst: torch.Tensor, shift: int | torch.Tensor = 0, defer: bool = False) -> None:
        """Copy K/V from slots ``src`` [N] to slots ``dst`` [N] in every layer.

        A non-zero ``shift`` (one int, or [N] per row) re-positions the keys (rotation by
        ``shift`` positions); values carry no position. A slot may be both a source and a
        destination (an in-place eviction): every source row is read before any is written.
        One call moves any number of ranges: every layer's rows in one rotation. ``defer``
        queues the move for :meth:`flush` (its sources must stay unchanged until then).
        """
        if src.numel() == 0:
            return
        if defer:
            per_row_shift = shift if isinstance(shift, torch.Tensor) else torch.full_like(src, shift)
            self._pending.append((src, dst, per_row_shift.to(torch.int64)))
            return
        self.flush()
        self.moves += 1
        per_row = isinstance(shift, torch.Tensor)
        if (per_row or shift) and self.rope is None:
            raise RuntimeError("re-positioning keys needs the model's rotary embedding")
        if self._move is not None:
            table = None
            if per_row or shift:
                delta = shift if per_row else torch.full((src.numel(),), shift, dtype=torch.int64)  # type: ignore[union-attr]
                table = self.rope.rotation_table(delta)  # type: ignore[union-attr]
            self._move(self.cache.k, self.cache.v, src, dst, table)
            self.cache.written(dst)
            return
        k = self.cache.k.index_select(1, src)
        v = self.cache.v.index_select(1, src)
        if per_row or shift:
            layers, n, heads, dim = k.shape
            delta = shift.to(torch.float32).repeat(layers) if per_row else shift
            k = self.rope.rotate(k.reshape(layers * n, heads, dim).float(),
                                 delta).to(k.dtype).reshape(layers, n, heads, dim)
        self.cache.k.index_copy_(1, dst, k)
        self.cache.v.index_copy_(1, dst, v)
        self.cache.written(dst)

    @torch.inference_mode()
    def export(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` as contiguous host tensors [layers, N, kv_heads, head_dim]."""
        self.flush()
        return (self.cache.k.index_select(1, slots).to("cpu"),
                self.cache.v.index_select(1, slots).to("cpu"))

    @torch.inference_mode()
    def load(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Write exported K/V rows ``start:`` back into ``slots`` (any free slots: positions
        are in the keys)."""
        self.flush()
        if start:
            k, v = k[:, start:], v[:, start:]
        expect = (self.cache.k.shape[0], slots.numel(), *self.cache.k.shape[2:])
        if tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise ValueError(f"saved KV has shape {tuple(k.shape)}, this model's cache needs {expect}")
        self.cache.k.index_copy_(1, slots.to(self.cache.k.device), k.to(self.cache.k.device, self.cache.k.dtype))
        self.cache.v.index_copy_(1, slots.to(self.cache.v.device), v.to(self.cache.v.device, self.cache.v.dtype))
        self.cache.written(slots)
