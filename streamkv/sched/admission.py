"""Admission control: when a new prefill may start, and when a prompt chunk waits.

``cell-budget`` (the Attention Once design): every admitted sequence is charged its
projected size, ``min(prompt + max_tokens, max_len)`` tokens of KV ("cells"); with a write
policy, what its phase holds (:func:`projected_tokens`). A new
request is admitted only while the charges stay under ``ceiling`` x the pool; the rest of
the pool is reserved for cached prefixes and session state. Above ``high_water`` pool
occupancy, prompt chunks go one per step: decodes go on, the highest-ranked running prompt
keeps one chunk per step (so nothing stalls), the other running prompts' chunks wait, and a
new request starts only when no admitted prompt is still prefilling (its first chunk is a
prompt chunk too: admitting new requests beside held ones piled up half-computed prompts that
each held a chunk of KV, and with the pool's last 5% as headroom they preempted each other,
README "tight pool"). Requests are never rejected for this, only delayed; pinned streams
(sessions, span queries) are exempt::

    pool tokens  |====== charged (admitted) ======|---- free for new ----|== reserve ==|
                 0                                      ceiling x pool              pool
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from streamkv.kv.block_pool import BlockPool
from streamkv.sched.sequence import Sequence, SeqStatus


@dataclass
class AdmissionStats:
    deferred_requests: int = 0  # (request, step) pairs a new request waited for the cell budget
    deferred_chunks: int = 0    # prompt chunks held back above the high-water mark
    charged_tokens: int = 0     # projected tokens of admitted sequences (as admitted; less those finished since)


def projected_tokens(seq: Sequence) -> int:
    """The KV a sequence may come to hold: its prompt plus every token it may generate, less
    the rows a fork shares with its parent (a session query's window is the session's).

    With a write policy the charge follows its phase: until the layout starts, the rows up to
    the policy's point plus the layout's own (both are held in the step that compresses); once
    compressed, the layout's capacity (later tokens go to its ring). Charged its plain
    projection for good, a snapstream request at budget 1,024 counted 3.8x its KV after
    compression, and admission held back requests for room that was free::

        prefilling   [ prompt rows ........................ | layout ]   point + capacity
        compressed   [ layout ]                                          capacity
    """
    size = min(seq.num_prompt_tokens + seq.params.max_tokens, seq.max_len)
    write = seq.write
    if write is not None:
        point = write.point(seq.num_prompt_tokens)
        if seq.layout is not None:
            size = write.capacity
        elif size > point:  # it computes size - 1 rows at most (the last token is never fed)
            size = point + write.capacity
    return size - seq.forked_rows


def _charged(seq: Sequence) -> bool:
    """Whether the cell budget charges ``seq``: admitted (running or swapped out), not pinned."""
    return not seq.pinned and (seq.status is SeqStatus.RUNNING or seq.swapped)


class CellBudget:
    """Per step: :meth:`begin` charges the admitted sequences, then :meth:`admits` and
    :meth:`holds_chunk` answer for each ranked sequence in phase 1."""

    name = "cell-budget"

    def __init__(self, pool: BlockPool, ceiling: float, high_water: float) -> None:
        if not 0.0 < ceiling <= 1.0 or not 0.0 < high_water <= 1.0:
            raise ValueError(f"admission ceiling and high water must be in (0, 1], got {ceiling}, {high_water}")
        self.pool = pool
        self.ceiling = ceiling
        self.high_water = high_water
        self.stats = AdmissionStats()
        self._charged = 0
        self._requests = 0  # the part of ``_charged`` that admitted requests (not forks or idle inputs) hold
        self._chunk_passed = False  # a prompt chunk went ahead this step
        self.chunk_to: int | None = None  # the sequence it went to (phase 1)
        self._stuck: int | None = None    # last step's, which then found no block: it sits this step out
        self._prefilling = False    # an admitted (charged) sequence still has prompt rows to compute

    @property
    def pool_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    def begin(self, seqs: Iterable[Sequence]) -> None:
        seqs = list(seqs)
        self._charged = sum(projected_tokens(s) for s in seqs if _charged(s))
        # what admitted requests hold, less forks (session and span questions, which enter
        # running without admission and come and go): while they overlapped, a request over
        # the ceiling, which runs only "alone", and every request behind it waited (review)
        # Idle streaming inputs (every arrived row computed, the client not done) are left out
        # too: the client may stay quiet for minutes, and the request over the ceiling waited
        # as long (it resumes once they get text: they then hold prompt work like any request)
        self._requests = sum(projected_tokens(s) for s in seqs
                             if _charged(s) and not s.forked_rows and not _awaiting_input(s))
        self.stats.charged_tokens = self._charged
        self._chunk_passed, self.chunk_to = False, None
        self._prefilling = any(_charged(s) and s.status is SeqStatus.RUNNING and s.prefilling for s in seqs)

    def above_high_water(self) -> bool:
        """Pool occupancy (referenced blocks) is above the high-water mark."""
        return self.pool.num_used > self.high_water * self.pool.num_blocks

    def release(self, seq: Sequence) -> None:
        """``seq`` finishes: its charge leaves the gauge at once (the next step charges afresh;
        an idle server otherwise showed its last request's charge for good)."""
        if _charged(seq):
            self.stats.charged_tokens = max(0, self.stats.charged_tokens - projected_tokens(seq))

    def admits(self, seq: Sequence) -> bool:
        """A waiting request may start now (charged by :meth:`admit` once it gets its chunk).
        The first one always may, so a request larger than the ceiling still runs, alone (beside
        forks: questions). Above the high-water mark it waits while an admitted prompt is still
        prefilling (or another was admitted this step)."""
        if seq.pinned:
            return True
        if self._charge(self._charged, self._requests, seq) is None or (
                self._charged and self._prefilling and self.above_high_water()):
            self.deferred()
            return False
        return True

    def deferred(self) -> None:
        """A new request waits this step (refused by :meth:`admits`, or ranked after one that was)."""
        self.stats.deferred_requests += 1

    def admit(self, seq: Sequence) -> None:
        """``seq``, which :meth:`admits` let in, got its chunk this step: its charge counts for
        the requests ranked after it. (Charged when asked, one that the cadence, its blocks or
        the fork gate then left without rows still deferred them and showed in the gauge.)"""
        after = None if seq.pinned else self._charge(self._charged, self._requests, seq)
        if after is not None:
            self._prefilling = self._prefilling or seq.prefilling
            self._charged, self._requests = after
            self.stats.charged_tokens = self._charged

    def _charge(self, charged: int, requests: int, seq: Sequence) -> tuple[int, int] | None:
        """(charged, requests) once ``seq`` is admitted beside ``charged`` tokens, ``requests``
        of them held by requests; None: over the ceiling while other requests hold some (one over
        it alone, beside forks and idle inputs only, still runs)."""
        cost = projected_tokens(seq)
        if charged + cost > self.ceiling * self.pool_tokens and requests > 0:
            return None
        return charged + cost, requests + (0 if seq.forked_rows else cost)

    def prefilling(self, ranked: list[Sequence]) -> int:
        """How many of ``ranked`` (after :meth:`begin`) may get prompt rows this step, for the
        adaptive chunk: running, swapped or pinned ones with prompt rows, and the waiting ones
        :meth:`admits` would let in, in rank order (the first it defers holds the later new
        ones back). Counting every waiting prompt, the one admitted request got budget / N
        rows of a step whose budget was otherwise unused (review: 7 of 64 with 9 queued).
        Above the high-water mark: at most one (its chunk is whole)."""
        if self.above_high_water():
            return min(1, sum(1 for s in ranked if s.prefilling))
        charged, requests, n, deferred = self._charged, self._requests, 0, False
        for seq in ranked:
            if not seq.prefilling:
                continue
            if seq.pinned or seq.swapped or seq.status is not SeqStatus.WAITING:
                n += 1
                continue
            after = None if deferred else self._charge(charged, requests, seq)
            deferred = after is None
            if after is not None:
                (charged, requests), n = after, n + 1
        return n

    def holds_chunk(self, seq: Sequence) -> bool:
        """A running sequence's next prompt chunk waits: the pool is above the high-water mark.
        The highest-ranked prompt that can move still moves (one chunk per step,
        :meth:`took_chunk`), so a step never stalls."""
        if not _chunked(seq) or not self.above_high_water():
            return False
        if not self._chunk_passed and seq.seq_id != self._stuck:
            return False
        self.stats.deferred_chunks += 1
        return True

    def took_chunk(self, seq: Sequence) -> None:
        """``seq`` got prompt rows this step, past the fork gate and the cadence: the step's one
        chunk is taken. (Marked when it was first asked for, it went to a fork the gate then
        held, and no prompt moved until the held fork failed: review.)"""
        if _chunked(seq):
            self._chunk_passed, self.chunk_to = True, seq.seq_id

    def acquired(self, got_blocks: set[int]) -> None:
        """After phase 2 (``got_blocks``: the sequences that got theirs): a chunk's taker that
        found no block (a fork needing blocks the pool's pinned streams hold) sits the next
        step out, so the next prompt that can move gets the chunk. (It took it step after step,
        every prompt below it was held, nothing moved, and the engine failed a question that
        runs at once without admission: review.)"""
        self._stuck = self.chunk_to if self.chunk_to is not None and self.chunk_to not in got_blocks else None


def _awaiting_input(seq: Sequence) -> bool:
    """A streaming input whose arrived rows are all computed: it waits for its client."""
    return seq.partial and not seq.has_work


def _chunked(seq: Sequence) -> bool:
    """A running request's prompt chunk: what the high-water mark holds back."""
    return not seq.pinned and seq.status is SeqStatus.RUNNING and seq.prefilling
