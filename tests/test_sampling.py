"""Sampler, sampling-parameter validation and incremental detokenization."""
from __future__ import annotations

import math

import pytest
import torch

from streamkv.errors import InvalidRequestError
from streamkv.sampling.detokenizer import IncrementalDetokenizer
from streamkv.sampling.params import SamplingParams
from streamkv.sampling.sampler import Sampler, apply_penalties, filtered_probs
from streamkv.sched.plan import ScheduledSeq


def item(seq_id=0, history=(), num_prompt=0, **kw):
    return ScheduledSeq(seq_id, 0, (1,), (0,), True, SamplingParams(**kw), tuple(history), num_prompt)


@pytest.mark.parametrize("kw", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-2), dict(min_p=1.5), dict(max_tokens=0), dict(max_tokens=-3), dict(presence_penalty=3.0),
    dict(frequency_penalty=-2.5), dict(repetition_penalty=0.0), dict(logprobs=21), dict(logprobs=-1),
    dict(seed=1.5), dict(stop=[""]), dict(min_tokens=5, max_tokens=2), dict(temperature="hot"),
    # JSON's true is not an integer (a span gen's "logprobs": true reached the sampler's topk and
    # failed the whole step, other requests included); nor is a dict a list of stop strings
    dict(logprobs=True), dict(max_tokens=True), dict(top_k=True), dict(min_tokens=True), dict(seed=True),
    dict(stop={"a": 1}), dict(stop_token_ids=[True]), dict(stop_token_ids=["5"]), dict(ignore_eos="no"),
    dict(include_stop_str_in_output=1),
    # a JSON integer past float range (1 followed by 400 zeros) made math.isfinite overflow: a 500
    *(dict([(name, 10 ** 400)]) for name in ("temperature", "top_p", "min_p", "presence_penalty",
                                            "frequency_penalty", "repetition_penalty")),
])
def test_invalid_params_raise_typed_error(kw):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    tokens, lps = Sampler()(logits.clone(), [item(logprobs=2, temperature=0.0)])
    assert tokens == [1]
    ref = torch.log_softmax(logits[0], -1)
    assert math.isclose(lps[0].logprob, ref[1].item(), rel_tol=1e-6)
    assert [t for t, _ in lps[0].top] == [1, 3]


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert (filtered_probs(logits, [item(top_k=2, temperature=1.0)])[0, 2:] == 0).all()
    p = filtered_probs(logits, [item(top_p=0.8, temperature=1.0)])[0]
    assert p[0] > 0 and p[1] > 0 and p[2] == 0 and p[3] == 0  # 0.5 + 0.3 reaches 0.8
    p = filtered_probs(logits, [item(min_p=0.5, temperature=1.0)])[0]
    assert p[1] > 0 and p[2] == 0  # 0.15 < 0.5 * 0.5
    torch.testing.assert_close(filtered_probs(logits, [item(temperature=1.0)])[0], torch.exp(logits[0]))


def test_a_rows_filters_never_depend_on_the_rows_beside_it():
    # a top_p 1.0 row batched with a top_p < 1 one went through the nucleus cut too, and its
    # float32 cumulative sum, reaching 1.0 before the tail, dropped ~16k tokens: with PLD on, a
    # verified row is sampled alone, so a seeded request's distribution changed (review)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1, 49152, generator=gen) * 3
        plain = item(temperature=0.8)
        alone = filtered_probs(logits.clone(), [plain])[0]
        for other in (item(temperature=0.8, top_p=0.9), item(temperature=0.5, top_k=5), item(min_p=0.2)):
            assert torch.equal(filtered_probs(torch.cat([logits, logits]), [plain, other])[0], alone)


def test_sampling_follows_distribution_and_seed():
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler()
    counts = torch.zeros(3)
    for i in range(3000):
        (t,), _ = sampler(torch.log(probs)[None].clone(), [item(seq_id=i, temperature=1.0, seed=i)])
        counts[t] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.04)
    a = [Sampler()(torch.log(probs)[None].clone(), [item(seq_id=7, temperature=1.0, seed=5)])[0][0] for _ in range(5)]
    assert len(set(a)) == 1


