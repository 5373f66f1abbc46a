"""Batched sampling: penalties, greedy / temperature / top-k / top-p / min-p, logprobs.

Every random draw uses the sequence's own ``torch.Generator`` (seeded by the request's
``seed``), one draw per sampled token, so a seeded request produces the same tokens
whatever else shares its batch.
"""
from __future__ import annotations

import array
import os
from dataclasses import replace
from typing import Sequence

import torch

from streamkv.sampling.grammar import Grammars, Guide
from streamkv.sched.plan import ScheduledSeq, TokenLogprobs


def generator_seed(seed: int) -> int:
    """The 32 bits torch's CPU generator (mt19937) takes from a request's 64-bit ``seed`` (a
    CUDA generator keys Philox with all 64 and takes the seed as it is): a seed
    in [0, 2**32) as it is; any other, read modulo 2**64 (-1 is 2**64 - 1), mixed down (SplitMix64's finalizer), so seeds that differ
    only above bit 31 (5 and 5 + 2**32: ``manual_seed`` kept the low 32 bits) sample apart. Any
    two seeds still share a stream with probability 2**-32: the generator's own limit."""
    seed %= 1 << 64
    if seed < 1 << 32:
        return seed
    z = (seed + 0x9E3779B97F4A7C15) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (z ^ (z >> 31)) >> 32


class Sampler:
    """Holds one generator per live sequence; :meth:`release` drops finished ones."""

    def __init__(self, device: torch.device | str = "cpu", grammars: Grammars | None = None) -> None:
        self.device = torch.device(device)
        self._generators: dict[int, torch.Generator] = {}
        self.guide = Guide(grammars)

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)
        self.guide.release(seq_ids)

    def _generator(self, item: ScheduledSeq) -> torch.Generator:
        g = self._generators.get(item.seq_id)
        if g is None:
            g = torch.Generator(device=self.device)
            seed = item.params.seed if item.params.seed is not None else int.from_bytes(os.urandom(8), "little")
            g.manual_seed(generator_seed(seed) if g.device.type == "cpu" else seed % (1 << 64))  # CUDA: Philox, 64 bits
            self._generators[item.seq_id] = g
        return g

    def __call__(self, logits: torch.Tensor, items: list[ScheduledSeq]) -> tuple[list[int], dict[int, TokenLogprobs]]:
        """logits [N, V] float32, one row per item -> sampled ids and requested logprobs."""
        want_lp = [i for i, it in enumerate(items) if it.params.logprobs is not None]
        raw_lp = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None
        for i, item in enumerate(items):
            if item.params.needs_penalties:
                apply_penalties(logits[i], item)
            if item.banned_ids:
                logits[i, list(item.banned_ids)] = float("-inf")
        guided = self.guide.mask(logits, items)
        for i in guided:  # min_tokens banned the end its grammar has reached: the end wins
            if item_ends_only(logits[i]):
                logits[i, list(items[i].banned_ids)] = 0.0
                self.guide.mask(logits[i:i + 1], items[i:i + 1])
        random_rows = [i for i, it in enumerate(items) if not it.params.greedy]
        # greedy rows: the first largest logit (max's indices: argmax's, in about half its time)
        tokens = (logits.max(dim=-1).indices if len(random_rows) < len(items)
                  else torch.zeros(len(items), dtype=torch.long, device=logits.device))
        if random_rows:
            probs = filtered_probs(logits[random_rows], [items[i] for i in random_rows])
            for j, i in enumerate(random_rows):   # each row summed alone, in token order
                tokens[i] = draw(probs[j].double().cumsum(0), self._generator(items[i]))
        token_list = tokens.tolist()
        self.guide.accept(guided, items, token_list)
        logprobs: dict[int, TokenLogprobs] = {}
        if raw_lp is not None:
            for j, i in enumerate(want_lp):
                logprobs[items[i].seq_id] = token_logprobs(raw_lp[j], token_list[i], items[i].params.logprobs or 0)
        return token_list, logprobs


    def verify(self, logits: torch.Tensor, item: ScheduledSeq) -> tuple[int, ...]:
        """logits [d+1, V] float32 at a speculating chunk's last d+1 rows -> emitted tokens.

        Row i goes through exactly what a decode step at that position does (this sampler on
        one row whose history holds the tokens emitted before it: its structured-output
        matcher, its generator, one draw per emitted token), and draft i is accepted iff it
        equals that row's token. So the emitted tokens are the ones non-speculative decoding
        emits, greedy, seeded or guided; a draft ``x`` is accepted with probability p(x), as
        under the standard rejection rule for a deterministic draft.
        """
        draft = item.draft
        out: list[int] = []
        for i in range(logits.shape[0]):
            row = replace(item, history=(*item.history, *out), draft=())
            tok = self(logits[i:i + 1], [row])[0][0]
            out.append(tok)
            if i == len(draft) or tok != draft[i]:
                break
        return tuple(out)


