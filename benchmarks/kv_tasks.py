"""Long-context probes for KV compression (benchmarks/kv_compression.py), RULER-style, generated.

The haystack is the text of Python's own bundled documentation (``pydoc_data.topics``): license
clean, always installed, ~113k tokens. Every sample is seeded, so every policy sees the same
prompt ids. Each task returns ``Sample(prompt, answers, max_tokens)``; :func:`score` gives 1.0 when
every answer appears in the output (variable tracing: the fraction found).

  passkey        "The pass key is 71432. Remember it." at a random depth; "The pass key is"
  niah_single    one "special magic number for <key>" (7 digits) at a random depth
  niah_multikey  four such needles with different keys; asked about one
  vt             a 4-hop chain "VAR QPZKR = 41870 ... VAR HJSAM = VAR QPZKR" spread through the text;
                 "which variables are assigned 41870?"
  ppl            a continuous span of the haystack: the context, then 128 tokens whose
                 log-likelihood is measured (teacher forcing)
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field
from functools import lru_cache

TASKS = ("passkey", "niah_single", "niah_multikey", "vt", "ppl")
KEYS = ("amber", "birch", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
        "lagoon", "meadow", "nectar", "onyx", "prairie", "quartz", "raven", "saffron", "tundra")
PPL_TOKENS = 128
VT_HOPS = 4  # RULER's; SmolLM2-135M names none of them even at 1k tokens with the full cache (2 hops, or
#             "what is the value of VAR X?", did no better): the task discriminates only on larger models


@dataclass(frozen=True)
class Sample:
    task: str
    prompt: list[int]                       # token ids (context + question)
    answers: tuple[str, ...] = ()
    max_tokens: int = 12
    continuation: tuple[int, ...] = field(default=())  # ppl: the ids whose likelihood is measured


@lru_cache(maxsize=2)
def haystack_ids(tok_key: int, tok) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    return tok.encode(text, add_special_tokens=False)


def _filler(tok, rng: random.Random, n: int) -> list[int]:
    ids = haystack_ids(id(tok), tok)
    start = rng.randint(0, len(ids) - n - 1)
    return ids[start:start + n]


def _insert(tok, rng: random.Random, length: int, head: str, needles: list[str], question: str) -> list[int]:
    """``head`` + filler with each needle at a random depth (in order) + ``question``: ``length`` ids."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    pieces = [enc(n) for n in needles]
    fixed = len(enc(head)) + sum(map(len, pieces)) + len(enc(question)) + 1
    body = _filler(tok, rng, length - fixed)
    cuts = sorted(rng.randint(int(0.05 * len(body)), int(0.95 * len(body))) for _ in needles)
    ids, prev = list(tok.encode(head, add_special_tokens=True)), 0
    for cut, piece in zip(cuts, pieces):
        ids += body[prev:cut] + piece
        prev = cut
    return ids + body[prev:] + enc(question)


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10 ** n - 1))


def make(task: str, tok, length: int, seed: int) -> Sample:
    rng = random.Random(f"{task}-{length}-{seed}")
    if task == "passkey":
        key = _digits(rng, 5)
        ids = _insert(tok, rng, length, "There is an important piece of information hidden inside a lot of irrelevant "
                      "text. Find it and memorize it.\n", [f"\nThe pass key is {key}. Remember it. {key} is the pass "
                                                           f"key.\n"], "\nWhat is the pass key? The pass key is")
        return Sample(task, ids, (key,), 8)
    if task in ("niah_single", "niah_multikey"):
        keys = rng.sample(KEYS, 1 if task == "niah_single" else 4)
        values = [_digits(rng, 7) for _ in keys]
        asked = rng.randrange(len(keys))
        needles = [f" One of the special magic numbers for {k} is: {v}. " for k, v in zip(keys, values)]
        q = (f"\nWhat is the special magic number for {keys[asked]} mentioned in the provided text? The special "
             f"magic number for {keys[asked]} mentioned in the provided text is")
        ids = _insert(tok, rng, length, "Some special magic numbers are hidden within the following text. Make sure "
                      "to memorize them. I will quiz you about the numbers afterwards.\n", needles, q)
        return Sample(task, ids, (values[asked],), 12)
    if task == "vt":
        value = _digits(rng, 5)
        names = ["".join(rng.choice(string.ascii_uppercase) for _ in range(5)) for _ in range(VT_HOPS)]
        chain = [f" VAR {names[0]} = {value}. "] + [f" VAR {b} = VAR {a}. " for a, b in zip(names, names[1:])]
        q = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
             f"According to the chain(s) of variable assignment in the text above, {VT_HOPS} variables are assigned "
             f"the value {value}, they are:")
        ids = _insert(tok, rng, length, "Memorize and track the chain(s) of variable assignment hidden in the "
                      "following text.\n", chain, q)
        return Sample(task, ids, tuple(names), 30)
    if task == "ppl":
        span = _filler(tok, rng, length + PPL_TOKENS)
        return Sample(task, list(tok.encode("", add_special_tokens=True)) + span[:length],
                      continuation=tuple(span[length:]), max_tokens=PPL_TOKENS)
    raise ValueError(f"unknown task {task!r}; known: {TASKS}")


def score(sample: Sample, text: str) -> float:
    """1.0 if the answer is in the output (vt: the share of the chain's variables named)."""
    found = [bool(re.search(rf"\b{re.escape(a)}\b", text)) for a in sample.answers]
    return sum(found) / len(found) if sample.task == "vt" else float(all(found))
