"""Per-step page selection for spans with a read policy (see :mod:`streamkv.policies.read`).

Built once per step (it refreshes the page bounds every layer will score); per layer,
:meth:`LayerSelector.for_layer` ranks each selecting span's candidate pages with that
layer's queries and returns the spans with compacted context slots::

    span    start=700, blocks [b0 b1 | b2 b3 ... b40 | b41 b42 b43 b44], ctx 708
    layer l picks b5 b17 b30   ->  slots of [b0 b1 b5 b17 b30 b41 b42 b43 b44 (first 4 tokens)]
                                   start = 700 - (39 - 3) * block_size

The step's new rows stay in the (uncompacted) tail, so their slots and the causal order
among them are unchanged; skipped blocks only shift the compacted positions, which the
attention kernels never turn into RoPE angles (keys are cached after RoPE).

A question's rows (a session question's, under the policy before ``num_prompt``) each rank
the pages with their own query, in any chunking alike (:mod:`streamkv.attention.picks`), and
read as one span per row (inside the native layer loop too: :meth:`LayerSelector.fused`). Picks are remembered per sequence as page
*positions*, plus per layer the slots they resolve to, valid while the block table up to the
tail is unchanged (a swap moves slots): an answer row whose policy does not re-score reuses,
per layer, the pages the question's last rows chose together, or its first row's (a request,
whose prompt is exact), with the tail grown by the tokens decoded since.

A sequence in a write policy's layout (``span.rows`` >= 0, see ``streamkv.policies.write``)
has a fixed set of rows whose last ``window`` are a ring holding the newest tokens; its tail
is that whole ring (the new row is written somewhere inside it), so its plan is the same
every step, and the pages compete among the sinks and kept rows before it::

    rows    [ S S | K K K K K K K K K K K K | ring: w w w N w w w ]   N: this step's row
    read    [ S S |   K     K K       K     | w w w N w w w       ]
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from streamkv.attention.backend import KVCache, SeqSpan
from streamkv.attention.picks import (WINDOW, Picks, fills, is_question, question_plan, question_rows, remembered,
                                      window_picks)
from streamkv.policies.read import PagePlan, ReadCount, SpanSlots


RECALL_EVERY = 16  # decode rows at positions divisible by this measure, in one layer (rotating), the exact attention mass they read


@dataclass(frozen=True)
class _Choice:
    index: int                # the span's place in the step
    plan: PagePlan
    candidates: torch.Tensor  # [tail - sink] block ids, int64
    slots: SpanSlots          # the span's context slots and their regions
    picks: Picks | None       # reused (answer rows), or being filled (a request's first answer row), or None
    window: Picks | None = None  # a question span's: the answer's picks its window rows score for


@dataclass(frozen=True)
class FusedEntry:
    """One selecting span of a fused step (``native_layers.SkSelect``): its first query row,
    its choice, and the offset of its region in the step's flat slot buffer."""

    q_row: int
    choice: _Choice
    offset: int
    picked: torch.Tensor | None = None  # reused page positions [layers, keep] (None: re-scored)
    rows: int = 0                       # a question's rows, each picking its own pages (0: one decode row)
    first: int = 0                      # a question's: the tail slots its first row reads
    # a question's window rows' (the answer's) shares: [layers, rows in the window, pages] float32,
    # filled by the native loop (None: no row of the span is in the window)
    shares: torch.Tensor | None = None


@dataclass(frozen=True)
class FusedSelection:
    """A step whose selecting spans are all decode rows that re-score every layer or reuse the
    pages they picked for every layer, or session questions' rows (each ranking the pages with
    its own query), laid out for ``native/layer.c``'s ``streamkv_fwd_sel``: context lengths
    are known before the layers run (sinks + ``keep`` pages + tail), so one flat slot buffer
    serves every layer; each selecting span's region of it is rewritten per layer by the C
    selection, or from the reused page positions."""

    seqs: torch.Tensor                      # [B, 4] int64 (row0, q_len, offset, compacted ctx_len)
    slots: torch.Tensor                     # [sum ctx_len] int64 (selecting regions filled per layer)
    entries: list[FusedEntry]
    recall_layers: tuple[int, ...] = ()     # the layers whose queries the step hands back (ascending)
    # the rows measuring their recall: (layer, choice, row in the span), in the per-layer path's order
    sampled: list[tuple[int, _Choice, int]] = field(default_factory=list)


