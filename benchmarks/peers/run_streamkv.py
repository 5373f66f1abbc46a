"""streamkv itself, measured by the same harness as the peers.

Relies only on the public offline API:
    LLM(model=None, dtype=..., **kwargs).generate(list_of_token_id_lists, SamplingParams(...))
    -> outputs in order, each with .token_ids and .metrics {'arrival_time', 'first_token_time',
       'finish_time'} in time.perf_counter() seconds.
Constructor extras (enable_prefix_caching, max_num_batched_tokens, max_num_seqs, ...) come
from the driver's --streamkv-kwargs JSON; by default the engine's own defaults are measured.
"""
from __future__ import annotations

import json
import sys
import time

import harness


def _attr(obj, path: str):
    try:
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj
    except AttributeError:
        return None


def _resolved_dtype(llm, asked: str) -> str:
    """Best effort: what 'auto' became (for the ceiling comparison)."""
    for path in ("engine.bundle.dtype", "dtype", "config.model.dtype", "engine.dtype"):
        s = str(_attr(llm, path)).replace("torch.", "")
        if s in ("float32", "bfloat16", "float16"):
            return s
    return asked


def _decode_weights(llm, dtype: str) -> str:
    """Which weights a decode step reads: 'q4' (the GGUF's packed blocks), 'q4f' (the same on float32
    fmas), 'deq' (those blocks rebuilt to the dense bits, for steps of few rows) or 'dense'.
    Prefers an engine attribute; else mirrors the engine's documented 'auto' rule (packed
    blocks for a GGUF model in bfloat16 on CPU)."""
    for path in ("engine.bundle.decode_weights", "decode_weights"):
        v = _attr(llm, path)
        if v in ("q4", "q4f", "dense", "deq"):
            return v
    mode = _attr(llm, "config.model.decode_weights")
    if mode in ("q4", "dense"):
        return mode
    if mode == "auto":
        model = _attr(llm, "config.model.model")
        gguf = model is None or str(model).endswith(".gguf")
        return "q4" if gguf and dtype == "bfloat16" else "dense"
    return "dense"


class Engine:
    def __init__(self, args, wl):
        import torch
        import streamkv
        from streamkv import LLM

        torch.set_num_threads(wl.get("threads", 2))
        kw = {"model": args.model or None, "dtype": args.dtype}
        kw.update(json.loads(args.kwargs))
        self.llm = LLM(**kw)
        dtype = _resolved_dtype(self.llm, args.dtype)
        self.info = {"streamkv": getattr(streamkv, "__version__", "dev"),
                     "torch": torch.__version__, "threads": torch.get_num_threads(),
                     "dtype_asked": args.dtype, "dtype": dtype,
                     "decode_weights": _decode_weights(self.llm, dtype),
                     **{k: v for k, v in kw.items() if k not in ("model", "dtype")}}

    def _gen(self, prompts, n):
        from streamkv import SamplingParams

        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([list(p) for p in prompts], sp)
        assert len(outs) == len(prompts)
        return outs

    def prefill(self, ids):
        self._gen([ids], 1)

    def decode(self, ids, n):
        o = self._gen([ids], n)[0]
        m = o.metrics
        # only first and last token times are exposed: spread the rest evenly (the harness
        # uses the first and last only)
        k = len(o.token_ids)
        t0, t1 = m["first_token_time"], m["finish_time"]
        times = [t0 + (t1 - t0) * i / max(k - 1, 1) for i in range(k)]
        return times, list(o.token_ids)

    def concurrent(self, prompts, n):
        return [{"first": o.metrics["first_token_time"], "last": o.metrics["finish_time"],
                 "n": len(o.token_ids)} for o in self._gen(prompts, n)]


def _args(ap):
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: embedded)")


if __name__ == "__main__":
    sys.exit(harness.main(Engine, _args))
