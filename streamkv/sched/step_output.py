r"""The runner's side of the step boundary: what the scheduler does with a step's outputs.

    Scheduler.schedule() -> StepPlan -> runner -> StepOutput -> Scheduler.update()
                                               \-> seconds    -> Scheduler.observe_step()

``update`` advances each sequence by the rows the plan computed, appends the sampled (or
verified speculated) tokens and finishes stopped sequences; ``observe_step`` feeds the decode
cadence the step's time. A mixin of ``Scheduler`` (``scheduler.py``), which owns the state it
reads: the sequences, the KV manager, the speculation state and the cadence.
"""
from __future__ import annotations

from typing import Callable

from streamkv.kv.manager import KVManager
from streamkv.policies.read import ReadCount
from streamkv.sched.cadence import StepCadence, row_context
from streamkv.sched.plan import ScheduledSeq, StepOutput, StepPlan
from streamkv.sched.sequence import Sequence, SeqStatus
from streamkv.sched.speculation import SpecState, SpecStats, Speculator


def _decodes(item: ScheduledSeq) -> bool:
    """A decode row: one generated token's row (plus its drafts), sampled."""
    return item.sample and item.start >= item.num_prompt and item.num_tokens - len(item.draft) == 1


class StepUpdates:
    """``Scheduler``'s output half: applies a step's ``StepOutput`` to its sequences."""

    seqs: dict[int, Sequence]
    kv: KVManager
    cadence: StepCadence | None
    speculator: Speculator | None
    spec_states: dict[int, SpecState]
    spec_stats: SpecStats
    finish: Callable[[int, str], Sequence | None]  # ``Scheduler.finish``: stop one, free its KV

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """The engine reports each executed step's time (the decode cadence learns from it)."""
        if self.cadence is None:
            return
        chunks = [(it.num_tokens, it.start) for it in plan.seqs if not _decodes(it)]
        self.cadence.observe(len(plan.seqs) - len(chunks), sum(n for n, _ in chunks), seconds,
                             sum(row_context(n, start) for n, start in chunks), sum(start for _, start in chunks))

    def _enter_layout(self, seq: Sequence, item: ScheduledSeq, output: StepOutput) -> None:
        """The write policy's point is reached: from now on the sequence holds its layout's
        rows. When the runner compressed the prompt into the blocks after it, those become
        the table and the prompt's blocks go back to the pool (their prefix-cache entries
        stay: the prompt is still a prefix hit for others; compressed blocks never are)."""
        if item.write is not None:
            if item.seq_id not in output.compressed:
                raise RuntimeError(f"sequence {seq.seq_id} reached its compression point uncompressed")
            self.kv.compact(seq.seq_id, self.kv.blocks_for(seq.num_computed))
            seq.compress_s += output.compressed[item.seq_id]
        seq.layout = seq.write.layout(seq.num_prompt_tokens)

    def update(self, plan: StepPlan, output: StepOutput) -> list[tuple[Sequence, int | None]]:
        """Advance ``num_computed``, append sampled tokens, finish stopped sequences.

        Returns ``(sequence, new_token_or_None)`` for every sequence that sampled.
        """
        events: list[tuple[Sequence, int | None]] = []
        for item in plan.seqs:
            seq = self.seqs.get(item.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue
            if item.start < seq.computable <= item.start + item.num_tokens and not seq.num_output:
                seq.event("kv_resident")  # every token that has arrived now has KV
            emitted = self._verified(seq, item, output)
            seq.num_computed = item.start + item.num_tokens - len(item.draft) + max(0, len(emitted) - 1)
            read = output.reads.get(item.seq_id)
            if read is not None and item.start + item.num_tokens > seq.reads_to:  # not a recomputed row
                seq.reads = seq.reads or ReadCount()
                seq.reads.add(read)
            seq.reads_to = max(seq.reads_to, seq.num_computed)
            if seq.cacheable and seq.layout is None:  # (accepted drafts have rows, not yet tokens)
                tokens = seq.tokens if seq.exact_rows <= len(seq.tokens) else seq.tokens + list(emitted)
                self.kv.commit(seq.seq_id, tokens, seq.exact_rows)
            if seq.write is not None and seq.layout is None and seq.num_computed == seq.write_point:
                self._enter_layout(seq, item, output)
            if not item.sample or not emitted:
                continue
            if not seq.samples:  # a peeking stream: keep the distribution, append nothing
                seq.peeked = output.logprobs.get(item.seq_id)
                continue
            for token in emitted:
                seq.tokens.append(token)
                events.append((seq, token))
                reason = seq.stop_reason_after(token)
                if reason is not None:
                    self.finish(seq.seq_id, reason)
                    break
        return events

    def _verified(self, seq: Sequence, item: ScheduledSeq, output: StepOutput) -> tuple[int, ...]:
        """The tokens ``item`` emitted: its speculated ones (counted), or its one sample."""
        if not item.draft:
            token = output.tokens.get(item.seq_id)
            return () if token is None else (token,)
        emitted = output.drafts[item.seq_id]
        accepted = len(emitted) - 1
        st = self.spec_stats
        st.steps, st.proposed, st.accepted = st.steps + 1, st.proposed + len(item.draft), st.accepted + accepted
        state = self.spec_states.get(seq.seq_id)
        if state is not None and self.speculator is not None:
            self.speculator.observe(state, len(item.draft), accepted)
        return emitted
