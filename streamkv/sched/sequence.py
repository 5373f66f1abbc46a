"""One sequence: the unit every workload is made of (DESIGN.md section 3)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from streamkv.policies.read import ReadCount, ReadPolicy
from streamkv.policies.write import KVLayout, WritePolicy
from streamkv.sampling.params import SamplingParams


class PriorityClass(enum.IntEnum):
    """Scheduling classes, most urgent first (DESIGN.md section 4)."""

    FLASH = 0
    SESSION = 1
    POOL = 2
    STREAM = 3


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids plus how many of them have KV (``num_computed``).

    The scheduler only ever closes the gap ``len(tokens) - num_computed``; prefill, chunked
    prefill, prefix hits and decode are all that one operation. When the last token of a
    step's chunk is the last token of ``tokens``, its logits yield the next token.
    """

    seq_id: int
    tokens: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_len: int
    stop_ids: frozenset[int] = frozenset()
    priority: int = 0
    klass: PriorityClass = PriorityClass.POOL
    arrival: float = field(default_factory=time.perf_counter)
    cache_key: int = 0
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Session streams: ``samples=False`` only computes KV (an idle stream has remaining 0 and
    # is skipped); ``pinned`` is never preempted (it waits for blocks instead); blocks of a
    # non-``cacheable`` sequence never enter the prefix cache (their KV may be re-positioned).
    samples: bool = True
    pinned: bool = False
    cacheable: bool = True
    # ``forked_rows``: leading rows whose KV a copy-on-write fork gave it (a session's window,
    # re-positioned or compressed: no prefill of the ids need reproduce it); a recompute
    # preemption drops only the rows after them, and they are never charged as its own KV.
    forked_rows: int = 0
    # ``keep_kv``: finishing leaves the KV in place for its owner to take over (a span query
    # reuses an inner generate's KV as it was written); the owner frees it (SeqOps.release_kv).
    keep_kv: bool = False
    # ``peek``: a non-sampling stream that still wants the next-token distribution at its
    # end (``peeked``: top logprobs, with ``params.logprobs`` alternatives) without appending.
    peek: bool = False
    peeked: object = None
    # ``read``: a read-time KV policy for rows at positions >= ``read_from`` (a fork's own
    # rows; lossy: such a sequence is never ``cacheable``, so its KV cannot reach the prefix
    # cache). Rows before ``read_from`` (recomputed after a preemption) stay exact.
    read: ReadPolicy | None = None
    read_from: int = 0
    # ``write``: a write-time KV policy. Once ``write.point(num_prompt_tokens)`` tokens have KV
    # the sequence switches to ``layout``: a fixed set of rows, later tokens in a ring (the
    # prompt's middle compressed first when it is longer than the policy's capacity). Until
    # then chunks stop at that point; after it, one row per step (each row its own ring write).
    write: WritePolicy | None = None
    layout: KVLayout | None = None
    compress_s: float = 0.0  # selection + move time of its compressions
    # ``observe``: the runner keeps the queries of this stream's newest ``observe`` rows as they
    # are computed (a session evicting by SnapKV score ranks with them; ``RecentQueries``).
    observe: int = 0
    reads: ReadCount | None = None  # what its read policy read, summed over its steps
    # rows whose reads are in ``reads``: rows recomputed after a preemption read what they read
    # before and are not counted again (the report equals the request's run alone)
    reads_to: int = 0
    # Streaming input (``streamkv.inputs``): while ``partial`` the prompt may still change.
    # Its last token is held back (it is computed, and sampled from, once the input is
    # finished: the tail's tokenization may change with the next chunk anyway) and the
    # sequence ranks in the lower tier. ``last_input``: arrival of its latest chunk (LCAS and
    # aging; the request's arrival for a complete one).
    partial: bool = False
    swapped: bool = False  # preempted by swap: its computed rows wait in host blocks
    tokens_invalidated: int = 0  # computed rows dropped by input changes (LCP invalidation)
    last_input: float = -1.0
    # Grouped prefill (``sched/grouping.py``): the match point at which this request started
    # waiting for a leader's shared blocks (-1: not waiting for one).
    grouped_from: int = -1
    # Telemetry of a request: ``(event, perf_counter time)`` in order (queued, scheduled,
    # kv_resident, ...); None (long-lived session streams) records nothing.
    events: list[tuple[str, float]] | None = None

    def __post_init__(self) -> None:
        if self.last_input < 0:
            self.last_input = self.arrival

    def event(self, name: str, now: float | None = None) -> None:
        if self.events is not None:
            self.events.append((name, time.perf_counter() if now is None else now))

    @property
    def computable(self) -> int:
        """Tokens the scheduler may compute now (all but a partial input's held-back last one)."""
        n = len(self.tokens)
        return n - 1 if self.partial and n else n

    @property
    def prefilling(self) -> bool:
        """More than one row to compute now: prompt work (a decode step computes one row)."""
        return self.computable - self.num_computed > 1

    @property
    def has_work(self) -> bool:
        """Rows to compute, or swapped-out rows to bring back (idle streams and inputs waiting
        for more text have none and are not even ranked)."""
        return self.num_computed < self.computable or self.swapped

    @property
    def write_point(self) -> int:
        """Token count at which the write policy's layout starts (0: no policy)."""
        return self.write.point(self.num_prompt_tokens) if self.write is not None else 0

    @property
    def compresses(self) -> bool:
        """The write policy's layout is still ahead: reaching it moves the kept rows into fresh
        blocks (the ring must never write into blocks the prefix cache or another sequence
        reads, so even a prompt that fits is copied, unchanged, once)."""
        return self.write is not None and self.layout is None

    @property
    def fork_kept(self) -> bool:
        """A fork whose parent's rows stay put on preemption (only its own rows are dropped):
        uncompressed, so its rows past ``forked_rows`` follow the fork point one for one."""
        return bool(self.forked_rows) and self.layout is None

    @property
    def compressed(self) -> bool:
        """In its write policy's layout, with rows of the prompt dropped."""
        return self.layout is not None and self.write is not None and self.write.moves(self.num_prompt_tokens)

    def chunk_limit(self, computed: int, block_size: int) -> int | None:
        """Most rows one step may compute from ``computed`` (None: no limit of its own).

        Rows must be computed alike in any chunking (and after a preemption by recompute, as
        they were the first time): a question's rows stop where the answer starts (and, replayed,
        where the rows whose reads were counted end: ``reads_to``) and need no other limit, as
        each row under the policy reads what it would read alone (``streamkv.attention.picks``).
        Its exact rows (before ``read_from``) share a step with them (the runner computes them as
        a span of their own) only if every page the question scores lies before them: a page's
        bounds are read before the step writes, so one the step's exact rows fill was scored by
        what its slots held before (answers then depended on the pool's history: review). A
        request's exact rows (its prompt) stop where the policy starts; the answer's rows go one
        per step, as they did, so each recomputed row's reads and recall sample are reported as
        they were. A write policy's chunks stop at its point and its ring takes one row per step."""
        limits = []
        if self.write is not None:
            limits.append(1 if self.layout is not None else self.write_point - computed)
        if self.read is not None and self.read_from > 0:
            end = self.num_prompt_tokens
            question = computed < end and self.read_from < end
            if question and (self.read_from <= computed  # (a replay stops where rows counted before end)
                             or self.read.scored_end(self.read_from, end, block_size) <= computed):
                limits.append((self.reads_to if computed < self.reads_to < end else end) - computed)
            elif computed < self.read_from:
                limits.append(self.read_from - computed)
            else:
                limits.append(1)
        return min(limits) if limits else None

    @property
    def exact_rows(self) -> int:
        """Computed rows whose KV is exact, so may enter the prefix cache: not those a read
        policy computed (they attended to some pages only)."""
        return min(self.num_computed, self.read_from) if self.read is not None else self.num_computed

    def kv_rows(self, end: int) -> int:
        """Rows of KV that hold tokens ``[0, end)``."""
        return self.layout.rows if self.layout is not None else end

    def extra_blocks(self, end: int, block_size: int) -> int:
        """Blocks taken on top of ``end`` rows: the chunk reaching a compression point also
        holds the compressed rows' blocks (the runner moves the kept rows there)."""
        if not self.compresses or end != self.write_point:
            return 0
        return self.write.layout_blocks(block_size)

    @property
    def match_tokens(self) -> list[int]:
        """Tokens a prefix-cache lookup may cover: never a compression point's observed rows,
        nor (a policy that observes none) the row reaching the point. A lookup leaves the last
        token of what it is given, so a hit stops at ``write_point - max(observation, 1)`` at
        most: some step computes up to the point and enters the layout there. (A recomputed
        sequence's tokens run past its point; with a hit of exactly ``write_point`` rows its
        chunk limit was 0 and it never ran again: a hypothesis example of
        ``tests/test_kv_write_fake.py`` stepped 5,000 times.) With a read policy, never past
        the exact rows (``read_from``): the policy's rows are its own, as ``exact_rows`` keeps
        them out of the cache."""
        end = len(self.tokens)
        if self.write is not None and self.layout is None:
            end = self.write_point - max(self.write.observation, 1) + 1
        if self.read is not None:
            # nor a read policy's rows: a recomputed answer took another request's exact rows
            # for the same ids (a follow-up turn's) and its later logprobs changed (review)
            end = min(end, self.read_from + 1)
        return self.tokens[:end]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def stop_reason_after(self, token_id: int) -> str | None:
        """Finish reason once ``token_id`` has been appended, or None to continue."""
        if token_id in self.stop_ids and self.num_output >= self.params.min_tokens:
            return "stop"
        if self.num_output >= self.params.max_tokens or len(self.tokens) >= self.max_len:
            return "length"
        return None
