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
from streamkv.kv.host_pool import HostPool
from streamkv.kv.prefix import ROOT_HASH, hash_block_tokens


@dataclass
class SeqKV:
    """Blocks held by one sequence and the chained hashes of its registered full blocks."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    cache_key: int = 0
    host_ids: list[int] = field(default_factory=list)  # swapped out: the KV waits in these host blocks


@dataclass(frozen=True)
class PrefixHit:
    """Result of a prefix lookup: cached blocks covering ``num_tokens`` leading tokens."""

    block_ids: tuple[int, ...]
    hashes: tuple[int, ...]

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


class KVManager:
    """Owns every sequence's block table; all ownership changes go through here."""

    def __init__(self, pool: BlockPool, host: HostPool | None = None) -> None:
        self.pool = pool
        self.host = host or HostPool(0)
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

    def num_unshared(self, *seq_ids: int) -> int:
        """Blocks held by ``seq_ids`` and nobody else: what dropping all their KV gives back
        (a block the set holds ``n`` times is unshared when its ref count is ``n``)."""
        uses: dict[int, int] = {}
        for seq_id in seq_ids:
            for b in (kv.block_ids if (kv := self._seqs.get(seq_id)) else ()):
                uses[b] = uses.get(b, 0) + 1
        return sum(1 for b, n in uses.items() if self.pool.blocks[b].ref_count == n)

    # ---------------------------------------------------------------- changes
    def admit(self, seq_id: int, hit: PrefixHit, cache_key: int = 0, num_tokens: int = 0) -> None:
        """Start tracking ``seq_id`` (``num_tokens`` long), taking references on its hit blocks."""
        if seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq_id} already has KV")
        self.pool.acquire(hit.block_ids)
        self.pool.prefix_queries += max(0, (num_tokens - 1) // self.block_size)
        self.pool.prefix_hits += len(hit.block_ids)
        self._seqs[seq_id] = SeqKV(list(hit.block_ids), list(hit.hashes), cache_key)

    def grow(self, seq_id: int, num_tokens: int, extra: int = 0) -> bool:
        """Make the table cover ``num_tokens`` (and ``extra`` blocks after them); False (and no
        change) if blocks are short."""
        kv = self._seqs[seq_id]
        need = self.blocks_for(num_tokens) + extra - len(kv.block_ids)
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

    def fork(self, src_id: int, dst_id: int, num_tokens: int) -> tuple[int, int] | None:
        """Start ``dst_id`` as a copy-on-write view of the first ``num_tokens`` tokens of ``src_id``.

        Full blocks are shared (one more reference each); a partial last block is copied
        into a fresh block, because both sequences will write past its last token::

            src  [b3 | b8 | b5:.....xx]       (2 tokens of b5 belong to the fork)
            dst  [b3 | b8 | b11:xx     ]      returns (b5, b11): the caller copies the slots

        Raises :class:`OutOfBlocksError` (nothing changed) when no block is free for the copy.
        """
        if dst_id in self._seqs:
            raise RuntimeError(f"sequence {dst_id} already has KV")
        src = self._seqs[src_id]
        full, part = divmod(num_tokens, self.block_size)
        if self.blocks_for(num_tokens) > len(src.block_ids):
            raise ValueError(f"cannot fork {num_tokens} tokens of a sequence holding {len(src.block_ids)} blocks")
        shared = src.block_ids[:full]
        copy: tuple[int, int] | None = None
        new_blocks: list[int] = []
        if part:
            new_blocks = self.pool.allocate(1)
            copy = (src.block_ids[full], new_blocks[0])
        self.pool.acquire(shared)
        self._seqs[dst_id] = SeqKV(list(shared) + new_blocks, list(src.hashes[:full]), src.cache_key)
        return copy

    def rewrite_tail(self, seq_id: int, first_block: int, num_tokens: int) -> tuple[list[int], list[int]]:
        """Prepare to rewrite blocks ``first_block..`` of ``seq_id`` so it holds ``num_tokens`` tokens.

        Returns ``(old, new)`` tails of the block table; the table now ends in ``new``. When
        no other sequence shares the old tail, ``new`` reuses its leading blocks in place;
        otherwise (forks still read it) ``new`` is freshly allocated (copy-on-write). The
        caller moves the KV from old to new slots, then calls :meth:`release_blocks` with
        ``old`` blocks not in ``new``. Raises OutOfBlocksError (nothing changed) when short.
        """
        kv = self._seqs[seq_id]
        need = max(0, self.blocks_for(num_tokens) - first_block)
        old = kv.block_ids[first_block:]
        if all(self.pool.blocks[b].ref_count == 1 and self.pool.blocks[b].block_hash is None for b in old):
            new = old[:need]
        else:
            new = self.pool.allocate(need)
        kv.block_ids[first_block:] = new
        del kv.hashes[first_block:]
        return old, new

    def truncate(self, seq_id: int, num_tokens: int) -> tuple[int, int] | None:
        """Keep the KV of ``seq_id``'s first ``num_tokens`` tokens; release the blocks past them.

        Full blocks kept keep their hashes (prefix-cache entries are never touched). Rows
        after the cut in the partial last block will be overwritten, so when another
        sequence holds that block or the prefix cache indexes it, it is swapped for a fresh
        block: returns ``(old, new)`` and the caller copies the first ``num_tokens % bs``
        rows. Raises OutOfBlocksError (nothing changed) when that block is not available.
        """
        kv = self._seqs[seq_id]
        full, part = divmod(num_tokens, self.block_size)
        keep = self.blocks_for(num_tokens)
        dropped = kv.block_ids[keep:]
        copy: tuple[int, int] | None = None
        if part and keep <= len(kv.block_ids):
            old = self.pool.blocks[kv.block_ids[full]]
            if old.ref_count > 1 or old.block_hash is not None:
                copy = (old.block_id, self.pool.allocate(1)[0])
                kv.block_ids[full] = copy[1]
                dropped = [old.block_id] + dropped
        del kv.block_ids[keep:]
        del kv.hashes[full:]
        self.pool.release(reversed(dropped))
        return copy

    def truncates_in_place(self, seq_id: int, num_tokens: int) -> bool:
        """Whether :meth:`truncate` to ``num_tokens`` needs no fresh block and no copy (its
        partial last block, if any, is the sequence's own and unindexed)."""
        kv = self._seqs.get(seq_id)
        full, part = divmod(num_tokens, self.block_size)
        if kv is None or len(kv.block_ids) < self.blocks_for(num_tokens):
            return False
        if not part:
            return True
        block = self.pool.blocks[kv.block_ids[full]]
        return block.ref_count == 1 and block.block_hash is None

    def compact(self, seq_id: int, first_block: int) -> None:
        """The blocks from ``first_block`` on become the whole table (a write policy moved the
        rows it keeps there); the ones before go back to the pool, keeping their prefix-cache
        entries. The new table is never registered (see :meth:`commit`'s callers)."""
        kv = self._seqs[seq_id]
        old = kv.block_ids[:first_block]
        kv.block_ids = kv.block_ids[first_block:]
        kv.hashes = []
        self.pool.release(reversed(old))

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop references taken out of a table by :meth:`rewrite_tail`."""
        self.pool.release(reversed(list(block_ids)))

    def adopt(self, seq_id: int, num_tokens: int) -> list[int]:
        """Track ``seq_id`` with fresh blocks for ``num_tokens`` tokens (restoring saved KV)."""
        if seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq_id} already has KV")
        blocks = self.pool.allocate(self.blocks_for(num_tokens))
        self._seqs[seq_id] = SeqKV(blocks, [], 0)
        return blocks

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id`` (tail first, host blocks too) and forget it."""
        kv = self._seqs.pop(seq_id, None)
        if kv is not None:
            self.pool.release(reversed(kv.block_ids))
            self.host.release(kv.host_ids)

    # ------------------------------------------------------------------- swap
    def is_swapped(self, seq_id: int) -> bool:
        kv = self._seqs.get(seq_id)
        return kv is not None and bool(kv.host_ids)

    def can_swap_out(self, num_tokens: int) -> bool:
        return 0 < self.blocks_for(num_tokens) <= self.host.num_free

    def swap_out(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Move the KV of ``seq_id``'s first ``num_tokens`` rows to host blocks and release
        its device blocks (shared ones keep their other holders and cache entries).

        Returns ``(device block, host block)`` copies the runner makes before this step's
        forward pass (the released device blocks may be rewritten by it)."""
        kv = self._seqs[seq_id]
        n = self.blocks_for(num_tokens)
        kv.host_ids = self.host.allocate(n)
        pairs = list(zip(kv.block_ids[:n], kv.host_ids))
        self.pool.release(reversed(kv.block_ids))
        kv.block_ids, kv.hashes = [], []
        self.host.swapped_out_blocks += n
        return pairs

    def begin_step(self) -> None:
        """Host blocks swapped in by the previous step are free again."""
        self.host.settle()

    def swap_in_cost(self, seq_id: int, num_tokens: int, extra: int = 0) -> int:
        """Device blocks :meth:`swap_in` takes for these arguments."""
        return max(self.blocks_for(num_tokens), len(self._seqs[seq_id].host_ids)) + extra

    def swap_in(self, seq_id: int, num_tokens: int, extra: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back with room for ``num_tokens`` rows (and ``extra`` blocks
        after them); None (nothing changed) when the device pool is short. Returns ``(host
        block, device block)`` copies."""
        kv = self._seqs[seq_id]
        need = self.swap_in_cost(seq_id, num_tokens, extra)
        if need > self.pool.num_free:
            return None
        kv.block_ids = self.pool.allocate(need)
        pairs = list(zip(kv.host_ids, kv.block_ids))
        self.host.release_after_step(kv.host_ids)  # this step's copies still read them
        self.host.swapped_in_blocks += len(kv.host_ids)
        kv.host_ids = []
        return pairs

    def truncate_host(self, seq_id: int, num_tokens: int) -> None:
        """A swapped sequence keeps only its first ``num_tokens`` rows: host blocks past them go back."""
        kv = self._seqs[seq_id]
        keep = self.blocks_for(num_tokens)
        self.host.release(kv.host_ids[keep:])
        del kv.host_ids[keep:]

    # -------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        self.pool.check_integrity(kv.block_ids for kv in self._seqs.values())
        self.host.check_integrity([kv.host_ids for kv in self._seqs.values()])
        for seq_id, kv in self._seqs.items():
            if len(kv.hashes) > len(kv.block_ids):
                raise AssertionError(f"sequence {seq_id}: more hashes than blocks")
