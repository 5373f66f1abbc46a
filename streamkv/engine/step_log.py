"""An opt-in log of every engine step (``--step-log PATH``): one JSON line per executed step.

    {"t": 1764456789.123, "s": 0.212, "seqs": [[seq_id, start, rows, sampled, drafts, class], ...]}

``t`` is the wall clock at the step's start (``time.time()``), ``s`` its execute time in seconds;
each scheduled sequence gives its first row, its rows this step (drafts included), whether a token
is sampled, its drafted tokens and its priority class (0 flash, 1 session question, 2 pool, 3
stream). A decode row is ``rows - drafts == 1`` with ``sampled``. This is what the decode cadence's
step logs in the README were made from (``benchmarks/multitenant.py --step-log``). Lines are
appended, one open per step, so a log survives a crash and is never held open between steps.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from streamkv.sched.plan import StepPlan

log = logging.getLogger(__name__)


class StepLog:
    """Appends a line per step to ``path`` (checked writable at construction; a write that fails
    later, a full disk, is logged once and ends the log, never the step)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.failed = False
        try:
            with self.path.open("a"):
                pass
        except OSError as exc:
            raise ValueError(f"step_log {path!r} cannot be written: {exc.strerror or exc}") from exc

    def record(self, plan: StepPlan, started: float, seconds: float, seqs: dict[int, Any]) -> None:
        """One step: ``plan``'s sequences, started at ``started`` (wall clock), ``seconds`` long;
        ``seqs``: the scheduler's seq id -> sequence (for the class; finished ones read -1)."""
        if self.failed:
            return
        rows = [[it.seq_id, it.start, len(it.token_ids), int(it.sample), len(it.draft),
                 int(seqs[it.seq_id].klass) if it.seq_id in seqs else -1] for it in plan.seqs]
        line = json.dumps({"t": round(started, 6), "s": round(seconds, 6), "seqs": rows}, separators=(",", ":"))
        try:
            with self.path.open("a") as f:
                f.write(line + "\n")
        except OSError as exc:
            self.failed = True
            log.warning("step log %s cannot be written (%s): no more steps are logged", self.path, exc)
