"""The GIL convoy: how long one engine decode step takes beside a busy Python thread, at each
thread switch interval (``sys.setswitchinterval``; ``streamkv serve --switch-interval``).

    .venv/bin/python benchmarks/gil_convoy.py                     # ~2 min on 2 cores
    .venv/bin/python benchmarks/gil_convoy.py --decoders 32 --intervals 0.005,0.0005

In ``streamkv serve`` the engine thread steps the model while uvicorn's event loop and the HTTP
threads run Python (JSON, pydantic, SSE framing) beside it. Every torch op and native kernel
releases the GIL; when another thread holds it, the engine thread waits until that thread's
switch interval runs out before it can go on, once per op, and a step is hundreds of ops:

    engine  |op|..wait..|op|..wait..|op|        step time ~ ops x min(interval, other's work)
    busy    ....|#####|.....|#####|....

Per interval the benchmark times ``--steps`` decode steps of ``--decoders`` greedy sequences,
first alone, then beside one thread that encodes and decodes JSON without pause. It prints the
CPU, a table (median / p90 / max ms per step) and writes ``benchmarks/results/gil_convoy-*.json``.
A machine's neighbours disturb single runs; compare rows of one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


class BusyThread:
    """One Python thread that holds the GIL as an HTTP thread serialising responses does."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.loops = 0
        self.thread = threading.Thread(target=self._run, daemon=True, name="busy-json")

    def _run(self) -> None:
        payload = {"choices": [{"index": i, "text": "token " * 20, "logprobs": None} for i in range(16)]}
        while not self.stop.is_set():
            json.loads(json.dumps(payload))
            self.loops += 1

    def __enter__(self) -> BusyThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def decode_steps(llm, prompts: list[list[int]], steps: int) -> list[float]:
    """Seconds of each of ``steps`` engine steps in which every sequence decodes one token."""
    from streamkv import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}-{time.monotonic_ns()}", p, params)
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[-steps:]  # the last ``steps``: prefill done, all decoding (max_tokens = steps + 2)


def summary(times: list[float]) -> dict[str, float]:
    ms = sorted(1000 * t for t in times)
    return {"median": statistics.median(ms), "p90": ms[int(0.9 * (len(ms) - 1))], "max": ms[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intervals", default="0.005,0.002,0.001,0.0005,0.0002",
                    help="switch intervals in seconds (0.005 is CPython's default)")
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per case")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    intervals = [float(x) for x in args.intervals.split(",")]
    from streamkv import LLM

    info = common.machine_info(args.threads)
    print(f"CPU: {info['cpu']['model']} ({', '.join(info['cpu']['flags'])}); {info['cores']} cores; "
          f"torch {info.get('torch')}, {info.get('torch_threads')} threads")
    llm = LLM(threads=args.threads, speculation="none")
    prompts = [[100 + 7 * i + j for j in range(128)] for i in range(args.decoders)]
    decode_steps(llm, prompts, 4)  # warm-up
    default = sys.getswitchinterval()
    rows, out = [], {"machine": info, "decoders": args.decoders, "steps": args.steps, "cases": []}
    try:
        for k, interval in enumerate(intervals):
            sys.setswitchinterval(interval)
            fresh = [[t + 1 + k for t in p] for p in prompts]  # no prefix-cache hit on an earlier case
            alone = summary(decode_steps(llm, fresh, args.steps))
            with BusyThread() as busy:
                beside = summary(decode_steps(llm, [[t + 50 for t in p] for p in fresh], args.steps))
            out["cases"].append({"interval_s": interval, "alone": alone, "beside_busy": beside,
                                 "busy_loops": busy.loops})
            rows.append([f"{interval * 1e3:g}", *(common.fmt(alone[q], 1) for q in ("median", "max")),
                         *(common.fmt(beside[q], 1) for q in ("median", "p90", "max")),
                         f"{beside['median'] / alone['median']:.1f}x"])
    finally:
        sys.setswitchinterval(default)
    print(f"\n{args.decoders} decoders, {args.steps} decode steps per case; ms per engine step")
    print(common.md_table(["switch interval ms", "alone median", "alone max", "beside busy median",
                           "beside p90", "beside max", "slowdown"], rows))
    print(f"\nwrote {common.write_json('gil_convoy', out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