def draw(cdf: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id (a 0-d tensor) by inverting a row's cumulative distribution ``cdf`` [V] (its
    probabilities summed in float64, in token order; the total need not be 1): one uniform u in
    (0, 1] from the sequence's generator, then the first token whose cumulative value reaches
    u times the total. A token of probability 0 is never drawn: its cumulative value equals its
    predecessor's, which reaches the point first. V additions instead of the exponential race's V
    logarithms (argmax p / Exp(1)): at V = 49,152 ~0.09 instead of ~1.1 ms per sampled row on 2 vCPUs."""
    u = 1.0 - torch.rand((), generator=generator, dtype=torch.float64, device=cdf.device)
    return torch.searchsorted(cdf, u * cdf[-1]).clamp_(max=cdf.numel() - 1)


def item_ends_only(row: torch.Tensor) -> bool:
    """Every logit of ``row`` is -inf (nothing can be sampled)."""
    return bool(torch.isneginf(row).all())


def history_ids(history: Sequence[int], device: torch.device) -> torch.Tensor:
    """A sequence's token ids as int64 [n] (through array's C conversion: ~3x faster than
    torch.tensor from a tuple, ~0.18 vs ~0.58 ms for 6,000 ids)."""
    if not history:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(array.array("q", history), dtype=torch.int64).to(device)


def apply_penalties(row: torch.Tensor, item: ScheduledSeq) -> None:
    """In place on row [V]: repetition (prompt + output, HF style), presence and frequency
    (output only, OpenAI style). Each seen token's logit takes one division or multiplication by
    the repetition penalty, then output tokens lose frequency * count + presence, in float32
    (counted per distinct output id: a [V] count and three [V]-wide passes cost ~0.5 ms a row)."""
    p = item.params
    history = history_ids(item.history, row.device)
    if p.repetition_penalty != 1.0 and history.numel():
        seen = history.unique()
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    output = history[item.num_prompt:]
    if output.numel() and (p.presence_penalty or p.frequency_penalty):
        ids, counts = output[output < row.numel()].unique(return_counts=True)
        counts = counts.to(row.dtype)
        row[ids] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def filtered_probs(logits: torch.Tensor, items: list[ScheduledSeq]) -> torch.Tensor:
    """Temperature, top-k, min-p and top-p over rows [R, V] -> probabilities [R, V]."""
    temps = torch.tensor([it.params.temperature for it in items], dtype=logits.dtype, device=logits.device)
    x = logits / temps[:, None]
    ks = [it.params.top_k if it.params.top_k > 0 else 0 for it in items]
    if any(ks):
        kmax = min(max(ks), x.shape[-1])
        top = x.topk(kmax, dim=-1).values
        idx = torch.tensor([min(k, kmax) - 1 if k else kmax - 1 for k in ks], device=x.device)
        kth = top.gather(1, idx[:, None])
        active = torch.tensor([k > 0 for k in ks], device=x.device)[:, None]
        x = x.masked_fill(active & (x < kth), float("-inf"))
    min_ps = [it.params.min_p for it in items]
    if any(min_ps):
        probs = x.softmax(-1)
        mp = torch.tensor(min_ps, dtype=x.dtype, device=x.device)[:, None]
        x = x.masked_fill(probs < mp * probs.max(-1, keepdim=True).values, float("-inf"))
    # only rows with top_p < 1 are cut (a top_p 1 row once went through the cut beside a top_p < 1
    # one, and its float32 sums reached 1.0 before the tail: its distribution depended on the batch)
    nucleus_rows = [i for i, it in enumerate(items) if it.params.top_p < 1.0]
    if nucleus_rows:
        tp = torch.tensor([items[i].params.top_p for i in nucleus_rows], dtype=torch.float64, device=x.device)
        x[nucleus_rows] = nucleus(x[nucleus_rows], tp)
    return x.softmax(-1)


NUCLEUS_TRIES = (256, 4096)   # the top-k sizes a row's nucleus is looked for in before a full sort


def nucleus(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x [R, V] logits -> x with every token outside its row's nucleus at -inf: the smallest prefix
    of the row's tokens by descending probability (``softmax``, float32) whose mass, summed in
    float64 in that order, reaches top_p [R] (float64). Each row looks for its prefix among its top
    256 tokens, then its top 4,096, then its whole sorted row, and the first that reaches top_p
    decides, so the cut depends on the row alone. (A full sort of V = 49,152 took ~4 ms per row on
    2 vCPUs, the top 256 ~0.25 ms; float32 sums over ~40k tokens of a flat row moved the cut by
    tokens.)"""
    probs, out, v = x.softmax(-1), torch.full_like(x, float("-inf")), x.shape[-1]
    todo = torch.arange(x.shape[0], device=x.device)
    for k in (*(k for k in NUCLEUS_TRIES if k < v), v):
        vals, idx = probs[todo].topk(k, dim=-1) if k < v else probs[todo].sort(dim=-1, descending=True)
        vals = vals.double()
        cum = vals.cumsum(-1)
        done = (cum[:, -1] >= top_p[todo]) | (k == v)   # the prefix ends within these k tokens
        keep = (cum - vals)[done] < top_p[todo[done], None]   # the mass before a token is short of top_p
        rows, idx = todo[done], idx[done]
        out[rows] = out[rows].scatter(1, idx, torch.where(keep, x[rows].gather(1, idx), float("-inf")))
        todo = todo[~done]
        if todo.numel() == 0:
            break
    return out


def token_logprobs(lp: torch.Tensor, token: int, top_n: int) -> TokenLogprobs:
    top: tuple[tuple[int, float], ...] = ()
    if top_n:
        vals, ids = lp.topk(top_n)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprobs(token, float(lp[token]), top)
