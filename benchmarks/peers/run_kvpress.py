"""kvpress (the reference KV presses, on transformers) for benchmarks/kv_compression.py.

Runs in .venv-kvpress (benchmarks/setup_peers.sh kvpress):

    .venv-kvpress/bin/python benchmarks/peers/run_kvpress.py JOBS.json OUT.jsonl

JOBS.json: {"model": HF_DIR, "threads": 2, "jobs": [{"id", "press", "budget", "prompt": [ids],
"max_tokens", "continuation": [ids]}]}. Each job prefills its prompt with the press applied (kvpress
compresses every layer's cache as the prefill runs), then decodes greedily, or teacher-forced over
``continuation``, with positions continuing from the true length. One JSON line per job:
{"id", "tokens": [...], "nll": mean NLL or null, "seconds"}.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time

import torch


def make_press(name: str, budget: int, length: int):
    import kvpress

    ratio = max(0.0, 1 - budget / length)
    if name == "kvpress_snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7)
    if name == "kvpress_streaming_llm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=16)
    raise ValueError(f"unknown press {name!r}")


def run(model, press, prompt: list[int], max_tokens: int, cont: list[int]) -> tuple[list[int], float | None]:
    from transformers import DynamicCache

    n = len(prompt)
    ctx = press(model) if press is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        out = model(torch.tensor([prompt]), past_key_values=DynamicCache(), use_cache=True)
    cache, logits = out.past_key_values, out.logits[0, -1]
    if cont:  # teacher forcing: the whole continuation in one forward over the compressed cache
        m, clen = len(cont), cache.get_seq_length()
        with torch.no_grad():
            rest = model(torch.tensor([cont[:-1]]), position_ids=torch.arange(n, n + m - 1)[None],
                         past_key_values=cache, cache_position=torch.arange(clen, clen + m - 1), use_cache=True)
        lp = torch.log_softmax(torch.cat([logits[None], rest.logits[0]]).float(), -1)
        return list(cont), -float(lp[torch.arange(m), torch.tensor(cont)].mean())
    tokens: list[int] = []
    for t in range(max_tokens):
        tok = int(logits.argmax())
        tokens.append(tok)
        if t == max_tokens - 1:
            break
        with torch.no_grad():
            out = model(torch.tensor([[tok]]), position_ids=torch.tensor([[n + t]]), past_key_values=cache,
                        cache_position=torch.tensor([cache.get_seq_length()]), use_cache=True)
        logits = out.logits[0, -1]
    return tokens, None


def main() -> None:
    from transformers import AutoModelForCausalLM

    spec = json.load(open(sys.argv[1]))
    torch.set_num_threads(int(spec.get("threads", 2)))
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16).eval()
    with open(sys.argv[2], "w") as f:
        for job in spec["jobs"]:
            t0 = time.perf_counter()
            press = make_press(job["press"], job["budget"], len(job["prompt"]))
            tokens, nll = run(model, press, job["prompt"], job["max_tokens"], job.get("continuation") or [])
            f.write(json.dumps({"id": job["id"], "tokens": tokens, "nll": nll,
                                "seconds": round(time.perf_counter() - t0, 2)}) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
