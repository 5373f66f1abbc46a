"""transformers peer: the embedded GGUF loaded by transformers (dequantized), model.generate.

Batch-1 and batched greedy generation through `generate` with a streamer that timestamps each
step; concurrent requests are one batched `generate` call (all prompts have equal length, so
no padding is involved).
"""
from __future__ import annotations

import os
import sys
import time

import harness


class _Clock:
    """A generate() streamer that records when each step's tokens became available."""

    def __init__(self):
        self.times, self.calls = [], 0

    def put(self, value):
        self.calls += 1
        if self.calls > 1:  # the first put is the prompt
            self.times.append(time.perf_counter())

    def end(self):
        pass


class Engine:
    def __init__(self, args, wl):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(wl.get("threads", 2))
        self.torch = torch
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        path = wl["gguf"]
        self.model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
        self.model.eval()
        self.eos = self.model.generation_config.eos_token_id
        self.info = {"transformers": transformers.__version__, "torch": torch.__version__,
                     "threads": torch.get_num_threads(), "dtype": args.dtype,
                     "attn_implementation": self.model.config._attn_implementation}

    def _generate(self, ids_2d, n, streamer=None):
        torch = self.torch
        x = torch.tensor(ids_2d, dtype=torch.long)
        with torch.inference_mode():
            return self.model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, temperature=None, top_p=None, top_k=None,
                pad_token_id=self.eos if isinstance(self.eos, int) else 0, streamer=streamer)

    def prefill(self, ids):
        self._generate([ids], 1)

    def decode(self, ids, n):
        clock = _Clock()
        out = self._generate([ids], n, clock)
        return clock.times, out[0, len(ids):].tolist()

    def concurrent(self, prompts, n):
        if len({len(p) for p in prompts}) != 1:
            raise NotImplementedError("batched generate needs equal prompt lengths here")
        clock = _Clock()
        out = self._generate(prompts, n, clock)
        k = out.shape[1] - len(prompts[0])
        return [{"first": clock.times[0], "last": clock.times[-1], "n": k, "times": clock.times}
                for _ in prompts]


if __name__ == "__main__":
    sys.exit(harness.main(Engine))
