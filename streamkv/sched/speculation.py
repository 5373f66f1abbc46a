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

import numpy as np

from streamkv.kv.manager import KVManager
from streamkv.sched.sequence import Sequence, SeqStatus


@dataclass
class SpecState:
    """Per sequence: its tokens as an array (searched for n-grams) and its running acceptance rate."""

    history: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # tokens[:known], spare room after
    known: int = 0     # tokens copied into ``history``
    rate: float = 0.5  # EMA of accepted / proposed drafts (a neutral prior: two misses stop it)
    idle_steps: int = 0  # steps since its last draft (a cooled-down sequence probes again)

    def tokens(self, tokens: list[int]) -> np.ndarray:
        """``tokens`` as an int64 array [len(tokens)]: only the new tail is copied (the whole list
        again when it was cut, e.g. by a stop string); the buffer doubles when full."""
        n = len(tokens)
        if n < self.known:
            self.known = 0
        if n > self.history.size:
            grown = np.empty(max(2 * self.history.size, n + 64), dtype=np.int64)
            grown[:self.known] = self.history[:self.known]
            self.history = grown
        if n > self.known:
            self.history[self.known:n] = tokens[self.known:n]
            self.known = n
        return self.history[:n]


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
        if state.rate < self.min_acceptance:
            state.idle_steps += 1
            if state.idle_steps < self.probe_every:
                return ()
            limit = min(limit, 1)
        start = self._continuation(state.tokens(tokens))
        if start is None:
            return ()
        state.idle_steps = 0
        return tuple(tokens[start:start + limit])

    def _continuation(self, a: np.ndarray) -> int | None:
        """Where the continuation of the longest (``ngram_max`` .. ``ngram_min`` tokens) n-gram
        ending ``a`` starts, at its most recent earlier occurrence (one that ends before the last
        token), or None. ``ends`` holds the end positions e < L - 1 whose n tokens up to e equal
        the last n; it shrinks as n grows (one O(L) comparison, then candidates only), so a long
        context costs no per-token index in Python."""
        last = a.size - 1
        if last < 1:
            return None
        ends = np.flatnonzero(a[:last] == a[last])
        best = None
        for n in range(1, self.ngram_max + 1):
            if ends.size == 0:
                break
            if n >= self.ngram_min:
                best = int(ends[-1]) + 1
            if n == self.ngram_max or last - n < 0:
                break
            ends = ends[ends >= n]
            ends = ends[a[ends - n] == a[last - n]]
        return best

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


class Drafting:
    """``Scheduler``'s speculation half of phase 1: the step's draft cap and each decoding
    sequence's drafts (the verified tokens come back through :class:`StepUpdates`)."""

    kv: KVManager
    speculator: Speculator | None
    spec_states: dict[int, SpecState]
    spec_stats: SpecStats

    def _spec_cap(self, ranked: list[Sequence]) -> int:
        """Drafts per sequence this step (0: no speculation), from the number of decoders."""
        if self.speculator is None:
            return 0
        decoders = sum(1 for s in ranked if s.status is SeqStatus.RUNNING and s.remaining == 1 and s.samples)
        self.spec_stats.cap = self.speculator.cap(decoders)
        return self.spec_stats.cap

    def _draft(self, seq: Sequence, limit: int, crowded: bool) -> tuple[int, ...]:
        """Draft tokens for a decoding ``seq``: within the step budget, its max_tokens and
        max_len (every emitted token must fit), and only for plain sampling. ``crowded`` (a
        sequence waits for admission): only within the blocks it already holds, so drafts
        never take a block someone waiting needs."""
        if self.speculator is None or not speculable(seq):
            return ()
        limit = min(limit, seq.params.max_tokens - seq.num_output - 1, seq.max_len - len(seq.tokens) - 1)
        if crowded:
            limit = min(limit, self.kv.num_blocks_held(seq.seq_id) * self.kv.block_size - len(seq.tokens))
        state = self.spec_states.setdefault(seq.seq_id, SpecState())
        return self.speculator.draft(seq, state, limit)
