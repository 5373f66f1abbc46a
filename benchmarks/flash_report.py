"""Summary statistics, targets and markdown of the flash-query benchmark (stdlib only)."""
from __future__ import annotations

import argparse
import statistics
from collections import Counter
from typing import Any, Callable

import flash_workload as fw
from common import fmt, md_table

TARGET_MIX_SPEEDUP = 5.0
TARGET_HIT_P50_MS = 5.0
Row = dict[str, Any]


# --------------------------------------------------------------------------- statistics
def pct(xs: list[float], p: float) -> float | None:
    """Percentile p (0-100), linear interpolation between closest ranks."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def dist(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99),
            "mean": statistics.fmean(xs) if xs else None, "min": min(xs) if xs else None,
            "max": max(xs) if xs else None}


def pick(rows: list[Row], **where: Any) -> list[Row]:
    return [r for r in rows if all(r.get(k) == v for k, v in where.items())]


def mean_of(rows: list[Row], key: str = "ms") -> float | None:
    return statistics.fmean(r[key] for r in rows) if rows else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# --------------------------------------------------------------------------- summaries
def paths(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Latency distribution per answer path (client round trip and server-side ms)."""
    groups: dict[str, Callable[[Row], bool]] = {
        "flash hit": lambda r: r["session"] == "flash" and r["source"] == "flash",
        "ready exit (default scaffold)": lambda r: r["session"] == "ready" and r["source"] == "ready",
        "ready exit (answer-position scaffold, low gap)":
            lambda r: r["session"] == "scaffold" and r["source"] == "ready",
        "standard query": lambda r: r["session"] == "plain" and r["source"] == "session",
        "standard query (flash session, unregistered)":
            lambda r: r["session"] == "flash" and r["source"] == "session",
    }
    out = {}
    for name, pred in groups.items():
        sel = [r for r in rows if pred(r)]
        out[name] = {"client_ms": dist([r["ms"] for r in sel]), "server_ms": dist([r["server_ms"] for r in sel])}
    return out


def mix(rows: list[Row], wl: fw.Workload) -> dict[str, Any]:
    """70/30 mix (the flash session: hits + standard) vs all-standard (the plain session)."""
    m, a = pick(rows, session="flash", **{"pass": "mix"}), pick(rows, session="plain", **{"pass": "all_standard"})
    per_round = []
    for rnd in sorted({r["round"] for r in m}):
        mr, ar = pick(m, round=rnd), pick(a, round=rnd)
        per_round.append({"round": rnd, "mix_ms": mean_of(mr), "all_standard_ms": mean_of(ar),
                          "ratio": ratio(mean_of(ar), mean_of(mr))})
    share = len(wl.registered) / len(wl.questions) if wl.questions else 0.0
    misses = [r for r in m if r["registered"] and r["source"] != "flash"]
    return {"registered_share": share, "n_mix": len(m), "n_all_standard": len(a),
            "mix_mean_ms": mean_of(m), "all_standard_mean_ms": mean_of(a),
            "ratio": ratio(mean_of(a), mean_of(m)),
            "ratio_server_ms": ratio(mean_of(a, "server_ms"), mean_of(m, "server_ms")),
            "mix_p50_ms": pct([r["ms"] for r in m], 50), "all_standard_p50_ms": pct([r["ms"] for r in a], 50),
            "ratio_p50": ratio(pct([r["ms"] for r in a], 50), pct([r["ms"] for r in m], 50)),
            "bound_if_hits_free": 1.0 / (1.0 - share) if share < 1 else None,
            "registered_not_flash": len(misses), "per_round": per_round,
            "versions_mismatch": sum(1 for x, y in zip(m, a) if x["data_version"] != y["data_version"])}


