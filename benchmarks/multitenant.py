"""Multi-tenant continuous batching (issue 16): live sessions and stateless traffic on one
server, everything on, then each scheduler mechanism off in turn.

    .venv/bin/python benchmarks/multitenant.py                 # ~35 min on 2 cores
    .venv/bin/python benchmarks/multitenant.py --configs cadence   # ~12 min: the decode cadence's sweep
    .venv/bin/python benchmarks/multitenant.py --quick         # ~6 min: 8 sessions, shorter phases

Workload (``multitenant_load.py``):
- ``--sessions`` live sessions (default 32), contexts spread evenly from ``--ctx-min`` to
  ``--ctx-max`` tokens (500..6,000), each ingesting one market bar every ``--record-every`` s and
  asked a question every ``--question-every`` s (answers of ``--answer-tokens`` tokens, greedy;
  every 24 s each by default: 2 cores cannot serve 32 sessions a question every few seconds);
- stateless ``/v1/chat/completions`` traffic (streaming, greedy, EOS ignored) at each rate of
  ``--rates`` req/s: arrival gaps, prompt and output lengths from the Azure 2023 conversation
  trace (lengths x 0.25), 30% of requests carrying one ~600-token system prompt with 6 tool schemas.

Measured per phase: session-query round trip p50/p99, stateless TTFT and TPOT p50/p99, decode
stalls (the longest gap between two streamed chunks of one request, against the median gap,
which stands for the median step), the same engine-side (token gaps against the phase's median
step interval, from ``/metrics``' histograms), output chunks/s. Then a burst: ``--burst`` requests with one
fresh (cold) tool system prompt sent at once; the prompt tokens they computed (prompt - cached,
from ``usage.prompt_tokens_details``).

Configurations: the first of ``--configs`` (default ``all-on``: cell-budget admission, adaptive
chunks, grouped prefill, PLD) runs every rate; each ablation turns one mechanism off and runs the
highest rate the first one sustained (stateless TTFT p99 <= ``--ttft-slo`` and
no errors), so each row compares at the same load. ``cadence`` is ``all-on`` plus the decode
cadence (``--stall-factor 3``, off by default); ``--configs cadence`` sweeps it alone, and
``cadence-capped`` cuts questions too (``--question-chunks capped``). Results: ``benchmarks/results/multitenant-*.json`` and a plot of
session p99 against stateless load.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import multitenant_load as load  # noqa: E402
from common import RESULTS, fmt, machine_info, md_table, write_json  # noqa: E402
from flash_server import Api, Server, free_port  # noqa: E402

from streamkv.engine.token_gaps import Histogram  # noqa: E402

CONFIGS = {
    "all-on": ["--admission", "cell-budget", "--chunking", "adaptive", "--grouped-prefill", "--speculation", "pld"],
    "no-admission": ["--admission", "none", "--chunking", "adaptive", "--grouped-prefill", "--speculation", "pld"],
    "static-chunks": ["--admission", "cell-budget", "--chunking", "static", "--grouped-prefill", "--speculation",
                      "pld"],
    "no-grouping": ["--admission", "cell-budget", "--chunking", "adaptive", "--no-grouped-prefill", "--speculation",
                    "pld"],
    "no-speculation": ["--admission", "cell-budget", "--chunking", "adaptive", "--grouped-prefill", "--speculation",
                       "none"],
    # all-on plus the decode cadence (``sched/cadence.py``, off by default): prompt rows capped
    # while sequences decode so a step takes at most 3 decode-only steps
    "cadence": ["--admission", "cell-budget", "--chunking", "adaptive", "--grouped-prefill", "--speculation", "pld",
                "--stall-factor", "3"],
}
# the cadence with questions cut like any prompt while sequences decode (``--question-chunks``)
CONFIGS["cadence-capped"] = [*CONFIGS["cadence"], "--question-chunks", "capped"]
COUNTERS = ["streamkv_admission_deferred_requests_total", "streamkv_admission_deferred_chunks_total",
            "streamkv_grouped_prefill_tokens_saved_total", "streamkv_grouped_prefill_followers_total",
            "streamkv_spec_drafts_proposed_total", "streamkv_spec_drafts_accepted_total",
            "streamkv_engine_steps_total", "streamkv_engine_busy_seconds_total", "streamkv_preemptions"]
# engine-side histograms (streamkv/engine/token_gaps.py): token gaps and step intervals, seconds
GAPS, STEPS = "streamkv_inter_token_gap_seconds", "streamkv_step_interval_seconds"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--ctx-min", type=int, default=500)
    ap.add_argument("--ctx-max", type=int, default=6000)
    # 32 sessions x (a bar every 4 s, a question every 8 s) saturate 2 cores (session p50 8 s with no
    # stateless load at all, 2026-11-24): the defaults give 1.3 questions/s and 1.3 bars/s in all
    ap.add_argument("--record-every", type=float, default=24.0)
    ap.add_argument("--question-every", type=float, default=24.0)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--rates", default="0,0.25,0.5,1,2", help="stateless req/s per phase; 0 = sessions alone (idle)")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds per phase")
    ap.add_argument("--shared-share", type=float, default=0.3)
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--ttft-slo", type=float, default=5.0)
    # the pool in blocks, not bytes: 4 GiB hold 11,650 blocks of bf16 KV but 5,825 of float32 (the
    # default dtype on a CPU without bf16 dot products), fewer than the 104,000 session tokens
    ap.add_argument("--num-blocks", type=int, default=11650, help="KV pool size in blocks of 16 tokens")
    ap.add_argument("--kv-cache-memory", default=None, help="KV pool size in bytes (instead of --num-blocks)")
    ap.add_argument("--configs", default=",".join(c for c in CONFIGS if not c.startswith("cadence")))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-log", default=None, help="PREFIX: each config's server logs every engine step to "
                    "PREFIX.CONFIG.jsonl (streamkv/engine/step_log.py)")
    ap.add_argument("--plot-from", default=None, help="comma-separated result JSONs: merge their configs into one "
                    "report and plot (no runs)")
    ap.add_argument("--quick", action="store_true", help="8 sessions of 500..3,000 tokens asked every 8 s, 30 s "
                    "phases, rates 0,0.5,2")
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.ctx_max, args.duration, args.rates = 8, 3000, 30.0, "0,0.5,2"
        args.record_every = args.question_every = 8.0
    return args


def counters(api: Api) -> dict[str, Any]:
    """The counters, and the two histograms' cumulative buckets (one scrape)."""
    text = api.http.get("/metrics").text
    out: dict[str, Any] = {k: api.metric(k, text) or 0.0 for k in COUNTERS}
    for name in (GAPS, STEPS):
        out[name] = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "_bucket{")]
    return out


