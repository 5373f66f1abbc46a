"""Sessions that outgrow their window: ``"evict": "oldest"`` vs ``"evict": "snapkv"`` (issue 15).

    .venv/bin/python benchmarks/session_snapkv.py                      # ~5 min on 2 cores (10 samples)
    .venv/bin/python benchmarks/session_snapkv.py --samples 20 --retention 1024 --stream 4096

Defaults: a 2,048-token stream into a 512-token window (SmolLM2-135M finds the key with the full
cache only about half the time at 4k tokens, and at 2k most of the time).

A session of ``--retention`` tokens is fed a stream of ``--stream`` tokens as records of
``--record-tokens`` tokens of haystack text (Python's bundled docs, as in kv_tasks.py), one of them
the pass-key record ("The pass key is 71432. Remember it. 71432 is the pass key.") at a random
depth among the records that must leave the window. After the whole stream is ingested it is
asked "What is the pass key?". Configurations:

  full             retention = the whole stream: nothing leaves (the model's own accuracy)
  oldest           whole oldest records leave (the default)
  snapkv_B         a memory of B tokens keeps the evicted tokens the newest 32 rows attend to most

Each configuration runs twice: the stream ends in haystack, or in a cue record (``CUE``: "Keep
the pass key in mind ..."), which puts the key's topic in SnapKV's observation window.
Reported: pass-key accuracy, the share of samples whose memory still holds the key's digits,
ingestion time. The observation window is the newest *records*, not the question (a session
cannot know its future questions), so this measures what SnapKV scoring keeps on its own.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import kv_tasks  # noqa: E402
from common import fmt, md_table  # noqa: E402

from streamkv import LLM, SamplingParams  # noqa: E402
from streamkv.sessions.spec import SessionSpec  # noqa: E402

QUESTION = "What is the pass key? The pass key is"
CUE = "Keep the pass key in mind: you will be asked for the pass key."


def records_for(tok, seed: int, stream: int, record_tokens: int, retention: int,
                cue: bool) -> tuple[list[str], str]:
    """Haystack records totalling about ``stream`` tokens with the key record among those that
    will be evicted (before the last ``retention`` tokens), and with ``cue`` a last record that
    mentions the key; returns (records, key)."""
    rng = random.Random(f"session-snapkv-{seed}")
    key = str(rng.randint(10000, 99999))
    n = max(2, stream // record_tokens)
    ids = kv_tasks._filler(tok, rng, n * record_tokens)
    texts = [tok.decode(ids[i * record_tokens:(i + 1) * record_tokens]) for i in range(n)]
    evicted = max(1, (stream - retention) // record_tokens)
    at = rng.randint(0, max(0, evicted - 1))
    texts.insert(at, f"The pass key is {key}. Remember it. {key} is the pass key.")
    return texts + ([CUE] if cue else []), key


def run_one(llm: LLM, spec: SessionSpec, records: list[str], key: str) -> dict:
    engine = llm.engine
    sess = engine.sessions.create(spec)
    t0 = time.perf_counter()
    for i in range(0, len(records), 8):
        engine.sessions.push(sess.id, records[i:i + 8])
    while engine.has_unfinished() or sess.data.queue:
        engine.step()
    ingest = time.perf_counter() - t0
    engine.sessions.query(sess.id, "q", QUESTION, SamplingParams(max_tokens=8, temperature=0.0))
    text = engine.run_to_completion(["q"])["q"].text
    frozen = len(sess.layout.frozen)
    memory = engine.tokenizer.decode(list(sess.stream.tokens[frozen:frozen + sess.data.memory]))
    out = {"correct": bool(re.search(rf"\b{key}\b", text)), "key_in_memory": key in memory,
           "ingest_s": ingest, "evictions": sess.data.counters.evictions, "memory_tokens": sess.data.memory,
           "window_tokens": sess.data.sliding_tokens, "fallbacks": sess.data.counters.snapkv_fallbacks}
    engine.sessions.delete(sess.id)
    return out


def specs(args) -> dict[str, SessionSpec]:
    base = dict(system="There is an important piece of information hidden inside a lot of irrelevant text. Find it "
                "and memorize it.\n", chat=False, data_header="", record_format="{record}\n", query_prefix="\n",
                ingest_batch_tokens=512, max_queue_tokens=1 << 20)
    out = {"full": SessionSpec(retention_tokens=args.stream + 1024, **base),
           "oldest": SessionSpec(retention_tokens=args.retention, **base)}
    for b in args.budgets:
        out[f"snapkv_{b}"] = SessionSpec(retention_tokens=args.retention, evict="snapkv",
                                         kv_write={"budget_tokens": b, "observation_tokens": 32}, **base)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--retention", type=int, default=512)
    ap.add_argument("--stream", type=int, default=2048)
    ap.add_argument("--record-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="64,128,256")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.budgets = [int(b) for b in args.budgets.split(",")]
    machine = common.machine_info(args.threads)
    print(json.dumps({"machine": machine}), flush=True)
    llm = LLM()
    rows = []
    configs = [(c, item) for c in (False, True) for item in specs(args).items()]
    bar = common.progress(len(configs) * args.samples, "session streams")
    for cue, (name, spec) in configs:
        results = []
        for seed in range(args.samples):
            records, key = records_for(llm.tokenizer, seed, args.stream, args.record_tokens, args.retention, cue)
            results.append(run_one(llm, spec, records, key))
            bar.update()
        n = len(results)
        row = {"config": name, "cued": cue, "accuracy": 100 * sum(r["correct"] for r in results) / n,
               "key_in_memory": 100 * sum(r["key_in_memory"] for r in results) / n,
               "ingest_s": sum(r["ingest_s"] for r in results) / n,
               "evictions": sum(r["evictions"] for r in results) / n,
               "fallbacks": sum(r["fallbacks"] for r in results)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    bar.close()
    table = md_table(["config", "last record", "pass-key accuracy %", "key kept in memory %", "ingest s", "evictions"],
                     [[r["config"], "cue" if r["cued"] else "haystack", fmt(r["accuracy"]), fmt(r["key_in_memory"]) if r["config"].startswith("snapkv")
                       else "", fmt(r["ingest_s"], 2), fmt(r["evictions"], 1)] for r in rows])
    print(f"\n{args.samples} samples, stream {args.stream} tokens, retention {args.retention}, records of "
          f"{args.record_tokens} tokens\n\n{table}")
    path = common.write_json("session_snapkv", {"machine": machine, "args": vars(args), "rows": rows})
    print(f"cpu: {machine['cpu']['model']} {machine['cpu']['flags']}; results: {path}")


if __name__ == "__main__":
    main()
