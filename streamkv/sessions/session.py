"""One live session on the engine: its data book-keeping plus its KV-holding sequences."""
from __future__ import annotations

import itertools
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from streamkv.sched.sequence import Sequence
from streamkv.sessions.flash import FlashState
from streamkv.sessions.spec import SessionLayout, SessionSpec
from streamkv.sessions.state import SessionData

Listener = Callable[[dict[str, Any]], None]


_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")


def valid_session_id(session_id: object) -> bool:
    """Ids a client may choose (they name a directory under --session-dir): 8-64 of [A-Za-z0-9_-]."""
    return isinstance(session_id, str) and _SESSION_ID.fullmatch(session_id) is not None


def new_session_id() -> str:
    """Unguessable id (128 random bits)."""
    return "sess_" + secrets.token_urlsafe(16)


@dataclass
class Session:
    """A session as the engine thread sees it.

    ``stream`` holds the frozen + sliding KV (None while offloaded). ``ready`` is a fork
    at the newest complete version with the query prefix appended, so a question computes
    only its own tokens; it is rebuilt after every version.
    """

    id: str
    data: SessionData
    stream: Sequence | None = None
    ready: Sequence | None = None
    ready_version: int = -1
    host_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    host_q: torch.Tensor | None = None  # a snapkv session's query window, offloaded with its KV
    listeners: list[Listener] = field(default_factory=list)
    event_ids: Any = field(default_factory=lambda: itertools.count(1))
    created: float = field(default_factory=time.time)
    saved_version: int = -1
    changed_at: float = field(default_factory=time.monotonic)
    offloaded_tokens: list[int] | None = None
    flash: FlashState = field(default_factory=FlashState)
    ready_probe: dict[str, Any] | None = None  # the last ready-position top token, qualifying or not
    wanted_at: float = float("-inf")  # when a question last waited for room to fork it (monotonic)

    @property
    def where(self) -> str:
        """Where the stream's KV lives: ``pool`` (resident), ``host`` or ``disk``."""
        if self.stream is not None:
            return "pool"
        return "host" if self.host_kv is not None else "disk"

    @property
    def spec(self) -> SessionSpec:
        return self.data.spec

    @property
    def layout(self) -> SessionLayout:
        return self.data.layout

    def emit(self, kind: str, **payload: Any) -> None:
        event = {"event": kind, "id": next(self.event_ids), "session_id": self.id, **payload}
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:  # a broken subscriber must not break the engine loop
                self.listeners.remove(listener)

    def stats(self, block_size: int, kv_bytes_per_token: int, computed: int | None) -> dict[str, Any]:
        d = self.data
        c = d.counters
        n = d.stream_len
        return {
            "id": self.id, "created": int(self.created), "data_version": d.data_version,
            "last_version": d.last_version,
            "tokens": {"frozen": d.frozen_len, "sliding": d.sliding_tokens,
                       "ephemeral": len(d.layout.prefix) + len(d.layout.suffix), "total": n,
                       "computed": computed if computed is not None else n},
            "records": {"pushed": c.records_pushed, "ingested": c.records_ingested,
                        "dropped": c.records_dropped, "evicted": c.records_evicted,
                        "in_window": len(d.spans), "queued": len(d.queue)},
            "queue": {"records": len(d.queue), "tokens": d.queued_tokens, "capacity_tokens": d.spec.max_queue_tokens},
            "evictions": c.evictions, "tokens_evicted": c.tokens_evicted, "queries": c.queries,
            "memory_tokens": d.memory, "snapkv_fallbacks": c.snapkv_fallbacks,
            "kv": {"where": self.where, "bytes": n * kv_bytes_per_token,
                   "blocks": -(-n // block_size) if self.where == "pool" else 0},
            "spec": d.spec.to_dict(),
        }

    def layout_info(self) -> dict[str, Any]:
        d = self.data
        ids = list(self.stream.tokens) if self.stream is not None else None
        return {
            "frozen_ids": list(d.layout.frozen), "query_prefix_ids": list(d.layout.prefix),
            "query_suffix_ids": list(d.layout.suffix), "snapshot_tokens": d.snapshot_len(),
            "kv_read": d.spec.kv_read.to_dict() if d.spec.kv_read is not None else None,
            "records": [{"start": s.start, "end": s.end, "version": s.version} for s in d.spans],
            "stream_ids": ids,
        }