def answers(rows: list[Row]) -> dict[str, Any]:
    """Flash answers vs the standard answers of the same question, round and version."""
    flash = {(r["round"], r["q"]): r for r in pick(rows, session="flash", source="flash", **{"pass": "mix"})}
    plain = {(r["round"], r["q"]): r for r in pick(rows, session="plain", **{"pass": "all_standard"})}
    both = [k for k in flash if k in plain]
    return {"pairs": len(both), "same_text": sum(flash[k]["answer"] == plain[k]["answer"] for k in both),
            "flash_correct": sum(flash[k]["correct"] for k in both),
            "standard_correct": sum(plain[k]["correct"] for k in both),
            "standard_correct_all": sum(r["correct"] for r in plain.values()), "standard_all": len(plain)}


def ready(rows: list[Row], session: str, wl: fw.Workload, min_gap: float) -> dict[str, Any]:
    sel = pick(rows, session=session)
    fired = [r for r in sel if r["source"] == "ready"]
    gaps = [r["gap"] for r in fired if r.get("gap") is not None]
    plain = {(r["round"], r["q"]): r for r in pick(rows, session="plain", **{"pass": "all_standard"})}
    agree = [r for r in fired if (r["round"], r["q"]) in plain]
    kinds = {q.key: q.kind for q in wl.questions}
    return {"queries": len(sel), "fired": len(fired), "rate": len(fired) / len(sel) if sel else None,
            "sources": dict(Counter(r["source"] for r in sel)),
            "fired_correct": sum(r["correct"] for r in fired),
            "fired_on_non_word_questions": sum(kinds.get(r["q"]) not in fw.WORD_TYPES for r in fired),
            "fired_same_as_standard": sum(
                fw.same_answer(next(q for q in wl.questions if q.key == r["q"]), r["answer"],
                               plain[(r["round"], r["q"])]["answer"]) for r in agree),
            "fired_answers": dict(Counter(r["answer"] for r in fired)), "gap": dist(gaps),
            "ready_min_gap": min_gap, "fired_at_ready_min_gap": sum(g >= min_gap for g in gaps),
            "fallback_answers": dict(Counter(r["answer"] for r in sel if r["source"] != "ready"))}


def flash_eval(pushes: list[Row]) -> dict[str, Any]:
    rows = [r for r in pushes if r["session"] == "flash"]
    later = [r for r in rows if r["round"] > 0]
    return {"per_round": [{k: r.get(k) for k in ("round", "version", "ingest_ms", "flash_ms",
                                                   "flash_after_update_ms", "flash_first_ms")} for r in rows],
            "push_to_ready_ms": dist([r["flash_ms"] for r in later]),
            "update_to_ready_ms": dist([r["flash_after_update_ms"] for r in later])}


def busy(runs: list[Row]) -> list[dict[str, Any]]:
    out = []
    for b in runs:
        q = b["queries"]
        ft = [t["flash_ms"] for t in b["flash_timings"] if t.get("flash_ms") is not None]
        out.append({"run": "flash questions registered" if b["with_flash"] else "no flash questions",
                    "wall_s": b["wall_s"], "busy_s": b["busy_s"], "share": b["share"], "late": b["late"],
                    "queries": len(q), "sources": dict(Counter(r["source"] for r in q)),
                    "query_mean_ms": mean_of(q), "query_p50_ms": pct([r["ms"] for r in q], 50),
                    "correct": sum(r["correct"] for r in q),
                    "flash_push_to_ready_ms": dist(ft), "flash_stats": (b["session"] or {}).get("flash")})
    return out


def targets(mx: dict[str, Any], hit: dict[str, Any]) -> list[dict[str, Any]]:
    p50 = hit["client_ms"]["p50"]
    return [{"target": f"mean latency, all-standard / {mx['registered_share']:.0%} flash mix >= "
                       f"{TARGET_MIX_SPEEDUP:g}x", "value": mx["ratio"], "unit": "x",
             "pass": None if mx["ratio"] is None else mx["ratio"] >= TARGET_MIX_SPEEDUP},
            {"target": f"flash hit HTTP round trip p50 <= {TARGET_HIT_P50_MS:g} ms", "value": p50, "unit": "ms",
             "pass": None if p50 is None else p50 <= TARGET_HIT_P50_MS}]


