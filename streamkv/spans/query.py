"""One span query's book-keeping: its plan, task, usage, and what it holds until it ends."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from streamkv.sched.sequence import Sequence
from streamkv.spans.cache import State
from streamkv.spans.lower import PlusPlan, SpanPlan
from streamkv.spans.tasks import Task


@dataclass
class Usage:
    prompt_tokens: int = 0
    computed_tokens: int = 0
    reused_tokens: int = 0
    repositioned_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Query:
    request_id: str
    plan: SpanPlan
    priority: int
    blocks: int = 0  # the most KV blocks it may hold at once (admission)
    admitted: bool = False
    task: Task = field(init=False)
    usage: Usage = field(default_factory=Usage)
    inner: list[dict[str, str]] = field(default_factory=list)
    held: list[State] = field(default_factory=list)  # cache uses to release at the end
    private: list[Sequence] = field(default_factory=list)  # streams to close at the end
    internal: set[str] = field(default_factory=set)
    kept: list[Sequence] = field(default_factory=list)  # finished inner gens whose KV it takes over
    final: Sequence | None = None
    submitted: float = field(default_factory=time.perf_counter)
    stalled_steps: int = 0  # steps in a row its sequences found no block while nothing ran

    def seq_ids(self) -> set[int]:
        """Its pinned sequences: streams, inner gens (until it takes their KV over), the answer."""
        ids = {s.seq_id for s in self.private} | {s.seq_id for s in self.kept}
        return ids | ({self.final.seq_id} if self.final is not None else set())

    def report(self) -> dict[str, Any]:
        return {"usage": self.usage.as_dict(), "inner": list(self.inner), "submitted": self.submitted}


def held_rows(plan: SpanPlan) -> int:
    """KV rows a plan's states hold at once, at most: each piece's and the gen's once; a plus's
    operands each as their own states, and every operand after the first (the canonical order
    the execution keeps) again as its copy placed in the assembled stream. The states stay held
    until the query ends, so a fragment inside k nested plus nodes is held up to k + 1 times::

        plus(seq(y, plus(b, BIG)), ...)   BIG: its own state, the inner assembled copy,
                                          and the outer one's copy of seq(y, ...): 3 times
    """
    n = len(plan.gen.prompt) + plan.gen.params.max_tokens if plan.gen is not None else 0
    for seg in plan.segments:
        if isinstance(seg, PlusPlan):
            n += sum(held_rows(o) for o in seg.operands) + sum(o.max_len() for o in seg.operands[1:])
        else:
            n += len(seg.ids)
    return n


def forks(plan: SpanPlan) -> int:
    """Streams a plan creates (each fork may copy one partial block)."""
    n = len(plan.segments) + (2 if plan.gen is not None else 0)
    return n + sum(1 + sum(forks(o) for o in seg.operands) for seg in plan.segments if isinstance(seg, PlusPlan))
