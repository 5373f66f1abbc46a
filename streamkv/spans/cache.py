"""The position-independent span cache: computed states of span queries, by key.

A *state* is an idle, pinned stream whose KV is the computation of a span so far: a prefix,
an operand computed right after a prefix, an inner generate's span, or an assembled
``plus``. Its key (``lower.state_key``) depends only on how it was built, not on where a
query places it, so any query needing that piece reuses it (re-positioned by rotation when
it lands elsewhere). States share blocks copy-on-write (an operand's stream aliases its
prefix's full blocks).

Entries in use by a running query are never evicted; the others leave in LRU order when
the pool runs low (:meth:`trim`), so cached spans never starve ordinary requests of blocks.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from streamkv.kv.manager import KVManager
from streamkv.ops.seq_ops import SeqOps
from streamkv.sched.sequence import Sequence


@dataclass
class State:
    """``stream`` holds the KV of ``length`` tokens (None: the empty root state)."""

    key: bytes
    stream: Sequence | None
    length: int
    text: str | None = None  # an inner generate's output text
    uses: int = 0
    volatile: bool = False  # built on a sampled (not reproducible) output: never cached


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class SpanCache:
    def __init__(self, seq_ops: SeqOps, kv: KVManager, max_entries: int = 4096) -> None:
        self._ops = seq_ops
        self._kv = kv
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, State] = OrderedDict()
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def take(self, key: bytes) -> State | None:
        """The cached state (one more use, freshest in LRU order), or None."""
        state = self._entries.get(key)
        if state is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self._entries.move_to_end(key)
        state.uses += 1
        return state

    def put(self, state: State) -> State:
        """Cache a freshly computed state, in use by its query. A state computed twice
        concurrently keeps the first copy; the second stream is closed."""
        old = self._entries.get(state.key)
        if old is not None:
            if state.stream is not None and state.stream is not old.stream:
                self._ops.close(state.stream)
            old.uses += 1
            return old
        state.uses = 1
        self._entries[state.key] = state
        if len(self._entries) > self.max_entries:
            self.trim(0)
        return state

    def release(self, state: State) -> None:
        state.uses = max(0, state.uses - 1)

    def trim(self, free_blocks: int) -> int:
        """Evict unused states, least recent first, until the pool has ``free_blocks`` free
        blocks and at most ``max_entries`` entries remain; returns how many left."""
        evicted = 0
        for key in list(self._entries):
            if self._kv.pool.num_free >= free_blocks and len(self._entries) <= self.max_entries:
                break
            state = self._entries[key]
            if state.uses:
                continue
            del self._entries[key]
            if state.stream is not None:
                self._ops.close(state.stream)
            evicted += 1
        self.stats.evictions += evicted
        return evicted

    def clear(self) -> int:
        """Drop every unused state (``DELETE /v1/spans/cache``, tests)."""
        n = len(self._entries)
        self.trim(self._kv.pool.num_blocks + 1)
        return n - len(self._entries)

    def held_blocks(self) -> int:
        return len({b for s in self._entries.values() if s.stream is not None and self._kv.has(s.stream.seq_id)
                    for b in self._kv.block_table(s.stream.seq_id)})
