"""Which pages a read policy's rows pick, and which picks a sequence remembers.

A question (a session's question: rows under the policy before ``num_prompt``) and its
answer read under one plan, the question's, fixed by positions alone (its first row under
the policy and ``num_prompt``), so any chunking of the question plans alike::

    rows   [ sinks | candidate pages ........ | tail: ... question q q q q q ]  [ answer a a a
    plan   sink    ^                 tail_from ^ (at most the question's first row)

    question row p: reads the sinks, the ``keep`` pages its own query ranks best (its
                    shares, one row at a time: the same bits in any chunk) and the tail up to p
    window:         the question's last ``WINDOW`` rows; each page keeps its best share over
                    them, and the answer's rows (``rescore`` false) read the ``keep`` best

Every candidate page lies before the question, so no page a step computes is ranked by
bounds taken before the step wrote it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from streamkv.attention.backend import SeqSpan
from streamkv.policies.read import PagePlan, ReadCount, SpanSlots


WINDOW = 32  # the question's last rows whose queries choose the answer's pages (rescore false)


@dataclass
class Picks:
    """One sequence's remembered choice: its regions, the block table they were taken under
    (up to the tail) and, per layer, the picked positions and their sinks + pages slots."""

    plan: PagePlan
    table: tuple[int, ...]
    row: int = 0  # the context length of the row that took them: no earlier row reuses them
    layers: dict[int, torch.Tensor] = field(default_factory=dict)
    heads: dict[int, torch.Tensor] = field(default_factory=dict)
    # while the question's window scores the answer's candidates: per layer, each page's best
    # share so far, and the position up to which rows have scored (-1: the picks are taken)
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    scored_to: int = -1

    def add_window(self, layer: int, layers: int, share: torch.Tensor, last: bool) -> None:
        """Window rows' shares [rows, pages] in ``layer``; the question's ``last`` row takes the picks."""
        best = self.scores.get(layer)
        share = share.amax(dim=0)
        best = self.scores[layer] = share if best is None else torch.maximum(best, share)
        if last:
            self.layers[layer] = best.topk(self.plan.keep).indices.sort().values
            if len(self.layers) == layers:
                self.scores.clear()
                self.scored_to = -1


def is_question(span: SeqSpan) -> bool:
    """Rows of a question under a read policy (not yet the answer's, not a ring layout's)."""
    return span.read is not None and span.rows < 0 and span.start < span.num_prompt


def step_count(span: SeqSpan) -> ReadCount:
    """A span's read report for one step, before its layers count what they read: a question's
    rows count one step each (so the report does not depend on the chunking), other spans one."""
    if is_question(span):
        full = span.q_len * span.start + span.q_len * (span.q_len + 1) // 2  # row r reads start + r + 1
        return ReadCount(span.q_len, full, full)
    return ReadCount(1, span.ctx_len, span.ctx_len)


def question_plan(span: SeqSpan, block_size: int) -> PagePlan | None:
    """The question's plan (None: its rows read every page): rows from its first under the
    policy (``policy_from``; -1: this span's first) on are read whole, up to ``num_prompt``."""
    first = span.policy_from if 0 <= span.policy_from <= span.start else span.start
    return span.read.plan(first, span.num_prompt, block_size)


def window_picks(span: SeqSpan, plan: PagePlan, memory: dict[int, Picks]) -> Picks | None:
    """The answer's picks this question span's window rows score for (a policy without
    ``rescore`` whose plan picks pages), started afresh by the window's first row (and again
    when a recompute replays it)."""
    if span.read.rescore or plan.keep <= 0 or span.start + span.q_len <= span.num_prompt - WINDOW:
        return None
    picks = memory.get(span.seq_id)
    if picks is None or picks.scored_to < 0 or span.start < picks.scored_to:
        picks = memory[span.seq_id] = Picks(plan, tuple(span.block_table[:plan.tail]), span.num_prompt)
    picks.scored_to = span.start + span.q_len
    return picks


def remembered(span: SeqSpan, memory: dict[int, Picks]) -> Picks | None:
    """The picks an answer's rows reuse (a policy without ``rescore``), if taken already."""
    if span.read.rescore or span.start < span.num_prompt:
        return None
    picks = memory.get(span.seq_id)
    if picks is not None and (picks.scored_to >= 0 or span.start + 1 < picks.row):  # unfinished, or recomputed
        del memory[span.seq_id]                                  # (preempted, cut back): the replay picks again
        return None
    return picks


def fills(span: SeqSpan) -> bool:
    """Whether a span's picks are the ones its answer will reuse: a request's (whose question
    is exact) answer's first row's. (A session question's window takes them.)"""
    return not span.read.rescore and span.start >= span.num_prompt


def question_rows(span: SeqSpan, slots: SpanSlots, picked: torch.Tensor | None,
                  flat: torch.Tensor | None = None) -> tuple[list[SeqSpan], list[torch.Tensor]]:
    """One span per row of a question span, each with its own context slots: the sinks, its
    pages (``picked`` [rows, keep] positions, ascending; None: no page) and the tail up to its
    row; ``flat``: those slots already written back to back (a kernel's)."""
    bs, n = slots.block_size, span.q_len
    first = span.start - slots.tail_from + 1  # tail slots the span's first row reads
    if flat is not None:
        width = slots.sink_len + picked.shape[1] * bs
        out = list(flat.split([width + first + r for r in range(n)]))
    else:
        heads = slots.full[:slots.sink_len].expand(n, -1)
        if picked is not None and picked.numel():
            pages = slots.full[slots.sink_len:slots.tail_from].view(-1, bs)[picked].view(n, -1)  # [rows, keep * bs]
            heads = torch.cat([heads, pages], dim=1)
        tail = slots.full[slots.tail_from:]
        out = [torch.cat([heads[r], tail[:first + r]]) for r in range(n)]
    return [SeqSpan(span.q_start + r, 1, s.numel() - 1, span.block_table) for r, s in enumerate(out)], out
