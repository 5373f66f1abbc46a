"""Decode stalls measured on the engine thread: each sequence's gap between two emitted tokens
against the median step interval (issue 16's target: no gap over 3x the median step).

::

    model step ends:   |----i----|----i----|---------i---------|----i----|
    one sequence:      t1        t2                            t3        t4
                       gap(t1,t2) = 1 interval            gap(t2,t3) = 3 intervals' worth
                                                           (a long step, or a skipped one)

* An interval is the time between two model steps' ends while the engine had work at the first
  (an idle engine's wait is not a step). The median is over the last ``window`` intervals.
* A gap is counted between two steps that each emitted a token of the sequence (tokens a
  speculating sequence emits in one step have no gap between them); its ratio is the gap over
  the median interval at that moment. Ratios go into a fixed set of buckets (Prometheus).

This is the scheduler's share of a stall: what a client sees also holds the HTTP transport
(``benchmarks/multitenant.py`` measures both).
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass, field

RATIO_BUCKETS = (1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 20.0)  # upper bounds; then +Inf


@dataclass
class TokenGaps:
    """Engine-side inter-token gaps in multiples of the median step interval."""

    window: int = 64  # steps: ~3-10 s at this benchmark's cadence; a longer window lags a change of load
    intervals: deque = field(init=False)
    median: float = 0.0  # seconds; 0 until the first interval
    gaps: int = 0  # gaps measured (while a median was known)
    ratio_sum: float = 0.0
    worst: float = 0.0  # the largest ratio so far
    counts: list[int] = field(init=False)  # per bucket of RATIO_BUCKETS, then +Inf (not cumulative)
    _last_end: float | None = None
    _had_work: bool = False

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        self.intervals = deque(maxlen=self.window)
        self.counts = [0] * (len(RATIO_BUCKETS) + 1)

    def step_end(self, now: float) -> None:
        """A model step ended at ``now`` (seconds, monotonic)."""
        if self._last_end is not None and self._had_work and now > self._last_end:
            self.intervals.append(now - self._last_end)
            self.median = statistics.median(self.intervals)
        self._last_end, self._had_work = now, True

    def idle(self) -> None:
        """The engine ran out of work: the wait until its next step is not an interval."""
        self._had_work = False

    def gap(self, seconds: float) -> None:
        """One sequence emitted tokens ``seconds`` apart, in two different steps."""
        if self.median <= 0.0 or seconds <= 0.0:  # no step yet, or tokens of one step
            return
        ratio = seconds / self.median
        self.gaps += 1
        self.ratio_sum += ratio
        self.worst = max(self.worst, ratio)
        self.counts[bisect.bisect_left(RATIO_BUCKETS, ratio)] += 1

    def over(self, factor: float) -> int:
        """Gaps whose ratio exceeded ``factor`` (one of RATIO_BUCKETS)."""
        return sum(self.counts[RATIO_BUCKETS.index(factor) + 1:])

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus histogram buckets: (upper bound, gaps at or under it), +Inf last."""
        out, total = [], 0
        for bound, n in zip((*map(str, RATIO_BUCKETS), "+Inf"), self.counts):
            total += n
            out.append((bound, total))
        return out
