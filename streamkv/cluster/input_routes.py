"""Where each streaming input lives in the cluster (streams do not migrate), and which closed.

::

    open    istr_a -> replica-0   (seen 12.5 s ago)     an HTTP call or a WebSocket relay touches it
    closed  istr_b, istr_c ...    (the latest CLOSED)    late calls get 409, as on one server

An id leaves ``open`` when its replica says it is gone (404: the replica restarted), closed
(409, a finish or DELETE through the ingress, or a WebSocket whose replica reports it closed
afterwards), or when nothing touched it for the replicas' input TTL (the replica has expired
it: its TTL counts from the client's last change, and every change passes here). A stream with
a WebSocket relay open is never pruned: its frames reach the replica without touching it here.
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from contextlib import contextmanager
from typing import Iterator

CLOSED = 4096  # closed ids remembered


class InputRoutes:
    def __init__(self, ttl_s: float = 300.0, closed: int = CLOSED) -> None:
        if not ttl_s > 0 or closed < 0:
            raise ValueError(f"input routes need a positive TTL and a closed memory >= 0, got {ttl_s}, {closed}")
        self.ttl_s = ttl_s
        self.open: dict[str, str] = {}
        self.seen: dict[str, float] = {}
        self.closed: OrderedDict[str, None] = OrderedDict()
        self._memory = closed
        self._relays: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self.open)

    def add(self, stream_id: str, replica: str) -> None:
        self.open[stream_id] = replica
        self.seen[stream_id] = time.monotonic()

    def get(self, stream_id: str) -> str | None:
        """The replica holding an open stream (and it was seen now), or None."""
        replica = self.open.get(stream_id)
        if replica is not None:
            self.seen[stream_id] = time.monotonic()
        return replica

    def is_closed(self, stream_id: str) -> bool:
        return stream_id in self.closed

    def lost(self, stream_id: str) -> None:
        """Its replica does not know it (restarted, or failed): forget it, not as closed."""
        self.open.pop(stream_id, None)
        self.seen.pop(stream_id, None)

    def close(self, stream_id: str) -> None:
        """Finished, aborted or expired: forget where it was, remember that it closed."""
        self.lost(stream_id)
        self.closed[stream_id] = None
        while len(self.closed) > self._memory:
            self.closed.popitem(last=False)

    @contextmanager
    def relaying(self, stream_id: str) -> Iterator[None]:
        """While a WebSocket relays frames for ``stream_id``: it is in use, whatever the clock."""
        self._relays[stream_id] += 1
        try:
            yield
        finally:
            self._relays[stream_id] -= 1
            if not self._relays[stream_id]:
                del self._relays[stream_id]
            if stream_id in self.seen:
                self.seen[stream_id] = time.monotonic()

    def prune(self, now: float | None = None) -> list[str]:
        """Close the streams nothing touched for the TTL (their replica expired them); returns them."""
        now = time.monotonic() if now is None else now
        stale = [s for s, t in self.seen.items() if now - t > self.ttl_s and s not in self._relays]
        for stream_id in stale:
            self.close(stream_id)
        return stale
