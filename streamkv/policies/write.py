"""Write-time KV policies: what a sequence keeps of its KV, so memory really comes back.

Once the prompt (``L`` tokens) is prefilled, a write policy keeps three parts and the
sequence's other blocks return to the pool::

    prompt rows   [ s s | m m m m m m m m m m m m m m m m m m m m | w w w w ]   L rows
    kept rows     [ s s | m     m m       m   m   (top budget)     | w w w w ]   R = S + K + W rows
                   sinks  per (layer, kv head): that head's own picks  ring of the W newest

    decode token i (>= L) overwrites ring row  S + K + (i - (L - W)) % W   (the oldest)

Keys keep their RoPE positions (they are cached after RoPE); new tokens take positions
``L, L + 1, ...``. A row may hold different tokens in different (layer, kv head) pairs:
attention never asks which token a row was, only for its key and value.

A prompt that already fits (``L <= S + K + W``) is not compressed; the ring starts when the
sequence reaches ``S + K + W`` rows (:meth:`WritePolicy.point`), its rows copied unchanged
into fresh blocks first: the ring never writes into a block the prefix cache or another
sequence reads. Either way a sequence never holds more than ``ceil((S + K + W) /
block_size)`` blocks afterwards.
"""
from __future__ import annotations

import math
from abc import ABC
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

import torch
import torch.nn.functional as F

from streamkv.policies.registry import build_policy, check_count

MAX_POOL_KERNEL = 127  # SnapKV pools over 5-13 keys; the pooling runs on the engine thread (k=1023: 0.6 s at 8k)


@dataclass(frozen=True)
class KVLayout:
    """Where a compressed sequence's tokens live (tensor-free; ``rows`` = S + K + W)."""

    at: int      # the tokens [0, at) were compressed (the prompt); later ones go through the ring
    sink: int
    kept: int
    window: int

    @property
    def rows(self) -> int:
        return self.sink + self.kept + self.window

    @property
    def ring_from(self) -> int:
        """First row of the ring (the ``window`` newest tokens)."""
        return self.sink + self.kept

    def row(self, index: int) -> int:
        """Cache row that token ``index`` (>= ``at``) is written to."""
        return self.sink + self.kept + (index - (self.at - self.window)) % self.window


