"""A dense, independent reference for sessions: Hugging Face ``transformers`` with a plain
(unpaged) cache that the test edits by hand: append = forward, evict = drop a range (keeping
chosen tokens) and rotate the later keys by the offset (RoPE composes), query = forward on a
copy. With ``observe`` it also keeps the queries (after RoPE) of its newest rows, taken from
transformers' own ``apply_rotary_pos_emb`` as each layer calls it."""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch


def rotate_keys(k: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """k [B, H, S, D] (rotate-half layout) rotated by ``delta`` positions (one, or [S])."""
    ang = torch.as_tensor(delta, dtype=torch.float64).reshape(-1, 1) * inv_freq.double()  # [1 or S, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(k.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(k.dtype)
    half = k.shape[-1] // 2
    rot = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return k * cos + rot * sin


def tiny_pair(kind: str, tmp_path_factory: Any) -> tuple[Any, Any]:
    """A tiny random ``kind`` checkpoint as (transformers model, float32 streamkv LLM with 4-token
    blocks and a 64-token step budget, so ingestion is chunked and evictions cross blocks)."""
    from transformers import AutoModelForCausalLM

    from streamkv import LLM
    from tests.tiny_checkpoints import make_tiny_hf_checkpoint

    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(kind), kind, max_position_embeddings=512)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, LLM(model=str(path), dtype="float32", num_blocks=256, block_size=4, max_num_batched_tokens=64)


class DenseSession:
    def __init__(self, hf: Any, inv_freq: torch.Tensor, observe: int = 0) -> None:
        from transformers import DynamicCache

        self.hf = hf
        self.inv_freq = inv_freq
        self.cache = DynamicCache(config=hf.config)
        self.length = 0
        self.observe = observe
        self.queries: torch.Tensor | None = None  # [layers, <= observe, heads, D] of the newest rows

    @torch.inference_mode()
    def append(self, ids: list[int]) -> torch.Tensor:
        pos = torch.arange(self.length, self.length + len(ids)).unsqueeze(0)
        with _capture_queries(self.hf) as seen:
            out = self.hf(torch.tensor([ids]), past_key_values=self.cache, position_ids=pos, use_cache=True)
        if self.observe and seen:
            new = torch.stack([q[0].transpose(0, 1).float() for q in seen])  # [layers, S, heads, D]
            rows = new if self.queries is None else torch.cat([self.queries, new], dim=1)
            self.queries = rows[:, -self.observe:]
        self.length += len(ids)
        return out.logits[0, -1].float()

    def evict(self, start: int, count: int, keep: list[int] | tuple[int, ...] = ()) -> None:
        """Drop rows ``[start, start+count)`` but the offsets ``keep``; later rows move down."""
        kept = torch.tensor([start + i for i in keep], dtype=torch.int64)
        tail = torch.arange(start + count, self.length)
        src = torch.cat([kept, tail])
        delta = torch.arange(start, start + src.numel()) - src
        for layer in self.cache.layers:
            k, v = layer.keys, layer.values
            layer.keys = torch.cat([k[:, :, :start], rotate_keys(k[:, :, src], delta, self.inv_freq)], dim=2)
            layer.values = torch.cat([v[:, :, :start], v[:, :, src]], dim=2)
        if self.queries is not None:  # the newest rows: the tail's last (or kept ones)
            n = self.queries.shape[1]
            q = self.queries.permute(0, 2, 1, 3)  # [layers, heads, n, D]
            self.queries = rotate_keys(q, delta[-n:], self.inv_freq).permute(0, 2, 1, 3)
        self.length -= count - len(keep)

    def keys(self) -> list[torch.Tensor]:
        """Per layer: the cached keys [L, kv_heads, D]."""
        return [layer.keys[0].transpose(0, 1).float() for layer in self.cache.layers]

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


@contextlib.contextmanager
def _capture_queries(hf: Any) -> Iterator[list[torch.Tensor]]:
    """Record the queries each attention layer rotates (transformers' ``apply_rotary_pos_emb``)."""
    import importlib

    seen: list[torch.Tensor] = []
    module = importlib.import_module(type(hf.model.layers[0].self_attn).__module__)
    original = module.apply_rotary_pos_emb

    def spy(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = original(q, k, *args, **kwargs)
        seen.append(out[0])
        return out

    module.apply_rotary_pos_emb = spy
    try:
        yield seen
    finally:
        module.apply_rotary_pos_emb = original
