"""Where the engine steps and what that costs: a batch-1 decode step (the embedded model, context
500, speculation off) run in the thread that built the engine, in another thread (as the
server's ``AsyncEngine`` does) with the builder's OpenMP team left standing, and in another
thread after the builder handed its team back (``native/omp.py``, what ``AsyncEngine.start``
does since 2026-12-02).

    .venv/bin/python benchmarks/engine_thread.py            # ~1 min

Each case runs in a fresh process (libgomp's teams live as long as their threads). Per case:
the median and 20th percentile of the runner's ``execute`` over the decode steps of three
64-token requests. Prints the CPU model and flags.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

CASES = {"building thread": "same", "engine thread, builder's team kept": "kept",
         "engine thread, builder's team released": "released"}


def _case(where: str, threads: int) -> list[float]:
    """Decode-step execute times (s) with the steps run ``where`` (one of CASES' values)."""
    import random
    import threading

    from streamkv.config import EngineConfig
    from streamkv.engine.engine import Engine
    from streamkv.native.omp import release_thread_team
    from streamkv.sampling.params import SamplingParams

    engine = Engine(EngineConfig.from_flat(threads=threads, speculation="none"))
    execute, times = engine.bundle.runner.execute, []

    def timed(plan):
        t0 = time.perf_counter()
        try:
            return execute(plan)
        finally:
            times.append(time.perf_counter() - t0)

    engine.bundle.runner.execute = timed
    rng = random.Random(0)
    kept: list[float] = []

    def work() -> None:
        for k in range(3):
            engine.add_request(f"r{k}", [rng.randrange(1000, 40000) for _ in range(500)],
                               SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
            times.clear()
            while engine.has_unfinished():
                engine.step()
            kept.extend(times[2:])  # the decode steps (the prompt's chunk and the first step out)

    if where == "same":
        work()
    else:
        if where == "released":
            release_thread_team()
        t = threading.Thread(target=work)
        t.start()
        t.join()
    return kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in a child process
    args = ap.parse_args()
    if args.case is not None:
        print(json.dumps(_case(args.case, args.threads)))
        return 0
    info = common.machine_info(args.threads)
    print(f"CPU: {info['cpu']['model']} ({', '.join(info['cpu']['flags'])}); {args.threads} threads")
    rows = []
    for name, where in CASES.items():
        out = subprocess.run([sys.executable, __file__, "--case", where, "--threads", str(args.threads)],
                             capture_output=True, text=True, check=True)
        steps = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append([name, common.fmt(1e3 * statistics.median(steps), 2),
                     common.fmt(1e3 * statistics.quantiles(steps, n=5)[0], 2), str(len(steps))])
    print(common.md_table(["batch-1 decode step (execute)", "median ms", "p20 ms", "steps"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
