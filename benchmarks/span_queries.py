"""Span queries (issue 14): RAG TTFT, nested generation, bulk order, attention locality,
fidelity and repositioning throughput, on the embedded model, with vLLM as the RAG peer.

    .venv/bin/python benchmarks/span_queries.py                       # every part (~20 min)
    .venv/bin/python benchmarks/span_queries.py --parts rag --docs 8,24 --peers none

Documents are random words (~300 tokens each, seeded), as in the Span Queries paper. Every
latency is measured with nothing else running: TTFT = submission to the first token
(max_tokens=1 for RAG). The plain prompt is the same token ids as the span query's layout,
computed causally (streamkv with its prefix cache; vLLM with automatic prefix caching).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import fmt, md_table  # noqa: E402

from streamkv import LLM, SamplingParams  # noqa: E402
from streamkv.spans.ir import fragment, gen, plus, seq, system, user  # noqa: E402

SYS = system("Answer the question from the documents.")
PLOT = common.REPO / "docs" / "img" / "span_queries_rag.png"
WORDS = ("river city light stone paper music garden window market winter summer forest ocean bridge "
         "tower engine signal number letter silver golden quiet rapid ancient modern northern southern "
         "village harbor valley mountain island desert castle library station theatre museum").split()


def doc_text(rng: random.Random, tok, tokens: int, label: str) -> str:
    words = [f"Document {label}:"]
    while len(tok.encode(" ".join(words))) < tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words) + "\n"


def plain_ids(llm: LLM, question: str, docs: list[str]) -> list[int]:
    """The span query's token ids with the documents in the given order, as one causal prompt."""
    r = llm.engine.spans.renderer
    ids = list(r.bos) + list(r.text(SYS))
    for d in docs:
        ids += r.text(fragment(d))
    return ids + list(r.text(user(question))) + list(r.generation_prompt())


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def one_token(question: str, docs) -> object:
    return gen(seq(SYS, plus(*[fragment(d) for d in docs]), user(question)), max_tokens=1, temperature=0)


# ------------------------------------------------------------------------------- 1. RAG
def part_rag(llm: LLM, args, rng: random.Random) -> dict:
    tok = llm.engine.tokenizer
    pool = [doc_text(rng, tok, 300, str(i)) for i in range(max(args.docs_list) * 2)]
    q = "Which document mentions the ancient castle?"
    rows, peer_groups = {}, {}
    for n in args.docs_list:
        docs = pool[:n]
        orders = [rng.sample(docs, n) for _ in range(args.repeats + 1)]
        plain = [plain_ids(llm, q, o) for o in orders]
        # plain prompt: the layout's ids as one causal prompt; the prefix cache is on
        llm.engine.pool.reset_prefix_cache()
        llm.generate([plain[0]], SamplingParams(max_tokens=1, temperature=0))  # warm the system prefix
        t_plain = [timed(lambda ids=ids: llm.generate([ids], SamplingParams(max_tokens=1, temperature=0)))[0]
                   for ids in plain[1:]]
        t_miss = []
        for o in orders[1:]:
            llm.engine.spans.cache.clear()
            llm.engine.pool.reset_prefix_cache()  # the prefix state would hit the plain runs' blocks
            t_miss.append(timed(lambda o=o: llm.span_queries(one_token(q, o)))[0])
        llm.engine.spans.cache.clear()
        llm.span_queries(one_token(q, orders[0]))
        t_hit = [timed(lambda o=o: llm.span_queries(one_token(q, o)))[0] for o in orders[1:]]
        # operands cached, but a new subset: the plus state misses, operands are re-positioned
        llm.span_queries(one_token(q, pool[n:2 * n]))
        t_reuse, repos = [], 0
        for _ in range(args.repeats):
            mix = rng.sample(docs + pool[n:2 * n], n)
            if set(mix) == set(docs):
                mix[0] = pool[n]
            t, outs = timed(lambda mix=mix: llm.span_queries(one_token(q, mix)))
            t_reuse.append(t)
            repos = outs[0].metrics["spans"]["usage"]["repositioned_tokens"]
        rows[n] = {"tokens": len(plain[0]), "plain": t_plain, "miss": t_miss, "hit": t_hit,
                   "operands_cached": t_reuse, "repositioned_tokens": repos}
        peer_groups[str(n)] = plain[1:]
        print(f"  RAG {n:2d} docs ({len(plain[0])} tok): plain {med(t_plain):.3f} s  miss {med(t_miss):.3f}  "
              f"hit {med(t_hit):.3f}  operands cached {med(t_reuse):.3f} ({repos} tok re-positioned)", flush=True)
    if args.peers == "vllm":
        peer = run_vllm_prompts(peer_groups, args)
        for n in args.docs_list:
            rows[n]["vllm"] = peer.get(str(n))
    return {str(k): v for k, v in rows.items()}


