"""llama.cpp peer for benchmarks/speculation.py: batch-1 greedy decode with and without
prompt-lookup decoding (llama-cpp-python's ``LlamaPromptLookupDecoding``), same GGUF.

    python run_pld_llamacpp.py WORKLOAD.json OUT.json plain|spec
"""
from __future__ import annotations

import json
import sys
import time

import harness


def main() -> None:
    wl_path, out_path, mode = sys.argv[1:4]
    wl = json.load(open(wl_path))
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    kw = dict(n_ctx=4096, n_threads=wl["threads"], n_threads_batch=wl["threads"], seed=0, verbose=False)
    if mode == "spec":  # llama-cpp-python's defaults are num_pred_tokens=10, max_ngram_size=2
        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=wl.get("num_pred_tokens", 10))
        kw["logits_all"] = True  # its verification reads the logits of every drafted position
    llm = Llama(model_path=wl["gguf"], **kw)
    rows = []
    for ids in wl["prompts"]:
        def run(n: int) -> tuple[float, int]:
            llm.reset()
            t0 = time.perf_counter()
            out = llm.create_completion(prompt=ids, max_tokens=n, temperature=0.0, top_k=1)
            return time.perf_counter() - t0, out["usage"]["completion_tokens"]

        rows.append(harness.best_decode_rate(run, wl["max_tokens"], wl["repeats"]))
    json.dump({"mode": mode, "rows": rows, "info": {"llama_cpp_python": llama_cpp.__version__,
                                                    "draft": "LlamaPromptLookupDecoding" if mode == "spec" else None}},
              open(out_path, "w"))


if __name__ == "__main__":
    main()
