"""Tables, verdicts and the plot of ``benchmarks/multitenant.py``'s results (the sweep, the
ablation arm: each config's fresh-server runs at one rate, median [min-max])."""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from common import fmt, md_table


def sustained(phases: list[dict], slo: float) -> float:
    ok = [p["rate"] for p in phases if p["rate"] > 0 and p["errors"] == 0 and not p.get("session_errors")
          and p["ttft_p99_s"] <= slo]
    return max(ok, default=0.0)


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
    lines = [(f"Machine: {m['cpu']['model']}, {m['cores']} cores ({' '.join(m['cpu']['flags'])}); "
              f"{args.sessions} sessions of {args.ctx_min}..{args.ctx_max} tokens, {args.duration:.0f} s phases"), ""]
    head = ["config", "stateless req/s", "session p50 ms", "session p99 ms", "TTFT p50 s", "TTFT p99 s",
            "TPOT p50 ms", "TPOT p99 ms", "worst gap ms", "median gap ms", "gap/median", "p99 worst gap/median",
            "p99 gap/median", "engine gaps > 3x", "engine p99 gap", "engine worst gap", "tokens/s",
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
                         fmt(p.get("output_tokens_per_s", float("nan")), 1), fmt(p["admission_deferred_chunks"]),
                         f"{p['spec_drafts_accepted']:.0f}/{p['spec_drafts_proposed']:.0f}", p["errors"],
                         p.get("session_errors", "-")])
    if rows:  # the sweep (absent with --no-sweep)
        brow = [[n, c["burst"]["requests"], c["burst"]["prompt_tokens"], c["burst"]["computed_tokens"],
                 fmt(c["burst"]["ttft_max_s"], 2)] for n, c in results["configs"].items()]
        lines += [md_table(head, rows), "",
                  md_table(["config", "burst requests", "prompt tokens", "computed tokens", "last TTFT s"], brow), ""]
    lines += [*ablation_report(results), *targets(results, args.ttft_slo)]
    return "\n".join(lines)


# the ablation arm's columns: (heading, phase key or a function of the run, digits, compared):
# "compared" columns are the latencies and throughput whose ranges are set against the reference's
ARM = [("session p50 ms", "session_p50_ms", 0, True), ("session p99 ms", "session_p99_ms", 0, True),
       ("TTFT p50 s", "ttft_p50_s", 2, True), ("TTFT p99 s", "ttft_p99_s", 2, True),
       ("TPOT p50 ms", "tpot_p50_ms", 0, True), ("TPOT p99 ms", "tpot_p99_ms", 0, True),
       ("worst gap ms", "gap_max_ms", 0, True),
       ("tokens/s", lambda run: run["phases"][0].get("output_tokens_per_s", float("nan")), 1, True),
       ("deferred chunks", "admission_deferred_chunks", 0, False),
       ("drafts accepted", "spec_drafts_accepted", 0, False), ("preemptions", "preemptions", 0, False),
       ("burst computed tokens", lambda run: run["burst"]["computed_tokens"], 0, False)]


def _arm_values(runs: list[dict], key: Any) -> list[float]:
    return [float(key(run)) if callable(key) else float(run["phases"][0][key]) for run in runs]


def spread(values: list[float], digits: int) -> str:
    """``median [min-max]`` (the median alone for one run)."""
    med = fmt(statistics.median(values), digits)
    return med if len(values) == 1 else f"{med} [{fmt(min(values), digits)}-{fmt(max(values), digits)}]"


def ablation_report(results: dict) -> list[str]:
    """The ablation arm: each config's fresh-server runs at one rate, median [range]; a config's
    median is called apart from the reference's only where their ranges do not overlap."""
    arm = {n: runs for n, runs in results.get("ablation", {}).items() if runs}
    if not arm:
        return []
    ref = results["reference"]
    rows = [[n, len(runs), *(spread(_arm_values(runs, k), d) for _, k, d, _ in ARM)] for n, runs in arm.items()]
    out = [(f"Ablation arm: fresh server per run, {results['ablation_rate']:g} stateless req/s "
            "(median [min-max] over runs)"), "", md_table(["config", "runs", *(h for h, _, _, _ in ARM)], rows), ""]
    if ref not in arm or len(arm[ref]) < 2:
        return out + ["- ablations: the reference needs 2 or more runs to tell its spread (--repeats)", ""]
    for name, runs in arm.items():
        if name == ref:
            continue
        apart = []
        for head, key, digits in (c[:3] for c in ARM if c[3]):
            a, b = _arm_values(arm[ref], key), _arm_values(runs, key)
            if max(a) < min(b) or max(b) < min(a):
                apart.append(f"{head} {fmt(statistics.median(b), digits)} vs {fmt(statistics.median(a), digits)}")
        out.append(f"- {name} vs {ref}: " + ("; ".join(apart) + " (ranges apart)" if apart
                                             else "every latency's range overlaps the reference's"))
    return out + [""]


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
                               f"{p['stall_ratio']:.1f}x (target <= 3x: "
                               f"{'met' if p['stall_ratio'] <= 3 else 'NOT met'}); p99 of per-request worst gaps "
                               f"/ median gap {_ratio(p, 'gap_worst_p99_ms'):.1f}x; p99 of all "
                               f"gaps / median gap {all_p99:.1f}x (proposed target <= 3x: "
                               f"{'met' if all_p99 <= 3 else 'NOT met'}); engine-side gaps over 3x the median step "
                               f"{_engine_over(p)} (worst <= {p.get('engine_gap_worst_x', float('nan')):.1f}x)")
    arm = results.get("ablation", {})
    bursts = {n: runs[0]["burst"] for n, runs in arm.items() if runs} or {n: c["burst"] for n, c in cfg.items()}
    if "all-on" in bursts and "no-grouping" in bursts:
        a, b = bursts["all-on"]["computed_tokens"], bursts["no-grouping"]["computed_tokens"]
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
    arm = {n: runs for n, runs in results.get("ablation", {}).items() if runs}
    for i, (name, runs) in enumerate(arm.items()):  # side by side around the arm's rate
        p99 = _arm_values(runs, "session_p99_ms")
        med = statistics.median(p99)
        x = results["ablation_rate"] * (1 + 0.04 * (i - (len(arm) - 1) / 2))
        ax.errorbar([x], [med], yerr=[[med - min(p99)], [max(p99) - med]], fmt="s", capsize=3,
                    label=f"{name}, fresh x{len(runs)}")
    ax.set_xlabel("stateless load (req/s, Azure conversation trace)")
    ax.set_ylabel("session-query p99 (ms)")
    ax.set_title(f"{len(set(results['configs']) | set(arm))} configs, {results['args']['sessions']} live sessions")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