def test_seeds_that_differ_only_above_bit_31_sample_apart():
    # torch's CPU generator keeps a seed's low 32 bits: 5 and 5 + 2**32 (and 0 and 2**63)
    # gave one stream, so a 64-bit seed (--seed-from-prompt's FNV-1a) had 2**32 distinct ones
    probs = torch.full((1000,), 1e-3)

    def draws(seed: int) -> list[int]:
        sampler, logits = Sampler(), torch.log(probs)[None]
        return [sampler(logits.clone(), [item(seq_id=1, temperature=1.0, seed=seed)])[0][0] for _ in range(8)]

    assert draws(5) == draws(5) and draws(2**32 - 1) == draws(2**32 - 1)
    streams = [draws(s) for s in (5, 5 + 2**32, 5 + 2**40, 0, 2**63, 2**64 - 1)]
    assert len({tuple(d) for d in streams}) == len(streams)
    assert draws(-1) == draws(2**64 - 1)  # seeds are read modulo 2**64 (as before)
    assert draws(-1) != draws(2**32 - 1)  # -1 is mixed: it kept the low 32 bits, 2**32 - 1's


def test_penalties():
    logits = torch.tensor([[2.0, 2.0, -1.0, 0.5]])
    s = Sampler()
    (t,), _ = s(logits.clone(), [item(history=(9, 0, 0), num_prompt=1, temperature=0.0, frequency_penalty=1.0)])
    assert t == 1  # token 0 appeared twice in the output: 2 - 2 < 2
    row = logits.clone()
    s(row, [item(history=(0, 2), num_prompt=2, temperature=0.0, repetition_penalty=2.0)])
    assert row[0, 0] == 1.0 and row[0, 2] == -2.0  # prompt tokens count for repetition penalty
    row = logits.clone()
    s(row, [item(history=(5, 3), num_prompt=1, temperature=0.0, presence_penalty=0.5)])
    assert row[0, 3] == 0.0


class ByteTok:
    def __init__(self, pieces):
        self.pieces = pieces

    def token_bytes(self, t):
        return self.pieces[t]


def test_detokenizer_multibyte_split_across_tokens():
    euro = "€".encode()  # 3 bytes
    tok = ByteTok([b"a", euro[:1], euro[1:2], euro[2:], "😀".encode()])
    d = IncrementalDetokenizer(tok)
    deltas = []
    for t in [0, 1, 2, 3, 4, 0]:
        d.add(t)
        deltas.append(d.take_delta())
    assert deltas == ["a", "", "", "€", "😀", "a"]
    assert "\ufffd" not in d.text


def test_detokenizer_stop_string_never_leaks():
    tok = ByteTok([b"Hel", b"lo ", b"ST", b"OP", b" tail"])
    d = IncrementalDetokenizer(tok, stop=("STOP",))
    streamed = ""
    for t in [0, 1, 2, 3, 4]:
        if d.add(t):
            break
        streamed += d.take_delta()
    streamed += d.take_delta()
    assert streamed == d.text == "Hello "
    d2 = IncrementalDetokenizer(tok, stop=("STOP",), include_stop=True)
    for t in [0, 1, 2, 3]:
        d2.add(t)
    assert d2.text == "Hello STOP"


def test_detokenizer_releases_held_text_at_finish():
    tok = ByteTok([b"ab", b"S"])
    d = IncrementalDetokenizer(tok, stop=("STOP",))
    d.add(0)
    d.add(1)
    assert d.take_delta() == "ab"  # the trailing "S" may still begin "STOP"
    d.finish()
    assert d.take_delta() == "S"


def test_a_sampled_token_takes_one_uniform_and_never_a_zero_probability_token():
    # inverse-CDF draws: one float64 uniform per sampled token (the exponential race took one per
    # vocabulary entry), so a sequence's generator advances alike whatever the vocabulary size
    probs = torch.zeros(1000)
    probs[[1, 500, 998]] = torch.tensor([0.2, 0.5, 0.3])   # token 0 and the last one have none
    seen = torch.zeros(1000)
    for seed in range(2000):
        sampler, twin = Sampler(), torch.Generator().manual_seed(seed)
        (t,), _ = sampler(torch.log(probs)[None].clone(), [item(seq_id=3, temperature=1.0, seed=seed)])
        seen[t] += 1
        twin.manual_seed(seed)
        torch.rand((), generator=twin, dtype=torch.float64)
        assert torch.equal(sampler._generators[3].get_state(), twin.get_state())
    assert set(seen.nonzero().flatten().tolist()) == {1, 500, 998}
    assert torch.allclose(seen[[1, 500, 998]] / 2000, torch.tensor([0.2, 0.5, 0.3]), atol=0.04)


