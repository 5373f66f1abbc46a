"""Workload of the flash-query benchmark (stdlib only): the market-data stream of
`market_data.py` plus a fixed set of questions whose text stays the same from round to round
(so they can be registered once as flash questions) and whose ground truth is recomputed from
the bars in context at every round.

The questions are made by `market_data.make_question` over the initial bars (so every window
fits from round 0 on); `truth` re-derives the answer at a later round from the question text
(window, threshold, timestamp) exactly as `make_question` did.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

import market_data
from market_data import Bar

ANSWER_WORDS = ("UP", "DOWN", "yes", "no", "rising", "falling")
WORD_TYPES = ("trend", "pullback", "consolidation", "volume")  # one-word answers
SENTINEL = "\u2063FLASHQ\u2063"
# start of the assistant turn in the answer-position scaffold: this model opens answers with
# "The ..." (the ready token is then "The"); a cue puts the ready position at the answer word
READY_CUES = {"trend": "The trend is", "volume": "Volume was", "pullback": "Answer:", "consolidation": "Answer:"}


@dataclass(frozen=True)
class Question:
    key: str  # q0, q1, ...
    kind: str
    text: str
    registered: bool  # a flash question of the flash session


@dataclass(frozen=True)
class Workload:
    system: str
    initial_bars: int
    bars_per_round: int
    bars: list[Bar]
    rounds: list[list[str]]  # records pushed per round (round 0 = the initial batch)
    questions: list[Question]

    def bars_at(self, rnd: int) -> list[Bar]:
        return self.bars[: self.initial_bars + rnd * self.bars_per_round]

    @property
    def registered(self) -> list[Question]:
        return [q for q in self.questions if q.registered]

    @property
    def unregistered(self) -> list[Question]:
        return [q for q in self.questions if not q.registered]


def make_questions(bars: list[Bar], n: int, flash_share: float, seed: int) -> list[Question]:
    """n distinct questions, types cycling through market_data.QTYPES; a shuffled
    round(n * flash_share) of them are the registered (flash) ones."""
    rng = random.Random(seed + 7)
    texts: list[tuple[str, str]] = []
    attempts = 0
    while len(texts) < n and attempts < 50 * n:
        kind = market_data.QTYPES[len(texts) % len(market_data.QTYPES)]
        q = market_data.make_question(kind, bars, rng)
        attempts += 1
        if q["question"] not in {t for _, t in texts}:
            texts.append((kind, q["question"]))
    rng.shuffle(texts)
    n_reg = round(len(texts) * flash_share)
    return [Question(f"q{i}", kind, text, i < n_reg) for i, (kind, text) in enumerate(texts)]


def build(initial_bars: int, bars_per_round: int, rounds: int, seed: int, n_questions: int,
          flash_share: float) -> Workload:
    sc = market_data.scenario(initial_bars, bars_per_round, rounds, seed)
    bars = market_data.make_bars(initial_bars + rounds * bars_per_round, seed)
    questions = make_questions(bars[:initial_bars], n_questions, flash_share, seed)
    return Workload(sc["system"], initial_bars, bars_per_round, bars,
                    [r["records"] for r in sc["rounds"]], questions)


# --------------------------------------------------------------------------- ground truth
def _window(text: str, bars: list[Bar]) -> list[Bar]:
    m = re.search(r"last (\d+) bars", text)
    return bars[-int(m.group(1)):] if m else bars


def _threshold(text: str) -> float:
    m = re.search(r"(\d+(?:\.\d+)?)%", text)
    if m is None:
        raise ValueError(f"no threshold in {text!r}")
    return float(m.group(1))


def truth(q: Question, bars: list[Bar]) -> str | float:
    """The answer to q over `bars` (everything in context), as market_data.make_question."""
    w = _window(q.text, bars)
    if q.kind == "trend":
        return "up" if w[-1].c > w[0].c else "down"
    if q.kind == "pullback":
        return "yes" if market_data.max_pullback_pct(w) > _threshold(q.text) else "no"
    if q.kind == "high":
        return max(b.h for b in w)
    if q.kind == "consolidation":
        return "yes" if market_data.range_pct(w) < _threshold(q.text) else "no"
    if q.kind == "volume":
        half = len(w) // 2
        first, second = w[:half], w[half:]
        return "rising" if sum(b.v for b in second) / len(second) > \
            sum(b.v for b in first) / max(1, len(first)) else "falling"
    if q.kind == "retrieval":
        stamp = re.search(r"at (\d{4}-\d\d-\d\d \d\d:\d\d)", q.text).group(1)
        return next(b.c for b in bars if f"{b.ts:%Y-%m-%d %H:%M}" == stamp)
    raise ValueError(f"unknown question type {q.kind!r}")


def correct(q: Question, bars: list[Bar], answer: str) -> bool:
    return market_data.is_correct(q.kind, truth(q, bars), answer or "")


def same_answer(q: Question, a: str, b: str) -> bool:
    """Two answers agree on what the scorer reads from them (first number / option word)."""
    pa, pb = market_data.parse_answer(q.kind, a or ""), market_data.parse_answer(q.kind, b or "")
    return pa is not None and pa == pb


# --------------------------------------------------------------------------- ready exit
def vocab_candidates(words: tuple[str, ...] = ANSWER_WORDS) -> list[str]:
    """Case variants of the answer words; the caller keeps those that are one token."""
    out: list[str] = []
    for w in words:
        for v in (w, w.lower(), w.upper(), w.capitalize()):
            if v not in out:
                out.append(v)
    return out


def answer_position_spec(before: str, after: str, q: Question, cue: bool = True,
                         data_header: str = "Data:\n") -> dict:
    """Session fields whose query scaffold *ends at the answer* of one fixed question: the
    chat template is written out by hand (chat=false), the question and the assistant marker
    sit in query_prefix, so the ready position is that question's first answer token.
    `before`/`after` = the chat template around the user turn's content; with `cue`, the
    assistant turn starts with READY_CUES[kind]."""
    start = READY_CUES.get(q.kind, "") if cue else ""
    return {"system": before, "chat": False, "data_header": data_header,
            "query_prefix": f"\nQuestion: {q.text}{after}{start}", "query_suffix": ""}


def split_template(rendered: str) -> tuple[str, str]:
    """The chat template text before / after the SENTINEL user content."""
    if rendered.count(SENTINEL) != 1:
        raise ValueError("the chat template does not render the user turn verbatim")
    before, after = rendered.split(SENTINEL)
    return before, after
