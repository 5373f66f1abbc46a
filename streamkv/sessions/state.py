"""Book-keeping of one session's data: queue, records in the window, versions, counters.

Pure logic (no engine, no tensors), owned by the engine thread. Token positions are
indices into the session's stream::

    stream   [ frozen | memory | span(v3) span(v3) span(v4) | span(v5, fed, not yet computed) ]
    queue    (v5) (v6) (v6) ...          pushed, not yet fed to the stream
    data_version = 4   (every record of versions <= 4 has KV; v5 is still pending)
    snapshot = end of the last span with version <= 4
    memory   = evicted tokens a ``"evict": "snapkv"`` session kept (0 otherwise; <= its budget)
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from streamkv.sessions.spec import SessionLayout, SessionSpec


@dataclass
class Record:
    """A pushed record waiting in the queue."""

    version: int
    ids: list[int]
    text: str


@dataclass
class Span:
    """A record fed to the stream: tokens ``[start, end)``."""

    start: int
    end: int
    version: int


@dataclass
class Counters:
    records_pushed: int = 0
    records_ingested: int = 0
    records_fed: int = 0
    records_dropped: int = 0
    records_evicted: int = 0
    tokens_ingested: int = 0
    tokens_evicted: int = 0
    evictions: int = 0
    snapkv_fallbacks: int = 0  # snapkv evictions without observed queries (kept the newest instead)
    queries: int = 0


@dataclass
class SessionData:
    """Queue + window + versions of one session (no KV)."""

    spec: SessionSpec
    layout: SessionLayout
    queue: deque[Record] = field(default_factory=deque)
    queued_tokens: int = 0
    spans: deque[Span] = field(default_factory=deque)
    last_version: int = 0
    data_version: int = 0
    counters: Counters = field(default_factory=Counters)
    last_used: float = field(default_factory=time.monotonic)
    memory: int = 0

    # ------------------------------------------------------------------ intake
    def accept(self, records: list[Record], unbounded: bool = False) -> list[Record]:
        """Queue records (all of one version) under the overflow policy; returns dropped ones.

        ``drop_oldest`` drops queued records, oldest first, and if the push alone exceeds the
        queue, the oldest of the push itself. ``reject`` / ``block`` are decided by the
        caller with :meth:`fits` before calling this.
        """
        dropped: list[Record] = []
        incoming = sum(len(r.ids) for r in records)
        cap = float("inf") if unbounded else self.spec.max_queue_tokens
        while self.queue and self.queued_tokens + incoming > cap:
            dropped.append(self._pop_queue())
        records = list(records)
        while records and incoming > cap:
            incoming -= len(records[0].ids)
            dropped.append(records.pop(0))
        for r in records:
            self.queue.append(r)
            self.queued_tokens += len(r.ids)
        self.counters.records_dropped += len(dropped)
        return dropped

    def fits(self, num_tokens: int) -> bool:
        return self.queued_tokens + num_tokens <= self.spec.max_queue_tokens

    def next_version(self) -> int:
        self.last_version += 1
        return self.last_version

    def take_batch(self, max_tokens: int) -> list[Record]:
        """Pop queued records totalling at most ``max_tokens`` (always at least one)."""
        out: list[Record] = []
        total = 0
        while self.queue and (not out or total + len(self.queue[0].ids) <= max_tokens):
            rec = self._pop_queue()
            out.append(rec)
            total += len(rec.ids)
        return out

    def requeue(self, batch: list[Record]) -> None:
        """Put a batch from :meth:`take_batch` back at the front of the queue, in order."""
        self.queue.extendleft(reversed(batch))
        self.queued_tokens += sum(len(r.ids) for r in batch)

    def _pop_queue(self) -> Record:
        rec = self.queue.popleft()
        self.queued_tokens -= len(rec.ids)
        return rec

    # ------------------------------------------------------------------ window
    @property
    def frozen_len(self) -> int:
        return len(self.layout.frozen)

    @property
    def base_len(self) -> int:
        """Where records start: after the frozen prefix and the snapkv memory."""
        return self.frozen_len + self.memory

    @property
    def stream_len(self) -> int:
        return self.spans[-1].end if self.spans else self.base_len

    @property
    def sliding_tokens(self) -> int:
        return self.stream_len - self.frozen_len

    def fed(self, record: Record) -> Span:
        span = Span(self.stream_len, self.stream_len + len(record.ids), record.version)
        self.spans.append(span)
        self.counters.records_fed += 1
        self.counters.tokens_ingested += len(record.ids)
        return span

    def eviction_for(self, incoming: int) -> tuple[int, int]:
        """``(records, tokens)`` to evict (oldest first) so ``incoming`` more tokens fit the
        retention window; at least ``evict_chunk`` tokens are freed once eviction is due. A
        snapkv session keeps up to its budget of the memory + evicted tokens, so it evicts
        that much more (``incoming <= record_window`` makes this always possible)."""
        over = self.sliding_tokens + incoming - self.spec.retention_tokens
        if over <= 0:
            return 0, 0
        want = max(over, self.spec.evict_chunk) + self.spec.memory_budget - self.memory
        n = tokens = 0
        for span in self.spans:
            if tokens >= want:
                break
            n += 1
            tokens += span.end - span.start
        return n, tokens

    def evicted(self, num_records: int, num_tokens: int, memory: int | None = None) -> int:
        """The oldest ``num_records`` records (``num_tokens``) left the window; a snapkv session
        now keeps ``memory`` tokens of its old memory and those records. Returns the tokens removed."""
        removed = num_tokens if memory is None else self.memory + num_tokens - memory
        if memory is not None:
            self.memory = memory
        for _ in range(num_records):
            self.spans.popleft()
        for span in self.spans:
            span.start -= removed
            span.end -= removed
        self.counters.records_evicted += num_records
        self.counters.tokens_evicted += removed
        self.counters.evictions += 1
        return removed

    # ---------------------------------------------------------------- versions
    def advance(self, num_computed: int) -> bool:
        """Recompute ``data_version`` given the stream's computed length; True if it moved."""
        pending = []
        for span in reversed(self.spans):  # uncomputed spans are at the tail
            if span.end <= num_computed:
                break
            pending.append(span.version)
        self.counters.records_ingested = self.counters.records_fed - len(pending)
        if self.queue:
            pending.append(self.queue[0].version)
        new = (min(pending) - 1) if pending else self.last_version
        moved = new > self.data_version
        self.data_version = max(self.data_version, new)
        return moved

    def snapshot_len(self) -> int:
        """Stream tokens visible at ``data_version`` (whole records only)."""
        end = self.base_len
        for span in self.spans:
            if span.version > self.data_version:
                break
            end = span.end
        return end
