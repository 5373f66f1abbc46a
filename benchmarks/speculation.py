"""Prompt-lookup speculative decoding (issue 16, mechanism 4): what it buys, what it costs.

    .venv/bin/python benchmarks/speculation.py                     # ~8 min on 2 cores
    .venv/bin/python benchmarks/speculation.py --peers llamacpp,vllm

Every figure is the best of ``--repeats`` runs that alternate the engines (machine drift hits
all of them alike). Part 1, batch 1 on repetitive tasks (repeat records as JSON, edit a code snippet, reformat
CSV as JSON): greedy decode tokens/s, plain vs ``--speculation pld``; the outputs are
asserted identical. Part 2, ordinary chat at 1 / 4 / 8 / 32 concurrent decoders: aggregate
tokens/s plain, capped PLD (the defaults) and uncapped PLD (every sequence drafts
``spec_max_draft`` tokens whenever its n-gram matches, whatever the load or acceptance).
Peers on the part-1 prompts (same token ids): llama.cpp's ``LlamaPromptLookupDecoding``
through llama-cpp-python, and vLLM's n-gram speculation (``speculative_config``), each
with and without, in their own venvs.

Decode tokens/s = (tokens - 1) / (end-to-end time - time to first token), the time to first
token measured by a 1-token run of the same prompt (the prompt prefix is cached by then).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import fmt, md_table  # noqa: E402

from streamkv import LLM, SamplingParams  # noqa: E402

BARS = "\n".join(f'{{"t": "09:{30 + i:02d}", "open": {101 + i * 0.25:.2f}, "high": {101.5 + i * 0.25:.2f}, '
                 f'"low": {100.75 + i * 0.25:.2f}, "close": {101.25 + i * 0.25:.2f}, "volume": {1200 + 37 * i}}}'
                 for i in range(20))
CODE = '''def summarize(orders):
    total = 0
    count = 0
    biggest = None
    for order in orders:
        if order["status"] != "paid":
            continue
        total += order["amount"]
        count += 1
        if biggest is None or order["amount"] > biggest["amount"]:
            biggest = order
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average, "biggest": biggest}
'''
CSV = "name,city,age\n" + "\n".join(f"user{i},{['Paris', 'Oslo', 'Rome', 'Lima'][i % 4]},{20 + 3 * i}" for i in range(14))
REPETITIVE = {
    "repeat 10 records as JSON": f"Market bars:\n{BARS}\n\nRepeat the last 10 bars exactly, one JSON object per line.",
    "edit a code snippet": f"{CODE}\nRename the variable `total` to `paid_total` everywhere. Reply with the whole function.",
    "CSV to JSON lines": f"{CSV}\n\nConvert every CSV row above to a JSON object, one per line.",
}
CHAT = ["What is the capital of {}?", "Give me two tips for learning {}.", "Write one sentence about {}.",
        "Why do people like {}?", "Explain {} to a child in two sentences.", "What rhymes with {}?",
        "Name three facts about {}.", "Suggest a name for a cat that likes {}."]
TOPICS = ["France", "guitar", "the moon", "coffee", "chess", "rain", "Python", "bicycles"]


def chat_ids(llm: LLM, text: str) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def decode_once(llm: LLM, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """One batch-1 greedy run: decode tokens/s and the output ids (the prompt is cached)."""
    t0 = time.perf_counter()
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].token_ids
    return (len(out) - 1) / max(1e-9, time.perf_counter() - t0 - ttft), out


def part1(engines: dict[str, LLM], repeats: int, max_tokens: int) -> list[dict]:
    """Plain and PLD runs alternate (best of ``repeats`` each), so machine drift hits both."""
    rows = []
    plain, spec = engines["plain"], engines["pld"]
    st = spec.engine.scheduler.spec_stats
    for name, text in REPETITIVE.items():
        ids = chat_ids(plain, text)
        for llm in (plain, spec):
            llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))  # warm: prefix cache
        best = {"plain": 0.0, "pld": 0.0}
        p0, a0 = st.proposed, st.accepted
        for _ in range(repeats):
            rate, want = decode_once(plain, ids, max_tokens)
            best["plain"] = max(best["plain"], rate)
            rate, got = decode_once(spec, ids, max_tokens)
            best["pld"] = max(best["pld"], rate)
            assert got == want, f"{name}: speculative output differs from plain decoding"
        rows.append({"task": name, "prompt_tokens": len(ids), "tokens": len(want), "plain_tok_s": best["plain"],
                     "pld_tok_s": best["pld"], "speedup": best["pld"] / best["plain"],
                     "acceptance": (st.accepted - a0) / max(1, st.proposed - p0), "ids": ids})
    return rows


def part2(engines: dict[str, LLM], batches: list[int], max_tokens: int, repeats: int) -> list[dict]:
    """Aggregate tokens/s per engine, best of ``repeats`` rounds that alternate the engines."""
    rows = []
    plain = engines["plain"]
    for b in batches:
        prompts = [chat_ids(plain, CHAT[i % 8].format(TOPICS[(i // 8 + i) % 8])) for i in range(b)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        row: dict = {"decoders": b}
        outs = None
        for llm in engines.values():
            llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))  # prompts cached
        for _ in range(repeats):
            for name, llm in engines.items():
                st = llm.engine.scheduler.spec_stats
                p0, a0 = st.proposed, st.accepted
                t0 = time.perf_counter()
                res = llm.generate(prompts, params)
                wall = time.perf_counter() - t0
                ids = [r.token_ids for r in res]
                assert outs is None or ids == outs, f"{name} at {b}: output differs from plain decoding"
                outs = ids
                row[f"{name}_tok_s"] = max(row.get(f"{name}_tok_s", 0.0), sum(map(len, ids)) / wall)
                row[f"{name}_acceptance"] = (st.accepted - a0) / max(1, st.proposed - p0)
                row[f"{name}_drafts"] = st.proposed - p0
        for name in engines:
            row[f"{name}_vs_plain"] = row[f"{name}_tok_s"] / row["plain_tok_s"] - 1
        rows.append(row)
    return rows


def run_peer(peer: str, prompts: list[list[int]], max_tokens: int, repeats: int, threads: int) -> dict:
    """One peer process (its own venv): plain vs its prompt-lookup speculation per prompt."""
    root = Path(__file__).resolve().parents[1]
    py = {"llamacpp": root / ".venv-llamacpp/bin/python", "vllm": root / ".venv-vllm/bin/python"}[peer]
    if not py.exists():
        return {"error": f"{py} missing (bash benchmarks/setup_peers.sh)"}
    wl = {"prompts": prompts, "max_tokens": max_tokens, "repeats": repeats, "threads": threads,
          "gguf": str(common.embedded_gguf()), "hf_dir": str(common.HF_EXPORT if (common.HF_EXPORT / "config.json").exists() else common.export_hf(common.HF_EXPORT))}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE="4", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    script = Path(__file__).resolve().parent / "peers" / f"run_pld_{peer}.py"
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:  # one process per mode: never two engines at once
        wl_path = Path(tmp) / "wl.json"
        wl_path.write_text(json.dumps(wl))
        for mode in ("plain", "spec"):
            out_path = Path(tmp) / f"{mode}.json"
            proc = subprocess.run([str(py), str(script), str(wl_path), str(out_path), mode], env=env, timeout=1800)
            if proc.returncode or not out_path.exists():
                return {"error": f"{mode}: exit {proc.returncode}"}
            res[mode] = json.loads(out_path.read_text())
    rows = [{"tokens": s["tokens"], "plain_tokens": p["tokens"], "plain_tok_s": p["tok_s"], "spec_tok_s": s["tok_s"]}
            for p, s in zip(res["plain"]["rows"], res["spec"]["rows"])]
    return {"rows": rows, "info": res["spec"]["info"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batches", default="1,4,8,32")
    ap.add_argument("--chat-tokens", type=int, default=96)
    ap.add_argument("--peers", default="", help="comma list of llamacpp,vllm")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    machine = common.machine_info(args.threads)
    print(json.dumps({"machine": machine}), flush=True)
    engines = {"plain": LLM(speculation="none"), "pld": LLM(speculation="pld"),
               "pld_uncapped": LLM(speculation="pld", spec_draft_budget=1 << 20, spec_min_acceptance=0.0)}
    rows1 = part1({k: engines[k] for k in ("plain", "pld")}, args.repeats, args.max_tokens)
    print(md_table(["task (batch 1, greedy)", "prompt tok", "output tok", "plain tok/s", "pld tok/s", "speedup",
                    "draft acceptance"],
                   [[r["task"], r["prompt_tokens"], r["tokens"], fmt(r["plain_tok_s"], 1), fmt(r["pld_tok_s"], 1),
                     f"{r['speedup']:.2f}x", f"{100 * r['acceptance']:.0f}%"] for r in rows1]), flush=True)
    rows2 = part2(engines, [int(b) for b in args.batches.split(",")], args.chat_tokens, args.repeats)
    print(md_table(["ordinary chat, decoders", "plain tok/s", "capped pld", "vs plain", "drafts", "uncapped pld",
                    "vs plain", "drafts (acceptance)"],
                   [[r["decoders"], fmt(r["plain_tok_s"], 1), fmt(r["pld_tok_s"], 1), f"{100 * r['pld_vs_plain']:+.1f}%",
                     r["pld_drafts"], fmt(r["pld_uncapped_tok_s"], 1), f"{100 * r['pld_uncapped_vs_plain']:+.1f}%",
                     f"{r['pld_uncapped_drafts']} ({100 * r['pld_uncapped_acceptance']:.0f}%)"] for r in rows2]), flush=True)
    peers = {}
    for peer in filter(None, args.peers.split(",")):
        peers[peer] = run_peer(peer, [r["ids"] for r in rows1], args.max_tokens, args.repeats, args.threads)
        res = peers[peer]
        if "rows" in res:
            print(md_table([f"{peer} task", "output tok", "plain tok/s", "lookup tok/s", "speedup"],
                           [[r1["task"], p["tokens"], fmt(p["plain_tok_s"], 1), fmt(p["spec_tok_s"], 1),
                             f"{p['spec_tok_s'] / p['plain_tok_s']:.2f}x"] for r1, p in zip(rows1, res["rows"])]),
                  flush=True)
        else:
            print(f"{peer}: {res.get('error')}", flush=True)
    for r in rows1:
        r.pop("ids")
    path = common.write_json("speculation", {"machine": machine, "repetitive": rows1, "chat": rows2, "peers": peers})
    print(f"cpu: {machine['cpu']['model']} {machine['cpu']['flags']}; results: {path}")


if __name__ == "__main__":
    main()
