"""Prompt-lookup speculation (``sched/speculation.py``) with a fake runner: the drafter, the
cap, and the engine's output being exactly plain decoding's under batching, small budgets,
preemption, EOS, stop strings and max_tokens."""
from __future__ import annotations

import random

import pytest

from streamkv.config import EngineConfig, RuntimeConfig, SchedulerConfig
from streamkv.sampling.params import SamplingParams
from streamkv.sched.sequence import Sequence, SeqStatus
from streamkv.sched.speculation import PromptLookup, SpecState, make_speculator
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes import fake_engine, slot_engine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _seq(tokens: list[int]) -> Sequence:
    seq = Sequence(0, list(tokens), 2, GREEDY, 512)
    seq.status, seq.num_computed = SeqStatus.RUNNING, len(tokens) - 1
    return seq


def test_draft_is_the_continuation_of_the_most_recent_longest_ngram():
    pl = PromptLookup(max_draft=4, ngram_max=3, ngram_min=1)
    # "7 8 9" occurs twice; the later occurrence continues with 5 6; the tail is "7 8 9"
    seq = _seq([1, 7, 8, 9, 2, 3, 7, 8, 9, 5, 6, 4, 7, 8, 9])
    assert pl.draft(seq, SpecState(), 4) == (5, 6, 4, 7)
    assert pl.draft(seq, SpecState(), 2) == (5, 6)
    assert pl.draft(seq, SpecState(), 0) == ()
    # no earlier 2- or 3-gram: with ngram_min 2 nothing is drafted, with 1 the last token's match is used
    seq = _seq([1, 2, 3, 4, 9, 5, 6, 4])
    assert PromptLookup(ngram_min=2).draft(seq, SpecState(), 4) == ()
    assert PromptLookup(ngram_min=1).draft(seq, SpecState(), 4) == (9, 5, 6, 4)


def _draft_by_scan(tokens: list[int], pl: PromptLookup, limit: int) -> tuple[int, ...]:
    """The rule spelled out: the longest n-gram ending the tokens, n = ngram_max .. ngram_min,
    found again ending earlier (before the last token); the latest such occurrence's continuation."""
    last = len(tokens) - 1
    for n in range(pl.ngram_max, pl.ngram_min - 1, -1):
        if last < n:
            continue
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1:end + 1] == tokens[last - n + 1:]:
                return tuple(tokens[end + 1:end + 1 + limit])
    return ()


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60), ngram=st.tuples(st.integers(1, 3), st.integers(0, 3)),
       grow=st.lists(st.integers(0, 3), max_size=8))
def test_draft_equals_the_spelled_out_rule(tokens, ngram, grow):
    """Over random sequences of a 4-token vocabulary (many repeats): the array search drafts what a
    plain scan does, before and after the sequence grows (the history array is extended in place)."""
    pl = PromptLookup(max_draft=4, ngram_min=ngram[0], ngram_max=ngram[0] + ngram[1])
    seq, state = _seq(tokens), SpecState()
    assert pl.draft(seq, state, 4) == _draft_by_scan(seq.tokens, pl, 4)
    seq.tokens += grow
    assert pl.draft(seq, state, 3) == _draft_by_scan(seq.tokens, pl, 3)


def test_history_is_incremental_and_rebuilt_when_tokens_are_cut():
    pl = PromptLookup(max_draft=3, ngram_min=2)
    state = SpecState()
    seq = _seq([1, 2, 3, 4, 1, 2])
    assert pl.draft(seq, state, 3) == (3, 4, 1)
    seq.tokens += [3, 9, 1, 2]          # now "1 2" was last followed by 3 9
    assert pl.draft(seq, state, 3) == (3, 9, 1)
    seq.tokens[:] = [5, 6, 7, 5, 6]     # cut and replaced (a stop string): the history is copied again
    assert pl.draft(seq, state, 3) == (7, 5, 6)


def test_cap_shares_a_budget_and_low_acceptance_cools_down_then_probes():
    pl = PromptLookup(max_draft=4, draft_budget=8, min_acceptance=0.3, ema=0.5, probe_every=3)
    assert [pl.cap(n) for n in (0, 1, 2, 3, 4, 8, 9, 32)] == [4, 4, 4, 2, 2, 1, 0, 0]
    state = SpecState()
    for _ in range(3):
        pl.observe(state, 4, 0)
    assert state.rate < 0.3
    seq = _seq([1, 2, 3, 1, 2])
    assert pl.draft(seq, state, 4) == () and pl.draft(seq, state, 4) == ()
    assert pl.draft(seq, state, 4) == (3,)  # the probe: one draft
    pl.observe(state, 1, 1)
    pl.observe(state, 1, 1)
    assert state.rate >= 0.3 and pl.draft(seq, state, 4) == (3, 1, 2)


