"""Live-session questions under a read policy (``kv_read``): latency, chunk invariance and
agreement with the exact session, on the embedded model.

    .venv/bin/python benchmarks/session_read_policy.py [--questions 8] [--budgets 256,512,1024]
        [--dtype float32] [--parts latency,forks,agreement]

Three parts (``--parts``), after the CPU (model, vector flags) and the model's dtype:

* latency: a session of ~5.9k tokens of sensor records; the median seconds to a question's
  first token and to its end (8 answer tokens) exact, under ``quest(1024)`` reusing the
  question's picks (``rescore: false``, the sessions' default) and re-scoring every row
  (``rescore: true``); each answer is also asked with ``max_chunk_tokens=5`` and must be
  bit-identical (the question's rows pick their own pages: ``streamkv.attention.picks``);
* forks: quest(1024) questions forking the session's ready fork (the scaffold prefix computed
  ahead) or the stream (no ready fork open: the prefix is computed exactly in the question's
  step); first-token and total median seconds, and the answers must be equal;
* agreement: 24 retrieval questions ("What is the code for item X?") over ~2.8k tokens of
  records, greedy 24 tokens; per budget, the mean length of the answer's prefix equal to the
  exact session's and how many answers are identical (the 135M model retrieves few codes
  exactly, so agreement with the exact session is the measure, not correctness).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_info, md_table  # noqa: E402
from streamkv import LLM, SamplingParams  # noqa: E402
from streamkv.engine.dtype import resolve_dtype  # noqa: E402
from streamkv.sessions.spec import SessionSpec  # noqa: E402

PARTS = ("latency", "forks", "agreement")
QUEST = {"policy": "quest", "budget_tokens": 1024, "sink_tokens": 64, "recent_tokens": 256}


def _session(engine, records: list[str], policy: dict | None, system: str):
    s = engine.sessions.create(SessionSpec(system=system, retention_tokens=8000, kv_read=policy))
    engine.sessions.push(s.id, records)
    while engine.has_unfinished():
        engine.step()
    return s


def _ask(engine, sid: str, rid: str, question: str, params: SamplingParams):
    engine.sessions.query(sid, rid, question, params)
    return engine.run_to_completion([rid])[rid]


def _timed(engine, sid: str, rid: str, question: str, params: SamplingParams):
    """(the answer, seconds to its first token, seconds to its end), stepping the engine here."""
    t, t_first, out = time.perf_counter(), None, None
    engine.sessions.query(sid, rid, question, params)
    while out is None:
        for o in engine.step():
            if o.request_id == rid and t_first is None and o.token_ids:
                t_first = time.perf_counter() - t
            out = o if o.request_id == rid and o.finished else out
    if t_first is None:
        raise RuntimeError(f"question {rid} finished without a token: {out.finish_reason}")
    return out, t_first, time.perf_counter() - t


def latency(n: int, dtype: str) -> list[list]:
    records = [f"sensor {i % 7} reading {(i * 37) % 1000} at t={i}" for i in range(400)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    questions = [f"Across every sensor listed above, what was the reading of sensor {j % 7} at t={j * 40 + 3}, "
                 "and which was largest?" for j in range(n + 2)]
    engines = {chunk: LLM(dtype=dtype, max_chunk_tokens=chunk).engine for chunk in (None, 5)}
    rows = []
    for label, policy in [("exact", None), ("quest(1024), rescore false", {**QUEST, "rescore": False}),
                          ("quest(1024), rescore true", {**QUEST, "rescore": True})]:
        answers, firsts, times, ctx = {}, [], [], 0
        for chunk, engine in engines.items():
            s = _session(engine, records, policy, "Answer from the data.")
            ctx = s.data.snapshot_len()
            for j, q in enumerate(questions):
                out, first, total = _timed(engine, s.id, f"q{j}", q, params)
                if chunk is None and j >= 2:  # two warm-up questions
                    firsts.append(first)
                    times.append(total)
                answers.setdefault(j, []).append((out.token_ids, [lp.logprob for lp in out.logprobs]))
            engine.sessions.delete(s.id)
        same = sum(a[0] == a[1] for a in answers.values())
        rows.append([label, ctx, f"{statistics.median(firsts):.3f}", f"{statistics.median(times):.3f}",
                     f"{same}/{len(answers)}"])
    return rows


def forks(n: int, dtype: str) -> list[list]:
    """Median first-token and total seconds of quest(1024) questions that fork the session's
    ready fork (its scaffold prefix computed ahead) or, that closed, the stream (the prefix is
    computed exactly with the question); the answers must be equal."""
    records = [f"sensor {i % 7} reading {(i * 37) % 1000} at t={i}" for i in range(400)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    engine = LLM(dtype=dtype).engine
    s = _session(engine, records, {**QUEST, "rescore": False}, "Answer from the data.")
    rows, answers = [], {}
    for fork in ("ready", "stream"):
        first, total = [], []
        for j in range(n + 2):
            q = (f"Across every sensor listed above, what was the reading of sensor {j % 7} at t={j * 40 + 3}, "
                 "and which was largest?")
            for _ in range(64):  # the ready fork reopens once the session is idle
                if s.ready is not None:
                    break
                engine.step()
            if fork == "stream":
                engine.sessions.ready_forks.close(s)
            assert (s.ready is not None) == (fork == "ready"), fork
            out, t_first, t_total = _timed(engine, s.id, f"{fork}{j}", q, params)
            if j >= 2:
                first.append(t_first)
                total.append(t_total)
            answers.setdefault(j, []).append(out.token_ids)
        rows.append([fork, s.data.snapshot_len(), f"{statistics.median(first):.3f}", f"{statistics.median(total):.3f}"])
    same = sum(a[0] == a[1] for a in answers.values())
    return [row + [f"{same}/{len(answers)}"] for row in rows]


def agreement(budgets: list[int], dtype: str) -> list[list]:
    rng = random.Random(7)
    names = [f"{rng.choice(['red', 'blue', 'green', 'amber', 'violet', 'grey'])}-"
             f"{rng.choice(['fox', 'owl', 'cat', 'elk', 'yak', 'eel'])}-{i}" for i in range(150)]
    codes = [rng.randint(1000, 9999) for _ in names]
    records = [f"The code for item {n} is {c}." for n, c in zip(names, codes)]
    asks = rng.sample(range(len(names)), 24)
    engine = LLM(dtype=dtype).engine
    params = SamplingParams(max_tokens=24, temperature=0.0)
    answers, rows = {}, []
    for budget in [0, *budgets]:
        policy = {**QUEST, "budget_tokens": budget, "sink_tokens": 32, "recent_tokens": 64} if budget else None
        s = _session(engine, records, policy, "Answer with the code only.")
        outs = [_ask(engine, s.id, f"a{budget}-{j}", f"What is the code for item {names[a]}?", params).token_ids
                for j, a in enumerate(asks)]
        engine.sessions.delete(s.id)
        answers[budget] = outs
        if budget:
            prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                      for a, b in zip(outs, answers[0])]
            rows.append([f"quest({budget})", s.data.snapshot_len(), f"{sum(prefix) / len(prefix):.2f}",
                         f"{sum(a == b for a, b in zip(outs, answers[0]))}/{len(outs)}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=8, help="timed questions per policy (after 2 warm-ups)")
    ap.add_argument("--budgets", default="256,512,1024", help="quest budgets of the agreement part")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="the model's dtype (auto: this machine's, as `make serve` "
                    "loads it: bfloat16 with AVX512-BF16, else float32)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"any of {', '.join(PARTS)}")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if any(p not in PARTS for p in parts):
        ap.error(f"--parts: expected a comma-separated list of {', '.join(PARTS)}, got {args.parts!r}")
    info = machine_info(args.threads)
    print(f"CPU: {info['cpu']['model']}, {info['affinity']} cores, flags: {', '.join(info['cpu']['flags'])}; "
          f"torch {info['torch']} with {info['torch_threads']} threads; dtype {args.dtype} "
          f"({resolve_dtype(args.dtype, torch.device('cpu'))})")
    if "latency" in parts:
        print("\n## Question latency (median s, 8 answer tokens) and chunk invariance\n")
        print(md_table(["policy", "context tokens", "first token s", "total s", "bit-identical with max_chunk_tokens=5"],
                       latency(args.questions, args.dtype)))
    if "forks" in parts:
        print("\n## quest(1024) questions on the ready fork or the stream (median s)\n")
        print(md_table(["fork", "context tokens", "first token s", "total s", "same answers"],
                       forks(args.questions, args.dtype)))
    if "agreement" in parts:
        print("\n## Agreement with the exact session (24 retrieval questions, greedy 24 tokens)\n")
        print(md_table(["policy", "context tokens", "mean agreeing prefix (tokens)", "identical answers"],
                       agreement([int(b) for b in args.budgets.split(",")], args.dtype)))


if __name__ == "__main__":
    main()
