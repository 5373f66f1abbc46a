"""Per-request sampling parameters (validated on construction)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Sequence

from streamkv.errors import InvalidRequestError
from streamkv.sampling.grammar import GuidedSpec

MAX_LOGPROBS = 20


def prompt_seed(ids: Sequence[int]) -> int:
    """FNV-1a (64-bit) over the prompt's token ids, each as 4 little-endian bytes."""
    h = 0xCBF29CE484222325
    for t in ids:
        for b in int(t).to_bytes(4, "little", signed=False):
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def _check(cond: bool, msg: str, param: str | None = None) -> None:
    """InvalidRequestError(``msg``) unless ``cond``; its ``param`` is ``param`` or the field the
    message starts with (the 400 body's ``param``)."""
    if not cond:
        head = msg.split(maxsplit=1)[0] if msg else ""
        raise InvalidRequestError(msg, param=param or (head if head in _FIELDS else None))


def _int(value: object) -> bool:
    """An integer, and not a bool (JSON's true would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its output.

    ``temperature == 0`` is greedy decoding. ``seed`` makes random sampling reproducible
    regardless of which other requests share the batch. ``logprobs`` (0..20) asks for the
    sampled token's log-probability plus that many top alternatives per position.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    guided: GuidedSpec | None = None  # structured output: the output must match it (xgrammar masks)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        _check(isinstance(self.stop, (tuple, list)), f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        _check(isinstance(self.stop_token_ids, (tuple, list)) and all(_int(t) for t in self.stop_token_ids),
               f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        _check(_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool)
                   and (isinstance(value, int) or math.isfinite(value)),  # isfinite overflows on ints > 1.8e308
                   f"{name} must be a finite number, got {value!r}")
        _check(0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
               f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(0.0 < self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        _check(self.seed is None or (_int(self.seed) and -(2 ** 63) <= self.seed < 2 ** 64),
               f"seed must be an integer in the 64-bit range, got {self.seed!r}")
        _check(self.logprobs is None or (_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(len(self.stop) <= 16, f"at most 16 stop strings, got {len(self.stop)}", param="stop")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative")
        _check(self.guided is None or isinstance(self.guided, GuidedSpec), "guided must be a GuidedSpec")
        _check(self.guided is None or not self.ignore_eos,
               "ignore_eos cannot be combined with a structured output (it ends where its grammar ends)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def deterministic(self) -> bool:
        """Output depends only on the prompt and these parameters."""
        return self.greedy or self.seed is not None


_FIELDS = frozenset(f.name for f in fields(SamplingParams))