@pytest.mark.parametrize("bad", [dict(max_draft=0), dict(ngram_min=3, ngram_max=2), dict(ngram_min=0),
                                 dict(draft_budget=-1), dict(min_acceptance=1.5)])
def test_bad_settings_are_value_errors(bad):
    with pytest.raises(ValueError):
        PromptLookup(**bad)


def test_config_validation():
    with pytest.raises(ValueError, match="speculation must be one of"):
        SchedulerConfig(speculation="medusa")
    with pytest.raises(ValueError, match="spec_max_draft"):
        SchedulerConfig(speculation="pld", spec_max_draft=0)
    with pytest.raises(ValueError, match="numerics=invariant"):
        EngineConfig(scheduler=SchedulerConfig(speculation="pld"), runtime=RuntimeConfig(numerics="fast"))
    assert make_speculator("none") is None
    fast = EngineConfig(runtime=RuntimeConfig(numerics="fast"))  # auto: no speculation without invariant numerics
    assert fast.scheduler.make_speculator(fast.runtime.numerics) is None
    assert EngineConfig().scheduler.make_speculator("invariant").name == "pld"


def _run(engine, prompts, params):
    ids = []
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        ids.append(f"r{i}")
    done = engine.run_to_completion(ids)
    engine.check_integrity()
    return [(done[r].token_ids, done[r].text, done[r].finish_reason) for r in ids]


def _prompts(n, seed, period=None):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if period:  # a repeating pattern: the repeat runner continues it, so drafts are accepted
            pat = [rng.randrange(1, 27) for _ in range(period)]
            out.append(pat * rng.randrange(2, 5) + pat[: rng.randrange(period)])
        else:
            out.append([rng.randrange(1, 64) for _ in range(rng.randrange(3, 30))])
    return out


@pytest.mark.parametrize("repeat", [None, 5])
@pytest.mark.parametrize("kwargs", [dict(budget=512), dict(budget=9), dict(budget=16, chunk=5),
                                    dict(num_blocks=20, budget=64), dict(num_blocks=16, budget=12, block_size=4)])
def test_speculative_output_equals_plain_decoding(repeat, kwargs):
    prompts = _prompts(10, seed=3, period=repeat)
    plain, _ = fake_engine(repeat=repeat, speculation="none", **kwargs)
    spec, _ = fake_engine(repeat=repeat, speculation="pld", spec_ngram_min=1, spec_draft_budget=64, **kwargs)
    assert _run(spec, prompts, GREEDY) == _run(plain, prompts, GREEDY)
    st = spec.scheduler.spec_stats
    if repeat:  # the pattern is drafted and accepted
        assert st.accepted > 0.8 * st.proposed > 0
        assert spec.stats.steps < plain.stats.steps


def test_eos_and_max_tokens_inside_an_accepted_draft():
    prompts = _prompts(8, seed=4, period=4)
    for params, eos_after in ((SamplingParams(max_tokens=7, temperature=0.0), None),
                              (SamplingParams(max_tokens=30, temperature=0.0), 9)):
        plain, _ = fake_engine(repeat=4, eos_after=eos_after, speculation="none")
        spec, _ = fake_engine(repeat=4, eos_after=eos_after, speculation="pld", spec_ngram_min=1)
        got, want = _run(spec, prompts, params), _run(plain, prompts, params)
        assert got == want
        assert spec.scheduler.spec_stats.accepted > 0


def test_a_stop_string_inside_an_accepted_draft_cuts_the_tokens_after_it():
    # tokens 1..26 <-> "a".."z"; the prompt repeats "abcde"; the first draft step emits b c d e a and
    # "cd" completes at its third token: the tokens after it (e a) are dropped
    prompt = [1, 2, 3, 4, 5] * 3
    params = SamplingParams(max_tokens=20, temperature=0.0, stop=["cd"])
    plain, _ = fake_engine(repeat=5, speculation="none")
    spec, _ = fake_engine(repeat=5, speculation="pld", spec_ngram_min=1)
    got, want = _run(spec, [prompt], params), _run(plain, [prompt], params)
    assert got == want and got[0][1] == "ab" and got[0][2] == "stop" and got[0][0] == [1, 2, 3, 4]
    assert spec.scheduler.spec_stats.accepted > 0


