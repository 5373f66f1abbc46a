"""Synthetic market data for the streaming-session benchmark (stdlib only).

One ticker's hourly OHLCV bars (weekdays, 10:00-16:00) moving through uptrend, correction and
consolidation phases, rendered one bar per record:

    2026-03-02 14:00 O 101.2 H 102.0 L 100.9 C 101.7 V 1200

(about 51 tokens per bar with SmolLM2's tokenizer, which splits digits), plus six kinds of
question with their ground truth computed from the bars exactly as shown (rounded), and a
parser that turns a short model answer into something comparable with the truth.
"""
from __future__ import annotations

import datetime as dt
import math
import random
import re
from dataclasses import dataclass

START = dt.datetime(2026, 3, 2, 10, 0)  # a Monday
HOURS = range(10, 17)  # 7 bars per trading day
QTYPES = ("trend", "pullback", "high", "consolidation", "volume", "retrieval")
WINDOWS = (5, 8, 10, 12, 16, 20, 24, 32, 40, 48)
# phase: (drift per bar, volatility per bar, volume drift per bar), as fractions
PHASES = {"uptrend": (0.0025, 0.004, 0.02), "correction": (-0.004, 0.006, 0.04),
          "consolidation": (0.0, 0.0015, -0.03)}
OPTIONS = {  # answer word -> canonical answer, per yes/no-like question type
    "trend": {"up": "up", "down": "down", "upward": "up", "downward": "down"},
    "pullback": {"yes": "yes", "no": "no"},
    "consolidation": {"yes": "yes", "no": "no"},
    "volume": {"rising": "rising", "falling": "falling", "increasing": "rising",
               "decreasing": "falling", "up": "rising", "down": "falling"},
}
SYSTEM = ("You are a market data assistant. The user streams hourly OHLCV bars of the ticker ACME "
          "(O open, H high, L low, C close, V volume), oldest first. Answer each question about "
          "them with a single word or number.")


@dataclass(frozen=True)
class Bar:
    ts: dt.datetime
    o: float
    h: float
    l: float
    c: float
    v: int

    def text(self) -> str:
        return (f"{self.ts:%Y-%m-%d %H:%M} O {self.o:.1f} H {self.h:.1f} L {self.l:.1f} "
                f"C {self.c:.1f} V {self.v}")


def timestamps(n: int) -> list[dt.datetime]:
    out, day = [], START
    while len(out) < n:
        if day.weekday() < 5:
            out.extend(day.replace(hour=h) for h in HOURS)
        day += dt.timedelta(days=1)
    return out[:n]


def phase_plan(n: int, rng: random.Random) -> list[str]:
    """Phase of every bar: uptrend -> correction -> consolidation -> ..., 8-24 bars each."""
    order, out, k = ("uptrend", "correction", "consolidation"), [], 0
    while len(out) < n:
        out.extend([order[k % 3]] * rng.randint(8, 24))
        k += 1
    return out[:n]


def make_bars(n: int, seed: int, price: float = 100.0) -> list[Bar]:
    rng = random.Random(seed)
    base = math.log(1500.0)
    lv, bars = base, []
    for ts, phase in zip(timestamps(n), phase_plan(n, rng)):
        drift, vol, vdrift = PHASES[phase]
        o = round(price, 1)
        c = round(o * (1 + drift + rng.gauss(0, vol)), 1)
        h = round(max(o, c) * (1 + abs(rng.gauss(0, vol / 2))), 1)
        l = round(min(o, c) * (1 - abs(rng.gauss(0, vol / 2))), 1)
        lv += vdrift + 0.05 * (base - lv) + rng.gauss(0, 0.08)  # mean-reverting log volume
        bars.append(Bar(ts, o, max(h, o, c), min(l, o, c), c, int(round(math.exp(lv), -1))))
        price = c
    return bars


# --------------------------------------------------------------------------- ground truth
def max_pullback_pct(w: list[Bar]) -> float:
    """Largest peak-to-trough fall inside the window: max over i <= j of (H_i - L_j) / H_i."""
    peak, best = 0.0, 0.0
    for b in w:
        peak = max(peak, b.h)
        best = max(best, (peak - b.l) / peak * 100)
    return best


