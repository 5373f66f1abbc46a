"""KV compression (issue 15): accuracy of snapstream / streaming_llm / quest against the full cache
and kvpress's SnapKV and StreamingLLM presses on transformers; memory, throughput and overhead.

    .venv/bin/python benchmarks/kv_compression.py                          # both parts (~45 min, 2 cores)
    .venv/bin/python benchmarks/kv_compression.py --parts accuracy --contexts 2048 --samples 3
    .venv/bin/python benchmarks/kv_compression.py --parts performance   # = overhead,decode,pool
    .venv/bin/python benchmarks/kv_compression.py --model /path/to/hf-dir  # a larger model as well
    .venv/bin/python benchmarks/kv_compression.py --plot-from benchmarks/results/kv_compression-*.json

Budgets are the KV tokens a sequence keeps in total (sinks + middle + window), the same number
kvpress keeps (``compression_ratio = 1 - budget / context``). Hyper-parameters per budget B:
snapstream sinks 16, window max(32, B/8), 32 observed rows, pool kernel 7 (max pooling);
streaming_llm sinks 16, window B - 16; quest B tokens of pages (16 sink, 64 recent), re-scored every
step; snapstream_quest (both on one request) snapstream at 2B with quest reading B of its rows;
kvpress SnapKV window 32, kernel 7; kvpress StreamingLLM 16 sinks. Our runs share one engine,
so a prompt is prefilled once and its prefix reused (never into snapstream's observed rows).
Speculative decoding is off in every run: requests with a KV policy never draft, so the exact
baseline must not either.
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
import kv_tasks  # noqa: E402
from common import fmt, md_table  # noqa: E402

from streamkv import LLM, SamplingParams  # noqa: E402
from streamkv.policies.write import SnapStreamPolicy  # noqa: E402

PLOT = common.REPO / "docs" / "img" / "kv_compression.png"
OURS = ("streaming_llm", "snapstream", "quest", "snapstream_quest")
PRESSES = ("kvpress_snapkv", "kvpress_streaming_llm")


def our_policy(name: str, budget: int) -> dict:
    sink = 16
    if name == "streaming_llm":
        return {"kv_write": {"policy": "streaming_llm", "sink_tokens": sink, "window_tokens": budget - sink}}
    if name == "snapstream":
        window = max(32, budget // 8)
        return {"kv_write": {"policy": "snapstream", "sink_tokens": sink, "window_tokens": window,
                             "budget_tokens": budget - sink - window, "observation_tokens": 32, "pool_kernel": 7}}
    if name == "quest":
        return {"kv_write": {"policy": "none"},
                "kv_read": {"policy": "quest", "budget_tokens": budget, "sink_tokens": sink, "recent_tokens": 64}}
    if name == "snapstream_quest":  # both: snapstream keeps 2 x budget rows, quest reads budget of them
        write = our_policy("snapstream", 2 * budget)["kv_write"]
        quest = {"policy": "quest", "budget_tokens": max(budget, sink + write["window_tokens"]), "sink_tokens": sink,
                 "recent_tokens": 64}
        return {"kv_write": write, "kv_read": quest}
    return {"kv_write": {"policy": "none"}}  # full


class ForcedSampler:
    """Teacher forcing for perplexity: the wrapped sampler's choice, except that sequences in
    ``forced`` take their next continuation token; records that token's log-probability."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.forced: dict[int, tuple[int, ...]] = {}
        self.nll: dict[int, list[float]] = {}

    def release(self, ids) -> None:
        self.inner.release(ids)

    def __call__(self, logits, items):
        import torch

        lp = torch.log_softmax(logits.float(), dim=-1)
        tokens, logprobs = self.inner(logits, items)
        for i, item in enumerate(items):
            cont = self.forced.get(item.seq_id)
            if cont is not None:
                k = len(item.history) - item.num_prompt
                tokens[i] = cont[k]
                self.nll.setdefault(item.seq_id, []).append(-float(lp[i, cont[k]]))
        return tokens, logprobs


