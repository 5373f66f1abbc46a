"""Host (swap) blocks: where a preempted sequence's KV waits instead of being recomputed.

Only the KV manager hands them out; each host block belongs to exactly one swapped
sequence (no sharing, no prefix cache), so there is no reference count, just a free list.
"""
from __future__ import annotations

from collections import deque


class HostPool:
    """``num_blocks`` host blocks of the device pool's block size (0: swapping is off)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} host blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def check_integrity(self, tables: list[list[int]]) -> None:
        held = [b for t in tables for b in t]
        if len(set(held)) != len(held):
            raise AssertionError("a host block belongs to two sequences")
        if set(held) & set(self._free) or len(held) + len(self._free) != self.num_blocks:
            raise AssertionError(f"host pool: {len(held)} held + {len(self._free)} free != {self.num_blocks}")
