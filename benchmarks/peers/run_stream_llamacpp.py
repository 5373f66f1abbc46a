"""llama.cpp in the streaming-session benchmark (llama-cpp-python in .venv-llamacpp).

`Llama(model_path=GGUF, n_ctx=8192+, n_threads=2, n_threads_batch=2)`, one completion per
round on the full prompt token ids (temperature 0 = greedy). `Llama.generate` keeps the KV of
the longest prefix its context shares with the new prompt (the data up to the previous round),
so each round evaluates the new bars + the question, then decodes.
"""
from __future__ import annotations

import argparse
import json
import sys

import stream_harness


class Engine:
    def __init__(self, args: argparse.Namespace, wl: dict) -> None:
        import llama_cpp
        from llama_cpp import Llama

        threads = wl.get("threads", 2)
        longest = max(len(r["ids"]) for r in wl["rounds"]) + wl["max_tokens"] + 16
        kw = dict(n_ctx=max(8192, longest), n_threads=threads, n_threads_batch=threads, seed=0)
        kw.update(json.loads(args.kwargs))
        self.llm = Llama(model_path=wl["gguf"], verbose=False, **kw)
        self.ignore_eos = wl["ignore_eos"]
        self.info = {"llama_cpp_python": llama_cpp.__version__, "dtype": "q4_1",
                     "n_batch": self.llm.n_batch, **kw}

    def answer(self, ids: list[int], data_len: int, max_tokens: int) -> dict:
        held = self.llm._input_ids[: self.llm.n_tokens].tolist()
        reused = next((i for i, (a, b) in enumerate(zip(held, ids)) if a != b), min(len(held), len(ids)))
        logit_bias = None
        if self.ignore_eos:
            logit_bias = {self.llm.token_eos(): float("-inf")}
        out = self.llm.create_completion(prompt=list(ids), max_tokens=max_tokens, temperature=0.0,
                                         top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                         logit_bias=logit_bias, stream=False)
        choice = out["choices"][0]
        # the ids of the answer are not all kept (the last sampled one is never evaluated): text
        return {"token_ids": None, "text": choice["text"], "finish_reason": choice["finish_reason"],
                "completion_tokens": out["usage"]["completion_tokens"],
                "cached_tokens": min(reused, len(ids) - 1)}

    def reset(self) -> None:
        self.llm.reset()


if __name__ == "__main__":
    sys.exit(stream_harness.main(Engine))
