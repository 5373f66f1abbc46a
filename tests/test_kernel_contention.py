"""Kernel measurements beside other load (native/contention.py, native/tuning.py): what other
processes use of our CPUs is seen, a busy machine is measured on one thread, and a choice made
beside a busy job is cached flagged, warned about and shown; a stalled call does not move a time."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch

from streamkv.engine.info import render
from streamkv.native import contention, invariant_gemm, kernel_bench, tuning
from streamkv.native.contention import Sample, Watch, others_share, parse_proc_stat, parse_self_stat, timed_quietly
from streamkv.native.tuning import ModelShapes, choose, runnable

PROC_STAT = """cpu  900 0 300 5000 10 0 0 0 0 0
cpu0 100 1 20 1000 5 3 4 7 0 0
cpu1 400 0 100 900 1 0 0 0 0 0
cpu2 10 20 30 40 50 60 70 80 0 0
intr 12345 0 0
"""


def test_busy_ticks_are_summed_over_our_cpus_only():
    # user nice system (idle iowait skipped) irq softirq steal
    assert parse_proc_stat(PROC_STAT, frozenset({0, 2})) == (100 + 1 + 20 + 3 + 4 + 7) + (10 + 20 + 30 + 60 + 70 + 80)
    assert parse_proc_stat(PROC_STAT, frozenset({1})) == 500
    assert parse_proc_stat(PROC_STAT, frozenset({0, 3})) is None  # a CPU without a line: not this format


def test_own_ticks_are_utime_plus_stime_whatever_the_command_name():
    fields = ["S"] + [str(i) for i in range(4, 60)]  # fields 3.. ; utime is field 14, stime 15
    assert parse_self_stat("4242 (py thon) x) " + " ".join(fields)) == 14 + 15


def test_the_others_share_excludes_this_process_and_is_clipped():
    a = Sample(busy=1000, own=100, cpus=2)
    assert others_share(a, Sample(1100, 150, 2), 1.0, hz=100) == pytest.approx(0.25)  # 50 of 200 ticks
    assert others_share(a, Sample(1100, 200, 2), 1.0, hz=100) == 0.0  # all of it was ours
    assert others_share(a, Sample(1500, 100, 2), 1.0, hz=100) == 1.0  # (tick rounding past capacity)
    assert others_share(None, a, 1.0) is None and others_share(a, Sample(1, 1, 4), 1.0) is None


def test_only_what_others_leave_short_of_our_threads_counts():
    # 8 CPUs, 1 s at 100 ticks/s; others keep 6 of them busy (600 ticks)
    a, b = Sample(busy=0, own=0, cpus=8), Sample(busy=600, own=0, cpus=8)
    assert others_share(a, b, 1.0, threads=2, hz=100) == 0.0             # 2 idle CPUs for 2 threads
    assert others_share(a, b, 1.0, threads=4, hz=100) == pytest.approx(0.5)  # 4 threads find 2
    assert others_share(a, b, 1.0, hz=100) == pytest.approx(0.75)        # one thread per CPU: 6 of 8
    assert others_share(a, b, 1.0, threads=16, hz=100) == pytest.approx(0.75)  # (capped at the CPUs)


@pytest.mark.skipif(contention.sample() is None, reason="no /proc/stat with per-CPU lines (not Linux)")
def test_a_busy_sibling_on_our_cpus_is_seen_and_our_own_work_is_not():
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    try:
        time.sleep(0.3)
        with contention.watch() as busy:
            time.sleep(1.0)
    finally:
        for p in burners:
            p.kill()
            p.wait()
    assert busy.others is not None and busy.others > 0.5  # one burner per CPU while we slept
    with contention.watch() as own:
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            pass
    assert own.others is not None and own.others < 0.5  # our own spinning is not "others"


def _watcher(shares: list[float | None]):
    it = iter(shares)

    @contextmanager
    def watch():
        w = Watch()
        yield w
        w.others = next(it)
    return watch


@pytest.mark.parametrize("shares, ran, share", [
    ([0.0, 0.02], ["team"], 0.02),                  # quiet: the team's measurement
    ([0.6, 0.0, 0.01], ["team"], 0.01),             # a passing job: gone a second later
    ([0.6, 0.5, 0.55], ["one"], 0.55),              # a job that stays: one thread, not the team
    ([0.0, 0.4, 0.6], ["team", "one"], 0.6),        # busy from the middle of the team's run
    ([None, None], ["team"], None),                 # no /proc: nothing to go by
], ids=["quiet", "passing", "lasting", "starting", "unknown"])
def test_a_busy_machine_is_measured_on_one_thread(shares, ran, share):
    calls: list[str] = []
    out = timed_quietly(lambda: calls.append("team") or "team", lambda: calls.append("one") or "one",
                        busy=0.15, probe_s=0, pause_s=0, watcher=_watcher(shares))
    assert calls == ran and out == (ran[-1], share)


def test_without_a_second_thread_a_busy_machine_still_measures():
    calls: list[str] = []
    out = timed_quietly(lambda: calls.append("team") or "team", None, probe_s=0, pause_s=0,
                        watcher=_watcher([0.6, 0.5, 0.45]))
    assert calls == ["team"] and out == ("team", 0.45)


def test_a_stalled_call_does_not_move_a_candidates_time(monkeypatch):
    # a virtual clock: every call takes 1 ms, but every fourth 10 ms (a descheduled thread held
    # the OpenMP team up): the mean of a run would say 3.25 ms, the median of its calls says 1
    clock, calls = [0.0], [0]

    def work() -> None:
        calls[0] += 1
        clock[0] += 0.010 if calls[0] % 4 == 0 else 0.001

    monkeypatch.setattr(kernel_bench.time, "perf_counter", lambda: clock[0])
    assert kernel_bench._best_each({"a": work}) == {"a": pytest.approx(1.0)}


@pytest.mark.skipif(invariant_gemm() is None, reason="no C compiler: the native kernels are not built")
def test_a_choice_made_beside_a_busy_job_is_cached_flagged_warned_and_cleared_by_a_quiet_retune(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    shapes = ModelShapes(hidden=64, inter=128, heads=4, kv_heads=2, head_dim=16, vocab=384, layers=2,
                         numerics="invariant", bf16=True, q4=False, q8_head=False)
    paths = runnable(shapes)
    if len(paths["attention"]) < 2:
        pytest.skip(f"attention has one path on this CPU ({paths['attention']}): nothing to choose")
    forced = {k: p[0] for k, p in paths.items() if k != "attention"}
    timings = {"f32": {"decode x1": 1.0}, "bf16": {"decode x1": 2.0}, "amx": {"decode x1": 3.0},
               "bf16f": {"decode x1": 4.0}}
    threads = []  # torch's thread count at each measurement
    monkeypatch.setattr(kernel_bench, "measure",
                        lambda k, s, chosen: threads.append(torch.get_num_threads()) or {p: timings[p] for p in paths[k]})
    share = [0.6]
    monkeypatch.setattr(tuning, "timed_quietly", lambda run, one, **kw: ((one or run)(), share[0]))
    team = torch.get_num_threads()
    first = choose(shapes, forced)
    assert first.paths["attention"] == "f32" and first.busy == {"attention": 0.6}
    # timed on one thread (where the process has more), then back to the team
    assert threads == [1] and torch.get_num_threads() == team
    assert "measured beside other load: 60% of the CPUs" in first.describe()
    (cached_file,) = [p for p in tmp_path.glob("kernels/*.json") if not p.name.startswith("last-")]
    assert json.loads(cached_file.read_text())["busy"] == {"attention": 0.6}
    with caplog.at_level(logging.WARNING, logger="streamkv.native.tuning"):
        again = choose(shapes, forced)
    assert again.source["attention"] == "cached" and again.busy == {"attention": 0.6}
    assert "measured while other processes used the CPUs (attention 60%)" in caplog.text
    share[0] = 0.01  # a quiet retune: no flag
    monkeypatch.setattr(tuning, "timed_quietly", lambda run, one, **kw: (run(), share[0]))
    assert choose(shapes, forced, retune=True).busy == {} and choose(shapes, forced).busy == {}


def test_info_shows_a_choice_made_beside_other_load():
    report = {"cpu": "x", "cores": 2, "flags": [], "torch": "2", "threads": 2, "native": {"built": False},
              "model": "m", "dtype": "bfloat16", "numerics": "invariant", "timings_ms": {},
              "kernels": {"attention": {"path": "f32", "how": "cached", "packed_rows": 0, "busy_others": 0.63},
                          "gemm": {"path": "amx", "how": "cached", "packed_rows": 0, "busy_others": None}}}
    text = render(report)
    assert "attention          f32     (cached; measured beside other load: 63% of the CPUs, --retune when quiet)" in text
    assert "gemm               amx     (cached)" in text
