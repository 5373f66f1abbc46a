"""Speculative decoding plug-ins: who drafts how many tokens this step.

A speculator proposes draft tokens for a decoding sequence; the runner computes the
sequence's last token and the drafts in one chunk and the sampler keeps the longest prefix of
drafts that equals what the sequence would have produced anyway (see ``Sampler.verify``)::

    tokens  ... t_{L-1}                    one decode step computes row L-1 only
    chunk       t_{L-1} d_0 d_1 d_2        a speculative step computes rows L-1 .. L+2
    sampled     s_0     s_1 s_2 s_3        s_i: the token the sequence draws at row L-1+i
    emitted     s_0 [s_1 if d_0 == s_0] [s_2 if also d_1 == s_1] ...

Invariant: ``num_computed`` only ever covers rows whose token was emitted; a rejected
draft's row is garbage past ``num_computed`` and is overwritten when that position is
computed again. With invariant numerics a chunk row computes exactly what a decode row
does, so the emitted tokens equal non-speculative decoding's, greedy or seeded.

The cap (:meth:`PromptLookup.cap`) shrinks drafts with load and with a sequence's running
acceptance rate: speculation costs rows, and rows are what a loaded step lacks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

from streamkv.sched.sequence import Sequence, SeqStatus


@dataclass
class SpecState:
    """Per sequence: an n-gram index of its tokens and its running acceptance rate."""

    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> where its continuation starts
    indexed: int = 0   # n-grams ending before this position are in ``index``
    rate: float = 0.5  # EMA of accepted / proposed drafts (a neutral prior: two misses stop it)
    idle_steps: int = 0  # steps since its last draft (a cooled-down sequence probes again)


@dataclass
class SpecStats:
    steps: int = 0      # speculative (sequence, step) pairs
    proposed: int = 0   # draft tokens verified
    accepted: int = 0   # draft tokens emitted
    cap: int = 0        # the load cap of the latest step (drafts per sequence)


class Speculator(ABC):
    """Drafts tokens for sequences; the scheduler calls :meth:`draft` in phase 1."""

    name: str

    @abstractmethod
    def draft(self, seq: Sequence, state: SpecState, limit: int) -> tuple[int, ...]:
        """At most ``limit`` draft tokens to follow ``seq.tokens`` (() for none)."""

    @abstractmethod
    def cap(self, num_decoders: int) -> int:
        """Most draft tokens per sequence in a step with ``num_decoders`` decoding sequences."""

    @abstractmethod
    def observe(self, state: SpecState, proposed: int, accepted: int) -> None:
        """A verified step: update the sequence's acceptance rate."""


@dataclass(frozen=True)
class PromptLookup(Speculator):
    """Prompt-lookup decoding: the sequence's last n-gram (``ngram_max`` down to
    ``ngram_min`` tokens) is looked up in its own earlier tokens (prompt + output); the
    tokens that followed its most recent earlier occurrence are the draft.

    Cap: ``draft_budget`` draft tokens per step are shared by the decoding sequences (at
    most ``max_draft`` each), so 1-2 decoders draft fully and past ``draft_budget`` decoders
    nobody drafts; a sequence whose acceptance EMA (weight ``ema``) falls below
    ``min_acceptance`` stops drafting, but probes with one draft every ``probe_every`` steps.
    """

    name = "pld"
    max_draft: int = 4
    ngram_max: int = 5
    ngram_min: int = 2
    draft_budget: int = 6
    min_acceptance: float = 0.3
    ema: float = 0.3
    probe_every: int = 16

    def __post_init__(self) -> None:
        if self.max_draft < 1:
            raise ValueError(f"spec_max_draft must be >= 1, got {self.max_draft}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= spec_ngram_min <= spec_ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.draft_budget < 0:
            raise ValueError(f"spec_draft_budget must be >= 0, got {self.draft_budget}")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"spec_min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if not 0.0 < self.ema <= 1.0 or self.probe_every < 1:
            raise ValueError("ema must be in (0, 1] and probe_every >= 1")

    def cap(self, num_decoders: int) -> int:
        return min(self.max_draft, self.draft_budget // max(1, num_decoders))

    def draft(self, seq: Sequence, state: SpecState, limit: int) -> tuple[int, ...]:
        tokens = seq.tokens
        if limit <= 0:
            return ()
        if len(tokens) < state.indexed:  # the tokens were cut (a stop string): index again
            state.index.clear()
            state.indexed = 0
        self._index(tokens, state)
        if state.rate < self.min_acceptance:
            state.idle_steps += 1
            if state.idle_steps < self.probe_every:
                return ()
            limit = min(limit, 1)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(tokens) <= n:
                continue
            start = state.index.get(tuple(tokens[-n:]))
            if start is not None:
                state.idle_steps = 0
                return tuple(tokens[start:start + limit])
        return ()

    def _index(self, tokens: list[int], state: SpecState) -> None:
        """Index every n-gram ending before the last token (each has a continuation)."""
        last = len(tokens) - 1
        for end in range(state.indexed, last):  # n-grams tokens[end-n+1 .. end]
            for n in range(self.ngram_min, self.ngram_max + 1):
                if end + 1 >= n:
                    state.index[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        state.indexed = max(state.indexed, last)

    def observe(self, state: SpecState, proposed: int, accepted: int) -> None:
        if proposed:
            state.rate += self.ema * (accepted / proposed - state.rate)


SPECULATORS: dict[str, Callable[..., Speculator]] = {"pld": PromptLookup}


def make_speculator(name: str, **params: object) -> Speculator | None:
    """``none`` -> None; otherwise the registered speculator with its hyper-parameters."""
    if name == "none":
        return None
    if name not in SPECULATORS:
        raise ValueError(f"speculation must be one of {['auto', 'none', *SPECULATORS]}, got {name!r}")
    return SPECULATORS[name](**params)


def speculable(seq: Sequence) -> bool:
    """A decoding sequence whose next tokens may be drafted: sampling without penalties,
    logprobs or banned stop ids (structured outputs may: ``Sampler.verify`` runs each row
    through the row's matcher), no KV policy, not a stream."""
    p = seq.params
    return (seq.status is SeqStatus.RUNNING and seq.samples and not seq.partial and not seq.swapped
            and seq.remaining == 1 and seq.layout is None and seq.write is None and seq.read is None
            and not seq.observe and not seq.keep_kv and p.logprobs is None
            and not p.needs_penalties and seq.num_output >= p.min_tokens)
