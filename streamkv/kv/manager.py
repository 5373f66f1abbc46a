"""Per-sequence facade over the block pool: block tables, prefix hits, growth, release.

A sequence's block table maps token index ``i`` to slot ``table[i // bs] * bs + i % bs``::

    tokens   0 ........ 15 | 16 ....... 31 | 32 .. 37
    table    [    b4       |      b9       |   b1     ]   (bs = 16, 38 tokens)
    hashes   [  h0=H(R,t0..15) | h1=H(h0,t16..31) ]        (full, computed blocks only)

Only the manager changes block ownership; policies and the scheduler ask it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from streamkv.kv.block_pool import BlockPool
from streamkv.kv.prefix import ROOT_HASH, hash_block_tokens


@dataclass
class SeqKV:
    """Blocks held by one sequence and the chained hashes of its registered full blocks."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    cache_key: int = 0


@dataclass(frozen=True)
class PrefixHit:
    """Result of a prefix lookup: cached blocks covering ``num_tokens`` leading tokens."""

    block_ids: tuple[int, ...]
    hashes: tuple[int, ...]

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


class KVManager:
    """Owns every sequence's block table; all ownership changes go through here."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._seqs: dict[int, SeqKV] = {}

    # ----------------------------------------------------------------- lookup
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id].block_ids

    def num_blocks_held(self, seq_id: int) -> int:
        kv = self._seqs.get(seq_id)
        return len(kv.block_ids) if kv else 0

    def match_prefix(self, tokens: Sequence[int], cache_key: int = 0) -> PrefixHit:
        """Longest run of cached full blocks at the start of ``tokens``.

        At most ``len(tokens) - 1`` tokens are matched so the last token is always computed
        (its logits are needed). Pure lookup: nothing changes.
        """
        bs = self.block_size
        max_blocks = (len(tokens) - 1) // bs
        ids: list[int] = []
        hashes: list[int] = []
        parent = ROOT_HASH
        for b in range(max_blocks):
            parent = hash_block_tokens(parent, tokens[b * bs:(b + 1) * bs], cache_key)
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            ids.append(block_id)
            hashes.append(parent)
        return PrefixHit(tuple(ids), tuple(hashes))

    def admission_cost(self, hit: PrefixHit, num_tokens: int) -> int:
        """Free blocks consumed by admitting a sequence with ``hit`` and ``num_tokens`` of KV."""
        reused_free = sum(1 for b in hit.block_ids if self.pool.is_free(b))
        return reused_free + max(0, self.blocks_for(num_tokens) - len(hit.block_ids))

    def growth_cost(self, seq_id: int, num_tokens: int) -> int:
        """Extra blocks needed for ``seq_id`` to hold ``num_tokens`` tokens of KV."""
        return max(0, self.blocks_for(num_tokens) - self.num_blocks_held(seq_id))

    # ---------------------------------------------------------------- changes
    def admit(self, seq_id: int, hit: PrefixHit, cache_key: int = 0, num_tokens: int = 0) -> None:
        """Start tracking ``seq_id`` (``num_tokens`` long), taking references on its hit blocks."""
        if seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq_id} already has KV")
        self.pool.acquire(hit.block_ids)
        self.pool.prefix_queries += max(0, (num_tokens - 1) // self.block_size)
        self.pool.prefix_hits += len(hit.block_ids)
        self._seqs[seq_id] = SeqKV(list(hit.block_ids), list(hit.hashes), cache_key)

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Make the table cover ``num_tokens``; False (and no change) if blocks are short."""
        kv = self._seqs[seq_id]
        need = self.blocks_for(num_tokens) - len(kv.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        kv.block_ids.extend(self.pool.allocate(need))
        return True

    def commit(self, seq_id: int, tokens: Sequence[int], num_computed: int) -> None:
        """Register every full block whose KV is now computed in the prefix cache."""
        kv = self._seqs[seq_id]
        bs = self.block_size
        full = min(num_computed // bs, len(kv.block_ids))
        parent = kv.hashes[-1] if kv.hashes else ROOT_HASH
        for b in range(len(kv.hashes), full):
            parent = hash_block_tokens(parent, tokens[b * bs:(b + 1) * bs], kv.cache_key)
            kv.hashes.append(parent)
            self.pool.cache(kv.block_ids[b], parent)

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id`` (tail first) and forget it."""
        kv = self._seqs.pop(seq_id, None)
        if kv is not None:
            self.pool.release(reversed(kv.block_ids))

    # -------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        self.pool.check_integrity(kv.block_ids for kv in self._seqs.values())
        for seq_id, kv in self._seqs.items():
            if len(kv.hashes) > len(kv.block_ids):
                raise AssertionError(f"sequence {seq_id}: more hashes than blocks")
