"""Which replica serves a request: pure book-keeping (no I/O), owned by the ingress.

* a session goes to its owner: the override table's entry while that replica is up, else
  the first up replica clockwise on the hash ring (``moved`` tells the caller to record it as
  an override, so the session stays put when its natural owner comes back);
* a stateless request goes to the least-loaded up replica: (requests in flight from this
  ingress + requests the replica reports waiting), then the larger KV free fraction;
* with prefix affinity, to the replica its key hashes to while that one carries at most
  ``slack`` more than the least loaded.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from streamkv.cluster.ring import HashRing

_GAUGE = re.compile(r"^(streamkv_requests_waiting|streamkv_requests_running|streamkv_kv_blocks_free|"
                    r"streamkv_kv_blocks_used) ([0-9.e+-]+)$", re.M)


class NoReplicaError(RuntimeError):
    """No replica is up (all failed, restarting or drained)."""


@dataclass
class ReplicaView:
    """The ingress's view of one replica."""

    name: str
    url: str | None = None
    live: bool = False
    draining: bool = False
    inflight: int = 0  # requests this ingress has open on it
    waiting: float = 0.0  # from its /metrics
    running: float = 0.0
    kv_free: float = 1.0  # free / (free + used) KV blocks
    kv_blocks: float = 0.0  # free + used

    @property
    def up(self) -> bool:
        """Takes new work: reachable and not being drained."""
        return self.live and not self.draining

    def load(self) -> float:
        return self.inflight + self.waiting

    def observe_metrics(self, text: str) -> None:
        """Read the load gauges from a replica's Prometheus text."""
        g = {m.group(1): float(m.group(2)) for m in _GAUGE.finditer(text)}
        self.waiting = g.get("streamkv_requests_waiting", 0.0)
        self.running = g.get("streamkv_requests_running", 0.0)
        free, used = g.get("streamkv_kv_blocks_free", 0.0), g.get("streamkv_kv_blocks_used", 0.0)
        self.kv_blocks = free + used
        self.kv_free = free / (free + used) if free + used > 0 else 1.0

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "url": self.url, "live": self.live, "draining": self.draining,
                "inflight": self.inflight, "waiting": self.waiting, "running": self.running,
                "kv_free": round(self.kv_free, 4)}


class Router:
    def __init__(self, names: list[str], vnodes: int = 64, prefix_affinity: bool = False, slack: int = 2) -> None:
        self.replicas = {n: ReplicaView(n) for n in names}
        self.ring = HashRing(names, vnodes)
        self.overrides: dict[str, str] = {}
        self.prefix_affinity = prefix_affinity
        self.slack = slack

    def _up(self, name: str) -> bool:
        r = self.replicas.get(name)
        return r is not None and r.up

    def _live(self, name: str) -> bool:
        r = self.replicas.get(name)
        return r is not None and r.live

    def owner(self, session_id: str, new: bool = False) -> tuple[str, bool]:
        """``(replica, moved)``: the recorded (override) or natural (ring) owner while it is live;
        a draining replica keeps its sessions until they are migrated off it. ``moved`` when
        that owner is down and the session lands on a successor (record it with
        :meth:`set_owner`). ``new``: a session being created, which never lands on a
        draining replica."""
        ok = self._up if new else self._live
        recorded = self.overrides.get(session_id)
        if recorded is not None and ok(recorded):
            return recorded, False
        natural = self.ring.lookup(session_id)
        if recorded is None and natural is not None and ok(natural):
            return natural, False
        name = self.ring.lookup(session_id, self._up)
        if name is None:
            raise NoReplicaError("no replica is up")
        return name, name != natural or recorded is not None

    def assigned(self, session_id: str) -> str | None:
        """The recorded or natural owner, up or not."""
        return self.overrides.get(session_id) or self.ring.lookup(session_id)

    def successor(self, session_id: str, exclude: str) -> str:
        """Where a session goes when it leaves ``exclude`` (drain, forced migration)."""
        name = self.ring.lookup(session_id, lambda n: n != exclude and self._up(n))
        if name is None:
            raise NoReplicaError(f"no replica other than {exclude} is up")
        return name

    def set_owner(self, session_id: str, name: str) -> None:
        """Record an override; a session back on its natural owner needs none."""
        if name == self.ring.lookup(session_id):
            self.overrides.pop(session_id, None)
        else:
            self.overrides[session_id] = name

    def least_loaded(self, key: str | None = None) -> str:
        cands = [r for r in self.replicas.values() if r.up]
        if not cands:
            raise NoReplicaError("no replica is up")
        best = min(cands, key=lambda r: (r.load(), -r.kv_free, r.name))
        if key is not None and self.prefix_affinity:
            pref = self.replicas[self.ring.lookup(key, self._up) or best.name]
            if pref.load() <= best.load() + self.slack:
                return pref.name
        return best.name

    def overloaded(self, low: float, high: float = 0.5) -> tuple[str, str] | None:
        """``(source, target)`` when an up replica's KV free fraction fell below ``low`` while
        another's is above ``high`` (the most and least full); None otherwise."""
        up = [r for r in self.replicas.values() if r.up]
        if low <= 0 or len(up) < 2:
            return None
        src, dst = min(up, key=lambda r: r.kv_free), max(up, key=lambda r: r.kv_free)
        return (src.name, dst.name) if src.kv_free < low and dst.kv_free > high else None

    def up_names(self) -> list[str]:
        return [n for n, r in self.replicas.items() if r.up]

    def live_names(self) -> list[str]:
        return [n for n, r in self.replicas.items() if r.live]
