"""The fork gate: a question's fork starts its own rows only when the pool can hold them to the end.

A question's fork (``Sequence.forked_rows`` > 0: a session question, a ``POOL`` fork) shares its
parent's blocks and holds one copied partial block; its own rows (the question, then the
answer) are its to grow. Started together, forks whose growth the pool cannot hold all at once
ran out of blocks mid-answer, truncated themselves back to their fork point and recomputed,
each in turn (fake runner, 48 blocks, a 58-row parent, 12 forks of 3 + 50 rows: 97 preemptions
before all were answered). The gate works like vLLM's admission watermark, per fork::

    free blocks |== reserved: started forks' remaining growth ==|-- admits the next fork --|

Each step it reserves what every started fork (one past its fork point) may still take to
its end, ``blocks(min(prompt + max_tokens, max_len)) - blocks held``, and lets a fork at its fork
point start only when its own such need fits in the free blocks left. The first fork always
may start when none has (a fork larger than the pool still runs, as before, reserving nothing,
so a smaller one that fits may still pass it). A held fork keeps
only its copied block; it is never failed for the gate (``Engine._fail_stalled`` may fail the
latest held one when nothing progresses: its copy is a block the others need). Other work
(requests, streams) is not held back by the reservations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from streamkv.kv.manager import KVManager
from streamkv.sched.admission import projected_tokens
from streamkv.sched.sequence import Sequence, SeqStatus


@dataclass
class ForkGateStats:
    deferred: int = 0   # (fork, step) pairs a fork at its fork point waited for room
    reserved: int = 0   # blocks the started forks may still take (as of the latest step or finish)


def gated(seq: Sequence) -> bool:
    """A running question fork (it samples, it is not a pinned stream) with KV forked from a parent."""
    return bool(seq.forked_rows) and seq.samples and not seq.pinned and seq.status is SeqStatus.RUNNING


def droppable(seq: Sequence) -> bool:
    """Whether preempting ``seq`` gives KV back: a fork keeps its parent's rows (``forked_rows``)."""
    return not seq.forked_rows or seq.num_computed > seq.forked_rows


def at_fork_point(seq: Sequence) -> bool:
    """A fork that has computed none of its own rows: it holds only its copied block."""
    return not droppable(seq)


def passes(seq: Sequence, behind_running: bool = False) -> bool:
    """Whether ``seq`` may run past a higher-ranked sequence that cannot fit: pinned streams,
    and forks unless that sequence is a running one that could not grow and gave its blocks
    back (they would take them, and it would recompute, step after step). Preempting a stream
    or a fork at its fork point gives nothing back, and a started fork gives back only its own
    rows, which the waiting one was found not to fit with (``Proposing._reachable``): holding
    them idle never makes room; only their progress (a fork finishing frees its share) can
    (helper-29's hang: forks at their fork point waited behind requests that waited for blocks;
    a started question held behind a request that needed its session's blocks never finished)."""
    return seq.pinned or (not behind_running and seq.forked_rows > 0)


class ForkGate:
    """Per step: :meth:`begin` reserves the started forks' growth, then :meth:`admits` answers
    for each ranked fork at its fork point, in ranking order, and :meth:`starts` reserves for
    each one that is given rows (one admitted and then given none, the decode cadence's 0-row
    cut, reserves nothing: the forks ranked after it may start)."""

    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.stats = ForkGateStats()
        self.held: list[int] = []  # forks held this step (seq ids)
        self._left = 0
        self._open = False  # a fork has started or starts this step

    def need(self, seq: Sequence) -> int:
        """Blocks ``seq`` may still take before it ends (its projected rows and its parent's)."""
        end = projected_tokens(seq) + seq.forked_rows
        return max(0, self.kv.blocks_for(seq.kv_rows(end)) - self.kv.num_blocks_held(seq.seq_id))

    def room_for(self, seqs: Iterable[Sequence], rows: int, end: int, extra: int = 0, spare: int = 0) -> bool:
        """Whether a new fork of a parent's first ``rows`` rows that may grow to ``end`` rows may
        take its copied block now (:meth:`start_blocks` free). ``extra`` blocks are taken first (a
        restore of the parent) and ``spare`` ones could be freed for it (idle sessions, less
        urgent requests)."""
        return self.kv.pool.num_free + spare - extra >= self.start_blocks(seqs, rows, end)

    def start_blocks(self, seqs: Iterable[Sequence], rows: int, end: int) -> int:
        """Free blocks a new fork (see :meth:`room_for`) needs to take its copy: after the copy
        they must still hold the started forks' remaining growth and the smallest need among the
        forks at their fork point, this one included, so the gate can always start one. (Copies
        of forks that could not start took every free block: nothing progressed until the engine
        failed the latest one 64 steps later.) With no other fork, only its copy, as the gate
        lets the first start whatever its need. Preempting started forks for it never raises
        this: their growth leaves the reservation, and their needs can only lower the smallest."""
        kv = self.kv
        copy = 1 if rows % kv.block_size else 0
        live = [s for s in seqs if gated(s)]
        if not live:
            return copy
        smallest = min([self.need(s) for s in live if at_fork_point(s)] + [kv.blocks_for(end) - kv.blocks_for(rows)])
        return copy + self._reserved(live) + smallest

    def begin(self, seqs: Iterable[Sequence]) -> None:
        live = [s for s in seqs if gated(s)]
        self.stats.reserved = self._reserved(live)
        self._left = self.kv.pool.num_free - self.stats.reserved
        self._open = any(not at_fork_point(s) for s in live)
        self.held = []

    def release(self, seqs: Iterable[Sequence]) -> None:
        """A fork finished: the gauge shows what the started forks among ``seqs`` (those left)
        may still take (an idle server otherwise showed its last question's reservation)."""
        self.stats.reserved = self._reserved([s for s in seqs if gated(s)])

    def _reserved(self, live: list[Sequence]) -> int:
        """What the started forks among ``live`` (gated forks) may still take to their ends."""
        return sum(self.need(s) for s in live if not at_fork_point(s))

    def admits(self, seq: Sequence) -> bool:
        """Whether ``seq`` may compute this step (anything but a gated fork at its fork point may);
        a fork refused is held (counted). Reserves nothing: :meth:`starts` does."""
        if not gated(seq) or not at_fork_point(seq):
            return True
        # the first may start even when it does not fit; it reserves nothing it cannot have, so
        # a smaller fork that fits still runs past it and frees its copy
        if self.need(seq) <= self._left or not self._open:
            return True
        self.stats.deferred += 1
        self.held.append(seq.seq_id)
        return False

    def starts(self, seq: Sequence) -> None:
        """``seq``, admitted, computes rows this step: a fork at its fork point reserves its need
        (what it cannot have, the first one's, stays free) and counts as started."""
        if not gated(seq) or not at_fork_point(seq):
            return
        need = self.need(seq)
        if need <= self._left:
            self._left -= need
        self._open = True
