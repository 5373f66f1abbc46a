"""llama.cpp peer (llama-cpp-python 0.3.36 in .venv-llamacpp), the same Q4_1 GGUF file.

Batch 1: `Llama(n_ctx=8192, n_threads=2, n_threads_batch=2)` with its defaults (n_batch 512,
no flash attention), `reset()` + `eval(prompt)` then one `eval([token])` per step, greedy
argmax on the last logits: the leanest path through the Python API (no sampler chain).
Concurrent requests: the Python high-level API serves one sequence at a time, so they go
through llama.cpp's own multi-sequence batching (low-level `llama_decode` with one token per
sequence per step, as llama-server does), on a second context with n_seq_max = batch size.
"""
from __future__ import annotations

import json
import sys
import time

import harness


class Engine:
    def __init__(self, args, wl):
        import llama_cpp
        import numpy as np
        from llama_cpp import Llama

        self.np, self.L = np, llama_cpp
        self.threads = wl.get("threads", 2)
        kw = dict(n_ctx=8192, n_threads=self.threads, n_threads_batch=self.threads, seed=0)
        kw.update(json.loads(args.kwargs))
        self.llm = Llama(model_path=wl["gguf"], verbose=False, **kw)
        self.n_vocab = self.llm.n_vocab()
        self.max_b = max(int(b) for b in wl["concurrent"]["batches"])
        self.bctx = None
        self.info = {"llama_cpp_python": llama_cpp.__version__, "threads": self.threads,
                     "n_batch": self.llm.n_batch, "dtype": "q4_1",
                     "flash_attn": kw.get("flash_attn", False),
                     "system_info": llama_cpp.llama_print_system_info().decode()[:300]}

    def _argmax(self, ptr) -> int:
        return int(self.np.argmax(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def prefill(self, ids):
        self.llm.reset()
        self.llm.eval(ids)
        return self._argmax(self.llm._ctx.get_logits())

    def decode(self, ids, n):
        tok = self.prefill(ids)
        times, toks = [time.perf_counter()], [tok]
        for _ in range(n - 1):
            self.llm.eval([tok])
            tok = self._argmax(self.llm._ctx.get_logits())
            times.append(time.perf_counter())
            toks.append(tok)
        return times, toks

    # ---- concurrent requests: llama.cpp multi-sequence batching
    def _batch_ctx(self):
        if self.bctx is None:
            from llama_cpp import _internals as I

            p = self.L.llama_context_default_params()
            p.n_ctx = 8192
            p.n_batch = p.n_ubatch = 512
            p.n_seq_max = self.max_b
            p.kv_unified = True
            p.n_threads = p.n_threads_batch = self.threads
            self.bctx = I.LlamaContext(model=self.llm._model, params=p, verbose=False)
            self.bbatch = I.LlamaBatch(n_tokens=512, embd=0, n_seq_max=1, verbose=False)
            self.info["batched"] = {"n_seq_max": self.max_b, "kv_unified": True, "n_ctx": 8192}
        return self.bctx

    def _decode_items(self, ctx, items):
        """items: (token, pos, seq, want_logits); returns {seq: argmax} for the wanted ones."""
        b = self.bbatch.batch
        b.n_tokens = len(items)
        for j, (t, pos, seq, want) in enumerate(items):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = t, pos, 1, want
            b.seq_id[j][0] = seq
        ctx.decode(self.bbatch)
        return {seq: self._argmax(ctx.get_logits_ith(j))
                for j, (_, _, seq, want) in enumerate(items) if want}

    def concurrent(self, prompts, n):
        if len(prompts) > self.max_b:
            raise NotImplementedError(f"more than {self.max_b} sequences")
        ctx = self._batch_ctx()
        mem = self.L.llama_get_memory(ctx.ctx)
        self.L.llama_memory_clear(mem, True)
        # prefill: all prompt tokens, packed into 512-token decode calls
        flat = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        last, first_t, toks = {}, {}, {s: [] for s in range(len(prompts))}
        for k in range(0, len(flat), 512):
            got = self._decode_items(ctx, flat[k:k + 512])
            now = time.perf_counter()
            for s, t in got.items():
                last[s], first_t[s] = t, now
                toks[s].append(t)
        # decode: one token per sequence per step
        steps = []
        for step in range(n - 1):
            items = [(last[s], len(prompts[s]) + step, s, True) for s in range(len(prompts))]
            last = self._decode_items(ctx, items)
            steps.append(time.perf_counter())
            for s, t in last.items():
                toks[s].append(t)
        end = steps[-1] if steps else max(first_t.values())
        return [{"first": first_t[s], "last": end, "n": len(toks[s]), "times": [first_t[s]] + steps}
                for s in range(len(prompts))]


if __name__ == "__main__":
    sys.exit(harness.main(Engine))
