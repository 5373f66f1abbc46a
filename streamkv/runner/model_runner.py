"""Executes StepPlans: flattens every scheduled chunk into one varlen batch.

::

    plan:   seq A chunk (start 0, 5 tok) | seq B decode (start 40) | seq C decode (start 7)
    rows:   [a0 a1 a2 a3 a4][b40][c7]           input_ids / positions  [T = 7]
    logits: rows 4, 5, 6 (last row of every chunk that samples)
"""
from __future__ import annotations

import torch

from streamkv.attention.backend import AttentionBackend, SeqSpan
from streamkv.models.q4_linear import DENSE, RowSplit
from streamkv.policies.read import ReadPolicy
from streamkv.runner.compression import Compressor
from streamkv.runner.kv_ops import KVOps
from streamkv.runner.recent_queries import RecentQueries
from streamkv.sampling.sampler import Sampler
from streamkv.sched.plan import ScheduledSeq, StepOutput, StepPlan


class ModelRunner:
    """Owns the model, the attention backend (and so the KV tensors) and the sampler."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, sampler: Sampler,
                 device: torch.device | str = "cpu") -> None:
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.grammars = sampler.guide.grammars  # structured outputs: the engine validates with them
        self.device = torch.device(device)
        self.kv_ops = KVOps(backend.cache, getattr(model, "rope", None))
        arch = getattr(model, "arch", None)
        heads = arch.num_heads if arch is not None else backend.cache.k.shape[2]
        self.compressor = Compressor(backend.cache, heads, backend.scale)
        layers, _, _, head_dim = backend.cache.k.shape
        self.recent = RecentQueries(layers, heads, head_dim, getattr(model, "rope", None), backend.scale)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        self.sampler.release(plan.released)
        self.backend.release(plan.released)
        self.compressor.release(plan.released)
        self.recent.release(plan.released)
        self.kv_ops.swap(plan.swap_out, plan.swap_in)
        if not plan.seqs:
            return StepOutput()
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[int] = []
        sample_items = []
        decode_rows: list[int] = []    # rows of single-token decode spans (their own kind, see RowSplit)
        decode_samples: list[int] = []  # their indices among the sampled rows
        observe = []
        spec: list[tuple[ScheduledSeq, int]] = []  # speculating items and their first sampled row
        for item in plan.seqs:
            q0 = len(ids)
            ids.extend(item.token_ids)
            positions.extend(range(item.start, item.start + item.num_tokens))
            for seen in (self.compressor.observe(item, q0), self.recent.observe(item, q0)):
                if seen is not None:
                    observe.append(seen)
            for span in item_spans(item, q0):
                spans.append(span)
                if span.is_decode:
                    decode_rows.append(span.q_start)
            decode = spans[-1].is_decode  # the kind of the row it samples
            if item.sample and item.draft:
                spec.append((item, len(ids) - len(item.draft) - 1))
            elif item.sample:
                if decode:
                    decode_samples.append(len(sample_rows))
                sample_rows.append(len(ids) - 1)
                sample_items.append(item)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        meta = self.backend.prepare(spans, len(ids), observe)
        q4_rows = getattr(self.model, "q4_max_rows", 0)
        step_split = RowSplit.build(decode_rows, len(ids), q4_rows)
        hidden = self.model(input_ids, pos, self.backend, meta, step_split)
        out = StepOutput()
        for item in plan.seqs:
            if self.compressor.due(item):
                out.compressed[item.seq_id] = self.compressor.compress(item)
        reads = getattr(meta, "reads", None)
        if reads:
            out.reads = self.backend.read_counts(meta)  # type: ignore[attr-defined]
        if sample_rows:
            rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
            # the sampled rows keep the kind they had in the step (all dense past q4_rows decodes)
            split = RowSplit.build(decode_samples, len(sample_rows), q4_rows) if step_split.q4 is not None else DENSE
            logits = self.model.compute_logits(hidden.index_select(0, rows), split)
            tokens, logprobs = self.sampler(logits, sample_items)
            out.tokens = {item.seq_id: tok for item, tok in zip(sample_items, tokens)}
            out.logprobs = logprobs
        if spec:  # one LM-head pass over every speculating row (invariant numerics: row by row alike)
            rows = torch.cat([torch.arange(row, row + len(item.draft) + 1) for item, row in spec])
            logits = self.model.compute_logits(hidden.index_select(0, rows.to(self.device)), DENSE)
            at = 0
            for item, _ in spec:
                n = len(item.draft) + 1
                out.drafts[item.seq_id] = self.sampler.verify(logits[at:at + n], item)
                at += n
        return out


def item_spans(item: ScheduledSeq, q0: int) -> list[SeqSpan]:
    """The attention spans of ``item``'s rows, from batch row ``q0``: one, or two when its
    chunk reaches its read policy's first row (``read_from``) from before it, as a session
    question's does (its scaffold's exact rows, then its own under the policy)::

        rows   [ start ... read_from-1 | read_from ... end-1 ]
        span     exact (read None)       under item.read

    Each is the span a step holding only its rows would build, so the rows compute alike
    whether or not one step holds both."""
    cut = item.read_from - item.start if item.read is not None and item.rows < 0 else 0

    def span(q: int, n: int, start: int, read: ReadPolicy | None) -> SeqSpan:
        return SeqSpan(q, n, start, item.block_table, read, item.seq_id, item.rows, item.write_row,
                       item.ring_from, item.num_prompt, item.read_from)

    if 0 < cut < item.num_tokens:
        return [span(q0, cut, item.start, None), span(q0 + cut, item.num_tokens - cut, item.read_from, item.read)]
    return [span(q0, item.num_tokens, item.start, item.read)]