def engine_gaps(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """The phase's engine-side gaps against its median step interval (the histograms' buckets
    are 26% wide; the median and the count over 3x it are interpolated within them): how many,
    how many over 3x, the p99 and the worst (its bucket's upper bound) as multiples."""
    gaps, steps = (Histogram.from_cumulative([b - a for a, b in zip(before[k], after[k])]) for k in (GAPS, STEPS))
    med = steps.quantile(0.5)
    return {"engine_gaps": gaps.n, "engine_step_median_ms": 1000.0 * med, "engine_gaps_over_3x": gaps.above(3 * med),
            "engine_gap_p99_x": gaps.quantile(0.99) / med, "engine_gap_worst_x": gaps.max_bound() / med}


def run_config(name: str, args: argparse.Namespace, rates: list[float]) -> dict:
    """Start a server with ``name``'s flags, fill the sessions, run each phase and the burst."""
    port = free_port()
    log = RESULTS / f"multitenant-{name}.log"
    pool = (["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory
            else ["--num-blocks", str(args.num_blocks)])
    steps = ["--step-log", f"{args.step_log}.{name}.jsonl"] if args.step_log else []
    server = Server(port, [*pool, "--max-waiting", "100000", *steps, *CONFIGS[name]], log)
    api = Api(server.url)
    try:
        banner = log.read_text().splitlines()[:4]
        contexts = [round(args.ctx_min + (args.ctx_max - args.ctx_min) * i / max(1, args.sessions - 1))
                    for i in range(args.sessions)]
        t0 = time.perf_counter()
        sessions = asyncio.run(_create(server.url, contexts, args.seed))
        setup_s = time.perf_counter() - t0
        print(f"[{name}] {len(sessions)} sessions, {sum(contexts):,} context tokens, filled in {setup_s:.0f} s",
              flush=True)
        system = load.tool_system_prompt()
        phases = []
        for rate in rates:
            before = counters(api)
            reqs = load.trace_requests(rate, args.duration, args.seed + int(rate * 100), args.shared_share, system)
            row = asyncio.run(load.run_phase(server.url, sessions, reqs, args.duration, args.record_every,
                                             args.question_every, args.answer_tokens))
            api.wait_idle(quiet_s=0.3, timeout=900)
            after = counters(api)
            row.update(rate=rate, **{k.removeprefix("streamkv_").removesuffix("_total"): after[k] - before[k]
                                      for k in COUNTERS}, **engine_gaps(before, after))
            phases.append(row)
            print(f"[{name}] rate {rate}: session p50/p99 {row['session_p50_ms']:.0f}/{row['session_p99_ms']:.0f} ms"
                  f" (server-side {row['session_server_p50_ms']:.0f}/{row['session_server_p99_ms']:.0f} ms),"
                  f" TTFT p99 {row['ttft_p99_s']:.2f} s, stall {row['gap_max_ms']:.0f} ms "
                  f"(median gap {row['gap_median_ms']:.0f} ms; engine-side {row['engine_gaps_over_3x']:.0f} of "
                  f"{row['engine_gaps']:.0f} gaps over 3x the median step of {row['engine_step_median_ms']:.0f} ms, "
                  f"p99 {row['engine_gap_p99_x']:.1f}x, worst <= {row['engine_gap_worst_x']:.1f}x), errors {row['errors']}, "
                  f"session pushes/questions refused {row['session_errors']}, preemptions {row['preemptions']:.0f}",
                  flush=True)
        burst = asyncio.run(load.burst(server.url, args.burst, salt=f"[{name} {time.time_ns()}] "))
        print(f"[{name}] burst of {args.burst}: {burst['computed_tokens']:,} of {burst['prompt_tokens']:,} prompt "
              f"tokens computed", flush=True)
        return {"name": name, "flags": CONFIGS[name], "banner": banner, "setup_s": setup_s, "phases": phases,
                "burst": burst}
    finally:
        api.close()
        server.stop()


async def _create(url: str, contexts: list[int], seed: int) -> list[load.LiveSession]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800)) as client:
        sessions = await load.create_sessions(client, url, contexts, seed)
        await load.wait_filled(client, url, sessions, timeout=1800)
        return sessions