def summarize(res: dict[str, Any], wl: fw.Workload, args: argparse.Namespace) -> dict[str, Any]:
    rows = res["latency"]["queries"]
    p = paths(rows)
    mx = mix(rows, wl)
    hits = {"metric": res["latency"]["engine"].get("flash_hits_metric"),
            "counted": len(pick(rows, source="flash")) + (1 if wl.registered else 0)}  # + the warm-up hit
    return {"flash_hits": hits, "paths": p, "mix": mx, "answers": answers(rows),
            "ready": ready(rows, "ready", wl, args.ready_min_gap),
            "ready_scaffold": ready(rows, "scaffold", wl, args.ready_min_gap),
            "flash_eval": flash_eval(res["latency"]["pushes"]),
            "busy": busy(res["busy"]), "targets": targets(mx, p["flash hit"]), "vocab": res["vocab"],
            "sessions": res["latency"]["sessions"], "foreign_load_cores": res["foreign_load_cores"]}


# --------------------------------------------------------------------------- markdown
def ms(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.2f}" if v < 1 else f"{v:.1f}" if v < 100 else f"{v:,.0f}"


def verdict(t: dict[str, Any]) -> str:
    return "n/a" if t["pass"] is None else "PASS" if t["pass"] else "FAIL"


def path_table(p: dict[str, Any]) -> str:
    rows = [[name, str(d["client_ms"]["n"]), ms(d["client_ms"]["p50"]), ms(d["client_ms"]["p90"]),
             ms(d["client_ms"]["p99"]), ms(d["client_ms"]["mean"]), ms(d["server_ms"]["p50"])]
            for name, d in p.items()]
    return md_table(["path", "n", "p50 ms", "p90 ms", "p99 ms", "mean ms", "server p50 ms"], rows)


def mix_table(mx: dict[str, Any]) -> str:
    rows = [[f"{mx['registered_share']:.0%} flash + {1 - mx['registered_share']:.0%} standard",
             ms(mx["mix_mean_ms"]), ms(mx["mix_p50_ms"]), str(mx["n_mix"])],
            ["all standard (same questions, same version)", ms(mx["all_standard_mean_ms"]),
             ms(mx["all_standard_p50_ms"]), str(mx["n_all_standard"])],
            ["speedup (all standard / mix)", fmt(mx["ratio"], 2) + "x", fmt(mx["ratio_p50"], 1) + "x", ""]]
    return md_table(["question mix", "mean ms", "p50 ms", "n"], rows)


def eval_table(fe: dict[str, Any]) -> str:
    rows = [[str(r["round"]), str(r["version"]), ms(r["ingest_ms"]), ms(r.get("flash_after_update_ms")),
             ms(r.get("flash_ms"))] for r in fe["per_round"]]
    return md_table(["round", "version", "push -> data_updated ms", "data_updated -> last flash_ready ms",
                     "push -> last flash_ready ms"], rows)


def busy_table(bs: list[dict[str, Any]]) -> str:
    rows = [[b["run"], f"{b['wall_s']:.1f}", f"{b['busy_s']:.2f}", f"{100 * (b['share'] or 0):.1f}%",
             ms(b["query_mean_ms"]), ms(b["query_p50_ms"]),
             ", ".join(f"{k} {v}" for k, v in sorted(b["sources"].items())), str(b["late"])] for b in bs]
    return md_table(["run", "wall s", "engine busy s", "busy share", "query mean ms", "query p50 ms",
                     "answered by", "late"], rows)


def ready_lines(name: str, r: dict[str, Any]) -> list[str]:
    g = r["gap"]
    gaps = (f"; top1-top2 logit gap of the fired answers p50 {fmt(g['p50'], 2)} (min {fmt(g['min'], 2)}, "
            f"max {fmt(g['max'], 2)}): {r['fired_at_ready_min_gap']} at or above {r['ready_min_gap']:g}"
            if g["n"] else "")
    return [f"- {name}: fired on {r['fired']}/{r['queries']} queries ({100 * (r['rate'] or 0):.0f}%); "
            f"fired answers {r['fired_answers'] or '{}'}, {r['fired_correct']} correct, "
            f"{r['fired_same_as_standard']} equal to the standard answer, "
            f"{r['fired_on_non_word_questions']} on numeric questions{gaps}; sources {r['sources']}"]


