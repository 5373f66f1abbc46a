"""Decode stalls measured on the engine thread: each sequence's gap between two emitted tokens,
and the interval between two model steps (issue 16's target: no gap over 3x the median step).

::

    model step ends:   |----i----|----i----|---------i---------|----i----|
    one sequence:      t1        t2                            t3        t4
                       gap(t1,t2) = 1 interval            gap(t2,t3) = 3 intervals' worth
                                                           (a long step, or a skipped one)

* An interval is the time between two model steps' ends while the engine had work at the first
  (an idle engine's wait is not a step).
* A gap is counted between two steps that each emitted a token of the sequence (tokens a
  speculating sequence emits in one step have no gap between them).
* Both go into the same log-spaced buckets (Prometheus histograms), so a reader can take the
  median interval of any window (two scrapes) and count the gaps over 3x it
  (``benchmarks/multitenant.py`` does, per phase).

This is the scheduler's share of a stall: what a client sees also holds the HTTP transport.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# upper bounds, seconds: 1 ms to ~65 s, 3 per doubling (each 26% above the last); then +Inf
BUCKETS = tuple(round(0.001 * 2 ** (i / 3), 6) for i in range(49))


@dataclass
class Histogram:
    """Counts per bucket of BUCKETS (then +Inf; not cumulative) and their sum, seconds."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    @property
    def n(self) -> int:
        return sum(self.counts)

    @classmethod
    def from_cumulative(cls, cum: list[float], total: float = 0.0) -> "Histogram":
        """From Prometheus' cumulative bucket values (BUCKETS then +Inf), e.g. a scrape's
        difference over a window."""
        if len(cum) != len(BUCKETS) + 1:
            raise ValueError(f"expected {len(BUCKETS) + 1} buckets, got {len(cum)}")
        counts = [round(b - a) for a, b in zip([0.0, *cum], cum)]
        return cls(counts, total)

    def _edges(self, i: int) -> tuple[float, float]:
        lo = BUCKETS[i - 1] if i > 0 else 0.0
        return lo, BUCKETS[i] if i < len(BUCKETS) else lo

    def quantile(self, q: float) -> float:
        """The ``q`` quantile, linear within its bucket (the last bound for +Inf); NaN if empty."""
        n, run = self.n, 0
        if n == 0:
            return float("nan")
        for i, c in enumerate(self.counts):
            if c and run + c >= q * n:
                lo, hi = self._edges(i)
                return lo + (hi - lo) * (q * n - run) / c
            run += c
        return BUCKETS[-1]

    def above(self, x: float) -> float:
        """Observations over ``x``: whole buckets past it, and a linear share of the bucket
        holding it."""
        i = bisect.bisect_left(BUCKETS, x)
        lo, hi = self._edges(i)
        share = (hi - x) / (hi - lo) if hi > lo else 0.0
        return self.counts[i] * share + sum(self.counts[i + 1:])

    def max_bound(self) -> float:
        """The upper bound of the highest non-empty bucket (inf for +Inf; 0 if empty)."""
        for i in range(len(self.counts) - 1, -1, -1):
            if self.counts[i]:
                return BUCKETS[i] if i < len(BUCKETS) else float("inf")
        return 0.0

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, observations at or under it), +Inf last."""
        out, run = [], 0
        for bound, n in zip((*map(str, BUCKETS), "+Inf"), self.counts):
            run += n
            out.append((bound, run))
        return out


@dataclass
class TokenGaps:
    """Engine-side inter-token gaps and step intervals (seconds)."""

    gaps: Histogram = field(default_factory=Histogram)
    intervals: Histogram = field(default_factory=Histogram)
    _last_end: float | None = None
    _had_work: bool = False

    def step_end(self, now: float) -> None:
        """A model step ended at ``now`` (seconds, monotonic)."""
        if self._last_end is not None and self._had_work and now > self._last_end:
            self.intervals.add(now - self._last_end)
        self._last_end, self._had_work = now, True

    def idle(self) -> None:
        """The engine ran out of work: the wait until its next step is not an interval."""
        self._had_work = False

    def gap(self, seconds: float) -> None:
        """One sequence emitted tokens ``seconds`` apart (0: in one step, not a gap)."""
        if seconds > 0.0:
            self.gaps.add(seconds)
