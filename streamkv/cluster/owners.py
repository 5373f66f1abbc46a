"""The owner table: session id -> replica, for sessions that do not live on their hash-ring
owner (moved by a migration, a drain or a failure). One named, detached Ray actor holds it,
so it outlives an ingress restart; the ingress keeps a write-through copy in its Router."""
from __future__ import annotations

from typing import Any

ACTOR_NAME = "streamkv-owner-table"
NAMESPACE = "streamkv"


class OwnerTable:
    """Overrides and a version that counts changes."""

    def __init__(self) -> None:
        self.overrides: dict[str, str] = {}
        self.version = 0

    def set(self, session_id: str, replica: str | None) -> int:
        """Record (``replica``) or clear (None) one override; returns the new version."""
        if replica is None:
            self.overrides.pop(session_id, None)
        else:
            self.overrides[session_id] = replica
        self.version += 1
        return self.version

    def snapshot(self) -> tuple[int, dict[str, str]]:
        return self.version, dict(self.overrides)


def owner_table_actor() -> Any:
    """The cluster's one owner-table actor (created by the first caller, found by the rest)."""
    import ray

    actor_cls = ray.remote(num_cpus=0)(OwnerTable)
    return actor_cls.options(name=ACTOR_NAME, namespace=NAMESPACE, lifetime="detached",
                             get_if_exists=True).remote()
