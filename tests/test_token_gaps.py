"""Engine-side decode stalls (``engine/token_gaps.py``): gaps between a sequence's tokens over
the median step interval, idle waits left out; counted by the engine on every emitted token."""
from __future__ import annotations

import pytest

from streamkv.engine.token_gaps import RATIO_BUCKETS, TokenGaps
from streamkv.sampling.params import SamplingParams
from tests.fakes import fake_engine


def test_ratios_are_over_the_median_of_busy_intervals_and_idle_waits_are_not_intervals():
    g = TokenGaps(window=3)
    g.gap(5.0)  # no interval yet: nothing to compare with
    assert g.gaps == 0
    for t in (0.0, 0.1, 0.2, 0.3):
        g.step_end(t)
    assert list(g.intervals) == pytest.approx([0.1] * 3) and g.median == pytest.approx(0.1)
    g.idle()
    g.step_end(10.0)  # after an idle wait: no 9.7 s interval
    assert len(g.intervals) == 3 and g.median == pytest.approx(0.1)
    for t in (10.4, 10.8):  # the window keeps the last 3: [0.1, 0.4, 0.4]
        g.step_end(t)
    assert g.median == pytest.approx(0.4)
    g.gap(0.4)  # 1x
    g.gap(1.2)  # 3x: at the target, not over it
    g.gap(1.3)  # 3.25x
    g.gap(100.0)  # 250x: +Inf
    assert g.gaps == 4 and g.over(3.0) == 2 and g.over(20.0) == 1
    assert g.worst == pytest.approx(250.0) and g.ratio_sum == pytest.approx(1 + 3 + 3.25 + 250)
    buckets = dict(g.cumulative())
    assert list(buckets) == [*map(str, RATIO_BUCKETS), "+Inf"]
    assert (buckets["1.25"], buckets["3.0"], buckets["4.0"], buckets["20.0"], buckets["+Inf"]) == (1, 2, 3, 3, 4)
    with pytest.raises(ValueError, match="window"):
        TokenGaps(window=0)


@pytest.mark.parametrize("speculation", ["none", "pld"])
def test_the_engine_counts_one_gap_per_step_that_emits_a_later_token(speculation):
    """4 requests of 12 tokens: without speculation every step emits one token of each, so
    11 gaps each; a speculating step emits several tokens of a sequence with no gap between
    them. A second batch after the engine went idle adds its own intervals only."""
    engine, runner = fake_engine(repeat=3, speculation=speculation, spec_ngram_min=1)
    engine.gaps = TokenGaps(window=10_000)  # every interval kept
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", "abcabcabc"[: 5 + i], params)
    engine.run_to_completion([f"r{i}" for i in range(4)])
    first = engine.stats.steps
    emitting = sum(1 for plan in runner.plans for item in plan.seqs if item.sample)  # sequence-steps that emitted
    assert engine.gaps.gaps == emitting - 4
    if speculation == "none":
        assert engine.gaps.gaps == 4 * 11
    else:
        assert engine.gaps.gaps < 4 * 11 and engine.stats.generated_tokens == 4 * 12
    assert len(engine.gaps.intervals) == first - 1 and sum(engine.gaps.counts) == engine.gaps.gaps
    engine.add_request("late", "abcab", params)
    engine.run_to_completion(["late"])
    assert len(engine.gaps.intervals) == (first - 1) + (engine.stats.steps - first - 1)
