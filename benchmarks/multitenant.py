"""Multi-tenant continuous batching (issue 16): live sessions and stateless traffic on one
server, everything on, then each scheduler mechanism off in turn.

    .venv/bin/python benchmarks/multitenant.py                 # ~35 min on 2 cores
    .venv/bin/python benchmarks/multitenant.py --configs cadence   # ~12 min: the decode cadence's sweep
    .venv/bin/python benchmarks/multitenant.py --quick         # ~6 min: 8 sessions, shorter phases
    .venv/bin/python benchmarks/multitenant.py --no-sweep --ablation-rate 1 --repeats 2  # ~55 min: the arm

Workload (``multitenant_load.py``):
- ``--sessions`` live sessions (default 32), contexts spread evenly from ``--ctx-min`` to
  ``--ctx-max`` tokens (500..6,000), each ingesting one market bar every ``--record-every`` s and
  asked a question every ``--question-every`` s (answers of ``--answer-tokens`` tokens, greedy;
  every 24 s each by default: 2 cores cannot serve 32 sessions a question every few seconds);
- stateless ``/v1/chat/completions`` traffic (streaming, greedy, EOS ignored) at each rate of
  ``--rates`` req/s: arrival gaps, prompt and output lengths from the Azure 2023 conversation
  trace (lengths x 0.25), 30% of requests carrying one ~600-token system prompt with 6 tool schemas.

Measured per phase: session-query round trip p50/p99, stateless TTFT and TPOT (per token)
p50/p99, decode stalls (the longest gap between two streamed chunks of one request, against the
median gap, which stands for the median step), the same engine-side (token gaps against the
phase's median step interval, from ``/metrics``' histograms), output tokens/s (and chunks/s: a
chunk carries every accepted draft). Then a burst: ``--burst`` requests with one fresh (cold)
tool system prompt sent at once while the engine prefills a 4,096-token prompt, so they wait
together; the prompt tokens they computed (prompt - cached, from
``usage.prompt_tokens_details``). ``--burst-only`` runs the burst alone on a fresh server per config.

Configurations: the first of ``--configs`` (default ``all-on``: cell-budget admission, adaptive
chunks, grouped prefill, PLD) runs every rate (the sweep). Then the ablation arm: every config,
the first included, on a fresh server at one rate (``--ablation-rate``, default the highest rate
the sweep sustained: stateless TTFT p99 <= ``--ttft-slo`` and no errors), ``--repeats`` times in
turn (A B C A B C), so every row starts from the same state at the same load and its spread is
measured. The sweep's row at that rate is not one of them: it ran after four earlier phases (on
2026-12-02 all-on gave 2.2 s session p99 there and 7.3 s on a fresh server). Near the knee a run
can tip into a growing queue, so read the arm at a rate below it (``--ablation-rate 1``).
``cadence`` is ``all-on`` plus the decode cadence (``--stall-factor 3``, off by default);
``--configs cadence`` sweeps it alone, and ``cadence-capped`` cuts questions too
(``--question-chunks capped``). Results: ``benchmarks/results/multitenant-*.json`` and a plot
of session p99 against stateless load.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import multitenant_load as load  # noqa: E402
from common import RESULTS, machine_info, md_table, write_json  # noqa: E402
from flash_server import Api, Server, free_port  # noqa: E402
from multitenant_report import spread, plot, report, sustained  # noqa: E402

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
    ap.add_argument("--ablation-rate", type=float, default=None, help="stateless req/s of the ablation arm "
                    "(default: the highest rate the sweep sustained)")
    ap.add_argument("--repeats", type=int, default=1, help="fresh-server runs of each config in the ablation arm")
    ap.add_argument("--no-sweep", action="store_true", help="skip the sweep: the ablation arm alone "
                    "(needs --ablation-rate)")
    ap.add_argument("--burst-only", action="store_true", help="each config: a fresh server and the burst "
                    "alone, --repeats times (no sessions, no phases; ~1 min each)")
    ap.add_argument("--step-log", default=None, help="PREFIX: each config's server logs every engine step to "
                    "PREFIX.CONFIG.jsonl (streamkv/engine/step_log.py)")
    ap.add_argument("--plot-from", default=None, help="comma-separated result JSONs: merge their configs into one "
                    "report and plot (no runs)")
    ap.add_argument("--quick", action="store_true", help="8 sessions of 500..3,000 tokens asked every 8 s, 30 s "
                    "phases, rates 0,0.5,2")
    args = ap.parse_args()
    if args.no_sweep and args.ablation_rate is None:
        ap.error("--no-sweep needs --ablation-rate")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
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


def pool_flags(args: argparse.Namespace) -> list[str]:
    """The server's KV pool: ``--kv-cache-memory`` bytes when given, else ``--num-blocks``."""
    return (["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory
            else ["--num-blocks", str(args.num_blocks)])


def run_config(name: str, args: argparse.Namespace, rates: list[float], tag: str = "") -> dict:
    """Start a server with ``name``'s flags, fill the sessions, run each phase and the burst
    (``tag`` names the run's log files: ``.r1`` for the ablation arm's first repeat)."""
    port = free_port()
    log = RESULTS / f"multitenant-{name}{tag}.log"
    pool = pool_flags(args)
    steps = ["--step-log", f"{args.step_log}.{name}{tag}.jsonl"] if args.step_log else []
    server = Server(port, [*pool, "--max-waiting", "100000", *steps, *CONFIGS[name]], log)
    api = Api(server.url)
    try:
        banner = log.read_text().splitlines()[:4]
        contexts = [round(args.ctx_min + (args.ctx_max - args.ctx_min) * i / max(1, args.sessions - 1))
                    for i in range(args.sessions)]
        t0 = time.perf_counter()
        sessions = asyncio.run(_create(server.url, contexts, args.seed))
        setup_s = time.perf_counter() - t0
        held = api.metric("streamkv_kv_blocks_used")  # the sessions' footprint, to size a tight pool by
        print(f"[{name}] {len(sessions)} sessions, {sum(contexts):,} context tokens, filled in {setup_s:.0f} s, "
              f"{held:.0f} KV blocks held", flush=True)
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
                  f"p99 {row['engine_gap_p99_x']:.1f}x, worst <= {row['engine_gap_worst_x']:.1f}x), "
                  f"errors {row['errors']}{' ' + str(row['error_kinds']) if row['errors'] else ''}, "
                  f"session pushes/questions refused {row['session_errors']}, preemptions {row['preemptions']:.0f}",
                  flush=True)
        burst = asyncio.run(load.burst(server.url, args.burst, salt=f"[{name} {time.time_ns()}] "))
        print(f"[{name}] burst of {args.burst}: {burst['computed_tokens']:,} of {burst['prompt_tokens']:,} prompt "
              f"tokens computed", flush=True)
        return {"name": name, "flags": CONFIGS[name], "banner": banner, "setup_s": setup_s, "blocks_after_fill": held,
                "phases": phases, "burst": burst}
    finally:
        api.close()
        server.stop()


