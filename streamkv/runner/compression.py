"""Write-policy compression in the runner: observe the prompt's last queries, then move the kept rows.

For a plan item with ``write`` (see :class:`streamkv.sched.plan.ScheduledSeq`)::

    chunks        [ 0 ........ c1 | c1 ......... c2 | c2 ........... L ]
    observed                                    [ L - obs ......... L )   queries of every layer, kept
                                                                          here by position (a recompute
                                                                          rewrites the same rows)
    step reaching L:  picks = policy.select(q_obs[l], keys[l]) per layer
                      rows  = sinks | picks | last W      [layers, R, kv_heads] source tokens
                      table [ prompt blocks ............ | R-row blocks ]  <- those rows' slots, per (layer, head)

The scheduler then drops the prompt blocks from the table (``KVManager.compact``).
"""
from __future__ import annotations

import time

import torch

from streamkv.attention.backend import KVCache, Observation
from streamkv.attention.torch_ref import span_slots
from streamkv.sched.plan import ScheduledSeq


class Compressor:
    """Per-sequence observation buffers and the compaction of a prompt's rows."""

    def __init__(self, cache: KVCache, num_heads: int, scale: float) -> None:
        self.cache = cache
        self.num_heads = num_heads
        self.scale = scale
        self._observed: dict[int, torch.Tensor] = {}  # seq id -> [layers, obs, heads, head_dim] float32

    def release(self, seq_ids: list[int] | tuple[int, ...]) -> None:
        for sid in seq_ids:
            self._observed.pop(sid, None)

    def observe(self, item: ScheduledSeq, q_row: int) -> Observation | None:
        """What to keep of ``item``'s rows (its first row is row ``q_row`` of the step)."""
        policy, prompt = item.write, item.num_prompt
        if policy is None or not policy.observation or not policy.moves(prompt):
            return None
        first = prompt - policy.observation
        lo, hi = max(item.start, first), min(item.start + item.num_tokens, prompt)
        if hi <= lo:
            return None
        buf = self._observed.get(item.seq_id)
        if buf is None:
            layers, _, _, dim = self.cache.k.shape
            buf = self._observed[item.seq_id] = torch.empty(layers, policy.observation, self.num_heads, dim)
        return Observation(q_row + lo - item.start, hi - lo, lo - first, buf)

    @staticmethod
    def due(item: ScheduledSeq) -> bool:
        """This step's chunk reaches the write policy's point."""
        return item.write is not None and item.start + item.num_tokens == item.write.point(item.num_prompt)

    def compress(self, item: ScheduledSeq) -> float:
        """Move the rows ``item.write`` keeps of the first ``point`` tokens into the table's
        blocks after them (a prompt that fits: all of them, unchanged); returns the seconds
        taken (selection and move)."""
        t0 = time.perf_counter()
        policy, bs = item.write, self.cache.block_size
        point = policy.point(item.num_prompt)
        src = span_slots(item.block_table, point, bs, self.cache.k.device)
        first = -(-point // bs)
        dst = span_slots(item.block_table[first:], policy.capacity, bs, self.cache.k.device)
        layers, slots, kvh, dim = self.cache.k.shape
        if policy.budget and policy.moves(item.num_prompt):
            q = self._observed.pop(item.seq_id)
            blocks = torch.tensor(item.block_table[:first], dtype=torch.int64, device=self.cache.k.device)
            picks = torch.stack([policy.select(q[layer], self._keys(layer, blocks, point), self.scale)
                                 for layer in range(layers)])
        else:  # no middle, or all of it (the prompt fits)
            middle = torch.arange(policy.sink_tokens, policy.sink_tokens + policy.budget)
            picks = middle.view(1, 1, -1).expand(layers, kvh, -1)
        # kept row r of (layer l, head h) is token rows[l, r, h], in slot src[that]: only those rows
        # are read, as rows of the cache viewed [layers * slots * kv_heads, D]
        at = ((torch.arange(layers)[:, None, None] * slots + src[policy.rows(picks, point)]) * kvh
              + torch.arange(kvh)[None, None, :]).flatten()
        for c in (self.cache.k, self.cache.v):
            c.index_copy_(1, dst, c.view(-1, dim).index_select(0, at).view(layers, -1, kvh, dim))
        self.cache.written(dst)
        return time.perf_counter() - t0

    def _keys(self, layer: int, blocks: torch.Tensor, length: int) -> torch.Tensor:
        """Layer ``layer``'s keys of the first ``length`` tokens, whose blocks are ``blocks``:
        [length, kv_heads, D], gathered a block (not a row) at a time."""
        bs, (kvh, dim) = self.cache.block_size, self.cache.k.shape[2:]
        return self.cache.k[layer].view(-1, bs, kvh, dim).index_select(0, blocks).view(-1, kvh, dim)[:length]