def test_no_drafts_for_penalties_logprobs_or_past_the_load_cap():
    prompts = _prompts(6, seed=5, period=3)
    for params in (SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.5),
                   SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)):
        spec, runner = fake_engine(repeat=3, speculation="pld", spec_ngram_min=1)
        _run(spec, prompts, params)
        assert spec.scheduler.spec_stats.proposed == 0
    # 6 decoders and a budget of 4 drafts per step: nobody drafts
    spec, runner = fake_engine(repeat=3, speculation="pld", spec_ngram_min=1, spec_draft_budget=4)
    _run(spec, prompts, GREEDY)
    assert all(not it.draft for plan in runner.plans for it in plan.seqs if len(plan.seqs) >= 5)


def test_no_draft_takes_a_free_block_while_a_grouped_follower_waits():
    """A grouped-prefill follower waits for its leader's blocks, then takes its own; it was left
    out of "someone waits", so drafts took free blocks meanwhile (5 in this run, review)."""
    rng = random.Random(0)
    system = [rng.randrange(1, 27) for _ in range(64)]
    engine, runner = fake_engine(num_blocks=64, block_size=4, budget=16, chunk_min_tokens=8, chunk_max_tokens=16,
                                 repeat=5, speculation="pld", spec_ngram_min=1)
    sched, took = engine.scheduler, []
    schedule = sched.schedule

    def watched():
        waiting = any(s.status is SeqStatus.WAITING for s in sched.seqs.values())
        plan = schedule()
        for it in plan.seqs:  # a draft whose rows run past the blocks its own rows need
            rows = it.start + it.num_tokens
            if it.draft and sched.kv.blocks_for(rows) > sched.kv.blocks_for(rows - len(it.draft)):
                took.append(waiting)
        return plan

    sched.schedule = watched
    engine.add_request("dec", [1, 2, 3, 4, 5] * 3, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for rid, tail in (("lead", [7, 8, 9]), ("fol", [9, 8, 7])):
        engine.add_request(rid, system + tail, GREEDY)
    engine.run_to_completion(["dec", "lead", "fol"])
    engine.check_integrity()
    assert sched.groups.stats.followers == 1 and sched.spec_stats.proposed > 0
    assert took and not any(took)  # drafts took new blocks only once nobody waited


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), blocks=st.sampled_from([12, 16, 24, 64]), budget=st.sampled_from([6, 16, 64]),
       swap=st.sampled_from([0, 8]))
def test_slot_kv_stays_exact_under_speculation_preemption_and_prefix_hits(seed, blocks, budget, swap):
    """Slot-level KV (every row checked against the sequence's tokens before each step) with
    drafts accepted and rejected, preemption by recompute or swap, and shared prefixes."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 27) for _ in range(rng.randrange(0, 9))]
    prompts = [shared + p for p in _prompts(6, seed, period=rng.choice([3, 4, 7]))]
    params = SamplingParams(max_tokens=rng.randrange(4, 20), temperature=0.0, ignore_eos=True)
    kw = dict(num_blocks=blocks, budget=budget, swap_blocks=swap, preemption="swap" if swap else "recompute",
              repeat=rng.choice([None, 3, 5]))
    plain, _ = slot_engine(speculation="none", **kw)
    spec, _ = slot_engine(speculation="pld", **kw)
    want = _run(plain, prompts, params)
    assert _run(spec, prompts, params) == want
    assert all(reason == "length" for _, _, reason in want)
    if kw["repeat"] and params.max_tokens >= 8:  # periodic outputs: drafts are accepted
        assert spec.scheduler.spec_stats.accepted > 0


def test_blocks_that_accepted_drafts_fill_enter_the_prefix_cache_under_their_tokens():
    # the commit ran before the emitted tokens were appended: a block that accepted drafts
    # completed was hashed over a short slice, so it (and every later block of the sequence)
    # sat in the prefix cache under a hash no lookup makes (helper-32: 3 of 7 blocks, a
    # follow-up turn 48 cached tokens instead of 112)
    from streamkv.kv.prefix import chain_hashes

    prompt = [1, 2, 3, 4, 5] * 4
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    cached = {}
    for spec in ("none", "pld"):
        engine, _ = fake_engine(repeat=5, speculation=spec, spec_ngram_min=1)
        engine.add_request("a", prompt, params)
        out = engine.run_to_completion(["a"])["a"]
        rows = prompt + out.token_ids[:-1]  # the last token has no KV row
        hashes = chain_hashes(rows, engine.kv.block_size)
        assert len(hashes) >= 7 and all(engine.pool.lookup(h) is not None for h in hashes), spec
        engine.add_request("b", rows + [9, 9], SamplingParams(max_tokens=1, temperature=0.0))
        cached[spec] = engine.run_to_completion(["b"])["b"].num_cached_tokens
        assert spec == "none" or engine.scheduler.spec_stats.accepted > 10
    assert cached["pld"] == cached["none"] >= 7 * engine.kv.block_size
