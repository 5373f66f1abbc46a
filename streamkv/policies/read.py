"""Read-time KV policies: which pages of a sequence's cache each layer attends to.

A read policy keeps every token in the cache and bounds what one step *reads*: the first
``sink_tokens`` (attention sinks), the newest ``recent_tokens`` plus the step's own rows
(the tail), and, with :class:`QuestPolicy`, the best-scoring whole pages in between, up to
``budget_tokens`` in all. Per layer and per step::

    blocks  [ s s | c c c c c c c c c c c c c c c c | t t t ]
             sinks   candidates (full blocks, scored)   tail (always read; holds the new rows)
    read    [ s s |     c     c c         c         | t t t ]   ->  a compacted slot list

Keys are stored after RoPE, so skipping blocks changes no position: the compacted list is
attended exactly like a shorter sequence whose last rows are the step's queries.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

import torch

from streamkv.native import page_select, page_shares
from streamkv.policies.registry import build_policy, check_count


@dataclass(frozen=True)
class PagePlan:
    """Block-table indices of one span: ``[0, sink)`` always, ``[sink, tail)`` compete for
    ``keep`` places, ``[tail, end)`` always (``tail`` <= the block of the first new row)."""

    sink: int
    tail: int
    keep: int


@dataclass
class ReadCount:
    """What one sequence's rows read in one step (or, summed, over a request): context rows
    without the policy (``rows_full``), rows read averaged over layers (``rows_read``), pages
    scored and picked (summed over layers), and, on sampled steps, the share of the exact
    softmax mass the read rows hold (``recall_sum`` over ``recall_n`` layer samples)."""

    steps: int = 0
    rows_full: float = 0.0
    rows_read: float = 0.0
    pages_scored: int = 0
    pages_picked: int = 0
    recall_sum: float = 0.0
    recall_n: int = 0
    layer_rows: int = 0  # within a step: compacted rows summed over the layers that selected
    layers: int = 0

    def close(self) -> ReadCount:
        """This step's count with ``rows_read`` averaged over its layers."""
        if self.layers:
            self.rows_read = self.layer_rows / self.layers
        return self

    def add(self, other: ReadCount) -> None:
        self.steps += other.steps
        self.rows_full += other.rows_full
        self.rows_read += other.rows_read
        self.pages_scored += other.pages_scored
        self.pages_picked += other.pages_picked
        self.recall_sum += other.recall_sum
        self.recall_n += other.recall_n


@dataclass(frozen=True)
class SpanSlots:
    """One span's context slots ``full`` [ctx_len] int64: ``[0, sink_len)`` sinks, whole pages
    of ``block_size`` slots up to ``tail_from``, then the tail."""

    full: torch.Tensor
    sink_len: int
    tail_from: int
    block_size: int

    def head(self, picked: torch.Tensor) -> torch.Tensor:
        """The sinks and the pages at positions ``picked`` [keep] (ascending)."""
        pages = self.full[self.sink_len:self.tail_from].view(-1, self.block_size)
        return torch.cat([self.full[:self.sink_len], pages.index_select(0, picked).view(-1)])

    def gather(self, picked: torch.Tensor) -> torch.Tensor:
        """The sinks, the pages at positions ``picked`` [keep] (ascending), the tail."""
        return torch.cat([self.head(picked), self.full[self.tail_from:]])


