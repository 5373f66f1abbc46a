"""Consistent-hash ring over replica names: a session's natural owner, stable as replicas
come and go (only the sessions of a missing replica move, to its clockwise successor)."""
from __future__ import annotations

import bisect
import hashlib
from typing import Callable, Iterable


def point(key: str) -> int:
    """64-bit position of ``key`` on the ring (blake2b: stable across processes and runs)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


class HashRing:
    """``vnodes`` points per replica; ``lookup`` walks clockwise to the first accepted one."""

    def __init__(self, names: Iterable[str], vnodes: int = 64) -> None:
        names = list(names)
        if not names:
            raise ValueError("a hash ring needs at least one replica")
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be unique, got {names}")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.names = names
        pairs = sorted((point(f"{name}#{i}"), name) for name in names for i in range(vnodes))
        self._points = [p for p, _ in pairs]
        self._owners = [n for _, n in pairs]

    def lookup(self, key: str, accept: Callable[[str], bool] | None = None) -> str | None:
        """The first replica clockwise from ``key`` that ``accept`` takes (all, by default);
        None when it takes none."""
        start = bisect.bisect(self._points, point(key))
        n = len(self._owners)
        seen: set[str] = set()
        for i in range(n):
            name = self._owners[(start + i) % n]
            if name in seen:
                continue
            if accept is None or accept(name):
                return name
            seen.add(name)
            if len(seen) == len(self.names):
                break
        return None
