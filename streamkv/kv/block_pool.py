"""Fixed-size KV blocks with reference counts, an LRU free list and a hash index.

Invariants (checked by :meth:`BlockPool.check_integrity`):

* every block is either referenced (``ref_count > 0``) or on the free list, never both;
* :meth:`allocate` pops from the front of the free list. A block released holding no hash
  goes to the front (the last such block freed is reused first: its pages are already
  touched and likely still in the CPU caches, so a never-used block, whose pages the OS must
  zero-fill on first touch, is taken only when no reused one is free); a block holding a
  hash goes to the tail, so cached blocks leave least-recently-freed first and one just
  released survives longest;
* ``hash -> block`` and ``block.block_hash`` agree; a cached block may sit on the free
  list (ref 0) until it is reused, at which point its hash is dropped (evicted).

::

    free list                  front ──▶ [b7][b4][b12 b13 .. never used][b2][b9] ◀── tail
                                         no hash, last freed first         hashed, LRU
    hash index                 h(b2) ─▶ b2,  h(b9) ─▶ b9    (b7, b4 hold no hash)
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable


@dataclass
class Block:
    """Metadata of one KV block; the tensors live in the runner's KV cache."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """Owns block metadata; hands out block ids and tracks who holds them."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def lookup(self, block_hash: int) -> int | None:
        """The cached block holding ``block_hash``, or None."""
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    # ----------------------------------------------------------------- changes
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free list (evicting their hashes)."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            out.append(block_id)
        return out

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add a reference to existing blocks (prefix hit, fork)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block reaching zero goes to the free-list
        tail when it holds a hash (cached), else to its front (reused first).

        Callers pass a sequence's blocks tail-first so its last (least shareable) blocks
        are evicted before its prefix.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def cache(self, block_id: int, block_hash: int) -> bool:
        """Index a full block under its chained hash; False if the hash is already indexed."""
        if not self.enable_prefix_caching or block_hash in self._cached:
            return False
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def uncache(self, block_id: int) -> None:
        """Drop a block's hash (its contents are about to change)."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()

    # -------------------------------------------------------------- integrity
    def check_integrity(self, tables: Iterable[Iterable[int]]) -> None:
        """Verify refcounts against ``tables`` (every live block table), free list, hashes."""
        expected = [0] * self.num_blocks
        for table in tables:
            for block_id in table:
                if not 0 <= block_id < self.num_blocks:
                    raise AssertionError(f"block id {block_id} out of range")
                expected[block_id] += 1
        for block in self.blocks:
            if block.ref_count != expected[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count} != {expected[block.block_id]} uses")
            on_free = block.block_id in self._free
            if on_free != (block.ref_count == 0):
                raise AssertionError(f"block {block.block_id}: ref {block.ref_count}, on free list {on_free}")
            if block.block_hash is not None and self._cached.get(block.block_hash) != block.block_id:
                raise AssertionError(f"block {block.block_id}: hash index disagrees")
        for block_hash, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise AssertionError(f"hash index entry for block {block_id} is stale")