def run_ours(llm: LLM, sample: kv_tasks.Sample, kv: dict) -> tuple[str, float]:
    """(output text, mean NLL for ppl samples else nan)."""
    params = SamplingParams(max_tokens=sample.max_tokens, temperature=0.0, ignore_eos=True)
    if sample.task != "ppl":
        return llm.generate([sample.prompt], params, **kv)[0].text, float("nan")
    engine = llm.engine
    forced = engine.bundle.runner.sampler
    seq = engine.add_request("ppl", sample.prompt, params, **kv)
    forced.forced[seq.seq_id] = sample.continuation
    engine.run_to_completion(["ppl"])
    nll = forced.nll.pop(seq.seq_id)
    forced.forced.pop(seq.seq_id)
    return "", sum(nll) / len(nll)


KVPRESS_PY = common.REPO / ".venv-kvpress" / "bin" / "python"


def run_presses(jobs: list[dict], hf_path: Path, threads: int) -> dict[str, dict]:
    """kvpress jobs in .venv-kvpress (benchmarks/peers/run_kvpress.py): id -> result."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "jobs.json", Path(tmp) / "out.jsonl"
        spec.write_text(json.dumps({"model": str(hf_path), "threads": threads, "jobs": jobs}))
        subprocess.run([str(KVPRESS_PY), str(common.BENCH / "peers" / "run_kvpress.py"), str(spec), str(out)],
                       check=True)
        return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def accuracy(args, llm: LLM, hf_path: Path | None) -> list[dict]:
    llm.engine.bundle.runner.sampler = ForcedSampler(llm.engine.bundle.runner.sampler)
    tok = llm.engine.tokenizer
    presses = hf_path is not None and args.kvpress and KVPRESS_PY.exists()
    if args.kvpress and not presses:
        print("kvpress skipped: run `bash benchmarks/setup_peers.sh kvpress export` first", flush=True)
    rows, jobs, samples = [], [], {}
    bar = common.progress(len(args.contexts) * len(args.tasks) * args.samples, "accuracy samples")
    for length in args.contexts:
        for task in args.tasks:
            for seed in range(args.samples):
                sample = samples[(length, task, seed)] = kv_tasks.make(task, tok, length, seed)
                for policy, budget in [("full", None)] + [(p, b) for p in args.policies for b in args.budgets
                                                          if b < length]:
                    t0 = time.perf_counter()
                    text, nll = run_ours(llm, sample, our_policy(policy, budget or 0))
                    value = nll if task == "ppl" else kv_tasks.score(sample, text)
                    rows.append({"context": length, "task": task, "seed": seed, "policy": policy, "budget": budget,
                                 "value": value, "seconds": round(time.perf_counter() - t0, 2)})
                    print(json.dumps(rows[-1]), flush=True)
                if presses:
                    jobs += [{"id": f"{length}/{task}/{seed}/{p}/{b}", "press": p, "budget": b,
                              "prompt": sample.prompt, "max_tokens": sample.max_tokens,
                              "continuation": list(sample.continuation)}
                             for p in PRESSES for b in args.budgets if b < length]
                bar.update()
    bar.close()
    if jobs:
        for jid, r in run_presses(jobs, hf_path, args.threads).items():
            length, task, seed, policy, budget = jid.split("/")
            sample = samples[(int(length), task, int(seed))]
            value = r["nll"] if task == "ppl" else kv_tasks.score(sample, tok.decode(r["tokens"]))
            rows.append({"context": int(length), "task": task, "seed": int(seed), "policy": policy,
                         "budget": int(budget), "value": value, "seconds": r["seconds"]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def summarize(rows: list[dict], budgets: list[int]) -> list[str]:
    """One markdown table per context: task x policy, the score at each budget (ppl: exp(NLL))."""
    import math

    out = []
    for length in sorted({r["context"] for r in rows}):
        sub = [r for r in rows if r["context"] == length]
        policies = ["full"] + [p for p in OURS + PRESSES if any(r["policy"] == p for r in sub)]
        table = []
        for task in kv_tasks.TASKS:
            for policy in policies:
                cells = []
                for b in ([None] if policy == "full" else budgets):
                    vals = [r["value"] for r in sub if r["task"] == task and r["policy"] == policy
                            and r["budget"] == b]
                    if not vals:
                        cells.append("")
                        continue
                    mean = sum(vals) / len(vals)
                    cells.append(fmt(math.exp(mean), 1) if task == "ppl" else fmt(100 * mean, 0))
                if any(cells):
                    table.append([task, policy] + (cells * len(budgets) if policy == "full" else cells))
        out.append(f"context {length} (score %, ppl = perplexity; {len({r['seed'] for r in sub})} samples)\n\n"
                   + md_table(["task", "policy"] + [f"B={b}" for b in budgets], table))
    return out


def plot(rows: list[dict], budgets: list[int], path: Path) -> None:
    import math

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(len(lengths), len(kv_tasks.TASKS), figsize=(3.2 * len(kv_tasks.TASKS),
                                                                        2.8 * len(lengths)), squeeze=False)
    for li, length in enumerate(lengths):
        for ti, task in enumerate(kv_tasks.TASKS):
            ax = axes[li][ti]
            for policy in ("full",) + OURS + PRESSES:
                pts = []
                for b in budgets:
                    vals = [r["value"] for r in rows if r["context"] == length and r["task"] == task
                            and r["policy"] == policy and (r["budget"] == b or policy == "full")]
                    if vals:
                        m = sum(vals) / len(vals)
                        pts.append((b, math.exp(m) if task == "ppl" else 100 * m))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=policy, linestyle="--" if policy == "full" else "-")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{task} @ {length}", fontsize=9)
            ax.set_xlabel("KV budget (tokens)", fontsize=8)
            ax.set_ylabel("perplexity" if task == "ppl" else "score %", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- performance
def long_prompts(tok, n: int, length: int) -> list[list[int]]:
    import random

    return [kv_tasks._filler(tok, random.Random(f"pool-{i}"), length) for i in range(n)]


def pool_run(args, kv: dict) -> dict:
    """32 long prompts against a fixed pool: most sequences holding KV at once, decode and
    end-to-end throughput."""
    from streamkv.sched.sequence import SeqStatus

    admission = ({"admission": "cell-budget", "admission_ceiling": args.pool_admission_ceiling}
                 if args.pool_admission == "cell-budget" else {})
    llm = LLM(num_blocks=args.pool_blocks, max_num_seqs=64, max_num_batched_tokens=2048, speculation="none",
              **admission)
    engine, sched = llm.engine, llm.engine.scheduler
    params = SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(long_prompts(engine.tokenizer, args.requests, args.prompt_tokens)):
        engine.add_request(f"r{i}", p, params, **kv)
    most, most_decoding, peak_blocks, dec_rows, dec_time, t0 = 0, 0, 0, 0, 0.0, time.perf_counter()
    while engine.has_unfinished():
        running = [s for s in sched.seqs.values() if s.status is SeqStatus.RUNNING]
        prefilling = any(s.num_computed < s.num_prompt_tokens for s in sched.seqs.values())
        decoding = sum(1 for s in running if s.num_computed >= s.num_prompt_tokens)
        t = time.perf_counter()
        engine.step()
        if not prefilling and decoding:
            dec_rows, dec_time = dec_rows + decoding, dec_time + time.perf_counter() - t
        most, most_decoding = max(most, sched.num_running), max(most_decoding, decoding)
        peak_blocks = max(peak_blocks, engine.pool.num_used)
    wall = time.perf_counter() - t0
    generated = args.requests * args.gen_tokens
    # max_concurrent counts running sequences, prompts part-computed included (under preemption
    # churn many hold a fraction of their KV); max_decoding those holding their whole prompt at once
    return {"admission": args.pool_admission, "max_concurrent": most, "max_decoding": most_decoding,
            "peak_blocks": peak_blocks, "wall_s": round(wall, 1),
            "tok_per_s_end_to_end": round(generated / wall, 2), "decode_only_tok_per_s":
            round(dec_rows / dec_time, 1) if dec_time else None, "preemptions": sched.num_preemptions}


def overhead(args) -> dict:
    """Compression time against the prefill time of the same prompt (prefix cache off)."""
    llm = LLM(enable_prefix_caching=False)
    prompt = long_prompts(llm.engine.tokenizer, 1, args.prompt_tokens)[0]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    snap = {"kv_write": {"policy": "snapstream", "budget_tokens": 1024, "sink_tokens": 64, "window_tokens": 512}}
    prefill, compress = [], []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate([prompt], one)
        prefill.append(time.perf_counter() - t)
        compress.append(llm.generate([prompt], one, **snap)[0].kv["compress_ms"] / 1e3)
    p, c = sorted(prefill)[1], sorted(compress)[1]
    return {"prompt_tokens": len(prompt), "prefill_s": round(p, 3), "compress_s": round(c, 4),
            "overhead_pct": round(100 * c / p, 2)}


def decode_at(args) -> dict:
    """Batch-1 decode time per token at a long context: exact vs quest, snapstream and both.

    The runs alternate (every configuration once per round, ``--decode-rounds`` rounds): this
    host's neighbours slow whole stretches down by 10-30%, so back-to-back runs of one
    configuration would compare different stretches. Each figure is the median over the rounds;
    the speedup is the median of the rounds' own exact / quest ratios."""
    llm = LLM(speculation="none")  # requests with a KV policy never draft: compare attention alone
    prompt = long_prompts(llm.engine.tokenizer, 1, args.prompt_tokens)[0]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    runs = {"exact": {},
            "quest_1024": {"kv_read": {"policy": "quest", "budget_tokens": 1024}},
            "quest_1024_question_picks": {"kv_read": {"policy": "quest", "budget_tokens": 1024, "rescore": False}},
            "snapstream_1024": {"kv_write": {"policy": "snapstream", "budget_tokens": 1024}},
            # both: quest reads 1,024 of the 2,624 rows snapstream keeps (64 + 2,048 + a 512 ring)
            "snapstream_2048_quest_1024": {"kv_write": {"policy": "snapstream", "budget_tokens": 2048},
                                           "kv_read": {"policy": "quest", "budget_tokens": 1024}},
            "snapstream_2048": {"kv_write": {"policy": "snapstream", "budget_tokens": 2048}}}
    llm.generate([prompt], SamplingParams(max_tokens=1))  # the prompt's prefix is cached for every run
    tpot: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.decode_rounds):
        for name, kv in runs.items():
            o = llm.generate([prompt], params, **kv)[0]
            m = o.metrics
            tpot[name].append((m["finish_time"] - m["first_token_time"]) / (len(o.token_ids) - 1))
    out: dict = {name: round(statistics.median(t) * 1e3, 2) for name, t in tpot.items()}
    ratios = [e / q for e, q in zip(tpot["exact"], tpot["quest_1024"])]
    out["quest_speedup"] = round(statistics.median(ratios), 2)
    out["quest_speedup_rounds"] = [round(r, 2) for r in ratios]
    out["rounds"] = args.decode_rounds
    return out