def range_pct(w: list[Bar]) -> float:
    lo = min(b.l for b in w)
    return (max(b.h for b in w) - lo) / lo * 100


def _threshold(actual: float, rng: random.Random, want_above: bool) -> float:
    """A round threshold (0.5% steps) on the chosen side of `actual`."""
    x = max(0.5, round((actual * (0.6 if want_above else 1.5)) * 2) / 2)
    if want_above and x >= actual:
        x = max(0.5, x - 0.5)
    if not want_above and x <= actual:
        x += 0.5
    return x


def make_question(kind: str, bars: list[Bar], rng: random.Random) -> dict:
    """One question about the bars in context (all of `bars`), with its truth."""
    fits = [n for n in WINDOWS if n <= len(bars)] or [len(bars)]
    n = rng.choice(fits)
    w = bars[-n:]
    if kind == "trend":
        truth = "up" if w[-1].c > w[0].c else "down"
        q = f"Is the trend over the last {n} bars UP or DOWN? Answer UP or DOWN."
    elif kind == "pullback":
        actual = max_pullback_pct(w)
        x = _threshold(actual, rng, want_above=rng.random() < 0.5)
        truth = "yes" if actual > x else "no"
        q = f"Was there a pullback of more than {x:g}% in the last {n} bars? Answer yes or no."
    elif kind == "high":
        truth = max(b.h for b in w)
        q = f"What was the highest high in the last {n} bars? Answer with the number only."
    elif kind == "consolidation":
        actual = range_pct(w)
        x = _threshold(actual, rng, want_above=rng.random() < 0.5)
        truth = "yes" if actual < x else "no"
        q = (f"Has the price been consolidating (range < {x:g}%) over the last {n} bars? "
             "Answer yes or no.")
    elif kind == "volume":
        half = n // 2
        first, second = w[:half], w[half:]
        rising = sum(b.v for b in second) / len(second) > sum(b.v for b in first) / max(1, len(first))
        truth = "rising" if rising else "falling"
        q = f"Was volume rising or falling over the last {n} bars? Answer rising or falling."
    elif kind == "retrieval":
        b = rng.choice(bars)
        n, truth = len(bars), b.c
        q = f"What was the close at {b.ts:%Y-%m-%d %H:%M}? Answer with the number only."
    else:
        raise ValueError(f"unknown question type {kind!r}")
    return {"type": kind, "question": q, "truth": truth, "window": n}


def scenario(initial_bars: int, bars_per_round: int, rounds: int, seed: int) -> dict:
    """Round 0 = the initial batch of bars, then `rounds` rounds of new bars; one question
    after each (types cycling through QTYPES)."""
    total = initial_bars + rounds * bars_per_round
    bars = make_bars(total, seed)
    rng = random.Random(seed + 1)
    out, end = [], 0
    for r in range(rounds + 1):
        start, end = end, initial_bars + r * bars_per_round
        q = make_question(QTYPES[r % len(QTYPES)], bars[:end], rng)
        out.append({"round": r, "records": [b.text() for b in bars[start:end]], "bars_in_context": end, **q})
    return {"system": SYSTEM, "seed": seed, "rounds": out}


# --------------------------------------------------------------------------- scoring
def parse_answer(kind: str, text: str) -> str | float | None:
    """Numbers: the first number in the answer. Words: the first word that is one of the
    question's options (or a listed synonym)."""
    if kind in ("high", "retrieval"):
        m = re.search(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
        return float(m.group()) if m else None
    for word in re.findall(r"[a-z]+", text.lower()):
        if word in OPTIONS[kind]:
            return OPTIONS[kind][word]
    return None


def is_correct(kind: str, truth: str | float, text: str) -> bool:
    got = parse_answer(kind, text)
    if got is None:
        return False
    if isinstance(truth, float):
        return isinstance(got, float) and abs(got - truth) < 0.051
    return got == truth


if __name__ == "__main__":
    import json
    import sys

    sc = scenario(16, 16, 7, int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    for r in sc["rounds"]:
        print(json.dumps({k: r[k] for k in ("round", "type", "question", "truth", "bars_in_context")}))
    print(sc["rounds"][0]["records"][0])