def run_vllm_prompts(groups: dict, args) -> dict:
    import os

    import throughput

    run_dir = common.RESULTS / "span_queries_peers"
    run_dir.mkdir(parents=True, exist_ok=True)
    wl = run_dir / "workload-rag.json"
    wl.write_text(json.dumps({"threads": args.threads, "hf_dir": str(common.HF_EXPORT), "max_model_len": 8192,
                              "budget": args.budget, "groups": groups}))
    env = dict(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", OMP_NUM_THREADS=str(args.threads))
    if os.path.exists(throughput.TCMALLOC):
        env["LD_PRELOAD"] = throughput.TCMALLOC
    cfg = dict(name="vLLM rag", py=str(common.REPO / ".venv-vllm/bin/python"), script="run_prompts_vllm.py",
               dtype="bfloat16", extra=[], env=env, needs_hf=True)
    r = throughput.run_engine(cfg, wl, run_dir, timeout=3600, wait=0)
    if "groups" not in r:
        print(f"  vLLM: {r.get('skipped') or r.get('error')}", flush=True)
        return {}
    return r["groups"]


# ------------------------------------------------------------------------ 2. nested generation
def part_nested(llm: LLM, args, rng: random.Random) -> list[dict]:
    """A judge over fan-out inner gens (each: a document + an instruction). ``cold``: no cache
    on either side; ``warm``: the same documents were used by the previous pipeline (span
    cache / prefix cache warm), with a new instruction."""
    tok = llm.engine.tokenizer
    asks = ["Summarize the document in one short sentence.", "Give the document a short title."]
    judge_q = "Which answer mentions a castle?"
    out = []
    for fanout in (1, 8):
        docs = [doc_text(rng, tok, 300, str(i)) for i in range(fanout)]
        for temp in (0.0, 0.5):
            row: dict = {"fanout": fanout, "temperature": temp}
            for phase, ask in zip(("cold", "warm"), asks):
                inner = [gen(seq(fragment(d), user(ask)), max_tokens=24, temperature=temp, ignore_eos=True)
                         for d in docs]
                query = gen(seq(SYS, plus(*inner), user(judge_q)), max_tokens=16, temperature=0, ignore_eos=True)
                if phase == "cold":
                    llm.engine.spans.cache.clear()
                    llm.engine.pool.reset_prefix_cache()
                t_span, _ = timed(lambda: llm.span_queries(query))
                before = None if phase == "cold" else asks[0]
                t_conc = plain_pipeline(llm, docs, ask, judge_q, temp, concurrent=True, before=before)
                t_seq = plain_pipeline(llm, docs, ask, judge_q, temp, concurrent=False, before=before)
                row[phase] = {"span_s": t_span, "plain_concurrent_s": t_conc, "plain_sequential_s": t_seq}
                print(f"  nested fan-out {fanout} T={temp} {phase}: span {t_span:.2f} s  plain (inner concurrent) "
                      f"{t_conc:.2f} s ({t_conc / t_span:.2f}x)  plain (inner one by one) {t_seq:.2f} s "
                      f"({t_seq / t_span:.2f}x)", flush=True)
            out.append(row)
    return out


def plain_pipeline(llm: LLM, docs, ask, judge_q, temp, concurrent: bool, before: str | None) -> float:
    """The same pipeline as plain requests: inner prompts, then a judge prompt holding their text.
    The prefix cache starts empty; with ``before``, the inner prompts of that instruction ran
    first (untimed), as a previous pipeline over the same documents would have."""
    tok = llm.engine.tokenizer
    msgs = lambda d, a: [{"role": "system", "content": SYS.text}, {"role": "user", "content": d + a}]  # noqa: E731
    inner_prompts = [tok.apply_chat_template(msgs(d, ask), add_generation_prompt=True) for d in docs]
    p_in = SamplingParams(max_tokens=24, temperature=temp, ignore_eos=True)
    llm.engine.pool.reset_prefix_cache()
    if before is not None:
        llm.generate([tok.apply_chat_template(msgs(d, before), add_generation_prompt=True) for d in docs], p_in)
    t = time.perf_counter()
    if concurrent:
        answers = [o.text for o in llm.generate(inner_prompts, p_in)]
    else:
        answers = [llm.generate([p], p_in)[0].text for p in inner_prompts]
    body = "".join(f"{d}{ask}\nAnswer: {a}\n" for d, a in zip(docs, answers))
    judge = tok.apply_chat_template([{"role": "system", "content": SYS.text},
                                     {"role": "user", "content": body + judge_q}], add_generation_prompt=True)
    llm.generate([judge], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    return time.perf_counter() - t


# ---------------------------------------------------------------------------------- 3. bulk
def part_bulk(args, rng: random.Random) -> dict:
    probe = LLM(dtype=args.dtype)
    tok = probe.engine.tokenizer
    frags = [doc_text(rng, tok, 100, str(i)) for i in range(60)]
    weights = [1.0 / (i + 1) ** 1.1 for i in range(60)]  # Zipf
    queries = []
    for _ in range(args.bulk_queries):
        pick: list[str] = []
        while len(pick) < 4:
            f = rng.choices(frags, weights)[0]
            if f not in pick:
                pick.append(f)
        queries.append(one_token("Which document is the longest?", pick))
    need = probe.engine.spans._need(probe.engine.spans.plan(queries[0])[1])
    state_blocks = -(-(len(tok.encode(frags[0])) + 16) // 16) + 1
    blocks = 2 * need + 15 * state_blocks  # room for two queries in flight + ~1/4 of the fragments' states
    del probe
    res = {"fragments": 60, "queries": len(queries), "pool_blocks": blocks, "pool_tokens": blocks * 16, "runs": []}
    for host in args.bulk_host:  # span_host_bytes: 0 = evicted states are dropped and recomputed
        for order in ("given", "clustered"):
            llm = LLM(dtype=args.dtype, num_blocks=blocks, span_host_bytes=host)
            t, (outs, _) = timed(lambda: llm.span_bulk(queries, order=order, concurrency=2))
            ttft = [o.metrics["first_token_time"] - o.metrics["spans"]["submitted"] for o in outs]
            st = llm.engine.spans.cache.stats
            run = {"order": order, "span_host_bytes": host, "wall_s": t, "mean_ttft_s": statistics.mean(ttft),
                   "hits": st.hits, "misses": st.misses, "offloads": st.offloads, "restores": st.restores,
                   "evictions": st.evictions,
                   "computed_tokens": sum(o.metrics["spans"]["usage"]["computed_tokens"] for o in outs)}
            res["runs"].append(run)
            print(f"  bulk {order:9} host {host >> 20:5} MiB: wall {t:.1f} s  mean TTFT {run['mean_ttft_s']:.3f} s  "
                  f"hits {st.hits}  misses {st.misses}  restores {st.restores}  "
                  f"computed {run['computed_tokens']} tok", flush=True)
            del llm
    return res


# ----------------------------------------------------------------------------- 4. locality
def part_locality(llm: LLM, args, rng: random.Random) -> list[dict]:
    tok = llm.engine.tokenizer
    syll = ["ka", "lo", "mi", "ren", "tor", "vas", "ze", "qui", "dor", "pel"]
    rows = []
    for hay in args.hay_list:
        found = {None: [], 2: []}
        for trial in range(args.trials):
            names = ["".join(rng.sample(syll, 3)).capitalize() for _ in range(8)]
            inner = [gen(seq(fragment(doc_text(rng, tok, hay, f"h{i}") if hay else ""), user(f"Say only this name: {nm}")),
                         max_tokens=6, temperature=0) for i, nm in enumerate(names)]
            query = gen(seq(system("You list names."), plus(*inner), user("List every name said above.")),
                        max_tokens=48, temperature=0)
            for k in found:
                llm.engine.spans.cache.clear()
                text = llm.span_queries(query, locality_k=k)[0].text
                found[k].append(sum(nm in text for nm in names) / len(names))
        row = {"hay_tokens": hay, "unoptimized": statistics.mean(found[None]), "locality_k2": statistics.mean(found[2])}
        rows.append(row)
        print(f"  locality hay {hay:4d}: names found {row['unoptimized']:.0%} unoptimized, "
              f"{row['locality_k2']:.0%} with locality_k=2", flush=True)
    return rows


# ------------------------------------------------------------------------------ 5. fidelity
def part_fidelity(llm: LLM, args, rng: random.Random) -> dict:
    """Generated QA: four one-sentence facts (the documents), one question about one of them."""
    people = ["Alice", "Bruno", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro"]
    fruits = ["apple", "banana", "cherry", "mango", "peach", "lemon", "grape", "plum"]
    agree = span_ok = plain_ok = 0
    for _ in range(args.qa):
        who, what = rng.sample(people, 4), rng.sample(fruits, 4)
        docs = [f"{p}'s favourite fruit is the {f}.\n" for p, f in zip(who, what)]
        ask = rng.randrange(4)
        question = f"What is {who[ask]}'s favourite fruit? Answer with one word."
        query = gen(seq(SYS, plus(*[fragment(d) for d in docs]), user(question)), max_tokens=16, temperature=0)
        span = llm.span_queries(query)[0].text
        plain = llm.generate([plain_ids(llm, question, docs)], SamplingParams(max_tokens=16, temperature=0))[0].text
        agree += span.strip() == plain.strip()
        span_ok += what[ask] in span.lower()
        plain_ok += what[ask] in plain.lower()
    res = {"questions": args.qa, "agreement": agree / args.qa, "span_correct": span_ok / args.qa,
           "plain_correct": plain_ok / args.qa}
    print(f"  fidelity: answers equal {res['agreement']:.0%}; correct: span {res['span_correct']:.0%}, "
          f"plain {res['plain_correct']:.0%} ({args.qa} questions)", flush=True)
    return res


# ------------------------------------------------------------------------- 6. repositioning
def part_reposition(llm: LLM, args) -> list[dict]:
    eng, ops = llm.engine, llm.engine.seq_ops
    eng.spans.cache.clear()
    rows = []
    for n in (1024, 2048, 4096, 8000):
        src = ops.open([100 + i % 1000 for i in range(n)])
        dst = ops.open([1])
        while not (ops.is_idle(src) and ops.is_idle(dst)):
            eng.step()
        times = []
        for _ in range(args.repeats):
            probe = ops.fork(dst, 1, [])
            t, _ = timed(lambda: (ops.splice(probe, [(src, 0, n)]), eng.kv_ops.flush()))  # splices are deferred
            times.append(t)
            ops.close(probe)
        ops.close(src)
        ops.close(dst)
        eng.step()
        rows.append({"tokens": n, "ms": med(times) * 1e3, "tokens_per_ms": n / (med(times) * 1e3)})
        print(f"  re-position {n:5d} tokens: {med(times) * 1e3:7.1f} ms  ({rows[-1]['tokens_per_ms']:.0f} tokens/ms, "
              f"K and V of every layer)", flush=True)
    return rows


def plot_rag(rag: dict, path: Path) -> Path | None:
    """TTFT against the number of documents, log scale: plain, span miss / hit / operands cached, vLLM."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is missing (pip install -e '.[bench]')")
        return None
    docs = sorted(int(n) for n in rag if int(n) > 1)  # one document: no order to shuffle
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for key, name in (("plain", "streamkv plain prompt (prefix cache)"), ("vllm", "vLLM (prefix caching)"),
                      ("miss", "span query, miss"), ("operands_cached", "span query, operands cached"),
                      ("hit", "span query, hit")):
        pts = [(n, med(rag[str(n)][key]) * 1e3) for n in docs if rag[str(n)].get(key)]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(yscale="log", xlabel="documents (~300 tokens each)", ylabel="TTFT (ms)", title="RAG TTFT, documents shuffled")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="rag,nested,bulk,locality,fidelity,reposition")
    ap.add_argument("--docs", default="1,4,8,16,24")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peers", default="vllm", choices=["vllm", "none"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=int, default=2048, help="step token budget (streamkv and vLLM)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--bulk-queries", type=int, default=500)
    ap.add_argument("--bulk-host", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1 << 30],
                    help="span_host_bytes values for the bulk part (0: evicted spans are recomputed)")
    ap.add_argument("--hay", default="0,50,200")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--qa", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot-from", help="only re-draw the RAG plot from a saved results JSON")
    args = ap.parse_args()
    if args.plot_from:
        print(plot_rag(json.loads(Path(args.plot_from).read_text())["rag"], PLOT))
        return 0
    args.docs_list = [int(x) for x in args.docs.split(",")]
    args.hay_list = [int(x) for x in args.hay.split(",")]
    machine = common.machine_info(args.threads)
    print(f"machine: {machine['cpu']['model']} flags={machine['cpu']['flags']} threads={machine.get('torch_threads')}",
          flush=True)
    parts = args.parts.split(",")
    result: dict = {"machine": machine, "args": {k: v for k, v in vars(args).items()}}
    # no response cache: a repeated plain prompt must be computed, as for the peers
    llm = LLM(dtype=args.dtype, max_num_batched_tokens=args.budget, response_cache_entries=0)
    rng = random.Random(args.seed)
    warm = one_token("Warm up.", ["A first document.\n", "A second document.\n"])  # kernel choice, first steps
    llm.span_queries(warm)
    llm.generate(["Warm up."], SamplingParams(max_tokens=2, temperature=0))
    llm.engine.spans.cache.clear()
    if "rag" in parts:
        result["rag"] = part_rag(llm, args, rng)
        print(rag_table(result["rag"]))
        plot_rag(result["rag"], PLOT)
    if "nested" in parts:
        result["nested"] = part_nested(llm, args, rng)
    if "locality" in parts:
        result["locality"] = part_locality(llm, args, rng)
    if "fidelity" in parts:
        result["fidelity"] = part_fidelity(llm, args, rng)
    if "reposition" in parts:
        result["reposition"] = part_reposition(llm, args)
    if "bulk" in parts:
        del llm
        result["bulk"] = part_bulk(args, rng)
    path = common.write_json("span_queries", result)
    print(f"results: {path}")
    return 0


def rag_table(rag: dict) -> str:
    rows = []
    for n, r in rag.items():
        v = med(r["vllm"]) if r.get("vllm") else None
        rows.append([n, r["tokens"], fmt(med(r["plain"]) * 1e3), fmt(med(r["miss"]) * 1e3), fmt(med(r["hit"]) * 1e3),
                     fmt(med(r["operands_cached"]) * 1e3), fmt(v * 1e3) if v else "-",
                     f"{med(r['plain']) / med(r['miss']):.2f}x", f"{v / med(r['hit']):.1f}x" if v else "-"])
    return md_table(["docs", "tokens", "plain ms", "span miss ms", "span hit ms", "operands cached ms", "vLLM ms",
                     "plain/miss", "vLLM/hit"], rows)


if __name__ == "__main__":
    sys.exit(main())
