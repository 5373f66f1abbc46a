"""A dense, independent reference for sessions: Hugging Face ``transformers`` with a plain
(unpaged) cache that the test edits by hand: append = forward, evict = drop a range and
rotate the later keys by the offset (RoPE composes), query = forward on a copy."""
from __future__ import annotations

import copy
from typing import Any

import torch


def rotate_keys(k: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """k [B, H, S, D] (rotate-half layout) rotated by ``delta`` positions."""
    ang = delta * inv_freq.double()
    cos = torch.cat([ang.cos(), ang.cos()]).to(k.dtype)
    sin = torch.cat([ang.sin(), ang.sin()]).to(k.dtype)
    half = k.shape[-1] // 2
    rot = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return k * cos + rot * sin


class DenseSession:
    def __init__(self, hf: Any, inv_freq: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.hf = hf
        self.inv_freq = inv_freq
        self.cache = DynamicCache(config=hf.config)
        self.length = 0

    @torch.inference_mode()
    def append(self, ids: list[int]) -> torch.Tensor:
        pos = torch.arange(self.length, self.length + len(ids)).unsqueeze(0)
        out = self.hf(torch.tensor([ids]), past_key_values=self.cache, position_ids=pos, use_cache=True)
        self.length += len(ids)
        return out.logits[0, -1].float()

    def evict(self, start: int, count: int) -> None:
        for layer in self.cache.layers:
            k, v = layer.keys, layer.values
            moved = rotate_keys(k[:, :, start + count:], -count, self.inv_freq)
            layer.keys = torch.cat([k[:, :, :start], moved], dim=2)
            layer.values = torch.cat([v[:, :, :start], v[:, :, start + count:]], dim=2)
        self.length -= count

    @torch.inference_mode()
    def answer(self, ids: list[int], max_tokens: int, stop: set[int]) -> tuple[list[int], torch.Tensor]:
        """Greedy answer to ``ids`` on a copy of the cache; also the first-token logits."""
        fork = copy.copy(self)
        fork.cache = copy.deepcopy(self.cache)
        logits = fork.append(ids)
        first = logits
        out: list[int] = []
        for _ in range(max_tokens):
            tok = int(logits.argmax())
            out.append(tok)
            if tok in stop:
                break
            logits = fork.append([tok])
        return out, first
