"""Phase 1 of the scheduler (``scheduler.py``): order and feasibility, no state change.

Walk the ranking and give each runnable sequence a chunk of the step's token budget::

    ranked ──> skip? ──> where it starts ──> rows it may compute ──> Proposal(seq, end, draft)
               (tier,     (prefix hit;        (budget, chunk, own
                admission, None: not even      limit, a stream's
                fork gate) preempting all      reachable blocks,
                           unpinned admits)    decode cadence)

A mixin of ``Scheduler``, which owns the state it reads (sequences, KV manager, queue policy,
admission, fork gate, grouping, cadence) and takes the KV blocks in phase 2.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from streamkv.config import SchedulerConfig
from streamkv.kv.manager import KVManager, PrefixHit
from streamkv.sched.admission import CellBudget
from streamkv.sched.cadence import StepAllowance, StepCadence
from streamkv.sched.fork_gate import ForkGate, passes
from streamkv.sched.grouping import PrefillGroups
from streamkv.sched.policies import QueuePolicy
from streamkv.sched.sequence import PriorityClass, Sequence, SeqStatus


def is_question(seq: Sequence) -> bool:
    """A session's or flash question: the latency the decode cadence protects (its prompt rows
    are charged to a step's allowance, and cut only with ``question_chunks="capped"`` while
    sequences decode)."""
    return seq.samples and seq.klass <= PriorityClass.SESSION


@dataclass
class Proposal:
    """Phase-1 decision: compute ``seq`` up to token index ``end`` this step."""

    seq: Sequence
    end: int
    draft: tuple[int, ...] = ()  # speculated tokens after ``end`` (``speculation.py``)


@dataclass
class _Pass:
    """Phase 1's running state over one ranking."""

    budget: int  # tokens left in the step
    chunk: int  # the per-sequence prefill chunk
    allow: StepAllowance | None  # the decode cadence's prompt allowance (None: whole chunks)
    hits: dict[int, PrefixHit] = field(default_factory=dict)  # prefix hits grouping looked up
    spec_cap: int = 0  # drafts per decoding sequence
    crowded: bool = False  # a request waits for admission: drafts only in held blocks
    foreground_prefill: bool = False  # a complete request prefills: background work waits
    blocked: bool = False  # a waiting sequence cannot fit: only ``passes`` ones may pass it
    deferred: bool = False  # admission defers a request: no new request passes it (running
    # ones go on: their charge only drops as they finish, so stalling them stalled both forever)
    capped: bool = False  # the cadence cut a chunk
    reclaimable: int | None = None  # free + unpinned running blocks, counted when first needed


