"""LRU cache of finished responses for stateless requests whose output is deterministic.

Key = (prompt token ids, SamplingParams). Only greedy requests (temperature 0) or requests
with an explicit ``seed`` are cached, and only outputs that finished normally (``stop`` or
``length``). A hit is answered at once, marked ``cached=True``, without model work.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Sequence

from streamkv.engine.outputs import RequestOutput
from streamkv.sampling.params import SamplingParams

Key = tuple[tuple[int, ...], SamplingParams]


class ResponseCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"response cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[Key, RequestOutput] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def cacheable(params: SamplingParams) -> bool:
        return params.temperature == 0 or params.seed is not None

    def key(self, ids: Sequence[int], params: SamplingParams) -> Key | None:
        if not self.capacity or not self.cacheable(params):
            return None
        return tuple(ids), params

    def get(self, key: Key | None, request_id: str, now: float) -> RequestOutput | None:
        if key is None:
            return None
        hit = self._entries.get(key)
        if hit is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return dataclasses.replace(
            hit, request_id=request_id, delta_text=hit.text, delta_token_ids=list(hit.token_ids),
            token_ids=list(hit.token_ids), prompt_token_ids=list(hit.prompt_token_ids), cached=True,
            logprobs=list(hit.logprobs) if hit.logprobs is not None else None, num_cached_tokens=len(key[0]),
            metrics={"arrival_time": now, "first_token_time": now, "finish_time": now, "num_preemptions": 0})

    def put(self, key: Key | None, out: RequestOutput) -> None:
        if key is None or out.error or out.finish_reason not in ("stop", "length"):
            return
        self._entries[key] = out
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