def sustained(phases: list[dict], slo: float) -> float:
    ok = [p["rate"] for p in phases if p["rate"] > 0 and p["errors"] == 0 and not p.get("session_errors")
          and p["ttft_p99_s"] <= slo]
    return max(ok, default=0.0)


def merged(paths: list[str]) -> dict:
    """Results of several runs as one (the first run's machine, reference and ablation rate)."""
    import json
    runs = [json.loads(Path(p).read_text()) for p in paths]
    out = {**runs[0], "configs": {}}
    for r in runs:
        out["configs"].update(r["configs"])
    return out


def main() -> None:
    args = parse()
    if args.plot_from:
        results = merged(args.plot_from.split(","))
        print(report(results, argparse.Namespace(**results["args"])))
        plot(results, RESULTS / "multitenant-merged.png")
        return
    rates = [float(r) for r in args.rates.split(",")]
    names = args.configs.split(",")
    machine = machine_info()
    print(f"CPU: {machine['cpu']['model']} ({machine['cores']} cores; {' '.join(machine['cpu']['flags'])})", flush=True)
    results = {"machine": machine, "args": vars(args), "configs": {}}
    ref = names[0]  # the reference runs every rate; the others idle and its highest sustained rate
    results["configs"][ref] = run_config(ref, args, rates)
    top = sustained(results["configs"][ref]["phases"], args.ttft_slo) or max(rates)
    results["reference"], results["ablation_rate"] = ref, top
    for name in names[1:]:
        results["configs"][name] = run_config(name, args, [top])
    path = write_json("multitenant", results)
    print(report(results, args))
    plot(results, RESULTS / f"{path.stem}.png")
    print(f"results: {path}")


def _ratio(phase: dict, key: str) -> float:
    """``phase[key]`` (a gap statistic, ms: ``gap_worst_p99_ms``, the p99 over requests of each
    one's worst gap, or ``gap_p99_ms``, the p99 over all gaps) over the median gap; NaN for
    phases recorded before ``key`` was."""
    return phase.get(key, float("nan")) / phase["gap_median_ms"]


def _engine_over(phase: dict) -> str:
    """``n / N``: engine-side gaps over 3x the phase's median step (``-`` for phases recorded
    before 2fcac7a, which had none or counted against a rolling median)."""
    if "engine_gap_worst_x" not in phase:
        return "-"
    return f"{phase['engine_gaps_over_3x']:.0f} / {phase['engine_gaps']:.0f}"


