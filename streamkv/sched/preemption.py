"""Preemption: drop a victim's KV (recompute it later) or move it to host memory (swap).

``cost`` compares two measured cost functions (``streamkv profile``)::

    recompute  T(num_computed)          prefill time, piecewise linear in tokens
    swap       C_out(blocks) + C_in(blocks)   copy time to host and back

and picks the cheaper; ``swap`` swaps whenever the host pool has room; ``recompute`` never
swaps. Both keep outputs bit-identical (swap restores the same rows; recompute recomputes
them with batch-invariant kernels).
"""
from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

PREEMPTION_POLICIES: dict[str, type["PreemptionPolicy"]] = {}


@dataclass(frozen=True)
class CostProfile:
    """Measured points ``(x, seconds)``, x ascending: prefill by tokens, swap by blocks (one way)."""

    prefill: tuple[tuple[int, float], ...]
    swap_out: tuple[tuple[int, float], ...]
    swap_in: tuple[tuple[int, float], ...]
    source: str = "measured"

    def __post_init__(self) -> None:
        for name in ("prefill", "swap_out", "swap_in"):
            pts = getattr(self, name)
            if len(pts) < 2 or any(b[0] <= a[0] for a, b in zip(pts, pts[1:])):
                raise ValueError(f"{name} needs >= 2 points with ascending x, got {pts}")
            if not all(x >= 0 and math.isfinite(y) and y >= 0 for x, y in pts):
                raise ValueError(f"{name} needs sizes >= 0 and finite times >= 0, got {pts}")

    def prefill_s(self, tokens: int) -> float:
        return _interp(self.prefill, tokens)

    def swap_s(self, blocks: int) -> float:
        return _interp(self.swap_out, blocks) + _interp(self.swap_in, blocks)

    def to_dict(self) -> dict[str, object]:
        return {"prefill": self.prefill, "swap_out": self.swap_out, "swap_in": self.swap_in, "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        return cls(*(tuple((int(x), float(y)) for x, y in d[k]) for k in ("prefill", "swap_out", "swap_in")),
                   source=str(d.get("source", "cached")))


def _interp(points: tuple[tuple[int, float], ...], x: float) -> float:
    """Piecewise linear through ``points``, extended linearly past both ends, never negative."""
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def register_preemption(cls: type["PreemptionPolicy"]) -> type["PreemptionPolicy"]:
    PREEMPTION_POLICIES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class PreemptionPolicy(ABC):
    name: ClassVar[str] = ""

    @abstractmethod
    def swap(self, num_computed: int, blocks: int) -> bool:
        """True: swap this victim out (the host pool has room); False: recompute it later."""


@register_preemption
@dataclass(frozen=True)
class Recompute(PreemptionPolicy):
    name: ClassVar[str] = "recompute"

    def swap(self, num_computed: int, blocks: int) -> bool:
        return False


@register_preemption
@dataclass(frozen=True)
class Swap(PreemptionPolicy):
    name: ClassVar[str] = "swap"

    def swap(self, num_computed: int, blocks: int) -> bool:
        return True


@register_preemption
@dataclass(frozen=True)
class Cost(PreemptionPolicy):
    """Swap when moving the blocks out and back costs less than recomputing the rows."""

    name: ClassVar[str] = "cost"
    profile: CostProfile | None = field(default=None)

    def swap(self, num_computed: int, blocks: int) -> bool:
        if self.profile is None:
            return False
        return self.profile.swap_s(blocks) < self.profile.prefill_s(num_computed)


def make_preemption(name: str, profile: CostProfile | None = None) -> PreemptionPolicy:
    if name not in PREEMPTION_POLICIES:
        raise ValueError(f"unknown preemption policy {name!r}; known: {sorted(PREEMPTION_POLICIES)}")
    return Cost(profile) if name == "cost" else PREEMPTION_POLICIES[name]()
