"""Serving benchmark: Poisson arrivals replayed against streamkv and llama_cpp.server.

Prompt and output lengths come from the Azure LLM inference trace (conversation service,
first 1,000 requests, `benchmarks/data/`), scaled by --scale-prompt / --scale-output to this
model and machine (SmolLM2-135M on a 2-core CPU) and clipped to [4, --max-prompt] and
[1, --max-output] tokens. Both servers get the same prompts (text cut to exact token counts
with the model's tokenizer), the same output lengths (EOS is suppressed: `ignore_eos` for
streamkv, a -100 `logit_bias` on the EOS ids for llama.cpp), greedy decoding, streaming.

Per rate: TTFT p50/p99, TPOT p50/p99 and output tokens/s (all output tokens / wall time from
the first send to the last token). "Keeps up" at a rate = no errors and p99 TTFT <= --ttft-slo
seconds: a server that cannot keep up queues requests and its TTFT grows without bound. The
comparison is each engine's output tokens/s at its highest rate that keeps up (its sustainable
throughput), plus both engines' p99 TTFT at llama.cpp's highest such rate.

    .venv/bin/python benchmarks/serving.py --rates 0.25,0.5,1,2,4 --requests 40
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO, embedded_gguf, machine_info, md_table, nearest_rank, prompt_text,  # noqa: E402
                    wait_http_ok, write_json)

TRACE = REPO / "benchmarks" / "data" / "azure_conv_2023_first1000.csv"
LLAMACPP_PY = REPO / ".venv-llamacpp" / "bin" / "python"


def load_trace(n: int, seed: int, sp: float, so: float, max_prompt: int, max_output: int) -> list[tuple[int, int]]:
    with open(TRACE) as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    rng = random.Random(seed)
    picked = rng.sample(rows, n)
    return [(min(max_prompt, max(4, round(c * sp))), min(max_output, max(1, round(g * so)))) for c, g in picked]


def make_prompts(lengths: list[tuple[int, int]], seed: int) -> list[str]:
    from streamkv.loading import load_checkpoint  # tokenizer only; weights are dropped

    tok = load_checkpoint(None).tokenizer
    ids = tok.encode(prompt_text())
    rng = random.Random(seed)
    out = []
    for plen, _ in lengths:
        start = rng.randrange(0, len(ids) - plen - 1)
        out.append(tok.decode(ids[start:start + plen]))
    return out


class Server:
    def __init__(self, name: str, cmd: list[str], port: int) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        if not wait_http_ok(self.proc, self.url + "/v1/models", 300, name):
            raise RuntimeError(f"{name} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def one_request(client: httpx.AsyncClient, url: str, body: dict, at: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    sent = time.perf_counter()
    stamps: list[float] = []
    tokens = None  # from the final usage chunk where the server sends one: a chunk may carry several
    try:           # tokens (speculative decoding emits every accepted token of a step at once)
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": r.status_code, "sent": sent}
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        stamps.append(time.perf_counter())
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "sent": sent}
    return {"sent": sent, "stamps": stamps, "tokens": len(stamps) if tokens is None else tokens}


async def run_rate(server: Server, model: str, prompts: list[str], lengths: list[tuple[int, int]], rate: float,
                   seed: int, extra: dict) -> dict:
    rng = random.Random(seed)
    at, arrivals = 0.0, []
    for _ in prompts:
        at += rng.expovariate(rate)
        arrivals.append(at)
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            one_request(client, server.url, {"model": model, "prompt": p, "max_tokens": out, "temperature": 0,
                                             "stream": True, **extra}, a, t0)
            for p, (_, out), a in zip(prompts, lengths, arrivals)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.get("stamps")]
    ttft = [r["stamps"][0] - r["sent"] for r in ok]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in ok)
    end = max((r["stamps"][-1] for r in ok), default=t0 + wall) - t0
    offered = rate * statistics.mean(o for _, o in lengths)
    return {"rate": rate, "completed": len(ok), "errors": len(results) - len(ok), "output_tok_s": tokens / end,
            "offered_tok_s": offered, "ttft_p50": nearest_rank(ttft, 50), "ttft_p99": nearest_rank(ttft, 99),
            "tpot_p50": nearest_rank(tpot, 50), "tpot_p99": nearest_rank(tpot, 99)}


def keeps_up(row: dict, slo: float) -> bool:
    return row["errors"] == 0 and row["ttft_p99"] <= slo


def start_server(name: str, port: int, dtype: str, streamkv_args: str = "") -> tuple[Server, str, dict]:
    if name == "streamkv":
        cmd = [sys.executable, "-m", "streamkv.cli", "serve", "--port", str(port), "--dtype", dtype,
               "--max-waiting", "100000", *shlex.split(streamkv_args)]
        return Server(name, cmd, port), "", {"ignore_eos": True, "stream_options": {"include_usage": True}}
    # --interrupt_requests False: by default a new request cancels the one being streamed
    cmd = [str(LLAMACPP_PY), "-m", "llama_cpp.server", "--model", str(embedded_gguf()), "--port", str(port),
           "--n_threads", "2", "--n_threads_batch", "2", "--n_ctx", "8192", "--interrupt_requests", "False"]
    return Server(name, cmd, port), "", {"logit_bias": {"0": -100, "2": -100}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="streamkv,llamacpp")
    ap.add_argument("--rates", default="0.25,0.5,1,2,4")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--scale-prompt", type=float, default=0.25)
    ap.add_argument("--scale-output", type=float, default=0.25)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--ttft-slo", type=float, default=5.0)
    ap.add_argument("--report", default=None, help="re-print the tables of a saved serving-*.json")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--streamkv-args", default="", help='extra `streamkv serve` flags, e.g. "--stall-factor 3"')
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        for key in ("requests", "scale_prompt", "scale_output", "max_prompt", "max_output", "seed"):
            setattr(args, key, saved["args"][key])
        lengths = load_trace(args.requests, args.seed, args.scale_prompt, args.scale_output, args.max_prompt,
                             args.max_output)
        report(saved["results"], args, lengths)
        return
    lengths = load_trace(args.requests, args.seed, args.scale_prompt, args.scale_output, args.max_prompt,
                         args.max_output)
    prompts = make_prompts(lengths, args.seed)
    rates = [float(r) for r in args.rates.split(",")]
    results: dict[str, list[dict]] = {}
    for i, name in enumerate(args.engines.split(",")):
        if name == "llamacpp" and not LLAMACPP_PY.exists():  # (it crashed here after streamkv's sweep, saving nothing)
            print(f"llamacpp skipped: {LLAMACPP_PY} missing (run `bash benchmarks/setup_peers.sh`)", flush=True)
            continue
        server, _, extra = start_server(name, 18500 + i, args.dtype, args.streamkv_args)
        try:
            model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
            results[name] = []
            for rate in rates:
                row = asyncio.run(run_rate(server, model, prompts, lengths, rate, args.seed, extra))
                results[name].append(row)
                print(f"{name} rate {rate}: {row}", flush=True)
        finally:
            server.stop()
    report(results, args, lengths)


def report(results: dict[str, list[dict]], args: argparse.Namespace, lengths: list[tuple[int, int]]) -> None:
    rows = []
    for name, rs in results.items():
        for r in rs:
            rows.append([name, r["rate"], f"{r['output_tok_s']:.1f}", f"{r['offered_tok_s']:.1f}",
                         f"{r['ttft_p50']:.2f}", f"{r['ttft_p99']:.2f}", f"{r['tpot_p50'] * 1e3:.0f}",
                         f"{r['tpot_p99'] * 1e3:.0f}", "yes" if keeps_up(r, args.ttft_slo) else "no"])
    print(f"\nrequests/rate {args.requests}; prompt tokens mean {statistics.mean(p for p, _ in lengths):.0f}, "
          f"output tokens mean {statistics.mean(o for _, o in lengths):.0f}")
    print(md_table(["engine", "rate req/s", "output tok/s", "offered tok/s", "TTFT p50 s", "TTFT p99 s",
                    "TPOT p50 ms", "TPOT p99 ms", "keeps up"], rows))
    summary = {}
    if "streamkv" in results and "llamacpp" in results:
        lc = [r for r in results["llamacpp"] if keeps_up(r, args.ttft_slo)]
        sk = [r for r in results["streamkv"] if keeps_up(r, args.ttft_slo)]
        if lc and sk:
            lc_best, sk_best = max(lc, key=lambda r: r["rate"]), max(sk, key=lambda r: r["rate"])
            same = next(r for r in results["streamkv"] if r["rate"] == lc_best["rate"])
            summary = {"llamacpp_max_rate": lc_best["rate"], "llamacpp_tok_s": lc_best["output_tok_s"],
                       "streamkv_max_rate": sk_best["rate"], "streamkv_tok_s": sk_best["output_tok_s"],
                       "throughput_ratio": sk_best["output_tok_s"] / lc_best["output_tok_s"],
                       "p99_ttft_at_llamacpp_max_rate": {"streamkv": same["ttft_p99"],
                                                         "llamacpp": lc_best["ttft_p99"]}}
            print(f"\nllama.cpp keeps up to {lc_best['rate']} req/s ({lc_best['output_tok_s']:.1f} tok/s); streamkv "
                  f"to {sk_best['rate']} req/s ({sk_best['output_tok_s']:.1f} tok/s): "
                  f"{summary['throughput_ratio']:.2f}x (target >= 3x); p99 TTFT at {lc_best['rate']} req/s: "
                  f"streamkv {same['ttft_p99']:.2f}s vs llama.cpp {lc_best['ttft_p99']:.2f}s")
    path = write_json("serving", {"machine": machine_info(2), "args": vars(args), "results": results,
                                  "summary": summary})
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
