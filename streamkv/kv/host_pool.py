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
        # Released by a swap-in this step: the step's copies still read them (swap-outs run
        # first), so they become free only at the next step (``settle``).
        self._cooling: list[int] = []
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cooling)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} host blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def release_after_step(self, blocks: list[int]) -> None:
        """Blocks a swap-in of this step reads: no swap-out of the same step may reuse them."""
        self._cooling.extend(blocks)

    def settle(self) -> None:
        """A new step: blocks swapped in before it are free again."""
        self._free.extend(self._cooling)
        self._cooling.clear()

    def check_integrity(self, tables: list[list[int]]) -> None:
        held = [b for t in tables for b in t]
        if len(set(held)) != len(held):
            raise AssertionError("a host block belongs to two sequences")
        idle = list(self._free) + self._cooling
        if set(held) & set(idle) or len(set(idle)) != len(idle) or len(held) + len(idle) != self.num_blocks:
            raise AssertionError(f"host pool: {len(held)} held + {len(idle)} free != {self.num_blocks}")
