"""Cooperative tasks on the engine thread: a span query is a generator that yields what it waits for.

::

    def run(...):                       the driver (``advance``) resumes a task between engine
        s = ops.fork(...)               steps once its wait is over:
        yield Idle([s])                   Idle(streams)    every stream's KV is computed
        out = yield Done("q/1")           Done(request)    that request finished (its output)
        rs = yield All([t1, t2])          All(generators)  sub-tasks, advanced together
        return state

No threads: everything runs where the engine state lives, between two steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generator

from streamkv.sched.sequence import Sequence

TaskGen = Generator[Any, Any, Any]


@dataclass
class Idle:
    seqs: list[Sequence]


@dataclass
class Done:
    request_id: str


@dataclass
class Step:
    """Wait until the engine has run a step after step number ``after``."""

    after: int


@dataclass
class All:
    gens: list[TaskGen]
    tasks: list["Task"] = field(default_factory=list)


@dataclass
class Task:
    gen: TaskGen
    wait: Any = None
    started: bool = False
    done: bool = False
    result: Any = None
    error: BaseException | None = None


class TaskFailed(RuntimeError):
    """A stream a task waits on finished without computing (aborted or out of blocks); ``retry``:
    for want of room (the query's error is then retryable too)."""

    def __init__(self, message: str, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


def advance(task: Task, ready: Callable[[Any], tuple[bool, Any]]) -> bool:
    """Resume ``task`` while its waits are over; True if it moved. ``ready(wait)`` returns
    (over, value sent back into the generator) for Idle / Done waits."""
    moved = False
    while not task.done:
        value: Any = None
        error: BaseException | None = None
        wait = task.wait
        if not task.started:
            task.started = True
        elif isinstance(wait, All):
            if not wait.tasks:
                wait.tasks = [Task(g) for g in wait.gens]
            for sub in wait.tasks:
                moved |= advance(sub, ready)
            error = next((s.error for s in wait.tasks if s.error is not None), None)
            if error is None and not all(s.done for s in wait.tasks):
                return moved
            if error is not None:
                for sub in wait.tasks:
                    sub.gen.close()
            value = [s.result for s in wait.tasks]
        else:
            try:
                over, value = ready(wait)
            except BaseException as exc:  # the wait itself failed (e.g. a stream was dropped)
                over, error = True, exc
            if not over:
                return moved
        moved = True
        try:
            task.wait = task.gen.throw(error) if error is not None else task.gen.send(value)
        except StopIteration as stop:
            task.done, task.result = True, stop.value
        except Exception as exc:
            task.done, task.error = True, exc
    return moved
