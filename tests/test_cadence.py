"""The decode cadence (``sched/cadence.py``): a step's prompt rows are capped while sequences
decode, from costs learned online; outputs stay those of the uncapped engine."""
from __future__ import annotations

import random

import pytest

from streamkv.config import SchedulerConfig
from streamkv.sampling.params import SamplingParams
from streamkv.sched.cadence import StepCadence
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


# nan and inf passed the old "<= 1" check and the engine died at its first step (int(nan) in prompt_rows)
@pytest.mark.parametrize("bad", [1.0, 0.5, -2.0, float("nan"), float("inf")])
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
    cadence.prompt_rows = lambda budget: 8  # what the learned costs would give; timing-free
    observe = cadence.observe
    cadence.observe = lambda d, p, s: (seen.append((d, p)), observe(d, p, s))
    assert run(engine) == want
    mixed = 0
    for plan, (decode, prompt) in zip(runner.plans, seen, strict=True):
        dec = [it for it in plan.seqs if it.sample and it.start >= it.num_prompt and it.num_tokens == 1]
        assert (decode, prompt) == (len(dec), sum(it.num_tokens for it in plan.seqs) - len(dec))
        if decode:
            assert prompt <= 8
            mixed += prompt > 0
    assert mixed > 0 and cadence.stats.capped_steps > 0
    # the long prompts alone (nobody decoding) take whole chunks
    assert max(sum(it.num_tokens for it in plan.seqs) for plan in runner.plans) > 8
