"""Queue policies: how sequences are ranked within a priority class."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Iterable

from streamkv.sched.sequence import Sequence

QUEUE_POLICIES: dict[str, type["QueuePolicy"]] = {}


def register_queue_policy(cls: type["QueuePolicy"]) -> type["QueuePolicy"]:
    QUEUE_POLICIES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class QueuePolicy(ABC):
    """Ranks runnable sequences; lower keys run first and are preempted last.

    Template method: :meth:`rank` orders by priority class, then the per-request
    ``priority`` value (lower = more urgent), then the policy's own :meth:`key`.
    """

    name: ClassVar[str] = ""

    def rank(self, seqs: Iterable[Sequence]) -> list[Sequence]:
        return sorted(seqs, key=lambda s: (s.klass, s.priority, self.key(s), s.seq_id))

    @abstractmethod
    def key(self, seq: Sequence) -> tuple[float, ...]:
        """Order within one (class, priority) group."""


@register_queue_policy
@dataclass(frozen=True)
class FCFS(QueuePolicy):
    """First come, first served."""

    name: ClassVar[str] = "fcfs"

    def key(self, seq: Sequence) -> tuple[float, ...]:
        return (seq.arrival,)


@register_queue_policy
@dataclass(frozen=True)
class MostComputedFirst(QueuePolicy):
    """MCPS: sequences with the most computed tokens first (finish what is started)."""

    name: ClassVar[str] = "mcps"

    def key(self, seq: Sequence) -> tuple[float, ...]:
        return (-seq.num_computed, seq.arrival)


def make_queue_policy(name: str) -> QueuePolicy:
    try:
        return QUEUE_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown queue policy {name!r}; known: {sorted(QUEUE_POLICIES)}") from None