def report(s: dict[str, Any], machine: dict[str, Any], args: argparse.Namespace) -> str:
    mx, an, fe = s["mix"], s["answers"], s["flash_eval"]
    out = ["## Flash queries: latency per answer path (HTTP round trip, keep-alive client)", "",
           path_table(s["paths"]), "", "## Question mix (effective mean latency)", "", mix_table(mx), "",
           f"With hits free the {mx['registered_share']:.0%} mix can be at most "
           f"{fmt(mx['bound_if_hits_free'], 2)}x faster than all-standard (1 / unregistered share). "
           f"Registered questions not answered from flash: {mx['registered_not_flash']}. "
           f"Flash answers equal the standard answer (same question, version) in {an['same_text']}/{an['pairs']} "
           f"cases; correct: flash {an['flash_correct']}/{an['pairs']}, standard {an['standard_correct']}/"
           f"{an['pairs']} (all standard {an['standard_correct_all']}/{an['standard_all']}). "
           f"streamkv_flash_hits {fmt(s['flash_hits']['metric'])} vs {s['flash_hits']['counted']} flash answers "
           "received.", "",
           "## Flash evaluation after each update (SSE arrival times)", "", eval_table(fe), "",
           f"Rounds >= 1: push -> last flash_ready p50 {ms(fe['push_to_ready_ms']['p50'])} ms, "
           f"data_updated -> last flash_ready p50 {ms(fe['update_to_ready_ms']['p50'])} ms.", "",
           f"## Engine busy share (push every {args.interval:g} s, {args.rounds} rounds, all "
           f"{args.questions} questions {args.query_offset:g} s after each push)", "", busy_table(s["busy"]), "",
           "## Ready-position early exit", "", f"- vocabulary: {s['vocab']}"]
    out += ready_lines(f"default scaffold, min gap {args.ready_min_gap:g} (all questions)", s["ready"])
    out += ready_lines(f"answer-position scaffold, min gap {args.scaffold_min_gap:g} (one fixed question"
                       f"{', answer cue' if args.ready_cue else ''})", s["ready_scaffold"])
    out += ["", "## Targets", "", md_table(["target", "value", "result"], [
        [t["target"], "n/a" if t["value"] is None else f"{t['value']:.2f} {t['unit']}", verdict(t)]
        for t in s["targets"]])]
    out += ["", "## Machine", ""] + machine_lines(machine, args, s["foreign_load_cores"])
    return "\n".join(out)


def machine_lines(m: dict[str, Any], args: argparse.Namespace, foreign: dict[str, float]) -> list[str]:
    warn = max(foreign.values(), default=0.0) > 0.1
    return [f"- CPU: {m['cpu']['model']}, {m['cores']} cores (affinity {m['affinity']}), flags: "
            f"{', '.join(m['cpu']['flags']) or 'none of interest'}; {m['mem_gib']} GiB; GPU: {m['gpu'] or 'none'}",
            f"- torch {m.get('torch')}, server --threads {args.threads}; Python {m['python']}; "
            f"load average at start {m['loadavg_1m']}",
            f"- other processes used {foreign['latency']:.2f} cores during the latency phase, "
            f"{foreign['busy']:.2f} during the busy-share runs" + (" (WARNING: machine not idle)" if warn else ""),
            f"- workload: seed {args.seed}, {args.initial_bars} initial bars + {args.rounds} rounds x "
            f"{args.bars_per_round} bars, retention {args.retention} tokens, {args.questions} questions, "
            f"max_tokens {args.max_tokens}, greedy, {args.flash_reps} extra hits per registered question "
            f"and round"]
