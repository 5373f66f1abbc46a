"""transformers in the streaming-session benchmark: one DynamicCache kept across rounds.

Each round: keep the cached KV of the longest common prefix of the tokens it holds and the new
prompt (`cache.crop`), prefill the rest (the new bars + the question) in one forward pass,
decode greedily token by token, then crop the cache back to the data part, dropping the
question and the answer. The weights are the embedded GGUF dequantized (the HF export in
benchmarks/.cache when present, the same float32 tensors, else the GGUF through `gguf_file`).
"""
from __future__ import annotations

import argparse
import os
import sys

import stream_harness


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Engine:
    def __init__(self, args: argparse.Namespace, wl: dict) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(wl.get("threads", 2))
        self.torch = torch
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        hf_dir = wl.get("hf_dir")
        if hf_dir and os.path.exists(os.path.join(hf_dir, "config.json")):
            src = hf_dir
            self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
        else:
            src = wl["gguf"]
            self.model = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(src), gguf_file=os.path.basename(src), dtype=dtype)
        self.model.eval()
        self.eos = set(wl.get("eos_ids") or [])
        self.ignore_eos = wl["ignore_eos"]
        self.reset()
        self.info = {"transformers": transformers.__version__, "torch": torch.__version__,
                     "threads": torch.get_num_threads(), "dtype": args.dtype, "weights": src,
                     "attn_implementation": self.model.config._attn_implementation,
                     "cache": "DynamicCache, cropped to the data prefix after each question"}

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.cached: list[int] = []

    def _crop_to(self, n: int) -> None:
        have = self.cache.get_seq_length()
        if n < have:  # a negative argument removes that many tokens (all recent versions)
            self.cache.crop(n - have)
        del self.cached[n:]

    def _forward(self, ids: list[int]) -> int:
        """Feed `ids` after the cached tokens; returns the greedy next token."""
        x = self.torch.tensor([ids], dtype=self.torch.long)
        out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cached.extend(ids)
        return int(out.logits[0, -1].argmax())

    def answer(self, ids: list[int], data_len: int, max_tokens: int) -> dict:
        with self.torch.inference_mode():
            keep = _common_prefix(self.cached, ids)
            if keep == len(ids):  # at least one token must be fed to get logits
                keep -= 1
            self._crop_to(keep)
            reused = keep
            tok, toks = self._forward(list(ids[keep:])), []
            while True:
                toks.append(tok)
                if len(toks) >= max_tokens or (tok in self.eos and not self.ignore_eos):
                    break
                tok = self._forward([tok])
            self._crop_to(data_len)  # keep only the data: the next round extends it
        return {"token_ids": toks, "cached_tokens": reused}


if __name__ == "__main__":
    sys.exit(stream_harness.main(Engine))