def performance(args) -> dict:
    res = {}
    if "overhead" in args.parts or "performance" in args.parts:
        res["overhead"] = overhead(args)
    if "decode" in args.parts or "performance" in args.parts:
        res["decode_ms_per_token"] = decode_at(args)
    print(json.dumps(res), flush=True)
    if "pool" not in args.parts and "performance" not in args.parts:
        return res
    configs = {"none": {}, "snapstream_1024": {"budget_tokens": 1024},  # defaults: 64 sinks, 512 window
               "snapstream_1024_w128": {"budget_tokens": 1024, "window_tokens": 128},
               # 1,024 rows in all, as the accuracy cells' budget B = 1024 counts them (our_policy):
               # 16 sinks + a 128-token ring + 880 picked
               "snapstream_1024_total": our_policy("snapstream", 1024)["kv_write"]}
    res["pool"] = {}
    for name, kw in configs.items():
        if name not in args.pool_configs:
            continue
        res["pool"][name] = run = pool_run(args, {"kv_write": {"policy": "snapstream", **kw}} if kw else {})
        run["gen_tokens"] = args.gen_tokens
        run["rows_kept"] = SnapStreamPolicy(**{k: v for k, v in kw.items() if k != "policy"}).capacity if kw else None
        if name != "none":
            base = res["pool"]["none"]
            run["concurrency_ratio"] = round(run["max_concurrent"] / base["max_concurrent"], 2)
            run["decoding_ratio"] = round(run["max_decoding"] / max(1, base["max_decoding"]), 2)
            run["throughput_ratio"] = round(run["tok_per_s_end_to_end"] / base["tok_per_s_end_to_end"], 2)
            if base["decode_only_tok_per_s"] and run["decode_only_tok_per_s"]:
                run["decode_ratio"] = round(run["decode_only_tok_per_s"] / base["decode_only_tok_per_s"], 2)
        print(json.dumps({name: run}), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="accuracy,performance")
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--budgets", default="256,512,1024,2048")
    ap.add_argument("--tasks", default=",".join(kv_tasks.TASKS))
    ap.add_argument("--policies", default=",".join(OURS), help=f"ours to run, of {','.join(OURS)}")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--model", default=None, help="a Hugging Face directory: also measure this model")
    ap.add_argument("--no-kvpress", dest="kvpress", action="store_false")
    ap.add_argument("--pool-blocks", type=int, default=2400, help="fixed KV pool (blocks of 16) for the pool run")
    ap.add_argument("--pool-configs", default="none,snapstream_1024,snapstream_1024_w128",
                    help="pool runs: none (always first), snapstream_1024 (64 sinks + 1,024 + a 512 ring), "
                    "snapstream_1024_w128 (a 128 ring), snapstream_1024_total (1,024 rows in all)")
    ap.add_argument("--pool-admission", choices=["none", "cell-budget"], default="none",
                    help="pool runs: the scheduler's admission (cell-budget charges a compressed request its "
                    "prompt and layout while it prefills, the layout once compressed, so prompts are not "
                    "all started at once to preempt each other)")
    ap.add_argument("--pool-admission-ceiling", type=float, default=1.0,
                    help="cell-budget ceiling for the pool runs (a pool of their own: nothing to reserve)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--decode-rounds", type=int, default=5,
                    help="decode part: rounds of alternating runs (each configuration once per round)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot-from", default=None)
    ap.add_argument("--no-plot", dest="plot", action="store_false", help=f"leave {PLOT.name} as it is")
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.budgets = [int(x) for x in args.budgets.split(",")]
    args.tasks = args.tasks.split(",")
    args.policies = args.policies.split(",")
    unknown = set(args.policies) - set(OURS)
    if unknown:
        ap.error(f"unknown --policies {sorted(unknown)}; known: {', '.join(OURS)}")
    args.pool_configs = ["none"] + [c for c in args.pool_configs.split(",") if c != "none"]
    if args.plot_from:
        data = json.loads(Path(args.plot_from).read_text())
        plot(data["accuracy"], data["budgets"], PLOT)
        print("\n\n".join(summarize(data["accuracy"], data["budgets"])))
        return
    machine = common.machine_info(args.threads)
    print(json.dumps({"machine": machine}), flush=True)
    res: dict = {"machine": machine, "budgets": args.budgets, "args": vars(args)}
    if "accuracy" in args.parts:
        models = [(None, common.export_hf(common.HF_EXPORT))] + ([(args.model, Path(args.model))] if args.model else [])
        res["accuracy"] = []
        for name, hf in models:
            # no speculation: teacher forcing (ForcedSampler) needs one sampled token per step, and
            # the policies never draft, so every policy, full included, decodes alike
            llm = LLM(model=name, speculation="none") if name else LLM(speculation="none")
            for row in accuracy(args, llm, hf):
                res["accuracy"].append({**row, "model": name or "SmolLM2-135M-Instruct (embedded)"})
            del llm
        if args.plot:
            plot(res["accuracy"], args.budgets, PLOT)
        tables = summarize(res["accuracy"], args.budgets)
        print("\n\n".join(tables))
    if any(p in args.parts for p in ("performance", "overhead", "decode", "pool")):
        res["performance"] = performance(args)
    path = common.write_json("kv_compression", res)
    print(f"cpu: {machine['cpu']['model']} {machine['cpu']['flags']}; results: {path}")


if __name__ == "__main__":
    main()
