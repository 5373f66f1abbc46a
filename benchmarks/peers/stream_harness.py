"""The round loop every streaming-session runner shares (stdlib only: it runs in every venv).

A runner defines an engine adapter and calls `main(make_engine)`. The adapter has either

    answer(ids, data_len, max_tokens) -> {"token_ids": [...], "cached_tokens": int|None, ...}
        one request-driven query on the full prompt `ids` (the first `data_len` of them are the
        data, the rest the question scaffold); the harness times the whole call
    reset()   [optional]  forget any state (called after the warm-up)

or its own `round(r, wl) -> {"latency_s": s, "token_ids": [...], ...}` (streamkv sessions, which
ingest records and time the query themselves). `info` (dict) describes the engine.

Workload (written by benchmarks/streaming_session.py): {"threads", "gguf", "hf_dir",
"max_tokens", "ignore_eos", "eos_ids", "warmup_ids", "system", "retention",
"rounds": [{"records": [...], "question": str, "ids": [...], "data_len": n}, ...]}.
Every request-driven engine gets the identical token ids (`ids`) of the streamkv session's query.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
from typing import Any, Callable

import harness  # same directory: runners are started as scripts
from harness import log


def timed_answer(eng: Any, r: dict, wl: dict) -> dict:
    t0 = time.perf_counter()
    out = eng.answer(r["ids"], r["data_len"], wl["max_tokens"])
    out["latency_s"] = time.perf_counter() - t0
    out["prompt_tokens"] = len(r["ids"])
    return out


def warm_up(eng: Any, wl: dict) -> None:
    """First-call costs (allocation, kernel choice, thread pools) stay out of round 0."""
    if hasattr(eng, "warmup"):
        eng.warmup(wl)
        return
    ids = wl["warmup_ids"]
    eng.answer(ids, len(ids) // 2, 2)
    eng.answer(ids + ids[:8], len(ids), 2)
    if hasattr(eng, "reset"):
        eng.reset()


def run_rounds(eng: Any, wl: dict, result: dict) -> None:
    result["rounds"] = []
    for i, r in enumerate(wl["rounds"]):
        try:
            rec = eng.round(r, wl) if hasattr(eng, "round") else timed_answer(eng, r, wl)
        except Exception as e:  # keep the rounds done so far
            traceback.print_exc()
            result["error"] = f"round {i}: {type(e).__name__}: {e}"
            return
        result["rounds"].append(rec)
        brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()
                 if k not in ("token_ids", "prompt_token_ids")}
        log(f"round {i}: {json.dumps(brief)}")


def main(make_engine: Callable[[argparse.Namespace, dict], Any],
         extra_args: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    harness.run(make_engine, extra_args, _measure)


def _measure(eng: Any, wl: dict, result: dict) -> None:
    t0 = time.perf_counter()
    warm_up(eng, wl)
    result["warmup_s"] = time.perf_counter() - t0
    run_rounds(eng, wl, result)
    result["info"] = getattr(eng, "info", result["info"])  # adapters may add details on the way
