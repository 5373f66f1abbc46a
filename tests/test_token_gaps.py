"""Engine-side decode stalls (``engine/token_gaps.py``): token gaps and step intervals in
log-spaced histograms, idle waits left out; counted by the engine on every emitted token."""
from __future__ import annotations

import math

import pytest

from streamkv.engine.token_gaps import BUCKETS, Histogram, TokenGaps
from streamkv.sampling.params import SamplingParams
from tests.fakes import fake_engine


def test_intervals_only_while_the_engine_has_work_and_gaps_only_across_steps():
    g = TokenGaps()
    for t in (0.0, 0.1, 0.2, 0.3):
        g.step_end(t)
    g.idle()
    g.step_end(10.0)  # after an idle wait: no 9.7 s interval
    g.step_end(10.4)
    assert g.intervals.n == 4 and g.intervals.total == pytest.approx(0.7)
    g.gap(0.0)  # two tokens of one step
    g.gap(0.25)
    assert g.gaps.n == 1 and g.gaps.total == 0.25


def test_histogram_quantiles_and_counts_over_a_threshold_interpolate_within_buckets():
    h = Histogram()
    for v in [0.1] * 50 + [0.2] * 49 + [5.0]:
        h.add(v)
    assert h.n == 100 and BUCKETS[0] == 0.001 and BUCKETS[3] == 0.002 and BUCKETS[-1] == pytest.approx(65.536)
    top = next(b for b in BUCKETS if b >= 0.1)  # the 26%-wide bucket holding 0.1: the 50 lowest
    assert h.quantile(0.5) == pytest.approx(top) and h.quantile(0.25) == pytest.approx((BUCKETS[BUCKETS.index(top) - 1] + top) / 2)
    assert h.above(0.3) == 1 and h.above(0.15) == 50 and h.above(100.0) == 0
    bucket = next(b for b in BUCKETS if b >= 0.2)  # a threshold inside a bucket: its linear share
    lower = BUCKETS[BUCKETS.index(bucket) - 1]
    assert h.above((lower + bucket) / 2) == pytest.approx(49 / 2 + 1)
    assert h.max_bound() == next(b for b in BUCKETS if b >= 5.0)
    h.add(1000.0)
    assert h.max_bound() == math.inf and h.quantile(1.0) == BUCKETS[-1]
    cum = [n for _, n in h.cumulative()]
    assert cum[-1] == h.n and Histogram.from_cumulative(cum).counts == h.counts
    assert math.isnan(Histogram().quantile(0.5)) and Histogram().max_bound() == 0.0
    with pytest.raises(ValueError, match="buckets"):
        Histogram.from_cumulative([1.0, 2.0])


@pytest.mark.parametrize("speculation", ["none", "pld"])
def test_the_engine_counts_one_gap_per_step_that_emits_a_later_token(speculation):
    """4 requests of 12 tokens: without speculation every step emits one token of each, so
    11 gaps each; a speculating step emits several tokens of a sequence with no gap between
    them. A second batch after the engine went idle adds its own intervals only."""
    engine, runner = fake_engine(repeat=3, speculation=speculation, spec_ngram_min=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", "abcabcabc"[: 5 + i], params)
    engine.run_to_completion([f"r{i}" for i in range(4)])
    first = engine.stats.steps
    emitting = sum(1 for plan in runner.plans for item in plan.seqs if item.sample)  # sequence-steps that emitted
    assert engine.gaps.gaps.n == emitting - 4
    if speculation == "none":
        assert engine.gaps.gaps.n == 4 * 11
    else:
        assert engine.gaps.gaps.n < 4 * 11 and engine.stats.generated_tokens == 4 * 12
    assert engine.gaps.intervals.n == first - 1
    engine.add_request("late", "abcab", params)
    engine.run_to_completion(["late"])
    assert engine.gaps.intervals.n == (first - 1) + (engine.stats.steps - first - 1)
