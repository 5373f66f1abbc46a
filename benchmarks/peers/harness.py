"""The measuring loop every engine runner shares (stdlib only: it runs in every venv).

A runner defines an adapter with three methods and calls `main(make_engine)`:

    prefill(ids)            -> None       one fresh prompt, exactly one generated token
    decode(ids, n)          -> (times, token_ids)   greedy, ignore EOS, n tokens; times[i] is
                                           time.perf_counter() when token i was available
    concurrent(prompts, n)  -> list of {"first": t, "last": t, "n": tokens[, "times": [t...]]}
                                           per request, or raise NotImplementedError
    info                    -> dict (versions, settings) [attribute]

The driver (benchmarks/throughput.py) writes the workload JSON (token ids, identical for all
engines) and reads back the result JSON: one process per engine, never two at once.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "best": max(values), "all": values}


def _phase(result: dict, key: str, fn):
    try:
        result[key] = fn()
    except NotImplementedError as e:
        result[key] = {"unsupported": str(e) or "not supported by this engine"}
    except Exception as e:  # keep the other phases' numbers
        traceback.print_exc()
        result[key] = {"error": f"{type(e).__name__}: {e}"}
    log(f"{key}: {json.dumps(_brief(result[key]))}")


def _brief(r):
    if isinstance(r, dict):
        return {k: (_brief(v) if isinstance(v, dict) else round(v, 1) if isinstance(v, float) else v)
                for k, v in r.items() if k not in ("all", "tokens")}
    return r


def log(msg: str) -> None:
    print(f"[{os.path.basename(sys.argv[0])} {time.strftime('%H:%M:%S')}] {msg}",
          file=sys.stderr, flush=True)


def run_prefill(eng, wl: dict) -> dict:
    out = {}
    for size, prompts in wl["prefill"].items():
        rates, secs = [], []
        for ids in prompts:
            t0 = time.perf_counter()
            eng.prefill(ids)
            dt = time.perf_counter() - t0
            rates.append(len(ids) / dt)
            secs.append(dt)
        out[size] = {"tok_s": _stats(rates), "ttft_s": secs}
    return out


def run_decode(eng, wl: dict) -> dict:
    n = wl["decode"]["max_tokens"]
    rates, ttfts, first_tokens = [], [], None
    for ids in wl["decode"]["prompts"]:
        t0 = time.perf_counter()
        times, toks = eng.decode(ids, n)
        if len(toks) < 2:
            raise RuntimeError(f"decode produced {len(toks)} tokens")
        rates.append((len(toks) - 1) / (times[-1] - times[0]))
        ttfts.append(times[0] - t0)
        first_tokens = first_tokens or list(toks)
    return {"tok_s": _stats(rates), "ttft_s": ttfts, "n_generated": len(toks),
            "prompt_len": len(wl["decode"]["prompts"][0]), "tokens": first_tokens}


def run_concurrent(eng, wl: dict) -> dict:
    out = {}
    n = wl["concurrent"]["max_tokens"]
    for b, prompts in wl["concurrent"]["batches"].items():
        t0 = time.perf_counter()
        recs = eng.concurrent(prompts, n)
        first = min(r["first"] for r in recs)
        last = max(r["last"] for r in recs)
        after_first = sum(r["n"] - 1 for r in recs)
        total = sum(r["n"] for r in recs)
        out[b] = {
            "steady_decode_tok_s": _steady(recs),
            # per spec: tokens generated after each request's first token / decode-phase time
            "agg_decode_tok_s": after_first / (last - first) if last > first else None,
            "e2e_tok_s": total / (last - t0),  # all generated tokens over the whole run
            "decode_window_s": last - first, "wall_s": last - t0,
            "first_token_spread_s": max(r["first"] for r in recs) - first,
            "n_requests": len(recs), "tokens_per_request": [r["n"] for r in recs],
        }
    return out


def _steady(recs: list[dict]):
    """Tokens/s while *all* requests decode: the window from the last request's first token
    to the first request's last token (per-token times where the engine gives them, else
    spread evenly between a request's first and last token)."""
    t0, t1 = max(r["first"] for r in recs), min(r["last"] for r in recs)
    if t1 <= t0:
        return None
    count = 0.0
    for r in recs:
        if r.get("times"):
            count += sum(1 for t in r["times"] if t0 < t <= t1)
        elif r["last"] > r["first"]:
            count += (r["n"] - 1) * (t1 - t0) / (r["last"] - r["first"])
    return count / (t1 - t0)


def run(make_engine, extra_args, measure) -> None:
    """Shared runner life cycle: parse ``--workload/--out/--dtype/--kwargs`` (+ ``extra_args``),
    load the engine (timed), call ``measure(eng, wl, result)``, write the result JSON, close."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kwargs", default="{}", help="JSON of extra engine constructor kwargs")
    if extra_args:
        extra_args(ap)
    args = ap.parse_args()
    with open(args.workload) as f:
        wl = json.load(f)
    os.environ.setdefault("OMP_NUM_THREADS", str(wl.get("threads", 2)))

    result: dict = {"dtype": args.dtype, "loadavg_1m_start": round(os.getloadavg()[0], 2)}
    t0 = time.perf_counter()
    eng = make_engine(args, wl)
    result["load_s"] = time.perf_counter() - t0
    result["info"] = getattr(eng, "info", {})
    log(f"loaded in {result['load_s']:.1f}s: {result['info']}")
    measure(eng, wl, result)
    result["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    close = getattr(eng, "close", None)
    if close:
        close()


def main(make_engine, extra_args=None) -> None:
    run(make_engine, extra_args, _measure)


def _measure(eng, wl: dict, result: dict) -> None:
    # warm-up: first-call costs (allocation, kernel selection, thread pools) stay out
    w = wl["warmup"]
    eng.prefill(w["prompt"])
    eng.decode(w["prompt"], w["max_tokens"])
    try:
        eng.concurrent(w["batch"], w["max_tokens"])
    except NotImplementedError:
        pass
    except Exception:
        traceback.print_exc()

    _phase(result, "prefill", lambda: run_prefill(eng, wl))
    _phase(result, "decode", lambda: run_decode(eng, wl))
    _phase(result, "concurrent", lambda: run_concurrent(eng, wl))


def best_decode_rate(run, max_tokens: int, repeats: int) -> dict:
    """Batch-1 decode tokens/s of a peer's ``run(n) -> (seconds, tokens)`` (one request of at
    most n tokens): a warm-up, then the best of ``repeats`` of (tokens - 1) / (time - the time
    of a 1-token run), as ``benchmarks/speculation.py`` measures streamkv."""
    run(max_tokens)  # warm-up (and the peer's prompt cache)
    best, tokens = 0.0, 0
    for _ in range(repeats):
        ttft, _ = run(1)
        wall, tokens = run(max_tokens)
        best = max(best, (tokens - 1) / max(1e-9, wall - ttft))
    return {"tokens": tokens, "tok_s": best}
