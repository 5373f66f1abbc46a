"""The position-independent span cache: computed states of span queries, by key.

A *state* is an idle, pinned stream whose KV is the computation of a span so far: a prefix,
an operand computed right after a prefix, an inner generate's span, or an assembled
``plus``. Its key (``lower.state_key``) depends only on how it was built, not on where a
query places it, so any query needing that piece reuses it (re-positioned by rotation when
it lands elsewhere). States share blocks copy-on-write (an operand's stream aliases its
prefix's full blocks).

Entries in use by a running query are never evicted; the others leave the pool in LRU order
when it runs low (:meth:`trim`), so cached spans never starve ordinary requests of blocks.

Two tiers::

    pool (pinned stream) ──trim──▶ host (K/V copy, ``host_bytes`` in all) ──LRU──▶ dropped
           ▲                              │
           └────────── take (a hit) ──────┘  restored, rows as they were

A restored state's rows are a copy of the rows it had, so a hit from the host equals a hit
from the pool bit for bit. When the state it was forked from (``State.base``) is in the pool,
the restore forks it and loads only the rows after it, so the restored stream shares blocks
as the original did and a query holds no more blocks than when it computed the span (its
admission counts on that); else every row is loaded into fresh blocks. A copy whose restore
finds no blocks stays on the host, and the lookup is a miss (the query computes the span; its
``put`` replaces the copy).

An assembled ``plus`` is dropped, never copied: its rows repeat its operands' rows,
re-positioned, so a host copy of a 24-operand ``plus`` (and of the question after it, a fork of
it) took three times the operands' room and pushed them out, while re-assembling it from the
operands costs about what restoring the copy would. Text computed on one is a *delta* copy:
only the rows after its base, restored onto the base (which a query always holds when it
looks the text up: the key goes through it), else a miss. The states computed on a ``plus``
leave the pool with it, so none holds the plus's rows alone.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from streamkv.kv.block_pool import OutOfBlocksError
from streamkv.kv.manager import KVManager
from streamkv.ops.seq_ops import SeqOps
from streamkv.sched.sequence import PriorityClass, Sequence


@dataclass
class State:
    """``stream`` holds the KV of ``length`` tokens (None: the empty root state, or a state
    moved to the host, whose K/V [layers, len(tokens) - host_from, kv_heads, head_dim] are ``host``)."""

    key: bytes
    stream: Sequence | None
    length: int
    text: str | None = None  # an inner generate's output text
    inner: tuple[str, ...] = ()  # a plus: its inner generates' texts, in inner_paths() order
    uses: int = 0
    volatile: bool = False  # built on a sampled (not reproducible) output: never cached
    host: tuple[Any, Any] | None = None  # (k, v) on the host, from SeqOps.export
    tokens: list[int] | None = None  # the stream's tokens while on the host
    host_bytes: int = 0
    base: bytes | None = None  # the state whose stream this one's was forked from (shares its blocks)
    # a plus: its rows are its operands' rows, spliced, so it never takes host room from them
    # (dropped when it leaves the pool; a hit re-assembles it from the operands)
    assembled: bool = False
    # the assembled plus whose blocks this state's stream shares, through any chain of states
    # computed on it (None: none), and its length. When that plus leaves the pool, so does this
    # state; its host copy holds only the rows after the plus (a delta copy) and restores onto
    # its base, or onto the (re-assembled) plus itself when the base is not in the pool
    root: bytes | None = None
    root_length: int = 0
    orphaned: bool = False  # its root left the pool while this state was in use: leaves it when released

    @property
    def host_from(self) -> int:
        """The first row a host copy holds: the root plus's length, else 0."""
        return self.root_length if self.root is not None else 0


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # dropped (from the pool without a host tier, or from the host)
    offloads: int = 0  # moved from the pool to the host
    restores: int = 0  # hits served from the host


