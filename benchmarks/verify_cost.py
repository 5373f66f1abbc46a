"""What a speculative verify step costs: engine step time by the number of rows it computes,
for one sequence decoding with prompt-lookup drafts of up to 8 tokens (issue 16).

    .venv/bin/python benchmarks/verify_cost.py        # ~1 min on 2 cores

The sequence repeats records (benchmarks/speculation.py's first task, a 1.3k-token prompt), so
drafts of every length occur; each step's ``runner.execute`` is timed and grouped by its rows
(1 = a plain decode step, 1 + d = a verify step with d drafts). Median milliseconds per group.
"""
from __future__ import annotations

import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import md_table  # noqa: E402
from speculation import REPETITIVE, chat_ids  # noqa: E402

from streamkv import LLM, SamplingParams  # noqa: E402


def main() -> None:
    machine = common.machine_info(2)
    print(json.dumps({"machine": machine}), flush=True)
    llm = LLM(speculation="pld", spec_max_draft=8, spec_min_acceptance=0.0, spec_ngram_min=1)
    runner = llm.engine.bundle.runner
    execute = runner.execute
    times: dict[int, list[float]] = collections.defaultdict(list)

    def timed(plan):
        t0 = time.perf_counter()
        out = execute(plan)
        times[plan.num_tokens].append(time.perf_counter() - t0)
        return out

    ids = chat_ids(llm, REPETITIVE["repeat 10 records as JSON"])
    llm.generate([ids], SamplingParams(max_tokens=256, temperature=0.0))  # warm: the prompt is cached
    runner.execute = timed
    for _ in range(3):
        llm.generate([ids], SamplingParams(max_tokens=256, temperature=0.0))
    base = statistics.median(times[1])
    rows = [[k, len(v), f"{1000 * statistics.median(v):.2f}", f"{statistics.median(v) / base:.2f}x"]
            for k, v in sorted(times.items()) if k <= 9 and len(v) >= 3]
    print(md_table(["rows in the step", "steps", "median ms", "vs 1 row"], rows))
    path = common.write_json("verify_cost", {"machine": machine, "rows": rows})
    print(f"cpu: {machine['cpu']['model']} {machine['cpu']['flags']}; results: {path}")


if __name__ == "__main__":
    main()