@dataclass(frozen=True)
class ReadPolicy(ABC):
    """Hyper-parameters of one read policy; validated on construction (ValueError).

    ``rescore``: decode rows pick their own pages every step (Quest); by default they reuse,
    per layer, the pages the question's last rows chose together (``streamkv.attention.picks``;
    a request's: its first answer row's), as SnapKV uses the prompt's last window to choose for
    the whole answer.

    Template: :meth:`plan` decides the page regions from lengths alone (no tensors), then
    :meth:`compact` keeps the pages :meth:`select` ranks best with the subclass's
    :meth:`score_pages`.
    """

    name = ""
    sink_tokens: int = 64
    recent_tokens: int = 256
    rescore: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "rescore":
                if not isinstance(value, bool):
                    raise ValueError(f"kv_read {self.name}: rescore must be true or false, got {value!r}")
            else:
                check_count(f"kv_read {self.name}", f.name, value)

    def keep_pages(self, sink: int, tail: int, end: int, block_size: int) -> int:
        """How many candidate pages may be read besides the sinks and the tail."""
        return 0

    def scored_end(self, start: int, ctx_len: int, block_size: int) -> int:
        """The position where the pages :meth:`plan` scores (their bounds read before a step's
        writes) end: rows from it on may be written in the same step as rows that read under the
        plan; 0 when no page is scored."""
        plan = self.plan(start, ctx_len, block_size)
        return plan.tail * block_size if plan is not None and plan.keep > 0 else 0

    def plan(self, start: int, ctx_len: int, block_size: int) -> PagePlan | None:
        """Regions for rows ``[start, ctx_len)``; None when every page would be read anyway."""
        end = -(-ctx_len // block_size)
        sink = min(-(-self.sink_tokens // block_size), end)
        tail = max(sink, min(start, max(0, ctx_len - self.recent_tokens)) // block_size)
        keep = self.keep_pages(sink, tail, end, block_size)
        if keep >= tail - sink:
            return None
        return PagePlan(sink, tail, keep)

    def compact(self, q: torch.Tensor, bounds: torch.Tensor | None, candidates: torch.Tensor, keep: int,
                scale: float, slots: SpanSlots) -> tuple[torch.Tensor, torch.Tensor]:
        """The context slots one layer reads (sinks, the ``keep`` best pages, the tail; int64)
        and the picked positions [keep]. Arguments as in :meth:`select`."""
        picked = self.select(q, bounds, candidates, keep, scale)
        return slots.gather(picked), picked

    def select(self, q: torch.Tensor, bounds: torch.Tensor | None, candidates: torch.Tensor, keep: int,
               scale: float) -> torch.Tensor:
        """Positions (ascending) in ``candidates`` of the ``keep`` pages to read.

        ``q`` [rows, kv_heads, group, head_dim] (float32 or bfloat16): this span's query rows;
        ``bounds`` [blocks, kv_heads, 2 * head_dim] bfloat16: one layer's page bounds (per
        block, the channel-wise max then min of its keys); ``candidates`` [pages] int64 block
        ids; None only when ``keep`` is 0 (no page is scored). Returns int64 [keep].
        """
        if keep <= 0:
            return torch.empty(0, dtype=torch.int64)
        scores = self.score_pages(q, bounds.index_select(0, candidates), scale)
        return scores.topk(keep).indices.sort().values

    @abstractmethod
    def score_pages(self, q: torch.Tensor, bounds: torch.Tensor, scale: float) -> torch.Tensor:
        """Importance [pages] of each candidate page for these queries (higher reads first)."""

    def row_scores(self, q: torch.Tensor, bounds: torch.Tensor, candidates: torch.Tensor, scale: float) -> torch.Tensor:
        """Each row's own :meth:`score_pages` [rows, pages] of the ``candidates`` (``bounds``:
        one layer's, every block): a row's scores are the same bits whatever rows come with it
        (so choices made over rows do not depend on how they were chunked)."""
        picked = bounds.index_select(0, candidates)
        return torch.stack([self.score_pages(row[None], picked, scale) for row in q])

    def rows_compact(self, q: torch.Tensor, bounds: torch.Tensor, candidates: torch.Tensor, keep: int, scale: float,
                     slots: SpanSlots, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Each row's :meth:`row_scores` [rows, pages], its ``keep`` best pages [rows, keep]
        (ascending) and, where a kernel writes them, the rows' compacted slots back to back
        (row r: the sinks, its pages, the first ``first + r`` tail slots; None: the caller
        builds them)."""
        shares = self.row_scores(q, bounds, candidates, scale)
        return shares, shares.topk(keep, dim=-1).indices.sort(dim=-1).values, None

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.name, **asdict(self)}


@dataclass(frozen=True)
class RecentPolicy(ReadPolicy):
    """StreamingLLM-style reads: the sinks and the recent window only."""

    name = "recent"

    def score_pages(self, q: torch.Tensor, bounds: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.zeros(bounds.shape[0])


@dataclass(frozen=True)
class QuestPolicy(ReadPolicy):
    """Quest-style query-aware page selection (Tang et al., 2024), one choice per layer.

    A page's upper bound for query q is ``sum_d max(q_d * kmax_d, q_d * kmin_d)``, which is
    ``[q+ | q-] . [kmax | kmin]``: one batched matmul (the scaled split query is rounded to
    bfloat16 like the bounds, as the native kernel does). Every (row, head) turns its bounds
    into a softmax over pages; a page scores its best share over rows and heads, so the
    pages that any head of any row could attend to strongly are read.
    """

    name = "quest"
    budget_tokens: int = 1024

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget_tokens < self.sink_tokens + self.recent_tokens:
            raise ValueError(f"kv_read quest: budget_tokens ({self.budget_tokens}) must cover sink_tokens + recent_tokens "
                             f"({self.sink_tokens + self.recent_tokens})")

    def keep_pages(self, sink: int, tail: int, end: int, block_size: int) -> int:
        return max(0, self.budget_tokens // block_size - sink - (end - tail))

    def compact(self, q: torch.Tensor, bounds: torch.Tensor | None, candidates: torch.Tensor, keep: int,
                scale: float, slots: SpanSlots) -> tuple[torch.Tensor, torch.Tensor]:
        native = _native(q, bounds, keep)
        if native is None:
            return super().compact(q, bounds, candidates, keep, scale, slots)
        picked, compact = native(q, bounds, candidates, keep, scale, slots.full, slots.sink_len, slots.tail_from,
                                 slots.block_size)
        return compact, picked

    def select(self, q: torch.Tensor, bounds: torch.Tensor | None, candidates: torch.Tensor, keep: int,
               scale: float) -> torch.Tensor:
        native = _native(q, bounds, keep)
        if native is None:
            return super().select(q, bounds, candidates, keep, scale)
        return native(q, bounds, candidates, keep, scale)[0]

    def score_pages(self, q: torch.Tensor, bounds: torch.Tensor, scale: float) -> torch.Tensor:
        rows, kvh, group, dim = q.shape
        qk = q.permute(1, 0, 2, 3).reshape(kvh, rows * group, dim)
        qk = qk.float() * scale
        qq = torch.cat([qk.clamp(min=0), qk.clamp(max=0)], dim=-1).bfloat16().float()  # [kvh, rows*group, 2D]
        upper = torch.bmm(qq, bounds.float().permute(1, 2, 0))                          # [kvh, rows*group, pages]
        return torch.softmax(upper, dim=-1).amax(dim=(0, 1))

    def row_scores(self, q: torch.Tensor, bounds: torch.Tensor, candidates: torch.Tensor, scale: float) -> torch.Tensor:
        """:meth:`score_pages` row by row: in one C pass (``page_shares``, rows always in vector
        lanes), or one row at a time (a batched GEMM's rows can differ in the last bits with
        the batch: seen with 2 threads and 7-query groups), so the bits do not depend on the rows."""
        shares = page_shares() if q.device.type == "cpu" else None
        if shares is not None:
            return shares(q, bounds, candidates, scale)[0]
        return super().row_scores(q, bounds, candidates, scale)

    def rows_compact(self, q: torch.Tensor, bounds: torch.Tensor, candidates: torch.Tensor, keep: int, scale: float,
                     slots: SpanSlots, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        shares = page_shares() if q.device.type == "cpu" and keep > 0 else None
        if shares is None:
            return super().rows_compact(q, bounds, candidates, keep, scale, slots, first)
        return shares(q, bounds, candidates, scale, keep, slots.full, slots.sink_len, slots.tail_from, first,
                      slots.block_size)


def _native(q: torch.Tensor, bounds: torch.Tensor | None, keep: int) -> Callable[..., Any] | None:
    """The C scorer (``native/page_select.c``) when it applies, else None (torch path)."""
    if keep <= 0 or bounds is None or q.device.type != "cpu":
        return None
    return page_select()


READ_POLICIES: dict[str, Callable[..., ReadPolicy] | None] = {"quest": QuestPolicy, "recent": RecentPolicy, "none": None}


def make_read_policy(spec: ReadPolicy | dict[str, Any] | None) -> ReadPolicy | None:
    """A policy from ``{"policy": name, **hyper-parameters}`` (or one already built; ``none``:
    every page is read, which overrides a server default)."""
    if spec is None or isinstance(spec, ReadPolicy):
        return spec
    return build_policy("kv_read", READ_POLICIES, spec, "quest")


def request_read_spec(spec: Any) -> Any:
    """A request's ``kv_read`` object (its own, or the server's ``--kv-read`` default, alike): a
    ``quest`` without ``rescore`` re-scores every decode step (sessions' questions reuse their
    picks unless told otherwise)."""
    if isinstance(spec, dict) and spec.get("policy") == "quest" and "rescore" not in spec:
        return {**spec, "rescore": True}
    return spec
