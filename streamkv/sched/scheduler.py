"""Two-phase continuous-batching scheduler (DESIGN.md section 4).

Phase 1 (order + feasibility): rank every runnable sequence and give each a chunk of the
step's token budget; nothing changes. Phase 2 (acquire): walk the ranking and take KV
blocks; when the pool runs dry, preempt (by recompute) the lowest-ranked running
sequences below the one being served. The scheduler never touches tensors.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from streamkv.config import SchedulerConfig
from streamkv.kv.manager import KVManager
from streamkv.sched.admission import CellBudget
from streamkv.sched.cadence import StepAllowance, StepCadence
from streamkv.sched.fork_gate import ForkGate, at_fork_point, droppable, passes
from streamkv.sched.grouping import PrefillGroups
from streamkv.sched.plan import ScheduledSeq, StepPlan
from streamkv.sched.policies import QueuePolicy, make_queue_policy
from streamkv.sched.preemption import PreemptionPolicy, Recompute
from streamkv.sched.sequence import PriorityClass, Sequence, SeqStatus
from streamkv.sched.speculation import Drafting, SpecState, SpecStats, Speculator
from streamkv.sched.step_output import StepUpdates

log = logging.getLogger(__name__)


def _question(seq: Sequence) -> bool:
    """A session's or flash question: the latency the decode cadence protects (its prompt rows
    are charged to a step's allowance, and cut only with ``question_chunks="capped"`` while
    sequences decode)."""
    return seq.samples and seq.klass <= PriorityClass.SESSION


@dataclass
class _Proposal:
    """Phase-1 decision: compute ``seq`` up to token index ``end`` this step."""

    seq: Sequence
    end: int
    draft: tuple[int, ...] = ()  # speculated tokens after ``end`` (``speculation.py``)


class Scheduler(StepUpdates, Drafting):
    """Owns the waiting/running sets; asks the KV manager for blocks. Applying a step's outputs
    (``update``, ``observe_step``) lives in ``step_output.py``."""

    def __init__(self, config: SchedulerConfig, kv: KVManager, policy: QueuePolicy | None = None,
                 preemption: PreemptionPolicy | None = None, speculator: Speculator | None = None) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy or make_queue_policy(config.queue_policy, config.max_wait_s)
        self.preemption = preemption or Recompute()
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self.seqs: dict[int, Sequence] = {}
        self.num_preemptions = 0
        self.preemptions_by_kind: dict[str, int] = {"recompute": 0, "swap": 0}
        self._released: list[int] = []
        self.speculator = speculator
        self.spec_states: dict[int, SpecState] = {}
        self.spec_stats = SpecStats()
        self.chunk = config.chunk_cap  # the per-sequence prefill chunk of the latest step
        self.admission = (CellBudget(kv.pool, config.admission_ceiling, config.admission_high_water)
                          if config.admission == "cell-budget" else None)
        self.cadence = StepCadence(config.stall_factor) if config.stall_factor is not None else None
        self.fork_gate = ForkGate(kv) if config.fork_gate else None
        self.groups = (PrefillGroups(kv) if config.grouped_prefill and kv.pool.enable_prefix_caching
                       else None)
        # pinned sequences, and forks at their fork point, that found no block in a step that
        # computes nothing: only their owners (span queries, sessions) or a client can change
        # that (the engine fails such a fork's request after a while, the span executor its query)
        self.stalled: frozenset[int] = frozenset()
        self.starved: frozenset[int] = frozenset()  # the same, in the latest step, progress or not
        self.gated: frozenset[int] = frozenset()  # forks the fork gate held at their fork point, latest step
        self.progressed = False  # the latest step computed new rows (or moved KV back)
        self._starved: list[int] = []
        self._gave_way = False  # a running sequence preempted itself for want of a block, latest step
        self._unplaced: list[int] = []  # pinned streams phase 1 found no reachable block for, this step
        # blocks the first waiting request that cannot be admitted needs (it holds up every
        # unpinned one behind it), latest step; 0: none (sessions offload idle KV for it)
        self.blocked_need = 0

    # ------------------------------------------------------------- bookkeeping
    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence {seq.seq_id} already scheduled")
        seq.status = SeqStatus.WAITING
        self.seqs[seq.seq_id] = seq
        seq.event("queued")

    def add_running(self, seq: Sequence) -> None:
        """Track a sequence whose KV the caller already gave it (a fork): it runs next step."""
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence {seq.seq_id} already scheduled")
        if not self.kv.has(seq.seq_id):
            raise ValueError(f"sequence {seq.seq_id} has no KV")
        seq.status = SeqStatus.RUNNING
        self.seqs[seq.seq_id] = seq

    def finish(self, seq_id: int, reason: str) -> Sequence | None:
        """Stop a sequence (stop string, abort, error) and free its KV at once (``keep_kv``:
        its owner takes the KV over, then frees it)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return None
        if self.admission is not None:
            self.admission.release(seq)
        if self.fork_gate is not None and seq.forked_rows:
            self.fork_gate.release(self.seqs.values())
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.spec_states.pop(seq_id, None)
        seq.event("finished")
        if not seq.keep_kv:
            self.kv.free(seq_id)
        self._released.append(seq_id)
        return seq

    @property
    def num_running(self) -> int:
        """Requests (sampling sequences) holding KV; session and span streams are not requests."""
        return sum(1 for s in self.seqs.values() if s.status is SeqStatus.RUNNING and s.samples)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self.seqs.values() if s.status is SeqStatus.WAITING)

    def has_work(self) -> bool:
        return bool(self.seqs)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        now = time.perf_counter()
        self.kv.begin_step()
        ranked = self.policy.rank([s for s in self.seqs.values() if s.has_work], now)
        if self._gave_way:
            ranked = _streams_first(ranked)
        self._gave_way = False
        proposals = self._propose(ranked)
        scheduled, preempted = self._acquire(proposals, lambda: self.policy.rank(self.seqs.values(), now))
        released, self._released = tuple(self._released), []
        work = tuple(self._to_plan(p) for p in scheduled if p.end > p.seq.num_computed)
        swaps, self._swap_out, self._swap_in = (tuple(self._swap_out), tuple(self._swap_in)), [], []
        # progress: rows no step computed before (``reads_to``: the high-water mark, lowered
        # only when the tokens change), or KV coming back. Recomputing rows a sequence had
        # already computed is not: a fork that truncates itself for want of a block and
        # recomputes them, step after step, left the forks starved behind it waiting for good
        self.progressed = any(p.end > p.seq.reads_to for p in scheduled) or bool(swaps[1])
        self.starved = frozenset(self._starved)
        self.stalled = frozenset() if self.progressed else self.starved
        self.gated = frozenset(self.fork_gate.held) if self.fork_gate is not None else frozenset()
        return StepPlan(work, tuple(preempted), released, *swaps)

    def _propose(self, ranked: list[Sequence]) -> list[_Proposal]:
        """Phase 1: chunk sizes under the token budget and sequence cap (no state change).

        ``ranked`` holds only sequences with work. The lower tier (inputs still streaming) is
        background work: it gets no prefill in a step where a sequence ranked above it
        prefills (more than one row), so a finishing request's last chunk never waits for
        prefill nobody needs yet::

            budget |== complete inputs' prefill ==|              (no background this step)
            budget |= decodes =|======= background prefill =======|
        """
        budget = self.config.max_num_batched_tokens
        foreground_prefill = False
        blocked = False  # a waiting sequence that cannot fit: only ``passes`` ones may pass it
        deferred = False  # a request admission defers: no new request passes it (running ones
        # go on: their charge only drops as they finish, so stalling them stalled both forever)
        reclaimable: int | None = None  # free + unpinned running blocks, counted only when needed
        self.blocked_need = 0
        self._unplaced = []
        out: list[_Proposal] = []
        followers, hits = (self.groups.plan(ranked, self.policy.background) if self.groups is not None
                           else (set(), {}))
        ranked = [s for s in ranked if s.seq_id not in followers]  # they wait for a leader's blocks
        spec_cap = self._spec_cap(ranked)
        prefilling = sum(1 for s in ranked if s.prefilling)
        if self.admission is not None and self.admission.above_high_water():
            prefilling = min(prefilling, 1)  # prompt chunks go one per step: the one that moves gets a whole chunk
        self.chunk = chunk = self.config.chunk_for(prefilling)
        crowded = spec_cap and any(s.status is SeqStatus.WAITING for s in ranked)
        if self.admission is not None:
            self.admission.begin(self.seqs.values())
        if self.fork_gate is not None:
            self.fork_gate.begin(self.seqs.values())
        allow = self._allowance(ranked, budget)
        capped = False
        for seq in ranked:
            if budget <= 0 or len(out) >= self.config.max_num_seqs:
                break
            background = self.policy.background(seq)
            fresh = seq.status is SeqStatus.WAITING and not seq.swapped and not seq.pinned
            if (background and foreground_prefill) or (blocked and not passes(seq)) or (deferred and fresh):
                continue
            if self.admission is not None and self._held(seq):
                deferred = deferred or fresh
                continue
            if self.fork_gate is not None and not self.fork_gate.admits(seq):
                continue
            target = seq.computable
            computed = seq.num_computed
            limit = seq.chunk_limit(computed)
            if seq.status is SeqStatus.WAITING:
                if not seq.swapped:
                    hit = hits.get(seq.seq_id) or self.kv.match_prefix(seq.match_tokens, seq.cache_key)
                    computed = hit.num_tokens(self.kv.block_size)
                    limit = seq.chunk_limit(computed)
                end = min(target, computed + budget, computed + limit if limit is not None else target)
                extra = seq.extra_blocks(end, self.kv.block_size)
                cost = (self.kv.swap_in_cost(seq.seq_id, seq.kv_rows(end), extra) if seq.swapped
                        else self.kv.admission_cost(hit, end) + extra)
                # not even preempting every unpinned sequence would admit (or swap in) it this
                # step: it keeps its place (only ``passes`` ones pass it) but spends no budget, so
                # pinned streams (sessions, span queries) and forks, which hold the rest of the
                # pool, progress (a swapped one that counted as this step's prompt work kept the
                # session streams, background work, from ever going idle to be offloaded for it)
                if cost > self.kv.pool.num_free:
                    if reclaimable is None:
                        reclaimable = self._reclaimable_blocks()
                    if cost > reclaimable:
                        if not blocked and not seq.partial:
                            self.blocked_need = cost
                        blocked = blocked or not seq.partial  # background work holds nobody up
                        continue
            # n == 0: a partial input whose arrived part is all a prefix hit (admitted, no rows)
            n = max(0, min(target - computed, budget, chunk, limit if limit is not None else budget))
            if seq.pinned and seq.status is SeqStatus.RUNNING and n > 0:
                # a stream's chunk only as far as free and reclaimable blocks reach: the budget of
                # a chunk that cannot get its blocks is spent for nothing, and a stream ranked
                # below it, one row from idle (so offloadable for the first), never got that row
                # (fuzz seed 8500). None reachable: it spends no budget and counts as starved
                if reclaimable is None:
                    reclaimable = self._reclaimable_blocks()
                rows = (self.kv.num_blocks_held(seq.seq_id) + reclaimable) * self.kv.block_size - computed
                if rows <= 0:
                    self._unplaced.append(seq.seq_id)
                    continue
                n = min(n, rows)
            if target - computed > 1 and allow is not None:  # prompt rows: under the decode cadence,
                # except a question (session or flash class): its latency is what the cadence is
                # for, so its rows are charged (less for the prompts ranked after it), and cut
                # only when it is told to (``question_chunks``, while sequences decode)
                fits = n if _question(seq) and allow.questions_whole else allow.rows(computed, n)
                if fits < n:
                    n, capped = fits, True
                    if n == 0:
                        continue
                allow.take(computed, n)
            if self.fork_gate is not None:
                self.fork_gate.starts(seq)
            draft = self._draft(seq, min(spec_cap, budget - n), crowded) if spec_cap and n == 1 else ()
            out.append(_Proposal(seq, computed + n, draft))
            budget -= n + len(draft)
            foreground_prefill = foreground_prefill or (not background and n > 1)
        if capped and self.cadence is not None:
            self.cadence.stats.capped_steps += 1
        return out

    def _reclaimable_blocks(self) -> int:
        """Free blocks plus those every unpinned running sequence holds (what preempting them all gives)."""
        return self.kv.pool.num_free + sum(self.kv.num_blocks_held(s.seq_id) for s in self.seqs.values()
                                           if s.status is SeqStatus.RUNNING and not s.pinned)

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
        if not decoding and not any(_question(s) and s.prefilling for s in ranked):
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

    def _acquire(self, proposals: list[_Proposal],
                 rank_all: Callable[[], list[Sequence]]) -> tuple[list[_Proposal], list[int]]:
        """Phase 2: take blocks in rank order, preempting from the bottom of the ranking of
        every sequence (idle ones hold KV too; ranked only when a victim is needed). An input
        still streaming (background work) only preempts inputs still streaming ranked below
        it: otherwise two that cannot fit together (two idle inputs) preempt each other in
        turn, step after step, and a complete request is never evicted for background work."""
        victims: list[Sequence] | None = None
        place: dict[int, int] = {}
        preempted: list[int] = []
        done: list[_Proposal] = []
        done_ids: set[int] = set()
        blocked = behind_running = False
        self._starved = list(self._unplaced)
        for prop in proposals:
            seq = prop.seq
            if seq.seq_id in preempted:
                continue
            if blocked and not passes(seq, behind_running):
                if at_fork_point(seq):  # a fork at its fork point, held back with its copied block
                    self._starved.append(seq.seq_id)
                continue
            while not self._try_take(prop):
                if victims is None:
                    ranking = rank_all()
                    place = {s.seq_id: i for i, s in enumerate(ranking)}
                    victims = [s for s in reversed(ranking) if s.status is SeqStatus.RUNNING and not s.pinned
                               and droppable(s)]
                victim = next((v for v in victims if v is not seq and v.seq_id not in preempted
                               and v.seq_id not in done_ids
                               and (not seq.partial or (v.partial and place[v.seq_id] > place[seq.seq_id]))), None)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim.seq_id)
            else:
                done.append(prop)
                done_ids.add(seq.seq_id)
                continue
            if seq.pinned:
                self._starved.append(seq.seq_id)
                continue  # a stream waits for blocks; it is never preempted
            if seq.status is SeqStatus.RUNNING:
                gave_back = droppable(seq)  # it preempts itself: its blocks are free now
                self._cannot_grow(seq, done, preempted)
                behind_running = behind_running or gave_back
            # only ``passes`` ones pass it (pinned streams and forks at their fork point still
            # take free blocks: holding them back frees nothing); an input still
            # streaming, which may only take free blocks or its inferiors', holds nobody up
            blocked = blocked or not seq.partial
        return done, preempted

    def reclaim(self, blocks: int, below: PriorityClass | None = None) -> list[tuple[int, int]]:
        """Preempt inputs still streaming (background work, which never finishes on its own),
        lowest ranked first, until ``blocks`` are free for KV taken between steps (a fork); with
        ``below``, then running requests of a less urgent class than it, lowest ranked first (a
        fork at its fork point gives nothing back and is skipped), and none at all when all of
        them together could not free ``blocks`` (a restore's preemptions were wasted). Returns their swap-out
        copies, which the caller makes before it writes a released block (they are not queued
        for the next step)."""
        mark = len(self._swap_out)
        victims = self._victims(below)
        if below is not None and self.kv.pool.num_free + self.reclaimable(below, victims) < blocks:
            return []  # preempting them all would still leave too few: their work is not wasted
        for seq in victims:
            if self.kv.pool.num_free >= blocks:
                break
            self._preempt(seq)
        pairs, self._swap_out[mark:] = self._swap_out[mark:], []
        return pairs

    def reclaimable(self, below: PriorityClass | None, victims: list[Sequence] | None = None) -> int:
        """The blocks :meth:`reclaim` could free at most: its victims' own blocks."""
        return sum(self.kv.num_unshared(s.seq_id) for s in (self._victims(below) if victims is None else victims))

    def _victims(self, below: PriorityClass | None) -> list[Sequence]:
        """What :meth:`reclaim` may preempt, lowest ranked first: running inputs still streaming,
        then (``below``) running requests of a less urgent class that give KV back."""
        ranked = list(reversed(self.policy.rank(self.seqs.values(), time.perf_counter())))
        inputs = [s for s in ranked if s.partial]
        requests = [s for s in ranked if not s.partial and below is not None and s.klass > below and droppable(s)]
        return [s for s in inputs + requests if s.status is SeqStatus.RUNNING and not s.pinned]

    def _try_take(self, prop: _Proposal) -> bool:
        seq = prop.seq
        extra = seq.extra_blocks(prop.end, self.kv.block_size)
        if seq.status is SeqStatus.RUNNING:
            if prop.draft and not self.kv.grow(seq.seq_id, seq.kv_rows(prop.end + len(prop.draft)), extra):
                prop.draft = ()  # drafts never preempt anyone: they take only free blocks
                # (possibly the last one, which a running sequence ranked after this one then
                # preempts for; reserving those blocks was measured no better: rows lost to
                # preemption 17,842 vs 17,787 and 11,594 vs 11,207 over 150-300 fake-runner mixes)
            return self.kv.grow(seq.seq_id, seq.kv_rows(prop.end), extra)
        if seq.swapped:
            pairs = self.kv.swap_in(seq.seq_id, seq.kv_rows(prop.end), extra)
            if pairs is None:
                return False
            self._swap_in.extend(pairs)
            seq.swapped, seq.status = False, SeqStatus.RUNNING
            seq.event("swapped_in")
            return True
        # Look the prefix up again: allocations earlier in this step may have evicted
        # blocks seen in phase 1. A hit can only shrink, so ``end`` stays reachable.
        hit = self.kv.match_prefix(seq.match_tokens, seq.cache_key)
        computed = hit.num_tokens(self.kv.block_size)
        if self.kv.admission_cost(hit, prop.end) + extra > self.kv.pool.num_free:
            return False
        self.kv.admit(seq.seq_id, hit, seq.cache_key, len(seq.tokens))
        if not self.kv.grow(seq.seq_id, prop.end, extra):
            raise RuntimeError("admission cost check and allocation disagree")
        seq.num_computed = computed
        if not seq.num_preemptions:  # a readmission's hit is the sequence's own earlier KV
            seq.num_cached_tokens = max(seq.num_cached_tokens, min(computed, seq.num_prompt_tokens))
        if self.groups is not None:
            self.groups.admitted(seq, computed)
        seq.status = SeqStatus.RUNNING
        seq.event("scheduled")
        return True

    def _cannot_grow(self, seq: Sequence, done: list[_Proposal], preempted: list[int]) -> None:
        """A running sequence found no block and nobody below it to preempt."""
        if done or any(s.status is SeqStatus.RUNNING and s is not seq for s in self.seqs.values()):
            if at_fork_point(seq):  # a fork at its fork point: nothing of its own to give back, it waits
                self._starved.append(seq.seq_id)
                return
            self._preempt(seq)
            preempted.append(seq.seq_id)
            self._starved.append(seq.seq_id)  # if nothing computes new rows, it is as stuck
            self._gave_way = True
        else:
            log.warning("sequence %d needs more KV than the whole pool; finishing it", seq.seq_id)
            self.finish(seq.seq_id, "length")

    def _preempt(self, seq: Sequence) -> None:
        """Requeue ``seq``: swap its KV to host blocks, or drop it (recompute), as the
        preemption policy decides; the tokens are kept either way."""
        n = seq.kv_rows(seq.num_computed)
        kind, seq.status = "recompute", SeqStatus.WAITING
        forked = seq.kv_rows(seq.forked_rows)
        if forked and seq.layout is None and self.kv.truncates_in_place(seq.seq_id, forked):
            # a fork keeps its parent's rows (nothing a prefill of its ids would give back) and
            # goes on running from the fork point: its own rows are recomputed. Never swapped:
            # that would move the rows it shares too, and bring them back as private copies
            # (a question of a 500-token session then needed 33 free blocks to resume)
            self.kv.truncate(seq.seq_id, forked)
            seq.num_computed, seq.status = seq.forked_rows, SeqStatus.RUNNING
        elif self.kv.can_swap_out(n) and self.preemption.swap(n, self.kv.blocks_for(n)):
            self._swap_out.extend(self.kv.swap_out(seq.seq_id, n))
            seq.swapped, kind = True, "swap"
        else:  # a compressed sequence re-runs its prefill and compression, reaching the same rows
            self.kv.free(seq.seq_id)
            seq.num_computed = 0
            seq.layout = None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_kind[kind] += 1
        seq.event(f"preempted_{kind}")

    def _to_plan(self, prop: _Proposal) -> ScheduledSeq:
        seq = prop.seq
        start, end = seq.num_computed, prop.end
        layout = seq.layout
        return ScheduledSeq(
            seq_id=seq.seq_id, start=start, token_ids=tuple(seq.tokens[start:end]) + prop.draft,
            block_table=tuple(self.kv.block_table(seq.seq_id)),
            sample=(seq.samples or seq.peek) and end == len(seq.tokens),
            params=seq.params, history=seq.tokens, num_prompt=seq.num_prompt_tokens,
            banned_ids=tuple(seq.stop_ids) if seq.num_output < seq.params.min_tokens else (),
            read=seq.read if start >= seq.read_from else None,
            write=seq.write if seq.compresses else None,
            rows=layout.rows if layout is not None else -1,
            write_row=layout.row(start) if layout is not None else -1,
            ring_from=layout.ring_from if layout is not None else -1, observe=seq.observe, draft=prop.draft)


def _streams_first(ranked: list[Sequence]) -> list[Sequence]:
    """The ranking with pinned streams (sessions ingesting, span queries) moved to the front,
    for the step after a running request gave its blocks back for want of one. Streams rank
    last, so requests ranked above them took the whole token budget step after step; a request
    that needs more than the pool holds beside a stream's blocks then prefilled, found no
    block and gave them back, over and over, while the stream, a few rows from idle (and only
    then offloadable for it), never got a row (fuzz seeds 1246, 1683)."""
    return [s for s in ranked if s.pinned] + [s for s in ranked if not s.pinned]
