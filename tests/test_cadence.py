"""The decode cadence (``sched/cadence.py``): a step's prompt rows are capped while sequences
decode, from costs learned online; outputs stay those of the uncapped engine."""
from __future__ import annotations

import random

import pytest

from streamkv.config import SchedulerConfig
from streamkv.sampling.params import SamplingParams
from streamkv.sched.cadence import PromptAllowance, StepCadence
from tests.fakes import fake_engine


def test_the_cap_follows_the_learned_costs():
    c = StepCadence(3.0, min_tokens=16, alpha=1.0)
    assert c.prompt_rows(2048) == 2048  # nothing learned yet: no cap
    c.observe(decode_rows=4, prompt_rows=0, seconds=0.010)   # d = 10 ms
    assert c.prompt_rows(2048) == 2048  # the row cost is still unknown
    c.observe(decode_rows=4, prompt_rows=100, seconds=0.030)  # (30 - 10) ms / 100 rows = 0.2 ms per row
    assert c.prompt_rows(2048) == 100   # (3 - 1) x 10 ms / 0.2 ms
    assert c.prompt_rows(50) == 50      # never above the step budget
    c.observe(decode_rows=0, prompt_rows=10, seconds=0.050)   # 5 ms per row (fixed cost charged to rows)
    assert c.prompt_rows(2048) == 16    # never below min_tokens: prompts always progress
    assert c.stats.decode_step_s == pytest.approx(0.010) and c.stats.row_s == pytest.approx(0.005)
    avg = StepCadence(3.0, alpha=0.5)
    for s in (0.010, 0.020):
        avg.observe(2, 0, s)
    assert avg.stats.decode_step_s == pytest.approx(0.015)


def test_under_steady_arrivals_the_decode_time_comes_from_mixed_steps():
    c = StepCadence(3.0, min_tokens=8, alpha=1.0)
    c.observe(decode_rows=0, prompt_rows=100, seconds=0.100)  # 1 ms per row (fixed cost included)
    c.observe(decode_rows=4, prompt_rows=50, seconds=0.070)   # no decode-only step yet: d = 70 - 50 = 20 ms
    assert c.stats.decode_step_s == pytest.approx(0.020)
    assert c.prompt_rows(2048) == 40  # (3 - 1) x 20 ms / 1 ms


@pytest.mark.parametrize("bad", [1.0, 0.5, -2.0])
def test_a_factor_of_one_or_less_is_refused(bad):
    with pytest.raises(ValueError, match="stall_factor"):
        SchedulerConfig(stall_factor=bad)
    with pytest.raises(ValueError, match="stall_factor"):
        StepCadence(bad)


def test_steps_with_decoders_carry_at_most_the_cap_and_outputs_stay():
    rng = random.Random(4)
    short = [[rng.randrange(1, 64) for _ in range(6)] for _ in range(3)]
    long = [[rng.randrange(1, 64) for _ in range(150)] for _ in range(2)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    def run(engine):
        for i, p in enumerate(short):
            engine.add_request(f"s{i}", p, params)
        for _ in range(3):  # the short ones are decoding when the long prompts arrive
            engine.step()
        for i, p in enumerate(long):
            engine.add_request(f"l{i}", p, params)
        done = engine.run_to_completion([f"s{i}" for i in range(3)] + ["l0", "l1"])
        engine.check_integrity()
        return {k: v.token_ids for k, v in done.items()}

    plain, _ = fake_engine(num_blocks=256, budget=64, speculation="none")
    want = run(plain)
    engine, runner = fake_engine(num_blocks=256, budget=64, speculation="none", stall_factor=3.0)
    seen = []
    cadence = engine.scheduler.cadence
    # what learned costs would give, timing-free: 40 s per step, 1 s per row, 0.05 s per key
    cadence.allowance = lambda budget: PromptAllowance(40.0, 1.0, 0.05, min_rows=1)
    observe = cadence.observe
    cadence.observe = lambda d, p, s, k: (seen.append((d, p, k)), observe(d, p, s, k))
    assert run(engine) == want
    mixed, rows_at = 0, {}
    for plan, (decode, prompt, keys) in zip(runner.plans, seen, strict=True):
        dec = [it for it in plan.seqs if it.sample and it.start >= it.num_prompt and it.num_tokens == 1]
        chunks = [it for it in plan.seqs if it not in dec]
        assert (decode, prompt) == (len(dec), sum(it.num_tokens for it in chunks))
        assert keys == sum(it.num_tokens * it.start + it.num_tokens * (it.num_tokens + 1) // 2 for it in chunks)
        if decode and prompt:
            allow = PromptAllowance(40.0, 1.0, 0.05, min_rows=1)
            assert sum(allow.cost(it.start, it.num_tokens) for it in chunks) <= 40.0 or prompt == 1
            mixed += 1
            for it in chunks:
                rows_at[it.start] = max(rows_at.get(it.start, 0), it.num_tokens)
    assert mixed > 0 and cadence.stats.capped_steps > 0
    # a chunk deep in a context attends to more keys: fewer rows fit the same time
    assert max(n for s, n in rows_at.items() if s < 20) > max(n for s, n in rows_at.items() if s >= 100)
    # prompts alone (nobody decoding) are not capped: the first step takes the whole budget
    alone, runner = fake_engine(num_blocks=256, budget=64, speculation="none", stall_factor=3.0)
    alone.scheduler.cadence.allowance = lambda budget: PromptAllowance(40.0, 1.0, 0.05, min_rows=1)
    for i, p in enumerate(long):
        alone.add_request(f"l{i}", p, params)
    alone.step()
    assert runner.plans[-1].num_tokens == 64


def test_the_attention_cost_is_fitted_from_steps_at_different_contexts():
    """Steps timed as d + a P + b A (A: keys the prompt rows attend to) give back a and b; a
    chunk deep in a context then gets fewer rows than one at its start."""
    d, a, b = 0.020, 1e-4, 2e-8
    c = StepCadence(3.0, min_tokens=8, alpha=0.2)
    c.observe(4, 0, d)
    for n, start in [(256, 0), (64, 6000), (128, 2000), (32, 5000), (200, 300), (96, 4000)] * 3:
        keys = n * start + n * (n + 1) // 2
        c.observe(4, n, d + a * n + b * keys, keys)
    row, key = c.costs()
    assert row == pytest.approx(a, rel=1e-6) and key == pytest.approx(b, rel=1e-6)
    assert c.stats.key_s == pytest.approx(b, rel=1e-6)
    early, late = c.allowance(2048), c.allowance(2048)
    n0, n6 = early.take(0, 2048), late.take(6000, 2048)
    assert n6 < n0 <= 2048
    for start, n in ((0, n0), (6000, n6)):  # the most rows whose predicted time fits 2 d
        fits = PromptAllowance(2 * d, a, b, 1)
        assert fits.cost(start, n) <= 2 * d < fits.cost(start, n + 1)
    one = c.allowance(2048)  # one step: the second chunk gets what the first left (at least the floor)
    assert one.take(6000, 2048) == n6 and one.take(0, 2048) < n0


def test_a_fit_that_cannot_separate_the_costs_keeps_the_row_cost():
    c = StepCadence(3.0, min_tokens=8, alpha=1.0)
    c.observe(4, 0, 0.010)
    c.observe(4, 100, 0.030, 100 * 50)  # one context only: rows and keys move together
    assert c.costs() == (pytest.approx(0.0002), 0.0) and c.stats.key_s == 0.0
    assert c.prompt_rows(2048) == 100
