"""Adaptive prefill chunks (issue 16, mechanism 2): what they cost a lone long prompt and what
they buy the decodes that share its steps.

    .venv/bin/python benchmarks/adaptive_chunks.py        # ~3 min on 2 cores

1. Prefill tokens/s of one 2,048- and one 4,096-token prompt (no prefix cache), static chunks
   (up to the 2,048-token budget) vs adaptive (clamp(budget / N, 128, 1024)).
2. Stalls: 4 sequences decode while 1 or 4 long prompts (2,048 tokens) arrive; the longest gap
   between two tokens of a decoding sequence, its median, and when the long prompts are done
   (their first token), static vs adaptive vs adaptive + the decode cadence (``--stall-factor 3``).
Runs alternate between the two engines; best of ``--repeats``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import fmt, md_table  # noqa: E402

from streamkv import LLM, SamplingParams  # noqa: E402


def prompt_ids(llm: LLM, n: int, salt: int) -> list[int]:
    ids = llm.tokenizer.encode(f"[{salt}] " + common.prompt_text(n * 8))
    return ids[:n]


def prefill_rate(llm: LLM, ids: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    return len(ids) / (time.perf_counter() - t0)


def stalls(llm: LLM, long_prompts: list[list[int]], short: list[list[int]]) -> dict:
    """Decode ``short`` until they run, then add ``long_prompts``; per-token times of the short ones."""
    e = llm.engine
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ids = [f"d{i}" for i in range(len(short))]
    for rid, p in zip(ids, short):
        e.add_request(rid, p, params)
    times: dict[str, list[float]] = {r: [] for r in ids}
    added_at, last_long = 0.0, 0.0
    while True:
        outs = e.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in times and o.delta_token_ids:
                times[o.request_id].append(now)
            elif o.request_id.startswith("l") and o.finished:
                last_long = now
        if not added_at and all(len(t) >= 4 for t in times.values()):
            for j, p in enumerate(long_prompts):
                e.add_request(f"l{j}", p, SamplingParams(max_tokens=1, temperature=0.0))
            added_at = time.perf_counter()
        if not e.has_unfinished():
            break
    gaps = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    return {"max_gap_ms": 1000 * max(gaps), "median_gap_ms": 1000 * statistics.median(gaps),
            "long_ttft_ms": 1000 * (last_long - added_at)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    machine = common.machine_info(args.threads)
    print(json.dumps({"machine": machine}), flush=True)
    engines = {m: LLM(chunking=m, enable_prefix_caching=False, speculation="none") for m in ("static", "adaptive")}
    cadence = LLM(chunking="adaptive", enable_prefix_caching=False, speculation="none", stall_factor=3.0)
    rows = []
    for n in (2048, 4096):
        best = {m: 0.0 for m in engines}
        for r in range(args.repeats):
            for m, llm in engines.items():
                best[m] = max(best[m], prefill_rate(llm, prompt_ids(llm, n, r)))
        rows.append({"prompt": n, **{f"{m}_tok_s": v for m, v in best.items()},
                     "change_pct": 100 * (best["adaptive"] / best["static"] - 1)})
    print(md_table(["prefill, one prompt", "static tok/s", "adaptive tok/s", "change"],
                   [[r["prompt"], fmt(r["static_tok_s"]), fmt(r["adaptive_tok_s"]), f"{r['change_pct']:+.1f}%"]
                    for r in rows]), flush=True)
    stall_rows = []
    engines["cadence"] = cadence  # adaptive + --stall-factor 3 (only matters while sequences decode)
    for n_long in (1, 4):
        best: dict[str, dict] = {}
        for r in range(args.repeats):
            for m, llm in engines.items():
                short = [prompt_ids(llm, 64, 100 + i) for i in range(4)]
                res = stalls(llm, [prompt_ids(llm, 2048, 10 * r + j) for j in range(n_long)], short)
                if m not in best or res["max_gap_ms"] < best[m]["max_gap_ms"]:
                    best[m] = res
        stall_rows.append({"long_prompts": n_long, **{f"{m}_{k}": v for m, d in best.items() for k, v in d.items()}})
    print(md_table(["long prompts arriving", *[f"{m} max / median gap ms" for m in engines],
                    *[f"{m} long prompts done ms" for m in engines]],
                   [[r["long_prompts"], *[f"{fmt(r[m + '_max_gap_ms'])} / {fmt(r[m + '_median_gap_ms'], 1)}"
                                          for m in engines],
                     *[fmt(r[m + "_long_ttft_ms"]) for m in engines]] for r in stall_rows]))
    path = common.write_json("adaptive_chunks", {"machine": machine, "prefill": rows, "stalls": stall_rows})
    print(f"cpu: {machine['cpu']['model']} {machine['cpu']['flags']}; results: {path}")


if __name__ == "__main__":
    main()
