"""Cost of structured outputs (issue 17): decode with xgrammar masks vs without, batch 1 and 32.

    .venv/bin/python benchmarks/structured_outputs.py            # ~6 min on 2 cores

Each guided request follows a JSON schema (a list of up to 12 small objects, with plain or with
length-bounded strings); its unguided twin
gets the same prompt and exactly as many tokens (``max_tokens`` = the guided length,
``ignore_eos``), so both runs decode the same number of rows per step. Prompts are cached
before timing (prefill is the same in both). Reported: decode tokens/s, the slowdown, and the
seconds the sampler spent in the masks (fill + apply + matcher advance).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import fmt, md_table  # noqa: E402

from streamkv import LLM, SamplingParams  # noqa: E402
from streamkv.sampling.grammar import GuidedSpec  # noqa: E402

def schema(bounded: bool) -> dict:
    """Up to 12 small objects; ``bounded``: ``maxLength`` strings and ranged integers, which
    xgrammar masks much more slowly (context-dependent tokens inside a bounded string)."""
    label = {"type": "string", "maxLength": 12} if bounded else {"type": "string"}
    ident = {"type": "integer", "minimum": 0, "maximum": 999} if bounded else {"type": "integer"}
    return {"type": "array", "minItems": 6, "maxItems": 12, "items": {"type": "object", "properties": {
        "id": ident, "color": {"enum": ["red", "green", "blue"]}, "label": label},
        "required": ["id", "color", "label"]}}
TOPICS = ["fruits", "cars", "cities", "tools", "birds", "songs", "books", "games"]


def run(llm: LLM, batch: int, repeats: int, bounded: bool) -> dict:
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"List some {TOPICS[i % 8]} "
                                                    f"(request {i}) as JSON."}])) for i in range(batch)]
    spec = GuidedSpec.json_schema(schema(bounded))
    guided = [SamplingParams(max_tokens=600, temperature=1.0, seed=i, guided=spec) for i in range(batch)]
    first = llm.generate(prompts, guided)  # warms the prefix cache and fixes the lengths
    lengths = [len(o.token_ids) for o in first]
    plain = [SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
    guide = llm.engine.bundle.runner.sampler.guide
    best = {}
    for name, params in (("plain", plain), ("guided", guided)):
        times, mask_s = [], []
        for _ in range(repeats):
            before = guide.seconds
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            times.append(time.perf_counter() - t0)
            mask_s.append(guide.seconds - before)
            assert [len(o.token_ids) for o in outs] == lengths or name == "guided"
        i = min(range(repeats), key=times.__getitem__)
        best[name] = {"s": times[i], "tok_s": sum(lengths) / times[i], "mask_s": mask_s[i]}
    valid = sum(o.finish_reason == "stop" and json.loads(o.text) is not None for o in first)
    return {"batch": batch, "schema": "bounded strings" if bounded else "plain", "valid_json": f"{valid}/{batch}",
            "tokens": sum(lengths), **{f"{k}_{m}": v for k, d in best.items()
                                                                           for m, v in d.items()},
            "slowdown_pct": 100 * (best["guided"]["s"] / best["plain"]["s"] - 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    machine = common.machine_info(args.threads)
    print(json.dumps({"machine": machine}), flush=True)
    llm = LLM()
    runs = [(int(b), bounded) for bounded in (False, True) for b in args.batches.split(",")]
    bar = common.progress(len(runs), "batches")
    rows = []
    for batch, bounded in runs:
        rows.append(run(llm, batch, args.repeats, bounded))
        bar.update()
    bar.close()
    for r in rows:
        print(json.dumps(r), flush=True)
    print(md_table(["schema", "batch", "tokens", "plain tok/s", "guided tok/s", "slowdown", "mask s (of guided s)", "valid JSON"],
                   [[r["schema"], r["batch"], r["tokens"], fmt(r["plain_tok_s"]), fmt(r["guided_tok_s"]),
                     f"{r['slowdown_pct']:+.1f}%", f"{r['guided_mask_s']:.3f} of {r['guided_s']:.2f}",
                     r["valid_json"]] for r in rows]))
    path = common.write_json("structured_outputs", {"machine": machine, "rows": rows})
    print(f"cpu: {machine['cpu']['model']} {machine['cpu']['flags']}; results: {path}")


if __name__ == "__main__":
    main()