async def _create(url: str, contexts: list[int], seed: int) -> list[load.LiveSession]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800)) as client:
        sessions = await load.create_sessions(client, url, contexts, seed)
        await load.wait_filled(client, url, sessions, timeout=1800)
        return sessions


def burst_only(names: list[str], args: argparse.Namespace, machine: dict) -> None:
    """The burst on a fresh server per config and repeat, in turn: computed prompt tokens."""
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names:
            server = Server(free_port(), [*pool_flags(args), *CONFIGS[name]],
                            RESULTS / f"multitenant-burst-{name}.r{r + 1}.log")
            try:
                runs[name].append(asyncio.run(load.burst(server.url, args.burst, salt=f"[{name} {time.time_ns()}] ")))
            finally:
                server.stop()
            b = runs[name][-1]
            print(f"[{name}] burst of {args.burst}: {b['computed_tokens']:,} of {b['prompt_tokens']:,} prompt tokens "
                  f"computed, last TTFT {b['ttft_max_s']:.2f} s, errors {b['errors']}", flush=True)
    path = write_json("multitenant-burst", {"machine": machine, "args": vars(args), "bursts": runs})
    rows = [[n, len(bs), spread([b["computed_tokens"] for b in bs], 0), bs[0]["prompt_tokens"],
             spread([b["ttft_max_s"] for b in bs], 2)] for n, bs in runs.items()]
    print(md_table(["config", "runs", "computed tokens", "prompt tokens", "last TTFT s"], rows))
    print(f"results: {path}")


def merged(paths: list[str]) -> dict:
    """Results of several runs as one (the first run's machine, reference and ablation rate)."""
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
    RESULTS.mkdir(parents=True, exist_ok=True)  # the servers' logs go there from the first run
    machine = machine_info()
    print(f"CPU: {machine['cpu']['model']} ({machine['cores']} cores; {' '.join(machine['cpu']['flags'])})", flush=True)
    if args.burst_only:
        return burst_only(names, args, machine)
    results = {"machine": machine, "args": vars(args), "configs": {}, "reference": names[0]}
    top = args.ablation_rate
    if not args.no_sweep:  # the reference runs every rate
        results["configs"][names[0]] = run_config(names[0], args, rates)
        top = top if top is not None else sustained(results["configs"][names[0]]["phases"], args.ttft_slo) or max(rates)
    results["ablation_rate"], results["ablation"] = top, {n: [] for n in names}
    if len(names) > 1 or args.no_sweep:
        for r in range(args.repeats):  # in turn, so a drift of the machine spreads over every config
            for name in names:
                results["ablation"][name].append(run_config(name, args, [top], tag=f".r{r + 1}"))
                (RESULTS / "multitenant-partial.json").write_text(json.dumps(results, default=str))
    path = write_json("multitenant", results)
    print(report(results, args))
    plot(results, RESULTS / f"{path.stem}.png")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
