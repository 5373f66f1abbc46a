"""Submits waiting for KV blocks in the server's engine loop (``AsyncEngine``; engine thread only).

A submitted fork (a session question) copies its parent's partial block at once. One that finds
no free block (``KVCacheFullError``) waits instead of failing, and so does a question the engine
failed for want of blocks before it produced anything (``Engine._fail_stalled`` fails the latest
fork held at its fork point: its copied block is what the others lack)::

    submit ──KVCacheFullError──▶ parked ──after each step, oldest first──▶ submit again
      │                            ▲
      ▼ accepted (``again``)       │ failed for want of blocks, no token yet
    fresh ─────────────────────────┘
      │ a token, or any other end
      ▼ (forgotten)

Either waits until its deadline (``_BLOCK_WAIT_S`` after it arrived) while work runs; the
owner fails it with the retryable error after that.
"""
from __future__ import annotations

from typing import Any

from streamkv.engine.outputs import RequestOutput


class BlockWaits:
    """The parked submits (in arrival order) and the accepted ``again`` submits with no output
    yet, each with its deadline; ``waits`` and ``restarts`` count them for /metrics."""

    def __init__(self) -> None:
        self.parked: list[tuple[Any, float]] = []  # (_Add, deadline), oldest first
        self.fresh: dict[str, tuple[Any, float]] = {}  # request id -> (_Add, deadline)
        self.waits = 0  # submits that have waited for a free block
        self.restarts = 0  # of them, failed for want of blocks after acceptance and parked again

    def park(self, cmd: Any, deadline: float, first: bool = True) -> None:
        """Queue a submit to wait for a block (``first``: counted in ``waits``)."""
        self.parked.append((cmd, deadline))
        self.waits += first

    def take(self) -> list[tuple[Any, float]]:
        """Every parked submit, oldest first, to try again (the list is emptied)."""
        parked, self.parked = self.parked, []
        return parked

    def unpark(self, request_id: str) -> Any | None:
        """Drop a parked submit (its client left) and forget a fresh one; the parked one, if any."""
        self.fresh.pop(request_id, None)
        for i, (cmd, _) in enumerate(self.parked):
            if cmd.request_id == request_id:
                del self.parked[i]
                return cmd
        return None

    def accepted(self, cmd: Any, deadline: float) -> None:
        """``cmd`` was added: an ``again`` submit is remembered until its first output."""
        if cmd.again:
            self.fresh[cmd.request_id] = (cmd, deadline)

    def restart(self, out: RequestOutput, work_left: bool, now: float) -> bool:
        """Park an ``again`` submit once more when the engine failed it for want of blocks
        (``out.retry``) before it produced a token, while work runs and before its deadline;
        True if it was (its client sees only the wait)."""
        entry = self.fresh.get(out.request_id)
        if entry is None:
            return False
        if out.token_ids or out.finished:
            del self.fresh[out.request_id]
        cmd, deadline = entry
        if not (out.finished and out.retry and not out.token_ids and work_left and now < deadline):
            return False
        self.park(cmd, deadline)
        self.parked.sort(key=lambda p: p[1])  # in arrival order among the waiting (a stable sort)
        self.restarts += 1
        return True
