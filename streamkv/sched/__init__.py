"""Continuous-batching scheduler: sequences, queue policies and the step plan."""
from __future__ import annotations

from streamkv.sched.plan import ScheduledSeq, StepOutput, StepPlan
from streamkv.sched.scheduler import Scheduler
from streamkv.sched.sequence import PriorityClass, Sequence, SeqStatus

__all__ = ["PriorityClass", "ScheduledSeq", "Scheduler", "SeqStatus", "Sequence", "StepOutput", "StepPlan"]
