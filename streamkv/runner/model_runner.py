"""Executes StepPlans: flattens every scheduled chunk into one varlen batch.

::

    plan:   seq A chunk (start 0, 5 tok) | seq B decode (start 40) | seq C decode (start 7)
    rows:   [a0 a1 a2 a3 a4][b40][c7]           input_ids / positions  [T = 7]
    logits: rows 4, 5, 6 (last row of every chunk that samples)
"""
from __future__ import annotations

import torch

from streamkv.attention.backend import AttentionBackend, SeqSpan
from streamkv.runner.kv_ops import KVOps
from streamkv.sampling.sampler import Sampler
from streamkv.sched.plan import StepOutput, StepPlan


class ModelRunner:
    """Owns the model, the attention backend (and so the KV tensors) and the sampler."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, sampler: Sampler,
                 device: torch.device | str = "cpu") -> None:
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.device = torch.device(device)
        self.kv_ops = KVOps(backend.cache, getattr(model, "rope", None))

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        self.sampler.release(plan.released)
        if plan.empty:
            return StepOutput()
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[int] = []
        sample_items = []
        for item in plan.seqs:
            q0 = len(ids)
            ids.extend(item.token_ids)
            positions.extend(range(item.start, item.start + item.num_tokens))
            spans.append(SeqSpan(q0, item.num_tokens, item.start, item.block_table))
            if item.sample:
                sample_rows.append(len(ids) - 1)
                sample_items.append(item)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        meta = self.backend.prepare(spans, len(ids))
        hidden = self.model(input_ids, pos, self.backend, meta)
        out = StepOutput()
        if sample_rows:
            rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            tokens, logprobs = self.sampler(logits, sample_items)
            out.tokens = {item.seq_id: tok for item, tok in zip(sample_items, tokens)}
            out.logprobs = logprobs
        return out