class LayerSelector:
    def __init__(self, spans: list[SeqSpan], slots: list[torch.Tensor], choices: list[_Choice], cache: KVCache,
                 scale: float) -> None:
        self.spans = spans
        self.slots = slots
        self.choices = choices
        self.cache = cache
        self.scale = scale
        self.counts: dict[int, ReadCount] = {}  # by sequence id: what its rows read this step
        self.layers = cache.k.shape[0]

    @classmethod
    def build(cls, spans: list[SeqSpan], slots: list[torch.Tensor], cache: KVCache, scale: float,
              memory: dict[int, Picks]) -> LayerSelector | None:
        """None when no span's policy leaves any page out this step; ``memory`` holds the
        remembered picks by sequence id (updated as layers pick)."""
        choices = []
        for i, span in enumerate(spans):
            if span.read is not None:
                c = (cls._question if is_question(span) else cls._choose)(i, span, slots[i], cache, memory)
                if c is not None:
                    choices.append(c)
        return cls(spans, slots, choices, cache, scale) if choices else None

    @staticmethod
    def _question(i: int, span: SeqSpan, slots: torch.Tensor, cache: KVCache, memory: dict[int, Picks]) -> _Choice | None:
        """A question span's plan and candidates (see :mod:`streamkv.attention.picks`)."""
        bs = cache.block_size
        plan = question_plan(span, bs)
        if plan is None:
            return None
        candidates = torch.tensor(span.block_table[plan.sink:plan.tail], dtype=torch.int64)
        if plan.keep > 0:
            cache.page_bounds().refresh(candidates)
        return _Choice(i, plan, candidates, SpanSlots(slots, plan.sink * bs, plan.tail * bs, bs), None,
                       window_picks(span, plan, memory))

    @staticmethod
    def _choose(i: int, span: SeqSpan, slots: torch.Tensor, cache: KVCache, memory: dict[int, Picks]) -> _Choice | None:
        """An answer span's regions and candidate pages (None: it reads every page); with its
        remembered picks when it reuses them, or new ones it fills when the answer will."""
        bs = cache.block_size
        picks = remembered(span, memory)
        plan = span.read.plan(span.read_from, span.ctx_len, bs) if picks is None or span.rows >= 0 else picks.plan
        if picks is not None and picks.plan != plan:  # the sequence entered its ring layout: pick again
            del memory[span.seq_id]
            picks = None
        if plan is None:
            return None
        if picks is not None and picks.table != span.block_table[:plan.tail]:
            picks.heads.clear()  # the blocks moved (swap): resolve the positions again
            picks.table = tuple(span.block_table[:plan.tail])
        candidates = torch.tensor(span.block_table[plan.sink:plan.tail], dtype=torch.int64)
        if picks is None and plan.keep > 0:
            cache.page_bounds().refresh(candidates)
            if fills(span):
                picks = memory[span.seq_id] = Picks(plan, tuple(span.block_table[:plan.tail]), span.ctx_len)
        return _Choice(i, plan, candidates, SpanSlots(slots, plan.sink * bs, plan.tail * bs, bs), picks)

    def fused(self) -> FusedSelection | None:
        """The whole step for the C layer loop, or None when a span needs this Python path (it
        fills its picks this step, picks no page or is a request's prompt chunk, or a row
        samples its recall in a layer past the 64th). Rows sampling their recall stay fused:
        the C loop hands back those layers' queries, and :meth:`after_fused` measures them."""
        if any((c.picks is not None and not self._reuses(c)) or c.plan.keep <= 0
               or not (self.spans[c.index].is_decode or is_question(self.spans[c.index])) for c in self.choices):
            return None
        sampled = sorted((layer, k, r) for k, c in enumerate(self.choices)  # the per-layer path's order
                         for r, layer in self._sampling_rows(self.spans[c.index]))
        if any(layer >= 64 for layer, _, _ in sampled):
            return None
        bs = self.cache.block_size
        selecting = {c.index: c for c in self.choices}
        rows, flat, entries, offset = [], [], [], 0
        for i, (span, s) in enumerate(zip(self.spans, self.slots)):
            c = selecting.get(i)
            if c is None:
                lengths = [s.numel()]
                flat.append(s)
            elif is_question(span):
                first = span.start - c.slots.tail_from + 1
                lengths = [c.slots.sink_len + c.plan.keep * bs + first + r for r in range(span.q_len)]
                window = span.q_len - self._window_skip(span) if c.window is not None else 0
                shares = torch.empty(self.layers, window, c.candidates.numel()) if window > 0 else None
                entries.append(FusedEntry(span.q_start, c, offset, rows=span.q_len, first=first, shares=shares))
                self._count_fused(span.seq_id, c, sum(lengths), scored=True, rows=span.q_len)
            else:
                lengths = [c.slots.sink_len + c.plan.keep * bs + s.numel() - c.slots.tail_from]
                picked = torch.stack([c.picks.layers[i] for i in range(self.layers)]) if c.picks is not None else None
                entries.append(FusedEntry(span.q_start, c, offset, picked))
                self._count_fused(span.seq_id, c, lengths[0], scored=picked is None)
            if c is not None:
                flat.append(torch.empty(sum(lengths), dtype=torch.int64))
            q_len = 1 if c is not None and is_question(span) else span.q_len  # a question: one span per row
            for r, length in enumerate(lengths):
                rows.append((span.q_start + r, q_len, offset, length))
                offset += length
        return FusedSelection(torch.tensor(rows, dtype=torch.int64), torch.cat(flat), entries,
                              tuple(sorted({layer for layer, _, _ in sampled})),
                              [(layer, self.choices[k], r) for layer, k, r in sampled])

    def _sampling_rows(self, span: SeqSpan) -> list[tuple[int, int]]:
        """(row in the span, layer) of each of its rows that measures its recall this step."""
        if is_question(span):
            return [(r, layer) for r in range(span.q_len)
                    if (layer := self._recall_layer_at(span.start + r)) is not None]
        layer = self._recall_layer(span)
        return [] if layer is None else [(0, layer)]

    def after_fused(self, fused: FusedSelection, q: torch.Tensor | None) -> None:
        """What the per-layer path does besides attention, after a fused step: the questions'
        window rows add their shares to the answer's picks (layer by layer), and the sampled
        rows measure their recall. q [len(fused.recall_layers), T, H, D] float32: those layers'
        queries after RoPE. Pages are picked again from them exactly as the layer picked them
        (same bounds, same scorer), so the per-layer path measures the same."""
        for e in fused.entries:
            span, c = self.spans[e.choice.index], e.choice
            if e.shares is not None:  # the question's window rows: the answer's picks
                for layer in range(self.layers):
                    c.window.add_window(layer, self.layers, e.shares[layer], span.start + e.rows == span.num_prompt)
        for layer, c, r in fused.sampled:
            span = self.spans[c.index]
            count = self.counts.get(span.seq_id)
            if count is None:
                continue
            ql = q[fused.recall_layers.index(layer)]
            if is_question(span):
                first = span.start - c.slots.tail_from + 1 + r
                row = ql[span.q_start + r:span.q_start + r + 1].view(1, self.cache.k.shape[2], -1, ql.shape[2])
                _, _, compact = span.read.rows_compact(row, self.cache.bounds.data[layer], c.candidates, c.plan.keep,
                                                       self.scale, c.slots, first)
                self._add_recall(count, layer, ql, span, c, compact, r)
            elif c.picks is not None:  # reused: the pages that layer read
                self._add_recall(count, layer, ql, span, c, c.slots.gather(c.picks.layers[layer]))
            else:
                self._add_recall(count, layer, ql, span, c, self._pick(layer, ql, span, c)[0])

    def _reuses(self, c: _Choice) -> bool:
        """Whether a span's remembered picks cover every layer (taken by an earlier step)."""
        return len(c.picks.layers) == self.layers

    def _count_fused(self, seq_id: int, c: _Choice, length: int, scored: bool, rows: int = 1) -> None:
        """What a fused span's ``rows`` rows read in every layer (``length`` slots in all, per layer)."""
        count = self.counts.get(seq_id)
        if count is not None:
            count.layer_rows += length * self.layers
            count.layers += self.layers
            count.pages_scored += c.candidates.numel() * rows * self.layers if scored else 0
            count.pages_picked += c.plan.keep * rows * self.layers

    def for_layer(self, layer: int, q: torch.Tensor) -> tuple[list[SeqSpan], list[torch.Tensor]]:
        """The step's spans and context slots with every selecting span compacted for
        ``layer``; q [T, H, D] are this layer's queries (after RoPE). A question span comes
        back as one span per row, each with its own pages."""
        spans, slots = list(self.spans), list(self.slots)
        rows: dict[int, tuple[list[SeqSpan], list[torch.Tensor]]] = {}
        for c in self.choices:
            span, tail = spans[c.index], c.slots.full[c.slots.tail_from:]
            if is_question(span):
                rows[c.index] = self._question_rows(layer, q, span, c)
                continue
            picked = c.picks.layers.get(layer) if c.picks is not None else None
            reused = picked is not None  # the pages the question's window chose (rescore false): nothing scored
            if reused:
                head = c.picks.heads.get(layer)
                if head is None:
                    head = c.picks.heads[layer] = c.slots.head(picked)
                compact = torch.cat([head, tail])
            else:
                compact, picked = self._pick(layer, q, span, c)
                if c.picks is not None:
                    c.picks.layers[layer] = picked
                    c.picks.heads[layer] = compact[:compact.numel() - tail.numel()]
            slots[c.index] = compact
            spans[c.index] = SeqSpan(span.q_start, span.q_len, compact.numel() - span.q_len, span.block_table)
            self._count(layer, q, span, c, compact, scored=not reused and c.plan.keep > 0)
        for i in sorted(rows, reverse=True):
            spans[i:i + 1], slots[i:i + 1] = rows[i]
        return spans, slots

    def _question_rows(self, layer: int, q: torch.Tensor, span: SeqSpan,
                       c: _Choice) -> tuple[list[SeqSpan], list[torch.Tensor]]:
        """A question span's rows (q [T, H, D]), each ranking the candidates with its own
        query; rows of the answer's window add their shares to its picks."""
        picked = flat = None
        if c.plan.keep > 0:
            n = span.q_len
            rows = q[span.q_start:span.q_start + n].view(n, self.cache.k.shape[2], -1, q.shape[2])
            first = span.start - c.slots.tail_from + 1                                 # tail slots row 0 reads
            share, picked, flat = span.read.rows_compact(rows, self.cache.bounds.data[layer], c.candidates,
                                                         c.plan.keep, self.scale, c.slots, first)
            if c.window is not None:
                c.window.add_window(layer, self.layers, share[self._window_skip(span):], span.start + n == span.num_prompt)
        out = question_rows(span, c.slots, picked, flat)
        count = self.counts.get(span.seq_id)
        if count is not None:  # each row counts as its own step (``picks.step_count``)
            count.layer_rows += sum(s.numel() for s in out[1])
            count.layers += 1
            count.pages_scored += c.candidates.numel() * span.q_len if c.plan.keep > 0 else 0
            count.pages_picked += c.plan.keep * span.q_len
            for r, compact in enumerate(out[1]):  # rows sample their recall as answer rows do
                if layer == self._recall_layer_at(span.start + r):
                    self._add_recall(count, layer, q, span, c, compact, r)
        return out

    @staticmethod
    def _window_skip(span: SeqSpan) -> int:
        """How many of a question span's rows come before the answer's window (its last rows)."""
        return max(0, span.num_prompt - WINDOW - span.start)

    def _count(self, layer: int, q: torch.Tensor, span: SeqSpan, c: _Choice, compact: torch.Tensor,
               scored: bool) -> None:
        count = self.counts.get(span.seq_id)
        if count is None:
            return
        count.layer_rows += compact.numel()
        count.layers += 1
        count.pages_scored += c.candidates.numel() if scored else 0  # keep 0 (recent) ranks nothing
        count.pages_picked += c.plan.keep
        if layer == self._recall_layer(span):
            self._add_recall(count, layer, q, span, c, compact)

    def _pick(self, layer: int, q: torch.Tensor, span: SeqSpan, c: _Choice) -> tuple[torch.Tensor, torch.Tensor]:
        """(compacted context slots, picked positions) of a selecting span in ``layer`` from that
        layer's queries q [T, H, D] (after RoPE)."""
        rows = q[span.q_start:span.q_start + span.q_len].view(span.q_len, self.cache.k.shape[2], -1, q.shape[2])
        bounds = self.cache.bounds.data[layer] if self.cache.bounds is not None else None
        return span.read.compact(rows, bounds, c.candidates, c.plan.keep, self.scale, c.slots)

    def _add_recall(self, count: ReadCount, layer: int, q: torch.Tensor, span: SeqSpan, c: _Choice,
                    compact: torch.Tensor, row: int | None = None) -> None:
        """The recall of a decode row, or of a question's row ``row`` (whose context ends at it),
        reading ``compact``."""
        full = c.slots.full if row is None else c.slots.full[:span.start + row + 1]
        count.recall_sum += self._recall(layer, q[span.q_start + (row or 0)], full, compact)
        count.recall_n += 1

    def _recall_layer(self, span: SeqSpan) -> int | None:
        """The layer in which this span's row measures its recall this step, if it samples:
        decode rows at positions divisible by RECALL_EVERY, in a layer that rotates with them."""
        return self._recall_layer_at(span.start) if span.is_decode else None

    def _recall_layer_at(self, position: int) -> int | None:
        """The layer in which a row at ``position`` measures its recall (one in RECALL_EVERY)."""
        if position > 0 and position % RECALL_EVERY == 0:
            return (position // RECALL_EVERY) % self.layers
        return None

    def _recall(self, layer: int, q: torch.Tensor, full: torch.Tensor, compact: torch.Tensor) -> float:
        """Share of the exact softmax mass (mean over heads) on the ``compact`` slots: q [H, D]."""
        kvh, dim = self.cache.k.shape[2:]
        qg = q.float().view(kvh, -1, dim)                                          # [Hkv, G, D]

        def lse(slots: torch.Tensor) -> torch.Tensor:
            k = self.cache.k[layer].index_select(0, slots).float()                # [n, Hkv, D]
            return torch.logsumexp(torch.einsum("hgd,nhd->hgn", qg, k) * self.scale, dim=-1)

        return float(torch.exp(lse(compact) - lse(full)).mean())