class Proposing:
    """``Scheduler``'s phase 1: chunk sizes under the token budget and the sequence cap."""

    config: SchedulerConfig
    kv: KVManager
    seqs: dict[int, Sequence]
    policy: QueuePolicy
    admission: CellBudget | None
    cadence: StepCadence | None
    fork_gate: ForkGate | None
    groups: PrefillGroups | None
    chunk: int
    blocked_need: int
    _unplaced: list[int]
    _spec_cap: Callable[[list[Sequence]], int]  # ``Drafting``: drafts per decoding sequence
    _draft: Callable[[Sequence, int, bool], tuple[int, ...]]  # ``Drafting``: one sequence's drafts

    def _propose(self, ranked: list[Sequence]) -> list[Proposal]:
        """Phase 1 over ``ranked`` (only sequences with work), in rank order.

        The lower tier (inputs still streaming) is background work: it gets no prefill in a
        step where a sequence ranked above it prefills (more than one row), so a finishing
        request's last chunk never waits for prefill nobody needs yet::

            budget |== complete inputs' prefill ==|              (no background this step)
            budget |= decodes =|======= background prefill =======|
        """
        budget = self.config.max_num_batched_tokens
        self.blocked_need = 0
        self._unplaced = []
        followers, hits = (self.groups.plan(ranked, self.policy.background) if self.groups is not None
                           else (set(), {}))
        # followers wait for a leader's blocks, then take their own: drafts leave free blocks alone
        waiting = any(s.status is SeqStatus.WAITING for s in ranked)
        ranked = [s for s in ranked if s.seq_id not in followers]
        spec_cap = self._spec_cap(ranked)
        if self.admission is not None:
            self.admission.begin(self.seqs.values())
            prefilling = self.admission.prefilling(ranked)  # not the requests it will defer
        else:
            prefilling = sum(1 for s in ranked if s.prefilling)
        self.chunk = self.config.chunk_for(prefilling)
        if self.fork_gate is not None:
            self.fork_gate.begin(self.seqs.values())
        st = _Pass(budget, self.chunk, self._allowance(ranked, budget), hits, spec_cap,
                   bool(spec_cap) and waiting)
        out: list[Proposal] = []
        for seq in ranked:
            if st.budget <= 0 or len(out) >= self.config.max_num_seqs:
                break
            prop = self._propose_one(seq, st)
            if prop is not None:
                out.append(prop)
        if st.capped and self.cadence is not None:
            self.cadence.stats.capped_steps += 1
        return out

    def _propose_one(self, seq: Sequence, st: _Pass) -> Proposal | None:
        """``seq``'s chunk this step (spent from ``st``), or None when it gets none."""
        background = self.policy.background(seq)
        fresh = seq.status is SeqStatus.WAITING and not seq.swapped and not seq.pinned
        if (background and st.foreground_prefill) or (st.blocked and not passes(seq)):
            return None
        if st.deferred and fresh and self.admission is not None:  # ranked after one the cell budget holds
            self.admission.deferred()
            return None
        if self.admission is not None and self._held(seq):
            st.deferred = st.deferred or fresh
            return None
        if self.fork_gate is not None and not self.fork_gate.admits(seq):
            return None
        start = self._start(seq, st)
        if start is None:
            return None
        computed, limit = start
        # n == 0: a partial input whose arrived part is all a prefix hit (admitted, no rows)
        n = max(0, min(seq.computable - computed, st.budget, st.chunk, limit if limit is not None else st.budget))
        n = self._fit(seq, st, computed, n)
        if n is None:
            return None
        if self.admission is not None:
            if seq.status is SeqStatus.WAITING and not seq.swapped:
                self.admission.admit(seq)
            if n > 0:
                self.admission.took_chunk(seq)
        if self.fork_gate is not None:
            self.fork_gate.starts(seq)
        draft = self._draft(seq, min(st.spec_cap, st.budget - n), st.crowded) if st.spec_cap and n == 1 else ()
        st.budget -= n + len(draft)
        st.foreground_prefill = st.foreground_prefill or (not background and n > 1)
        return Proposal(seq, computed + n, draft)

    def _start(self, seq: Sequence, st: _Pass) -> tuple[int, int | None] | None:
        """The row ``seq`` computes from this step (a waiting one's prefix hit) and its own chunk
        limit; None when not even preempting every unpinned sequence would admit (or swap in)
        it this step. Such a sequence keeps its place (only ``passes`` ones pass it) but spends
        no budget, so pinned streams (sessions, span queries) and forks, which hold the rest of
        the pool, progress (a swapped one that counted as this step's prompt work kept the
        session streams, background work, from ever going idle to be offloaded for it)."""
        computed = seq.num_computed
        limit = seq.chunk_limit(computed, self.kv.block_size)
        if seq.status is not SeqStatus.WAITING:
            return computed, limit
        hit = None
        if not seq.swapped:
            hit = st.hits.get(seq.seq_id) or self.kv.match_prefix(seq.match_tokens, seq.cache_key)
            computed = hit.num_tokens(self.kv.block_size)
            limit = seq.chunk_limit(computed, self.kv.block_size)
        target = seq.computable
        end = min(target, computed + st.budget, computed + limit if limit is not None else target)
        extra = seq.extra_blocks(end, self.kv.block_size)
        cost = (self.kv.swap_in_cost(seq.seq_id, seq.kv_rows(end), extra) if hit is None
                else self.kv.admission_cost(hit, end) + extra)
        if cost > self.kv.pool.num_free and cost > self._reachable(st):
            if not st.blocked and not seq.partial:
                self.blocked_need = cost
            st.blocked = st.blocked or not seq.partial  # background work holds nobody up
            return None
        return computed, limit

    def _fit(self, seq: Sequence, st: _Pass, computed: int, n: int) -> int | None:
        """``n`` rows cut to what ``seq`` may take: a running stream's to its reachable blocks,
        prompt rows to the decode cadence's allowance. None: it gets no chunk this step."""
        if seq.pinned and seq.status is SeqStatus.RUNNING and n > 0:
            # a stream's chunk only as far as free and reclaimable blocks reach: the budget of
            # a chunk that cannot get its blocks is spent for nothing, and a stream ranked
            # below it, one row from idle (so offloadable for the first), never got that row
            # (fuzz seed 8500). None reachable: it spends no budget and counts as starved
            rows = (self.kv.num_blocks_held(seq.seq_id) + self._reachable(st)) * self.kv.block_size - computed
            if rows <= 0:
                self._unplaced.append(seq.seq_id)
                return None
            n = min(n, rows)
        if seq.computable - computed > 1 and st.allow is not None:  # prompt rows: under the decode
            # cadence, except a question (session or flash class): its latency is what the cadence
            # is for, so its rows are charged (less for the prompts ranked after it), and cut
            # only when it is told to (``question_chunks``, while sequences decode)
            fits = n if is_question(seq) and st.allow.questions_whole else st.allow.rows(computed, n)
            if fits < n:
                n, st.capped = fits, True
                if n == 0:
                    return None
            st.allow.take(computed, n)
        return n

    def _reachable(self, st: _Pass) -> int:
        """Free blocks plus what preempting every unpinned running sequence gives back: blocks
        that only it holds, and of a fork only those past its fork point (it keeps its parent's
        rows and its copied block). Counting every block held (a session question's window is
        its session's), a request that needed nearly the pool preempted a question step after
        step, never fitting, and neither finished; phase 1 changes nothing, so it is counted
        once per pass."""
        if st.reclaimable is None:
            running = [s for s in self.seqs.values() if s.status is SeqStatus.RUNNING and not s.pinned]
            forks = [s for s in running if s.fork_kept]
            plain = [s.seq_id for s in running if not s.fork_kept]
            # plain ones together: a prefix two of them share (a prefix-cache hit) is freed when
            # both are preempted (counted one by one, it never was, and a request that fit only
            # then waited, blocking both, for good: review)
            st.reclaimable = self.kv.pool.num_free + self.kv.num_unshared(*plain) + sum(map(self._fork_gives_back, forks))
        return st.reclaimable

    def _fork_gives_back(self, seq: Sequence) -> int:
        """Blocks preempting a fork frees: its own, past its fork point (see :meth:`_reachable`)."""
        own = self.kv.num_unshared(seq.seq_id)
        return min(own, max(0, self.kv.num_blocks_held(seq.seq_id) - self.kv.blocks_for(seq.kv_rows(seq.forked_rows))))

    def _allowance(self, ranked: list[Sequence], budget: int) -> StepAllowance | None:
        """Prompt work this step may carry: the decode cadence's while someone waits on the step.
        A sequence decodes (the row of a token it generated, as ``step_output._decodes`` counts
        them) or a question has prompt rows (its first token waits for the whole step). With
        neither, whole chunks: capping them also while a live session merely could ask (058249c)
        cost more stateless throughput than it bought session latency on the Zen 4 (README,
        "Decode cadence": no run with it sustained 1 req/s, 5 of 7 without it did). A question's
        rows are charged to it but not cut, unless ``question_chunks="capped"`` while a sequence
        decodes (then a prompt ranked above a question may leave it nothing for a step)."""
        if self.cadence is None:
            return None
        decoding = any(s.status is SeqStatus.RUNNING and s.samples and s.remaining == 1 and s.num_output > 0
                       for s in ranked)
        if not decoding and not any(is_question(s) and s.prefilling for s in ranked):
            return None
        allow = self.cadence.allowance(budget)
        if allow is not None:
            allow.questions_whole = not (decoding and self.config.question_chunks == "capped")
        return allow

    def _held(self, seq: Sequence) -> bool:
        """Cell-budget admission: a new request waits for room, or a prompt chunk for the pool
        to fall below the high-water mark."""
        assert self.admission is not None
        if seq.status is SeqStatus.WAITING and not seq.swapped:
            return not self.admission.admits(seq)
        return self.admission.holds_chunk(seq)


def streams_first(ranked: list[Sequence]) -> list[Sequence]:
    """The ranking with pinned streams (sessions ingesting, span queries) moved to the front,
    for the step after a running request gave its blocks back for want of one. Streams rank
    last, so requests ranked above them took the whole token budget step after step; a request
    that needs more than the pool holds beside a stream's blocks then prefilled, found no
    block and gave them back, over and over, while the stream, a few rows from idle (and only
    then offloadable for it), never got a row (fuzz seeds 1246, 1683)."""
    return [s for s in ranked if s.pinned] + [s for s in ranked if not s.pinned]
