"""How much of this process's CPUs other processes used while it measured (Linux): its kernels
(``tuning.py``) and its preemption cost profile (``engine/profile.py``).

A kernel measurement beside another CPU-bound job times the scheduler, not the kernels: on a
2-core Xeon a first start during a test run cached ``attention=f32, lm_head=dense`` with every
candidate 8-40x slower than alone (an OpenMP team whose threads get descheduled waits at every
barrier), and every later start read that choice (prefill 3.6x slower). So the measurement
watches the CPUs it may run on::

    /proc/stat        cpuN  user nice system idle iowait irq softirq steal ...   (ticks, per CPU)
    /proc/self/stat   ... utime stime ...                                         (this process, all threads)

    busy(ours)   = sum over the N CPUs of our affinity of user + nice + system + irq + softirq + steal
    others       = (delta busy(ours) - delta own ticks) / elapsed ticks          (in CPUs, 0 .. N)
    share        = (others - (N - T)) / T, clipped to 0 .. 1                     (T: our threads)

The share is what other processes took of the CPUs our T threads need: on a 2-CPU VM with 2
threads every other busy CPU counts; a container allowed all 64 CPUs of a host, measuring on 2,
is contended only once others leave fewer than 2 idle.

``steal`` counts: a hypervisor that runs another guest on our vCPU slows us the same way.
Where ``/proc`` is missing (not Linux) the share is unknown (None) and the team measures as before.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, TypeVar

T = TypeVar("T")

BUSY = 0.15        # a measurement is "contended" above this share of the CPUs our threads need, taken by others
PROBE_S = 0.25     # a look at the load before measuring
PAUSE_S = 1.0      # a busy look waits this long for a passing job, then looks again


@dataclass(frozen=True)
class Sample:
    busy: int     # busy ticks of our CPUs, every process
    own: int      # this process's ticks (user + system, all threads)
    cpus: int     # how many CPUs ``busy`` covers


def parse_proc_stat(text: str, cpus: frozenset[int]) -> int | None:
    """Busy ticks (user nice system irq softirq steal) summed over ``cpus``; None when a CPU of
    ``cpus`` has no line (the file is not what we think it is)."""
    total, seen = 0, 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        v = [int(x) for x in rest.split()[:8]]
        if len(v) < 8:
            return None
        total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        seen += 1
    return total if seen == len(cpus) else None


def parse_self_stat(text: str) -> int:
    """utime + stime from /proc/self/stat (fields 14 and 15; the command name may hold spaces)."""
    fields = text.rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # fields[0] is field 3 (state)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return None


def sample() -> Sample | None:
    """Now, for the CPUs this process may run on; None off Linux or when /proc is unreadable."""
    try:
        cpus = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    stat, own = _read("/proc/stat"), _read("/proc/self/stat")
    busy = parse_proc_stat(stat, cpus) if stat is not None else None
    if busy is None or own is None:
        return None
    try:
        return Sample(busy, parse_self_stat(own), len(cpus))
    except (IndexError, ValueError):
        return None


def others_share(a: Sample | None, b: Sample | None, elapsed_s: float, threads: int | None = None,
                 hz: float | None = None) -> float | None:
    """The share (0..1) of the CPUs that ``threads`` threads (None: one per CPU) need that other
    processes used between samples ``a`` and ``b`` (module docstring)."""
    if a is None or b is None or elapsed_s <= 0 or a.cpus != b.cpus:
        return None
    hz = hz or os.sysconf("SC_CLK_TCK")
    t = min(threads or a.cpus, a.cpus)
    others = ((b.busy - a.busy) - (b.own - a.own)) / (elapsed_s * hz)  # in CPUs
    return min(1.0, max(0.0, (others - (a.cpus - t)) / t))


@dataclass
class Watch:
    others: float | None = None  # set when the block ends: the share other processes used


@contextmanager
def watch(threads: int | None = None) -> Iterator[Watch]:
    """``with watch(T) as w: ...`` then ``w.others``: what other processes took meanwhile of the
    CPUs that T threads need (None: every CPU of our affinity)."""
    w, a, t0 = Watch(), sample(), time.monotonic()
    try:
        yield w
    finally:
        w.others = others_share(a, sample(), time.monotonic() - t0, threads)


def timed_quietly(run: Callable[[], T], one_thread: Callable[[], T] | None, busy: float = BUSY,
                  probe_s: float = PROBE_S, pause_s: float = PAUSE_S,
                  watcher: Callable[[], ContextManager[Watch]] = watch) -> tuple[T, float | None]:
    """``run()`` (a measurement on the process's thread team) where the CPUs are quiet, else
    ``one_thread()`` (the same on one thread; None: there is no other); with the share of our
    CPUs other processes used during the measurement that is returned (None: unknown)::

        look (probe_s) --busy--> wait pause_s, look again --busy--------------+
             |quiet                   |quiet                                   v
             +------------------------+--> run() --contended meanwhile--> one_thread()
                                               |quiet
                                               v  its result

    Beside a busy job a team's calls wait at every barrier for a descheduled thread (the
    scheduler is what gets timed); one thread's calls mostly run between two preemptions."""
    share = _look(watcher, probe_s)
    if contended(share, busy):
        time.sleep(pause_s)
        share = _look(watcher, probe_s)
    if not contended(share, busy) or one_thread is None:
        with watcher() as w:
            out = run()
        if not contended(w.others, busy) or one_thread is None:
            return out, w.others
    with watcher() as w:
        out = one_thread()
    return out, w.others


def contended(share: float | None, busy: float = BUSY) -> bool:
    """Whether a measured share (None: unknown) is above ``busy``."""
    return share is not None and share > busy


def _look(watcher: Callable[[], ContextManager[Watch]], seconds: float) -> float | None:
    with watcher() as w:
        time.sleep(seconds)
    return w.others
