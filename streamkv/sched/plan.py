"""The scheduler -> runner contract: a tensor-free plan in, sampled tokens out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence as Seq

from streamkv.policies.read import ReadCount, ReadPolicy
from streamkv.policies.write import WritePolicy
from streamkv.sampling.params import SamplingParams


@dataclass(frozen=True)
class ScheduledSeq:
    """Work for one sequence in one step.

    Compute KV for ``token_ids`` at positions ``start .. start+len-1`` into the slots given
    by ``block_table`` (slot of position p = ``block_table[p // bs] * bs + p % bs``). If
    ``sample``, the last position's logits produce the next token with ``params``;
    ``history`` is the sequence's full token list (prompt first ``num_prompt`` ids), read
    only, for penalties; ``banned_ids`` may not be sampled (stop ids before ``min_tokens``);
    ``read`` limits which cached pages attention reads (None: all of them) for rows from
    ``read_from`` on (the question's first row under it).

    ``write``: the sequence compresses its ``num_prompt``-token prompt: the runner keeps the
    queries of its last ``write.observation`` rows as they are computed and, in the step whose
    chunk ends at ``num_prompt``, moves the rows ``write`` keeps into the blocks of
    ``block_table`` after the prompt's. A compressed sequence (``rows`` >= 0) computes one
    token per step, written to row ``write_row`` of its ``rows`` rows, in its ring (rows
    ``ring_from`` .. ``rows - 1``).
    ``observe`` > 0: the runner keeps the queries of the sequence's newest ``observe`` rows.

    ``draft``: the last ``len(draft)`` ids of ``token_ids`` are speculated; the runner samples
    at the chunk's last ``len(draft) + 1`` rows and returns the emitted tokens in
    ``StepOutput.drafts`` (``streamkv.sched.speculation``).
    """

    seq_id: int
    start: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    sample: bool
    params: SamplingParams
    history: Seq[int] = ()
    num_prompt: int = 0
    banned_ids: tuple[int, ...] = ()
    read: ReadPolicy | None = None
    read_from: int = -1
    write: WritePolicy | None = None
    rows: int = -1
    write_row: int = -1
    ring_from: int = -1
    observe: int = 0  # keep the queries of the sequence's newest rows (``RecentQueries``)
    draft: tuple[int, ...] = ()  # speculated ids at the end of ``token_ids``

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """Everything the runner does in one forward pass; ``released`` ids lose runner state.

    Before the forward pass the runner copies ``swap_out`` (device block -> host block)
    pairs, then ``swap_in`` (host block -> device block) pairs: a device block released by
    a swap-out may be reused by this very step.
    """

    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[int, ...] = ()
    released: tuple[int, ...] = ()
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the top alternatives at one position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepOutput:
    """What the runner returns: one sampled token per sequence that sampled; per sequence
    compressed this step, the seconds its selection and move took; per sequence with a read
    policy, what it read (plain numbers)."""

    tokens: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    compressed: dict[int, float] = field(default_factory=dict)
    reads: dict[int, ReadCount] = field(default_factory=dict)  # read-policy sequences: what they read
    # speculating sequences: every token emitted this step (accepted drafts, then one sampled);
    # ``tokens`` holds none of them
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)
