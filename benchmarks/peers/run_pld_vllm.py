"""vLLM peer for benchmarks/speculation.py: batch-1 greedy decode with and without its n-gram
speculation (``speculative_config={"method": "ngram", ...}``), bfloat16, the HF export.

    python run_pld_vllm.py WORKLOAD.json OUT.json plain|spec
"""
from __future__ import annotations

import json
import sys
import time

import harness


def main() -> None:
    wl_path, out_path, mode = sys.argv[1:4]
    wl = json.load(open(wl_path))
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(wl["threads"])
    kw = dict(model=wl["hf_dir"], tokenizer=wl["hf_dir"], dtype="bfloat16", enforce_eager=True,
              enable_prefix_caching=True, max_model_len=4096, seed=0)
    if mode == "spec":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 4,
                                    "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    llm = LLM(**kw)
    rows = []
    for ids in wl["prompts"]:
        def run(n: int) -> tuple[float, int]:
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                               SamplingParams(max_tokens=n, temperature=0.0), use_tqdm=False)
            return time.perf_counter() - t0, len(out[0].outputs[0].token_ids)

        rows.append(harness.best_decode_rate(run, wl["max_tokens"], wl["repeats"]))
    json.dump({"mode": mode, "rows": rows, "info": {"vllm": vllm.__version__, **{k: v for k, v in kw.items()
                                                                                 if k not in ("model", "tokenizer")}}},
              open(out_path, "w"))


if __name__ == "__main__":
    main()