def report(results: dict, args: argparse.Namespace) -> str:
    m = results["machine"]
    lines = [f"Machine: {m['cpu']['model']}, {m['cores']} cores ({' '.join(m['cpu']['flags'])}); "
             f"{args.sessions} sessions of {args.ctx_min}..{args.ctx_max} tokens, {args.duration:.0f} s phases", ""]
    head = ["config", "stateless req/s", "session p50 ms", "session p99 ms", "TTFT p50 s", "TTFT p99 s",
            "TPOT p50 ms", "TPOT p99 ms", "worst gap ms", "median gap ms", "gap/median", "p99 worst gap/median",
            "p99 gap/median", "engine gaps > 3x", "engine p99 gap", "engine worst gap", "chunks/s",
            "deferred chunks", "drafts acc/prop", "errors", "session refusals"]
    rows = []
    for name, c in results["configs"].items():
        for p in c["phases"]:
            rows.append([name, fmt(p["rate"], 2), fmt(p["session_p50_ms"]), fmt(p["session_p99_ms"]),
                         fmt(p["ttft_p50_s"], 2), fmt(p["ttft_p99_s"], 2), fmt(p["tpot_p50_ms"]), fmt(p["tpot_p99_ms"]),
                         fmt(p["gap_max_ms"]), fmt(p["gap_median_ms"]), fmt(p["stall_ratio"], 1),
                         fmt(_ratio(p, "gap_worst_p99_ms"), 1), fmt(_ratio(p, "gap_p99_ms"), 1),
                         _engine_over(p), fmt(p.get("engine_gap_p99_x", float("nan")), 1),
                         f"<= {p['engine_gap_worst_x']:.1f}" if "engine_gap_worst_x" in p else "-",
                         fmt(p["output_chunks_per_s"], 1), fmt(p["admission_deferred_chunks"]),
                         f"{p['spec_drafts_accepted']:.0f}/{p['spec_drafts_proposed']:.0f}", p["errors"],
                         p.get("session_errors", "-")])
    lines.append(md_table(head, rows))
    lines.append("")
    brow = [[n, c["burst"]["requests"], c["burst"]["prompt_tokens"], c["burst"]["computed_tokens"],
             fmt(c["burst"]["ttft_max_s"], 2)] for n, c in results["configs"].items()]
    lines.append(md_table(["config", "burst requests", "prompt tokens", "computed tokens", "last TTFT s"], brow))
    lines += ["", *targets(results, args.ttft_slo)]
    return "\n".join(lines)


def _session_verdict(ratio: float, rate: float, top: float, ttft_p99_s: float) -> str:
    """The session target (p99 <= 2x idle) is read at ``top``, the highest sustained rate."""
    if rate == top:
        return f"target <= 2x at the highest sustained rate: {'met' if ratio <= 2 else 'NOT met'}"
    if rate > top:
        return f"not sustained, TTFT p99 {ttft_p99_s:.1f} s: reported only"
    return "below the highest sustained rate: reported only"


def targets(results: dict, slo: float) -> list[str]:
    cfg = results["configs"]
    out = []
    for name in dict.fromkeys([results.get("reference", "all-on"), "cadence"]):
        if name not in cfg:
            continue
        ph = {p["rate"]: p for p in cfg[name]["phases"]}
        if 0.0 in ph:
            # the session target holds at the highest sustainable load (the words), the
            # highest rate whose stateless TTFT p99 met the objective; past it the queue grows
            # through the phase and every latency with it, so a ratio there is only reported
            top = sustained(cfg[name]["phases"], slo)
            if not top:
                out.append(f"- {name}: no stateless rate was sustained (TTFT p99 <= {slo:g} s): the session "
                           f"target cannot be read from this run; run lower --rates")
            for rate, p in sorted(ph.items()):
                if rate > 0:
                    r = p["session_p99_ms"] / ph[0.0]["session_p99_ms"]
                    all_p99 = _ratio(p, "gap_p99_ms")
                    verdict = _session_verdict(r, rate, top, p["ttft_p99_s"])
                    out.append(f"- {name} at {rate} req/s: session p99 / idle p99 {r:.2f}x ({verdict}); "
                               f"worst inter-token gap / median gap "
                               f"{p['stall_ratio']:.1f}x (target <= 3x: {'met' if p['stall_ratio'] <= 3 else 'NOT met'}); "
                               f"p99 of per-request worst gaps / median gap {_ratio(p, 'gap_worst_p99_ms'):.1f}x; p99 of all "
                               f"gaps / median gap {all_p99:.1f}x (proposed target <= 3x: "
                               f"{'met' if all_p99 <= 3 else 'NOT met'}); engine-side gaps over 3x the median step "
                               f"{_engine_over(p)} (worst <= {p.get('engine_gap_worst_x', float('nan')):.1f}x)")
    if "all-on" in cfg and "no-grouping" in cfg:
        a, b = cfg["all-on"]["burst"]["computed_tokens"], cfg["no-grouping"]["burst"]["computed_tokens"]
        cut = 1 - a / b if b else float("nan")
        out.append(f"- burst prompt tokens computed: {a:,} grouped vs {b:,} ungrouped, cut {cut:.0%} "
                   f"(target >= 50%: {'met' if cut >= 0.5 else 'NOT met'})")
    return out


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the results and tables are written already
        print("plot: skipped (matplotlib is not installed: pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, c in results["configs"].items():
        pts = sorted((p["rate"], p["session_p99_ms"]) for p in c["phases"])
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name,
                linestyle="-" if len(pts) > 1 else ":")
    ax.set_xlabel("stateless load (req/s, Azure conversation trace)")
    ax.set_ylabel("session-query p99 (ms)")
    ax.set_title(f"{len(results['configs'])} configs, {results['args']['sessions']} live sessions")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