@dataclass(frozen=True)
class WritePolicy(ABC):
    """Hyper-parameters of one write policy; validated on construction (ValueError).

    Template: :meth:`point` says (from lengths alone) when a sequence is compressed and
    :meth:`select` picks the middle tokens each (layer, kv head) keeps. A new policy is one
    subclass and a line in :data:`WRITE_POLICIES`.
    """

    name = ""
    sink_tokens: int = 64
    window_tokens: int = 512

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int):
                check_count(f"kv_write {self.name}", f.name, value)
        if self.window_tokens < 1:
            raise ValueError(f"kv_write {self.name}: window_tokens must be >= 1 (the ring holds each new token)")

    @property
    def budget(self) -> int:
        """Middle tokens kept per (layer, kv head)."""
        return 0

    @property
    def observation(self) -> int:
        """Trailing prompt rows whose queries :meth:`select` needs (0: none)."""
        return 0

    @property
    def capacity(self) -> int:
        return self.sink_tokens + self.budget + self.window_tokens

    def point(self, prompt_len: int) -> int:
        """Token count at which a sequence with this prompt length switches to its layout."""
        return max(prompt_len, self.capacity)

    def layout(self, prompt_len: int) -> KVLayout:
        return KVLayout(self.point(prompt_len), self.sink_tokens, self.budget, self.window_tokens)

    def layout_blocks(self, block_size: int) -> int:
        """Blocks of the layout itself: the kept rows copied into fresh blocks at the point."""
        return -(-self.capacity // block_size)

    def moves(self, prompt_len: int) -> bool:
        """Whether reaching the layout drops rows (the prompt is longer than the capacity)."""
        return prompt_len > self.capacity

    def observed_from(self, prompt_len: int) -> int:
        """First prompt row whose queries :meth:`select` needs (``prompt_len``: none): a row
        computed before the policy applied (a streamed input) is computed again from there."""
        return prompt_len - self.observation if self.observation and self.moves(prompt_len) else prompt_len

    def select(self, q: torch.Tensor | None, keys: torch.Tensor, scale: float) -> torch.Tensor:
        """Middle tokens kept by one layer: [kv_heads, budget] int64, ascending, in ``[sink, L - window)``.

        ``q`` [observation, heads, head_dim] float32: the layer's queries (after RoPE) of the
        prompt's last rows; ``keys`` [L, kv_heads, head_dim]: the layer's cached keys.
        """
        return torch.empty(keys.shape[1], 0, dtype=torch.int64)

    def rows(self, picks: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Source token of every kept row: [layers, R, kv_heads] int64 from ``picks`` [layers, kv_heads, K]."""
        layers, kvh, _ = picks.shape
        sink = torch.arange(self.sink_tokens).view(1, -1, 1).expand(layers, -1, kvh)
        tail = torch.arange(prompt_len - self.window_tokens, prompt_len).view(1, -1, 1).expand(layers, -1, kvh)
        return torch.cat([sink, picks.transpose(1, 2), tail], dim=1)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.name, **asdict(self)}


@dataclass(frozen=True)
class StreamingLLMPolicy(WritePolicy):
    """StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention
    Sinks"): the first tokens and a recent window, nothing in between."""

    name = "streaming_llm"


@dataclass(frozen=True)
class SnapStreamPolicy(WritePolicy):
    """SnapStream (Li et al., 2025): SnapKV selection (Li et al., 2024, "SnapKV: LLM Knows What
    You are Looking for Before Generation") of the prompt's middle, plus attention sinks and a
    ring buffer of recent tokens, so a sequence's KV stays constant under continuous batching.

    Score of middle token j for kv head h: the softmax attention of the last
    ``observation_tokens`` prompt rows, averaged over those rows (a constant multiple of their
    sum: the same ranking), pooled over ``pool_kernel`` neighbours (``pooling`` max, as
    specified; ``avg`` is kvpress's and the SnapKV repository's default), averaged over the
    query heads sharing h. Each (layer, kv head) keeps its own top ``budget_tokens``: heads
    attend to different tokens, and per-head picks are what SnapKV and kvpress do.
    """

    name = "snapstream"
    budget_tokens: int = 1024
    observation_tokens: int = 32
    pool_kernel: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"kv_write snapstream: pooling must be 'max' or 'avg', got {self.pooling!r}")
        if self.observation_tokens < 1:
            raise ValueError("kv_write snapstream: observation_tokens must be >= 1")
        if not 1 <= self.pool_kernel <= MAX_POOL_KERNEL or self.pool_kernel % 2 == 0:
            raise ValueError(f"kv_write snapstream: pool_kernel must be odd, in [1, {MAX_POOL_KERNEL}], "
                             f"got {self.pool_kernel}")
        if self.window_tokens < self.observation_tokens:
            raise ValueError(f"kv_write snapstream: window_tokens ({self.window_tokens}) must be >= observation_tokens "
                             f"({self.observation_tokens}): the observed rows are the newest and stay in the window")

    @property
    def budget(self) -> int:
        return self.budget_tokens

    @property
    def observation(self) -> int:
        return self.observation_tokens

    def select(self, q: torch.Tensor | None, keys: torch.Tensor, scale: float) -> torch.Tensor:
        scores = self.scores(q, keys, scale)[:, self.sink_tokens:keys.shape[0] - self.window_tokens]
        return scores.topk(self.budget_tokens, dim=-1).indices.sort(dim=-1).values + self.sink_tokens

    def scores(self, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
        """SnapKV scores [kv_heads, L - observation] of the keys before the observed rows.

        The arithmetic is kvpress's ``SnapKVPress``'s (the same [obs, D] x [D, L] product per head,
        the same softmax), so with ``pooling="avg"`` the scores are its bits, not just its ranking. Where
        kvpress adds a full [H, obs, L] causal mask, zeros everywhere but the last ``obs``
        columns, the mask is added to those columns only (x + 0 is x), and the products are
        scaled in place: the same bits, without three passes over the [H, obs, L] scores.
        ``tests/test_kv_write.py`` checks the bits against kvpress on the CPU it runs on.
        """
        obs, heads, dim = q.shape
        length, kvh, _ = keys.shape
        group, root = heads // kvh, math.sqrt(dim)
        # kvpress divides the products by sqrt(dim); where that is a power of two (dim 64: 8) the
        # queries are divided instead, exactly: scaling by 2^-n commutes with every rounding
        # (outside subnormals, which softmax maps to the same bits anyway)
        by_root = abs(scale * root - 1) < 1e-9
        pre = by_root and root == 2 ** round(math.log2(root))
        qs = q.float().view(obs, kvh, group, dim).permute(1, 2, 0, 3).contiguous()  # [kvh, group, obs, D]
        if pre:
            qs.div_(root)
        kt = torch.empty(kvh, length, dim).copy_(keys.permute(1, 0, 2)).transpose(1, 2)  # [kvh, D, L]
        # kvpress's one batched matmul over the keys repeated per query head, as one batched
        # matmul (the same routine) of one head at a time, of the same shape ([obs, D] x [D, L]):
        # the same products, without the repeated keys, and each GEMM split over every thread
        # (a batch of 9 is not, over 2)
        attn = torch.empty(1, heads, obs, length)
        for head in range(heads):
            torch.bmm(qs[head // group, head % group][None], kt[head // group][None], out=attn[:, head])
        if by_root and not pre:
            attn.div_(root)
        elif not by_root:
            attn.mul_(scale)
        attn[..., length - obs:].add_(torch.triu(torch.full((obs, obs), float("-inf")), diagonal=1))  # causal
        attn = torch.softmax(attn, dim=-1, dtype=torch.float32)[..., :-obs]
        scores = attn.mean(dim=-2)
        pad = self.pool_kernel // 2
        if self.pooling == "avg":
            scores = F.avg_pool1d(scores, kernel_size=self.pool_kernel, padding=pad, stride=1)
        else:
            scores = F.max_pool1d(scores, kernel_size=self.pool_kernel, padding=pad, stride=1)
        return scores.view(1, kvh, group, length - obs).mean(2)[0]

    def rank_span(self, q: torch.Tensor, keys: torch.Tensor, start: int, count: int, keep: int,
                  scale: float) -> torch.Tensor:
        """Offsets (ascending int64 [keep]) of the tokens ``[start, start + count)`` a session keeps.

        ``q`` [layers, obs, heads, head_dim]: the queries of the stream's last ``obs`` rows (its
        newest records); ``keys`` [layers, L, kv_heads, head_dim]. One choice for every layer and
        kv head: a session stream is a sequence of token ids that forks, snapshots and offload
        address (per-head picks would give each row a different token per head). A token's score
        is its SnapKV score (:meth:`scores`) averaged over layers and kv heads; the observed rows
        themselves, if they fall in the span, always stay.
        """
        obs = q.shape[1]
        total = torch.stack([self.scores(q[layer], keys[layer], scale).mean(0) for layer in range(q.shape[0])]).mean(0)
        total = torch.cat([total, torch.full((obs,), float("inf"))])                  # [L]
        span = total[start:start + count]
        return span.topk(keep).indices.sort().values if keep < count else torch.arange(count)


WRITE_POLICIES: dict[str, Callable[..., WritePolicy] | None] = {
    "snapstream": SnapStreamPolicy, "streaming_llm": StreamingLLMPolicy, "none": None}


def make_write_policy(spec: WritePolicy | dict[str, Any] | None) -> WritePolicy | None:
    """A policy from ``{"policy": name, **hyper-parameters}`` (``none``: no compression)."""
    if spec is None or isinstance(spec, WritePolicy):
        return spec
    return build_policy("kv_write", WRITE_POLICIES, spec, "snapstream")
