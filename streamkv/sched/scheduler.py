"""Two-phase continuous-batching scheduler (DESIGN.md section 4).

Phase 1 (order + feasibility): rank every runnable sequence and give each a chunk of the
step's token budget; nothing changes. Phase 2 (acquire): walk the ranking and take KV
blocks; when the pool runs dry, preempt (by recompute) the lowest-ranked running
sequences below the one being served. The scheduler never touches tensors.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from streamkv.config import SchedulerConfig
from streamkv.kv.manager import KVManager
from streamkv.sched.admission import CellBudget
from streamkv.sched.cadence import StepCadence
from streamkv.sched.fork_gate import ForkGate, at_fork_point, droppable, passes
from streamkv.sched.grouping import PrefillGroups
from streamkv.sched.plan import ScheduledSeq, StepPlan
from streamkv.sched.policies import QueuePolicy, make_queue_policy
from streamkv.sched.preemption import PreemptionPolicy, Recompute
from streamkv.sched.propose import Proposal, Proposing, streams_first
from streamkv.sched.sequence import PriorityClass, Sequence, SeqStatus
from streamkv.sched.speculation import Drafting, SpecState, SpecStats, Speculator
from streamkv.sched.step_output import StepUpdates

log = logging.getLogger(__name__)


class Scheduler(Proposing, StepUpdates, Drafting):
    """Owns the waiting/running sets; asks the KV manager for blocks. Phase 1 (``_propose``)
    lives in ``propose.py``, applying a step's outputs (``update``, ``observe_step``) in
    ``step_output.py``."""

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
        now = time.perf_counter()  # queued and scheduled at once: it holds its KV already
        seq.event("queued", now)
        seq.event("scheduled", now)

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
            ranked = streams_first(ranked)
        self._gave_way = False
        proposals = self._propose(ranked)
        scheduled, preempted = self._acquire(proposals, lambda: self.policy.rank(self.seqs.values(), now))
        if self.admission is not None:
            self.admission.acquired({p.seq.seq_id for p in scheduled})
        released, self._released = tuple(self._released), []
        work = tuple(self._to_plan(p) for p in scheduled if p.end > p.seq.num_computed)
        swaps, self._swap_out, self._swap_in = (tuple(self._swap_out), tuple(self._swap_in)), [], []
        # progress: rows no step computed before (``reads_to``: the high-water mark, lowered
        # only when the tokens change). Recomputing rows a sequence had already computed is
        # not: a fork that truncates itself for want of a block and recomputes them, step after
        # step, left the forks starved behind it waiting for good. Nor is KV coming back from
        # host: requests swapped out and in again, round after round beside two forks that could
        # not both fit, kept the stall rule from ever failing one (fuzz seed 2475, heavy)
        self.progressed = any(p.end > p.seq.reads_to for p in scheduled)
        self.starved = frozenset(self._starved)
        self.stalled = frozenset() if self.progressed else self.starved
        self.gated = frozenset(self.fork_gate.held) if self.fork_gate is not None else frozenset()
        return StepPlan(work, tuple(preempted), released, *swaps)

    def _acquire(self, proposals: list[Proposal],
                 rank_all: Callable[[], list[Sequence]]) -> tuple[list[Proposal], list[int]]:
        """Phase 2: take blocks in rank order, preempting from the bottom of the ranking of
        every sequence (idle ones hold KV too; ranked only when a victim is needed). An input
        still streaming (background work) only preempts inputs still streaming ranked below
        it: otherwise two that cannot fit together (two idle inputs) preempt each other in
        turn, step after step, and a complete request is never evicted for background work."""
        victims: list[Sequence] | None = None
        place: dict[int, int] = {}
        preempted: list[int] = []
        done: list[Proposal] = []
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
        """The blocks :meth:`reclaim` could free at most: its victims' own blocks (a fork's past
        its fork point: it keeps the rest, as phase 1 counts it)."""
        victims = self._victims(below) if victims is None else victims
        return sum(self._fork_gives_back(s) if s.fork_kept else self.kv.num_unshared(s.seq_id) for s in victims)

    def _victims(self, below: PriorityClass | None) -> list[Sequence]:
        """What :meth:`reclaim` may preempt, lowest ranked first: running inputs still streaming,
        then (``below``) running requests of a less urgent class that give KV back."""
        ranked = list(reversed(self.policy.rank(self.seqs.values(), time.perf_counter())))
        inputs = [s for s in ranked if s.partial]
        requests = [s for s in ranked if not s.partial and below is not None and s.klass > below and droppable(s)]
        return [s for s in inputs + requests if s.status is SeqStatus.RUNNING and not s.pinned]

    def _try_take(self, prop: Proposal) -> bool:
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

    def _cannot_grow(self, seq: Sequence, done: list[Proposal], preempted: list[int]) -> None:
        """A running sequence found no block and nobody below it to preempt."""
        if done or any(s.status is SeqStatus.RUNNING and s is not seq for s in self.seqs.values()):
            if at_fork_point(seq):  # a fork at its fork point: nothing of its own to give back, it waits
                self._starved.append(seq.seq_id)
                return
            preempted.append(seq.seq_id)
            if self._preempt(seq):
                self._starved.append(seq.seq_id)  # if nothing computes new rows, it is as stuck
                self._gave_way = True
        else:
            log.warning("sequence %d needs more KV than the whole pool; finishing it", seq.seq_id)
            self.finish(seq.seq_id, "length")

    def _preempt(self, seq: Sequence) -> bool:
        """Requeue ``seq``: swap its KV to host blocks, or drop it (recompute), as the
        preemption policy decides; the tokens are kept either way. One whose next row needs
        more blocks than the whole pool could never come back (waiting, it also held up every
        request ranked after it): it finishes "length", as it would running alone (False)."""
        if self.kv.blocks_for(seq.kv_rows(seq.computable)) > self.kv.pool.num_blocks:
            log.warning("sequence %d needs more KV than the whole pool; finishing it", seq.seq_id)
            self.finish(seq.seq_id, "length")
            return False
        n = seq.kv_rows(seq.num_computed)
        kind, seq.status = "recompute", SeqStatus.WAITING
        forked = seq.kv_rows(seq.forked_rows)
        if seq.fork_kept and self.kv.truncates_in_place(seq.seq_id, forked):
            # a fork keeps its parent's rows (nothing a prefill of its ids would give back) and
            # goes on running from the fork point: its own rows are recomputed. Never swapped:
            # that would move the rows it shares too, and bring them back as private copies
            # (a question of a 500-token session then needed 33 free blocks to resume)
            self.kv.truncate(seq.seq_id, forked)
            seq.num_computed, seq.status = seq.forked_rows, SeqStatus.RUNNING
        # the cost policy weighs re-prefilling every computed token against moving the rows'
        # blocks (a compressed sequence holds fewer rows than it computed: T(rows) was weighed)
        elif self.kv.can_swap_out(n) and self.preemption.swap(seq.num_computed, self.kv.blocks_for(n)):
            self._swap_out.extend(self.kv.swap_out(seq.seq_id, n))
            seq.swapped, kind = True, "swap"
        else:  # a compressed sequence re-runs its prefill and compression, reaching the same rows
            self._drop_kv(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_kind[kind] += 1
        seq.event(f"preempted_{kind}")
        return True

    def step_failed(self, plan: StepPlan) -> None:
        """The runner raised on ``plan``: its swap-out copies may never have run, so the victims
        it swapped out recompute instead (their host blocks could hold anything; a swap-in of
        them read rows that were never written)."""
        for seq_id in plan.preempted:
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.swapped:
                self._drop_kv(seq)

    def _drop_kv(self, seq: Sequence) -> None:
        """``seq`` recomputes: its blocks (device or host) go back, and its prefill starts over."""
        self.kv.free(seq.seq_id)
        seq.swapped, seq.num_computed, seq.layout = False, 0, None

    def _to_plan(self, prop: Proposal) -> ScheduledSeq:
        seq = prop.seq
        start, end = seq.num_computed, prop.end
        layout = seq.layout
        return ScheduledSeq(
            seq_id=seq.seq_id, start=start, token_ids=tuple(seq.tokens[start:end]) + prop.draft,
            block_table=tuple(self.kv.block_table(seq.seq_id)),
            sample=(seq.samples or seq.peek) and end == len(seq.tokens),
            params=seq.params, history=seq.tokens, num_prompt=seq.num_prompt_tokens,
            banned_ids=tuple(seq.stop_ids) if seq.num_output < seq.params.min_tokens else (),
            read=seq.read if end > seq.read_from else None, read_from=seq.read_from,
            write=seq.write if seq.compresses else None,
            rows=layout.rows if layout is not None else -1,
            write_row=layout.row(start) if layout is not None else -1,
            ring_from=layout.ring_from if layout is not None else -1, observe=seq.observe, draft=prop.draft)

