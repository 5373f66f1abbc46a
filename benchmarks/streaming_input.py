"""Streaming-input benchmark (Stream2LLM-shaped traces) on the embedded model.

    .venv/bin/python benchmarks/streaming_input.py                   # the default sweep (~15 min)
    .venv/bin/python benchmarks/streaming_input.py --queries 4 --qps 0.1 --traces append

Two synthetic traces (seeds and sizes below):
  append  a crawler: 6-10 chunks per query, 150-600 tokens each, gaps lognormal (median 700 ms,
          clipped to [20 ms, 30 s]);
  update  a vector search: a top-8 document list (~120 tokens per document) replaced 1-3 times,
          gaps lognormal (median 37 ms); each update keeps a prefix of the list, replaces the rest.
Queries arrive as a Poisson process at each --qps (or, --arrivals azure-conv|azure-code, with the
gaps of an Azure LLM inference trace from shared/data/traces, rescaled to that QPS). Per run:
  non-streaming  the client submits the whole prompt when its last chunk arrives;
  streaming      /open at the first chunk, append/update per chunk, finish at the last.
TTFT = first output token - arrival of the last chunk (what a client waits once its input is
complete). Trace completion = last answer - first arrival. A memory-pressure variant runs a KV
pool of about 1/4 of the working set with each preemption policy. One engine thread, the real
AsyncEngine, wall-clock replay; the machine is printed. Results: benchmarks/results/streaming_input.json.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import fmt, md_table  # noqa: E402

MAX_TOKENS = 16
TOKENS_PER_WORD = 1.3
QUESTION = "\nQuestion: what is the main topic of these pages? Answer:"


# --------------------------------------------------------------------------- traces
def _words(rng: random.Random, tokens: int, vocab: list[str]) -> str:
    n = max(1, int(tokens / TOKENS_PER_WORD))
    start = rng.randrange(len(vocab) - n - 1)
    return " ".join(vocab[start:start + n]) + " "


def append_trace(rng: random.Random, vocab: list[str]) -> list[tuple[float, str, str]]:
    """[(gap before this event, op, text)]: the first op opens, the last one finishes."""
    events = []
    for i in range(rng.randint(6, 10)):
        gap = 0.0 if i == 0 else min(30.0, max(0.02, rng.lognormvariate(0.0, 1.0) * 0.7))
        events.append((gap, "append", _words(rng, rng.randint(150, 600), vocab)))
    return events


def update_trace(rng: random.Random, vocab: list[str]) -> list[tuple[float, str, str]]:
    docs = [f"[doc {i}] " + _words(rng, 120, vocab) for i in range(8)]
    events = [(0.0, "update", "".join(docs))]
    for _ in range(rng.randint(1, 3)):
        keep = rng.randint(1, 7)
        docs = docs[:keep] + [f"[doc {keep + j}'] " + _words(rng, 120, vocab) for j in range(8 - keep)]
        events.append((min(30.0, max(0.005, rng.lognormvariate(0.0, 1.0) * 0.037)), "update", "".join(docs)))
    return events


def trace_gaps(name: str, n: int, qps: float, seed: int) -> list[float]:
    """``n`` consecutive inter-arrival gaps of a recorded trace (``shared/data/traces``: Azure
    LLM inference 2023, ``azure-conv`` or ``azure-code``) from a seeded offset, rescaled to a
    mean of 1/qps: the real burstiness at the chosen load."""
    import csv
    from datetime import datetime

    path = common.REPO.parent / "shared/data/traces" / f"AzureLLMInferenceTrace_{name.split('-')[1]}.csv"
    if not path.exists():
        raise SystemExit(f"--arrivals {name}: {path} is missing")
    with open(path) as f:
        stamps = [datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() for r in csv.DictReader(f)]
    start = random.Random(seed).randrange(len(stamps) - n - 1)
    gaps = [b - a for a, b in zip(stamps[start:start + n], stamps[start + 1:start + n + 1])]
    scale = (1.0 / qps) / max(1e-9, statistics.mean(gaps))
    return [g * scale for g in gaps]


def make_queries(kind: str, n: int, qps: float, seed: int, vocab: list[str],
                 arrivals: str = "poisson") -> list[tuple[float, list]]:
    rng = random.Random(seed)
    gaps = trace_gaps(arrivals, n, qps, seed) if arrivals != "poisson" else None
    t, out = 0.0, []
    for i in range(n):
        out.append((t, (append_trace if kind == "append" else update_trace)(rng, vocab)))
        t += gaps[i] if gaps else rng.expovariate(qps)
    return out


# --------------------------------------------------------------------------- replay
async def _query(engine, rid: str, start: float, events: list, streaming: bool, t0: float,
                 question: str) -> dict:
    from streamkv.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
    arrived, text, handle = time.perf_counter(), "", None
    for i, (gap, op, piece) in enumerate(events):
        if gap:
            await asyncio.sleep(gap)
        text = text + piece if op == "append" else piece
        if streaming:
            if handle is None:
                handle = await engine.open_input(rid, prompt=text, params=params)
            elif op == "append":
                await handle.append(piece)
            else:
                await handle.update(text)
    last_chunk = time.perf_counter()
    first = None
    if streaming:
        await handle.append(question)
        await handle.finish()
        outs = handle.outputs()
    else:
        outs = engine.generate(rid, text + question, params)
    final = None
    async for out in outs:
        if first is None and out.token_ids:
            first = time.perf_counter()
        final = out
    return {"ttft": first - last_chunk, "done": time.perf_counter() - t0, "arrived": arrived - t0,
            "invalidated": final.metrics.get("tokens_invalidated", 0), "preemptions": final.metrics["num_preemptions"]}


async def replay(engine, queries: list, streaming: bool, tag: str) -> dict:
    t0 = time.perf_counter()
    res = await asyncio.gather(*[_query(engine, f"{tag}-{i}", s, ev, streaming, t0, QUESTION)
                                 for i, (s, ev) in enumerate(queries)])
    ttft = sorted(r["ttft"] for r in res)
    pct = lambda p: ttft[min(len(ttft) - 1, int(round(p / 100 * (len(ttft) - 1))))]
    return {"p50": statistics.median(ttft), "p95": pct(95), "p99": pct(99), "ttfts": ttft,
            "completion_s": max(r["done"] for r in res) - min(r["arrived"] for r in res),
            "invalidated": sum(r["invalidated"] for r in res), "preemptions": sum(r["preemptions"] for r in res)}


def _configure(llm, policy: str, preemption: str) -> None:
    from streamkv.sched.policies import make_queue_policy
    from streamkv.sched.preemption import make_preemption

    s = llm.engine.scheduler
    if not hasattr(llm, "cost_profile"):  # what the engine was started with
        llm.cost_profile = getattr(s.preemption, "profile", None)  # loaded or measured at start
        llm.max_wait_s = s.policy.max_wait_s
    name, _, wait = policy.partition("@")  # "lcas@5": LCAS aged after 5 s (--max-wait-s otherwise)
    s.policy = make_queue_policy(name, float(wait) if wait else llm.max_wait_s)
    s.preemption = make_preemption(preemption, llm.cost_profile if preemption == "cost" else None)
    llm.engine.pool.reset_prefix_cache()


def run_matrix(llm, kind: str, qps: float, args, vocab, policies, preemptions, label: str) -> list[dict]:
    from streamkv.engine.async_engine import AsyncEngine

    queries = make_queries(kind, args.queries, qps, args.seed, vocab, args.arrivals)
    rows = []
    engine = AsyncEngine(llm.engine).start()
    try:
        for policy in policies:
            for pre in preemptions:
                for streaming in ([False, True] if policy == policies[0] and pre == preemptions[0] else [True]):
                    _configure(llm, policy if streaming else "fcfs", pre)  # the baseline: arrival order
                    tag = f"{label}-{kind}-{qps}-{policy}-{pre}-{int(streaming)}"
                    r = asyncio.run(replay(engine, queries, streaming, tag))
                    r.update(trace=kind, qps=qps, label=label, mode="streaming" if streaming else "non-streaming",
                             policy=policy if streaming else "-", preemption=pre)
                    rows.append(r)
                    print(f"  {label} {kind} qps={qps} {r['mode']:13} {r['policy']:5} {pre:9} "
                          f"TTFT p50 {r['p50'] * 1e3:7.0f} ms  p95 {r['p95'] * 1e3:7.0f}  p99 {r['p99'] * 1e3:7.0f}  "
                          f"completion {r['completion_s']:6.1f} s  preempt {r['preemptions']}", flush=True)
    finally:
        engine.shutdown()
    return rows


def _versions(events: list) -> list[str]:
    """The input text after each event (appends accumulate, updates replace)."""
    texts, text = [], ""
    for _, op, piece in events:
        text = text + piece if op == "append" else piece
        texts.append(text)
    return texts


def stream_bound(llm, queries: list) -> dict:
    """The best TTFT ratio any streaming scheduler could reach on this machine, idle: work done
    before the last event survives only inside the LCP of an earlier version with the final
    prompt, and only as much as the input's duration lets this machine compute (T(tokens), the
    measured prefill profile); the rest (at least the last chunk and the question) is prefilled
    after it, at T(all) - T(done) (its rows attend to everything before them). Returns the p50
    and p95 ratios non-streaming / best streaming."""
    from streamkv.engine.profile import measure_prefill
    from streamkv.sched.preemption import CostProfile

    if not hasattr(llm, "long_prefill"):  # up to the traces' prompt lengths: attention's share grows
        llm.long_prefill = tuple(measure_prefill(llm.engine, (16, 256, 1024, 2048, 4096), repeats=1))
    prof = CostProfile(llm.long_prefill, ((0, 0.0), (1, 0.0)), ((0, 0.0), (1, 0.0)))  # prefill only
    enc = lambda t: llm.engine.tokenizer.encode(t, add_special_tokens=True)
    non, best = [], []
    for _, events in queries:
        texts = _versions(events)
        full = enc(texts[-1] + QUESTION)
        duration = sum(g for g, _, _ in events[1:])
        lcp = max((_lcp(enc(t), full) for t in texts[:-1]), default=0)
        done = next((n for n in range(lcp, -1, -16) if prof.prefill_s(n) <= duration), 0)
        non.append(prof.prefill_s(len(full)))
        best.append(prof.prefill_s(len(full)) - prof.prefill_s(done))  # the rest, after the first `done`
    pct = lambda v, p: sorted(v)[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]
    return {"p50": statistics.median(non) / statistics.median(best), "p95": pct(non, 95) / pct(best, 95)}


def pressure_blocks(queries: list, block_size: int = 16) -> int:
    """A KV pool of about 1/4 of the trace's working set (every query's final prompt and answer,
    in the trace's nominal tokens), but at least 1.5x its largest query (so none is refused)."""
    sizes = [len(_versions(events)[-1].split()) * TOKENS_PER_WORD + MAX_TOKENS + 32 for _, events in queries]
    return int(max(sum(sizes) / 4, 1.5 * max(sizes)) // block_size) + 1


# --------------------------------------------------------------------------- vLLM peer
def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def peer_workload(llm, queries: list, args) -> dict:
    """Each query as token-id chunks that concatenate to exactly streamkv's final prompt: an
    append chunk ends where the arrived text's tokens stop agreeing with the final ones; an
    update trace sends everything with its last event (vLLM cannot replace an input)."""
    enc = lambda t: llm.engine.tokenizer.encode(t, add_special_tokens=True)
    out = []
    for start, events in queries:
        texts = _versions(events)
        full = enc(texts[-1] + QUESTION)
        cuts = [0]
        for t in texts[:-1]:
            cuts.append(max(cuts[-1], _lcp(enc(t), full)) if events[0][1] == "append" else 0)
        cuts.append(len(full))
        out.append({"start": start, "chunks": [[gap, full[a:b]] for (gap, _, _), a, b
                                               in zip(events, cuts, cuts[1:])]})
    return {"threads": args.threads, "hf_dir": str(common.HF_EXPORT), "max_tokens": MAX_TOKENS,
            "max_model_len": 8192, "budget": args.budget, "queries": out}


def run_vllm(llm, kind: str, qps: float, args, vocab) -> list[dict]:
    """vLLM on the same queries: non-streaming with prefix caching, and its own streaming input
    (appends only). Rows shaped like streamkv's."""
    import json
    import os

    import throughput

    wl = peer_workload(llm, make_queries(kind, args.queries, qps, args.seed, vocab, args.arrivals), args)
    run_dir = common.RESULTS / "streaming_input_peers"
    run_dir.mkdir(parents=True, exist_ok=True)
    wl_path = run_dir / f"workload-{kind}-{qps}.json"
    wl_path.write_text(json.dumps(wl))
    env = dict(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", OMP_NUM_THREADS=str(args.threads))
    if os.path.exists(throughput.TCMALLOC):
        env["LD_PRELOAD"] = throughput.TCMALLOC
    modes = "non-streaming,streaming" if kind == "append" else "non-streaming"
    cfg = dict(name=f"vLLM {kind} {qps}", py=str(common.REPO / ".venv-vllm/bin/python"), script="run_trace_vllm.py",
               dtype=args.peer_dtype, extra=["--modes", modes], env=env, needs_hf=True)
    r = throughput.run_engine(cfg, wl_path, run_dir, timeout=1800, wait=0)
    if "runs" not in r:
        print(f"  vLLM {kind} qps={qps}: {r.get('skipped') or r.get('error')}", flush=True)
        return []
    rows = []
    for mode, run in r["runs"].items():
        ttft = run["ttfts"]
        pct = lambda p: ttft[min(len(ttft) - 1, int(round(p / 100 * (len(ttft) - 1))))]
        row = {"p50": statistics.median(ttft), "p95": pct(95), "p99": pct(99), "ttfts": ttft,
               "completion_s": run["completion_s"], "invalidated": 0, "preemptions": "-", "trace": kind,
               "qps": qps, "label": f"vLLM {r['info']['vllm']} {args.peer_dtype}", "mode": mode, "policy": "-",
               "preemption": "-", "same_tokens": run["tokens"] == r["runs"]["non-streaming"]["tokens"]}
        rows.append(row)
        print(f"  vLLM {kind} qps={qps} {mode:13} TTFT p50 {row['p50'] * 1e3:7.0f} ms  p95 {row['p95'] * 1e3:7.0f}  "
              f"p99 {row['p99'] * 1e3:7.0f}  completion {row['completion_s']:6.1f} s", flush=True)
    return rows


def plot_ccdf(rows: list[dict], path: Path) -> Path | None:
    """TTFT CCDF (P[TTFT > t]) per mode/policy/preemption, one panel per (run, trace, QPS)."""
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is missing (pip install -e '.[bench]')")
        return None
    panels = sorted({(r["label"].split()[0] if r["label"].startswith("vLLM") else r["label"], r["trace"], r["qps"])
                     for r in rows}, key=str)
    panels = [p for p in panels if p[0] != "vLLM"]
    cols = min(3, len(panels))
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(5.5 * cols, 4.2 * -(-len(panels) // cols)),
                             squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (label, trace, qps) in zip(axes.flat, panels):
        for r in rows:
            if r["trace"] != trace or r["qps"] != qps or not (r["label"] == label or
                                                             (label == "normal" and r["label"].startswith("vLLM"))):
                continue
            xs = sorted(r["ttfts"])
            ys = [1 - (i + 1) / len(xs) for i in range(len(xs))]
            name = ("vLLM " if r["label"].startswith("vLLM") else "") + r["mode"] + (
                f" {r['policy']}" if r["policy"] != "-" else "")
            name += f" {r['preemption']}" if label == "pressure" and r["mode"] == "streaming" else ""
            ax.step([xs[0]] + xs, [1.0] + ys, where="post", label=name)
        ax.set(xscale="log", xlabel="TTFT (s)", ylabel="P[TTFT > t]", title=f"{label}: {trace}, {qps} QPS")
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def sched_overhead(n: int = 500) -> float:
    """Median ``Scheduler.schedule()`` time (µs) with ``n`` live streaming inputs (fake runner)."""
    sys.path.insert(0, str(common.REPO))
    from streamkv.sampling.params import SamplingParams
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=8192, block_size=16, budget=2048, max_input_streams=n + 1)
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.inputs.open(f"s{i}", prompt="abcdefghij" * 8, params=p)
    for _ in range(20):
        engine.step()  # prefill everything: then every step schedules 500 idle inputs + appends
    spent, schedule = [], engine.scheduler.schedule

    def timed():
        t = time.perf_counter()
        plan = schedule()
        spent.append(time.perf_counter() - t)
        return plan

    engine.scheduler.schedule = timed
    for k in range(400):
        engine.inputs.append(f"s{k % n}", "klmno")  # one input gains work: a one-chunk step
        engine.step()
    return statistics.median(spent) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="append,update")
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--qps", default="0.1,0.25", help="query arrival rates: low load, then the highest before "
                                                     "saturation (all policies and the pressure runs)")
    ap.add_argument("--budget", type=int, default=512, help="scheduler token budget per step (both modes)")
    ap.add_argument("--policies", default="fcfs,lcas,lcas@5,mcps,fifo",
                    help="the first also runs at low load; NAME@S: aged after S seconds (--max-wait-s)")
    ap.add_argument("--normal", action=argparse.BooleanOptionalAction, default=True, help="the QPS sweep")
    ap.add_argument("--pressure", action=argparse.BooleanOptionalAction, default=True,
                    help="the memory-pressure runs")
    ap.add_argument("--peers", default="vllm", help="vllm (same queries, non-streaming with prefix caching, "
                                                    "and vLLM's own streaming input), or none")
    ap.add_argument("--peer-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="vLLM's dtype (float32 on a CPU without AVX512-BF16, where its bf16 runs 4-6x slower)")
    ap.add_argument("--max-wait-s", type=float, default=None, help="aging bound of the queue policies")
    ap.add_argument("--pressure-modes", default="recompute,swap,cost", help="preemption modes of the pressure runs")
    ap.add_argument("--arrivals", default="poisson", choices=["poisson", "azure-conv", "azure-code"],
                    help="query arrivals: a Poisson process, or the gaps of an Azure LLM inference trace "
                         "(shared/data/traces) rescaled to each QPS")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    from streamkv import LLM

    machine = common.machine_info(args.threads)
    print(f"machine: {machine['cpu']['model']} ({', '.join(machine['cpu']['flags'])}), {machine['cores']} cores, "
          f"{args.threads} threads")
    vocab = common.prompt_text(400_000).split()
    policies = args.policies.split(",")
    rows: list[dict] = []
    rates = [float(x) for x in args.qps.split(",")]
    bounds: dict[str, dict] = {}
    if args.normal:
        llm = LLM(threads=args.threads, max_model_len=8192, max_num_batched_tokens=args.budget,
                  max_wait_s=args.max_wait_s)
        for kind in args.traces.split(","):
            for qps in rates:
                chosen = policies if qps == max(rates) else policies[:1]
                rows += run_matrix(llm, kind, qps, args, vocab, chosen, ["recompute"], "normal")
                b = stream_bound(llm, make_queries(kind, args.queries, qps, args.seed, vocab, args.arrivals))
                bounds[f"{kind}@{qps}"] = b
                print(f"  {kind} qps={qps}: best streaming TTFT ratio possible on this machine (idle, measured "
                      f"prefill profile): p50 {b['p50']:.2f}x, p95 {b['p95']:.2f}x", flush=True)
                if "vllm" in args.peers:
                    rows += run_vllm(llm, kind, qps, args, vocab)
        del llm
    if args.pressure:
        for kind in args.traces.split(","):
            qps = max(rates)
            blocks = pressure_blocks(make_queries(kind, args.queries, qps, args.seed, vocab, args.arrivals))
            print(f"  pressure {kind}: a {blocks}-block pool ({blocks * 16} tokens)", flush=True)
            small = LLM(threads=args.threads, max_model_len=8192, num_blocks=blocks, swap_space=1 << 30,
                        preemption="cost", max_num_batched_tokens=args.budget, max_wait_s=args.max_wait_s)
            rows += run_matrix(small, kind, qps, args, vocab, [p for p in policies if p.split("@")[0] in ("fcfs", "lcas")],
                               args.pressure_modes.split(","), "pressure")
            del small
    overhead = sched_overhead()
    print(f"\nscheduling: {overhead:.0f} µs per schedule() with 500 live streaming inputs (target < 200)")
    headers = ["run", "trace", "qps", "mode", "policy", "preemption", "TTFT p50 ms", "p95 ms", "p99 ms",
               "completion s", "preemptions", "invalidated"]
    table = [[r["label"], r["trace"], r["qps"], r["mode"], r["policy"], r["preemption"], fmt(r["p50"] * 1e3),
              fmt(r["p95"] * 1e3), fmt(r["p99"] * 1e3), fmt(r["completion_s"], 1), r["preemptions"],
              r["invalidated"]] for r in rows]
    print(md_table(headers, table))
    path = common.write_json("streaming_input", {"machine": machine, "args": vars(args), "rows": rows,
                                                  "sched_overhead_us": overhead,
                                                  "update_bounds": bounds})
    print(f"results: {path}")
    if rows:
        png = plot_ccdf(rows, path.with_suffix(".png"))
        print(f"plot: {png}" if png else "", end="\n" if png else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
