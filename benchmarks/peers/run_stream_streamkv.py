"""streamkv in the streaming-session benchmark, two ways (public offline API only):

  --mode session    a live session: `llm.session(system=..., retention_tokens=..., chat=True)`;
                    each round `push(bars)` + `ingest()` (timed as ingestion), then the timed
                    `query(question, max_tokens=...)`. Its query prompt ids become the workload
                    every request-driven engine is fed. With `--kv-read JSON`, the session's
                    questions use that read-time KV policy (`kv_read=...`, e.g. Quest pages).
  --mode stateless  request-driven: `llm.generate(full prompt ids)` every round, automatic
                    prefix caching on (the default), so the previous round's data blocks are reused.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import stream_harness
from run_streamkv import _decode_weights, _resolved_dtype


def _make_llm(args: argparse.Namespace, wl: dict) -> tuple[Any, dict]:
    import torch
    import streamkv
    from streamkv import LLM

    torch.set_num_threads(wl.get("threads", 2))
    kw: dict = {"dtype": args.dtype, "threads": wl.get("threads", 2)}
    kw.update(json.loads(args.kwargs))
    llm = LLM(**kw)
    dtype = _resolved_dtype(llm, args.dtype)
    info = {"streamkv": getattr(streamkv, "__version__", "dev"), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "dtype_asked": args.dtype, "dtype": dtype,
            "decode_weights": _decode_weights(llm, dtype), "mode": args.mode,
            **{k: v for k, v in kw.items() if k != "dtype"}}
    return llm, info


class SessionEngine:
    def __init__(self, args: argparse.Namespace, wl: dict) -> None:
        self.llm, self.info = _make_llm(args, wl)
        self.info["retention_tokens"] = wl["retention"]
        self.kv_read = json.loads(args.kv_read) if args.kv_read else None
        self.info["kv_read"] = self.kv_read
        self.session: Any = None
        self.prev_snapshot = self.prev_evicted = 0

    def _open(self, system: str, wl: dict) -> Any:
        return self.llm.session(system=system, retention_tokens=wl["retention"], chat=True, kv_read=self.kv_read)

    def _ask(self, s: Any, question: str, wl: dict, max_tokens: int | None = None) -> Any:
        return s.query(question, max_tokens=max_tokens or wl["max_tokens"], temperature=0.0,
                       ignore_eos=wl["ignore_eos"])

    def warmup(self, wl: dict) -> None:
        """A throw-away session (another system prompt: nothing it computed can be reused)."""
        recs = wl["rounds"][0]["records"]
        s = self._open("Warm-up session.", wl)
        for part in (recs[: max(1, len(recs) // 2)], recs[len(recs) // 2:] or recs[:1]):
            s.push(part)
            s.ingest()
            self._ask(s, "What was the last close?", wl, 2)
        s.close()

    def round(self, r: dict, wl: dict) -> dict:
        t0 = time.perf_counter()
        if self.session is None:  # creating it (the frozen prefix) counts as round 0's ingestion
            self.session = self._open(wl["system"], wl)
        self.session.push(r["records"])
        self.session.ingest()
        ingest_s = time.perf_counter() - t0
        snapshot = self.session.layout()["snapshot_tokens"]
        evicted = self.session.stats()["tokens_evicted"]
        t1 = time.perf_counter()
        a = self._ask(self.session, r["question"], wl)
        latency = time.perf_counter() - t1
        ingested = snapshot - self.prev_snapshot + evicted - self.prev_evicted
        self.prev_snapshot, self.prev_evicted = snapshot, evicted
        return {"latency_s": latency, "engine_latency_s": a.latency_s, "ingest_s": ingest_s,
                "ingested_tokens": ingested, "data_len": snapshot, "tokens_evicted": evicted,
                "prompt_tokens": len(a.prompt_token_ids),
                "computed_prompt_tokens": a.usage.get("computed_prompt_tokens"),
                "data_version": a.data_version, "finish_reason": a.finish_reason,
                "text": a.answer, "token_ids": list(a.token_ids),
                "prompt_token_ids": list(a.prompt_token_ids)}

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


class StatelessEngine:
    def __init__(self, args: argparse.Namespace, wl: dict) -> None:
        self.llm, self.info = _make_llm(args, wl)
        self.ignore_eos = wl["ignore_eos"]

    def answer(self, ids: list[int], data_len: int, max_tokens: int) -> dict:
        from streamkv import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=self.ignore_eos)
        o = self.llm.generate([list(ids)], sp)[0]
        if o.error:
            raise RuntimeError(o.error)
        return {"token_ids": list(o.token_ids), "text": o.text, "cached_tokens": o.num_cached_tokens,
                "finish_reason": o.finish_reason}


def make_engine(args: argparse.Namespace, wl: dict) -> Any:
    return SessionEngine(args, wl) if args.mode == "session" else StatelessEngine(args, wl)


def _args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mode", choices=("session", "stateless"), default="session")
    ap.add_argument("--kv-read", default="", help="JSON read policy for the session's questions")


if __name__ == "__main__":
    sys.exit(stream_harness.main(make_engine, _args))
