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
            span = SeqSpan(q0, item.num_tokens, item.start, item.block_table, item.read, item.seq_id,
                           item.rows, item.write_row, item.ring_from, item.num_prompt,
                           item.read_from)
            for seen in (self.compressor.observe(item, q0), self.recent.observe(item, q0)):
                if seen is not None:
                    observe.append(seen)
            spans.append(span)
            decode = span.is_decode
            if decode:
                decode_rows.append(q0)
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