def test_greedy_ties_take_the_first_largest_and_a_sampled_row_ignores_its_batch():
    logits = torch.tensor([[1.0, 4.0, 4.0, -2.0], [7.0, 7.0, 7.0, 7.0]])
    tokens, _ = Sampler()(logits.clone(), [item(seq_id=0, temperature=0.0), item(seq_id=1, temperature=0.0)])
    assert tokens == [1, 0]
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(4, 49152, generator=gen) * 3
    batch = [item(seq_id=0, temperature=0.7, seed=11), item(seq_id=1, temperature=0.0),
             item(seq_id=2, temperature=1.3, top_p=0.9, seed=12), item(seq_id=3, temperature=1.0, top_k=40, seed=13)]
    together = Sampler()
    alone = [Sampler() for _ in batch]
    for _ in range(5):
        got, _ = together(rows.clone(), batch)
        assert got == [alone[i](rows[i:i + 1].clone(), [batch[i]])[0][0] for i in range(4)]


def _nucleus_by_full_sort(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by its definition over the whole sorted row: the tokens whose mass before them
    (float64 sums by descending probability) is short of top_p; a bool mask [V]."""
    vals, order = x.softmax(-1).sort(descending=True)
    before = vals.double().cumsum(-1) - vals.double()
    return torch.zeros(x.shape[-1], dtype=torch.bool).scatter_(0, order, before < top_p)


@pytest.mark.parametrize("scale", [8.0, 3.0, 1.0, 0.05])   # nucleus within 256, 4,096, past it, nearly all
def test_the_nucleus_found_among_the_top_tokens_is_the_full_sorts(scale):
    gen = torch.Generator().manual_seed(int(scale * 100))
    for top_p in (0.5, 0.9, 0.95):
        x = torch.randn(6, 49152, generator=gen) * scale
        got = filtered_probs(x.clone(), [item(seq_id=i, temperature=1.0, top_p=top_p) for i in range(6)])
        for r in range(6):
            assert torch.equal(got[r] > 0, _nucleus_by_full_sort(x[r], top_p)), (scale, top_p, r)


def _penalties_over_the_vocabulary(row: torch.Tensor, item_: ScheduledSeq) -> None:
    """The penalties as whole-vocabulary passes: a seen mask, and a [V] count of the output."""
    p = item_.params
    history = torch.as_tensor(list(item_.history), dtype=torch.int64)
    if p.repetition_penalty != 1.0 and history.numel():
        seen = torch.zeros(row.numel(), dtype=torch.bool)
        seen[history] = True
        row.copy_(torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty), row))
    output = history[item_.num_prompt:]
    if output.numel() and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(output, minlength=row.numel())[: row.numel()].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.3), dict(repetition_penalty=0.8),
                                dict(presence_penalty=0.7, frequency_penalty=-0.4),
                                dict(repetition_penalty=1.1, presence_penalty=-1.0, frequency_penalty=0.25)])
def test_penalties_give_the_whole_vocabulary_formulas_bits(kw):
    # per distinct id (unique, counts) is only a cheaper schedule of the same float32 operations
    gen = torch.Generator().manual_seed(9)
    for n, num_prompt in ((1, 0), (50, 10), (3000, 2900), (3000, 3000)):
        history = tuple(torch.randint(0, 49152, (n,), generator=gen).tolist())
        it = ScheduledSeq(0, 0, (1,), (0,), True, SamplingParams(temperature=1.0, **kw), history, num_prompt)
        row = torch.randn(49152, generator=gen) * 4
        want = row.clone()
        _penalties_over_the_vocabulary(want, it)
        apply_penalties(row, it)
        assert torch.equal(row, want), (kw, n)