class SpanCache:
    """``host_bytes``: the host tier's size (0: off); ``bytes_per_token``: K+V of one token."""

    def __init__(self, seq_ops: SeqOps, kv: KVManager, max_entries: int = 4096, host_bytes: int = 0,
                 bytes_per_token: int = 0) -> None:
        self._ops = seq_ops
        self._kv = kv
        self.max_entries = max_entries
        self.host_bytes = host_bytes if bytes_per_token > 0 else 0
        self._per_token = bytes_per_token
        self.host_used = 0
        self._entries: OrderedDict[bytes, State] = OrderedDict()
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def take(self, key: bytes) -> State | None:
        """The cached state (one more use, freshest in LRU order), or None."""
        state = self._entries.get(key)
        if state is not None and state.host is not None and not self._restore(state):
            state = None  # no blocks now: the query computes it (its put replaces the host copy)
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
        if old is not None and old.host is not None:  # computed again while a copy waited on the host
            self._drop_host(old)
            del self._entries[state.key]
            old = None
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
        if not state.uses and state.orphaned and self._entries.get(state.key) is state:
            state.orphaned = False
            if state.stream is not None:
                self._move_out(state.key, state, drop=False)

    def trim(self, free_blocks: int) -> int:
        """Move unused states out of the pool, least recent first, until it has ``free_blocks``
        free blocks and at most ``max_entries`` entries remain: to the host when the copy
        would stay there (its size plus the newer host copies fit ``host_bytes``; older ones
        are dropped to make room), else dropped. Returns how many left the pool."""
        moved, newer = 0, self.host_used  # host bytes of the copies newer than the current key
        keys = list(self._entries)
        for i, key in enumerate(keys):
            over = len(self._entries) > self.max_entries
            if self._kv.pool.num_free >= free_blocks and not over:
                break
            state = self._entries.get(key)
            if state is None:  # (dropped meanwhile: _offload makes host room among older copies only)
                continue
            newer -= state.host_bytes
            if state.uses or (state.stream is None and not over):
                continue  # in use, or holds no blocks (on the host, or the root)
            moved += 1
            if not over and self._offload(state, room=self.host_bytes - newer):
                continue
            self._drop(key)
            if state.assembled:
                moved += self._move_dependents(key, over)
                newer = sum(s.host_bytes for k in keys[i + 1:] if (s := self._entries.get(k)) is not None)
        return moved

    def _move_dependents(self, key: bytes, drop: bool) -> int:
        """Move the states whose streams share the blocks of ``key`` (an assembled plus that
        just left the pool: ``State.root``, at any depth) out of the pool too, as host copies
        (delta copies for text on it) or dropped; one in use leaves when it is released. Left
        behind, each would hold the plus's rows alone, and a query re-assembling the plus
        would hold them twice, more blocks than its admission counted (found by the span
        fuzz, seed 20614; through text on text on the plus, by review). Restored, they fork
        the re-assembled plus and share its blocks again."""
        moved = 0
        for dep_key, dep in list(self._entries.items()):
            if dep.root != key or dep.stream is None:
                continue
            if dep.uses:
                dep.orphaned = True
                continue
            moved += 1 + self._move_out(dep_key, dep, drop)
        return moved

    def _move_out(self, key: bytes, state: State, drop: bool) -> int:
        """Offload an idle state (unless ``drop``), else drop it and, for a plus, the states on
        it; how many of those left the pool."""
        if not drop and self._offload(state, room=self.host_bytes - self._newer_than(key)):
            return 0
        self._drop(key)
        return self._move_dependents(key, drop) if state.assembled else 0

    def _newer_than(self, key: bytes) -> int:
        """Host bytes of the copies more recent than ``key``."""
        total = 0
        for k in reversed(self._entries):
            if k == key:
                return total
            total += self._entries[k].host_bytes
        return total

    def clear(self) -> int:
        """Drop every unused state, in the pool or on the host (``DELETE /v1/spans/cache``)."""
        unused = [key for key, state in self._entries.items() if not state.uses]
        for key in unused:
            state = self._entries.get(key)
            if state is None:  # (dropped with its plus just before)
                continue
            self._drop(key)
            if state.assembled:  # states on it in use (a plus on this one, hit alone) leave once released
                self._move_dependents(key, drop=True)
        return len(unused)

    def held_blocks(self) -> int:
        return len({b for s in self._entries.values() if s.stream is not None and self._kv.has(s.stream.seq_id)
                    for b in self._kv.block_table(s.stream.seq_id)})

    def host_entries(self) -> int:
        return sum(1 for s in self._entries.values() if s.host is not None)

    # ------------------------------------------------------------- host tier
    def _drop(self, key: bytes) -> None:
        state = self._entries.pop(key)
        if state.stream is not None:
            self._ops.close(state.stream)
            state.stream = None
        self._drop_host(state)
        self.stats.evictions += 1

    def _drop_host(self, state: State) -> None:
        self.host_used -= state.host_bytes
        state.host, state.tokens, state.host_bytes = None, None, 0

    def _offload(self, state: State, room: int) -> bool:
        """Copy an idle state's K/V to the host and close its stream (False: it needs more than
        ``room`` bytes, or the tier is off)."""
        stream = state.stream
        assert stream is not None
        start = state.host_from
        size = (len(stream.tokens) - start) * self._per_token
        if not self.host_bytes or state.assembled or size > room or not self._ops.is_idle(stream):
            return False
        restoring = sum(s.host_bytes for s in self._entries.values() if s.host is not None and s.uses)
        if restoring + size > self.host_bytes:  # copies being restored cannot make room: none dropped for it
            return False
        self._fit_host(self.host_bytes - size)  # older copies make room first: never over budget
        state.host = self._ops.export(stream, len(stream.tokens), start=start)
        state.tokens, state.host_bytes = list(stream.tokens), size
        self.host_used += size
        self._ops.close(stream)
        state.stream = None
        self.stats.offloads += 1
        return True

    def _fit_host(self, limit: int) -> None:
        """Drop host copies, least recent first, until they hold at most ``limit`` bytes."""
        for key in list(self._entries):
            if self.host_used <= limit:
                return
            state = self._entries[key]
            if state.host is not None and not state.uses:  # (uses: being restored)
                self._drop(key)

    def _restore(self, state: State) -> bool:
        """Bring a host copy back into the pool (making room among other unused states),
        forked from its base state's stream when that is in the pool, so it shares the base's
        blocks as the stream it was copied from did. False, the copy kept, when the pool
        cannot hold it."""
        assert state.host is not None and state.tokens is not None
        (k, v), tokens = state.host, state.tokens
        state.uses += 1  # not dropped by the trim below
        try:
            for attempt in range(2):
                base = self._base_stream(state)  # (again after a trim, which may have moved it out)
                if state.host_from and (base is None or len(base.tokens) < state.host_from):
                    return False  # a delta copy without its base: a miss, the copy kept
                try:
                    state.stream = self._ops.restore(tokens, k, v, klass=PriorityClass.POOL, base=base,
                                                     rows_from=state.host_from)
                    break
                except OutOfBlocksError:
                    if attempt:
                        return False
                    self.trim(self._kv.blocks_for(len(tokens)) + 1)
        finally:
            state.uses -= 1
        self._drop_host(state)
        self.stats.restores += 1
        return True

    def _base_stream(self, state: State) -> Sequence | None:
        """An idle stream in the pool whose tokens start the state's: its base's, else (a delta
        copy whose base is gone) its root plus's; None without either."""
        for key in (state.base, state.root):
            base = self._entries.get(key) if key is not None else None
            if base is None or base.stream is None or not self._ops.is_idle(base.stream):
                continue
            n = len(base.stream.tokens)
            if n <= len(state.tokens or ()) and base.stream.tokens == state.tokens[:n]:
                return base.stream
        return None
