"""Flash-query benchmark: registered questions answered before anyone asks, over HTTP.

    .venv/bin/python benchmarks/flash_queries.py              # 8 rounds x 10 bars, ~4k-5k tokens
    .venv/bin/python benchmarks/flash_queries.py --quick      # smoke run (~80 s on 2 cores)

Workload: the market-data stream of `streaming_session.py` (`market_data.py`: hourly OHLCV
bars, ~51 tokens each; an initial batch, then --bars-per-round new bars per round) and a fixed
set of --questions questions of the six types (text fixed across rounds, truth recomputed per
round); round(--flash-share x n) of them are registered as flash questions.

One `streamkv serve` subprocess (--kv-cache-memory 512 MiB), one keep-alive httpx client.

Phase 1, latency (same pushes to four sessions, one after another, every round):
  flash    the registered questions as flash questions; push -> data_updated -> flash_ready of
           every registered question at that version is timed from the SSE stream
  plain    no flash questions: the all-standard baseline (same records, same data version)
  ready    ready_exit_vocab = the answer words in every casing that is one token, default scaffold
  scaffold ready exit with the query scaffold ending at the answer of one fixed question
           (chat template written out, the question in query_prefix, then an answer cue such as
           "The trend is" unless --no-ready-cue): the ready position is that question's answer
           position, so the ready path can fire at all (--scaffold-min-gap, default 0: it fires
           whenever the top token is an answer word; the gaps it reports are summarized)
  After the pushes the driver waits until the engine is idle (flash answers of the current
  version ready), then times, per question and in one shuffled order: the question on `flash`
  (a flash hit if registered, a standard query if not) and the same question on `plain`
  (standard). mix mean = mean over `flash`; all-standard mean = mean over `plain`. Then
  --flash-reps more hits per registered question, every question on `ready`, and --ready-reps
  queries on `scaffold`.
Phase 2, engine busy share: two runs of one schedule (a push every --interval s for --rounds
  rounds, the questions asked --query-offset s after each push), with and without the flash
  questions registered; share = delta streamkv_engine_busy_seconds / wall time.

Targets: mix mean speedup >= 5x over all-standard; flash-hit HTTP round trip p50 <= 5 ms.
Output: markdown on stdout, JSON in benchmarks/results/flash_queries.json (--quick:
flash_queries-quick.json), server log in benchmarks/results/flash_queries-<stamp>.log.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import flash_report  # noqa: E402
import flash_workload as fw  # noqa: E402
from flash_server import Api, EventLog, Server, Timed, free_port  # noqa: E402

KV_CACHE_MEMORY = 536870912
WARMUP_QUESTION = "How many bars are shown? Answer with the number only."


@dataclass
class Sess:
    name: str
    sid: str
    log: EventLog
    flash: list[str]  # registered question texts


# --------------------------------------------------------------------------- setup
def ready_vocab(api: Api) -> list[str]:
    """Answer words in the forms that are a single token (with or without a leading space):
    the ready exit compares the decoded, stripped top token with this list."""
    out = []
    for word in fw.vocab_candidates():
        if any(len(api.tokenize(prompt=p, add_special_tokens=False)) == 1 for p in (word, " " + word)):
            out.append(word)
    return out


def chat_pieces(api: Api, system: str) -> tuple[str, str]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": fw.SENTINEL}]
    return fw.split_template(api.detokenize(api.tokenize(messages=msgs, add_special_tokens=False)))


def scaffold_question(wl: fw.Workload) -> fw.Question:
    """The fixed question of the `scaffold` session: a trend question if any, else one-word."""
    words = [q for q in wl.questions if q.kind in fw.WORD_TYPES]
    return next((q for q in words if q.kind == "trend"), words[0] if words else wl.questions[0])


def session_specs(api: Api, wl: fw.Workload, args: argparse.Namespace, vocab: list[str]) -> dict[str, dict]:
    base = {"system": wl.system, "retention_tokens": args.retention}
    ready = {"ready_exit_vocab": vocab, "ready_exit_min_gap": args.ready_min_gap}
    low = {"ready_exit_vocab": vocab, "ready_exit_min_gap": args.scaffold_min_gap}
    before, after = chat_pieces(api, wl.system)
    return {
        "flash": {**base, "flash": [{"question": q.text, "max_tokens": args.max_tokens} for q in wl.registered]},
        "plain": base,
        "ready": {**base, **ready},
        "scaffold": {**base, **low,
                     **fw.answer_position_spec(before, after, scaffold_question(wl), args.ready_cue)},
    }


def open_session(api: Api, url: str, name: str, spec: dict) -> Sess:
    sid = api.create_session(spec)
    return Sess(name, sid, EventLog(url, sid), [q["question"] for q in spec.get("flash", [])])


def close_session(api: Api, s: Sess) -> dict[str, Any]:
    """Final stats (flash counters included), then delete."""
    stats = api.stats(s.sid)
    api.delete_session(s.sid)
    s.log.join()
    return {"flash": stats.get("flash"), "data_version": stats.get("data_version"),
            "tokens": stats.get("tokens"), "evictions": stats.get("evictions"), "kv": stats.get("kv")}


# --------------------------------------------------------------------------- pushes
def push_and_wait(api: Api, s: Sess, records: list[str], timeout: float = 600.0) -> dict[str, Any]:
    """Push one round; wait for data_updated (and every flash_ready) at its version."""
    t0 = time.perf_counter()
    version = api.push(s.sid, records)
    upd = s.log.data_updated(version, timeout)
    out = {"session": s.name, "version": version, "ingest_ms": (upd.t - t0) * 1e3}
    if s.flash:
        evs = s.log.flash_ready(version, s.flash, timeout)
        last = max(e.t for e in evs)
        out.update(flash_ms=(last - t0) * 1e3, flash_after_update_ms=(last - upd.t) * 1e3,
                   flash_first_ms=(min(e.t for e in evs) - t0) * 1e3)
    return out


def flash_timings(s: Sess, pushes: list[tuple[int, float]]) -> list[dict[str, Any]]:
    """push -> last flash_ready per pushed version, from the events (versions skipped by the
    evaluator have no flash_ready of their own: they show the next evaluated version's)."""
    out = []
    for version, t in pushes:
        upd = s.log.first("data_updated", version)
        evs = [s.log.first("flash_ready", version, q) for q in s.flash]
        row: dict[str, Any] = {"version": version, "ingest_ms": (upd.t - t) * 1e3 if upd else None}
        if all(evs):
            row["flash_ms"] = (max(e.t for e in evs) - t) * 1e3
            row["evaluated_version"] = min(e.data["data_version"] for e in evs)
        out.append(row)
    return out


# --------------------------------------------------------------------------- queries
def record(t: Timed, s: Sess, q: fw.Question | None, rnd: int, kind: str, wl: fw.Workload) -> dict[str, Any]:
    answer = t.body.get("answer", "")
    row = {"round": rnd, "session": s.name, "pass": kind, "q": q.key if q else None,
           "type": q.kind if q else None, "registered": q.registered if q else None, "source": t.source,
           "ms": t.ms, "server_ms": t.server_ms, "answer": answer, "data_version": t.body.get("data_version"),
           "completion_tokens": (t.body.get("usage") or {}).get("completion_tokens")}
    if t.source == "ready":
        row["gap"] = (t.body.get("confidence") or {}).get("first")
    if q is not None:
        row["correct"] = fw.correct(q, wl.bars_at(rnd), answer)
    return row


def warm_up(api: Api, sessions: dict[str, Sess], wl: fw.Workload, args: argparse.Namespace) -> None:
    """Untimed: one standard query per session, one flash hit (first-call costs stay out)."""
    for s in sessions.values():
        api.query(s.sid, WARMUP_QUESTION, args.max_tokens)
    if wl.registered:
        api.query(sessions["flash"].sid, wl.registered[0].text, args.max_tokens)
    api.wait_idle()


def timed_round(api: Api, S: dict[str, Sess], wl: fw.Workload, rnd: int, args: argparse.Namespace,
                rng: random.Random) -> list[dict[str, Any]]:
    rows = []
    order = list(wl.questions)
    rng.shuffle(order)
    for q in order:  # interleaved, so both see the same machine state
        rows.append(record(api.query(S["flash"].sid, q.text, args.max_tokens), S["flash"], q, rnd, "mix", wl))
        rows.append(record(api.query(S["plain"].sid, q.text, args.max_tokens), S["plain"], q, rnd,
                           "all_standard", wl))
    for _ in range(args.flash_reps):
        for q in wl.registered:
            rows.append(record(api.query(S["flash"].sid, q.text, args.max_tokens), S["flash"], q, rnd,
                               "flash_rep", wl))
    for q in order:
        rows.append(record(api.query(S["ready"].sid, q.text, args.max_tokens), S["ready"], q, rnd, "ready", wl))
    sq = scaffold_question(wl)
    for _ in range(args.ready_reps):
        rows.append(record(api.query(S["scaffold"].sid, sq.text, args.max_tokens), S["scaffold"], sq, rnd,
                           "scaffold", wl))
    return rows


def latency_phase(api: Api, url: str, wl: fw.Workload, args: argparse.Namespace, vocab: list[str]) -> dict:
    specs = session_specs(api, wl, args, vocab)
    S = {name: open_session(api, url, name, spec) for name, spec in specs.items()}
    rng, pushes, rows = random.Random(args.seed + 11), [], []
    busy0, t0 = api.busy_s(), time.perf_counter()
    for rnd, records in enumerate(wl.rounds):
        for s in S.values():
            pushes.append({"round": rnd, **push_and_wait(api, s, records)})
        api.wait_idle()
        if rnd == 0:
            warm_up(api, S, wl, args)
        rows += timed_round(api, S, wl, rnd, args, rng)
        done = [r for r in pushes if r["round"] == rnd and r["session"] == "flash"][0]
        print(f"   round {rnd}: v{done['version']}, flash ready {done.get('flash_ms', 0):.0f} ms after push, "
              f"{len(rows)} queries so far", file=sys.stderr, flush=True)
    busy = {"busy_s": api.busy_s() - busy0, "wall_s": time.perf_counter() - t0,
            "flash_hits_metric": api.metric("streamkv_flash_hits_total")}
    final = {name: close_session(api, s) for name, s in S.items()}
    return {"pushes": pushes, "queries": rows, "sessions": final, "engine": busy,
            "scaffold_question": scaffold_question(wl).key}


# --------------------------------------------------------------------------- busy share
def sleep_until(t: float, slack: float = 0.05) -> bool:
    """Sleep until perf_counter() == t; False if t had passed by more than `slack` s."""
    dt = t - time.perf_counter()
    if dt > 0:
        time.sleep(dt)
    return dt >= -slack


def busy_run(api: Api, url: str, wl: fw.Workload, args: argparse.Namespace, with_flash: bool) -> dict:
    spec = {"system": wl.system, "retention_tokens": args.retention}
    if with_flash:
        spec["flash"] = [{"question": q.text, "max_tokens": args.max_tokens} for q in wl.registered]
    s = open_session(api, url, "busy_flash" if with_flash else "busy_plain", spec)
    push_and_wait(api, s, wl.rounds[0])
    api.wait_idle()
    api.query(s.sid, WARMUP_QUESTION, args.max_tokens)
    api.wait_idle()
    busy0, t0 = api.busy_s(), time.perf_counter()
    pushes, rows, late = [], [], 0
    for rnd in range(1, len(wl.rounds)):
        late += not sleep_until(t0 + (rnd - 1) * args.interval)
        tp = time.perf_counter()
        pushes.append((api.push(s.sid, wl.rounds[rnd]), tp))
        late += not sleep_until(tp + args.query_offset)
        for q in wl.questions:
            rows.append(record(api.query(s.sid, q.text, args.max_tokens), s, q, rnd, "busy", wl))
    late += not sleep_until(t0 + (len(wl.rounds) - 1) * args.interval)
    wall, busy = time.perf_counter() - t0, api.busy_s() - busy0
    timings = flash_timings(s, pushes) if with_flash else []
    final = close_session(api, s)
    return {"with_flash": with_flash, "wall_s": wall, "busy_s": busy, "share": busy / wall if wall else None,
            "late": late, "queries": rows, "flash_timings": timings, "session": final}


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="rounds after the initial batch")
    ap.add_argument("--bars-per-round", type=int, default=10, help="~51 tokens per bar")
    ap.add_argument("--initial-bars", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--questions", type=int, default=10, help="questions asked per round")
    ap.add_argument("--flash-share", type=float, default=0.7, help="share of them registered as flash")
    ap.add_argument("--flash-reps", type=int, default=10, help="extra hits per registered question and round")
    ap.add_argument("--ready-reps", type=int, default=5, help="queries per round on the scaffold session")
    ap.add_argument("--ready-min-gap", type=float, default=3.0, help="ready_exit_min_gap (logits)")
    ap.add_argument("--scaffold-min-gap", type=float, default=0.0,
                    help="ready_exit_min_gap of the scaffold session (0: fires whenever the top token is an "
                         "answer word, so the path's latency and the gaps are measured)")
    ap.add_argument("--no-ready-cue", dest="ready_cue", action="store_false",
                    help="scaffold session: no answer cue after the assistant marker")
    ap.add_argument("--interval", type=float, default=8.0, help="busy-share runs: seconds between pushes")
    ap.add_argument("--query-offset", type=float, default=2.5, help="busy-share runs: push -> questions, s")
    ap.add_argument("--retention", type=int, default=None, help="retention_tokens (default: every bar fits)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 4 bars, fewer repetitions")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.bars_per_round, args.initial_bars = 2, 4, 8
        args.flash_reps, args.ready_reps, args.interval, args.query_offset = 3, 3, 4.0, 1.0
    if args.retention is None:
        args.retention = min(7000, 56 * (args.initial_bars + args.rounds * args.bars_per_round) + 128)
    return args


def run(args: argparse.Namespace, wl: fw.Workload, log_path: Path) -> dict[str, Any]:
    port = args.port or free_port()
    server = Server(port, ["--kv-cache-memory", str(KV_CACHE_MEMORY), "--threads", str(args.threads)], log_path)
    api = Api(server.url)
    try:
        vocab = ready_vocab(api)
        print(f"   server up on port {port}; ready-exit vocabulary {vocab}", file=sys.stderr, flush=True)
        with common.ForeignLoad() as fl1:
            lat = latency_phase(api, server.url, wl, args, vocab)
        with common.ForeignLoad() as fl2:
            runs = [busy_run(api, server.url, wl, args, flag) for flag in (True, False)]
        return {"vocab": vocab, "latency": lat, "busy": runs,
                "foreign_load_cores": {"latency": fl1.cores, "busy": fl2.cores}}
    finally:
        api.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wl = fw.build(args.initial_bars, args.bars_per_round, args.rounds, args.seed, args.questions, args.flash_share)
    machine = common.machine_info(args.threads)
    stamp = common.timestamp()
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    log_path = common.RESULTS / f"flash_queries-{stamp}.log"
    res = run(args, wl, log_path)
    summary = flash_report.summarize(res, wl, args)
    print("\n" + flash_report.report(summary, machine, args))
    doc = {"benchmark": "flash_queries", "timestamp": stamp, "argv": sys.argv[1:], "quick": args.quick,
           "machine": machine, "workload": vars(args),
           "questions": [vars(q) for q in wl.questions], "summary": summary, "raw": res}
    path = common.RESULTS / ("flash_queries-quick.json" if args.quick else "flash_queries.json")
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\nJSON: {path.relative_to(common.REPO)}  (server log: {log_path.relative_to(common.REPO)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
