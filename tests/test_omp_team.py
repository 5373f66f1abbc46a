"""One OpenMP team per process (``native/omp.py``): the thread that built the engine hands its
worker threads back when the engine thread takes over (``AsyncEngine.start``). Timing lives in
``benchmarks/engine_thread.py``; here the mechanism: the team's threads exist, then do not."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from streamkv.engine.async_engine import AsyncEngine
from streamkv.native import omp


def _tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _gone(tids: set[str]) -> bool:
    for _ in range(100):  # workers leave asynchronously
        if not tids & _tids():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.skipif(omp._libgomp() is None, reason="no libgomp with omp_pause_resource_all in this process")
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to count threads")
def test_a_thread_hands_its_openmp_workers_back_and_gets_new_ones_when_it_computes_again():
    def parallel_region() -> None:
        a = torch.randn(512, 512)
        (a @ a).sum()

    out: list[object] = []

    def worker() -> None:  # a fresh thread: its own team, whatever the test process did before
        before = _tids()
        parallel_region()
        team = _tids() - before          # its team's worker(s) (other threads may come and go)
        out.append(len(team))
        assert omp.release_thread_team()
        out.append(_gone(team))
        before = _tids()
        parallel_region()
        out.append(len(_tids() - before))  # a new team: the call changed only who waits

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of at least one worker, on any machine
    try:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(threads)
    assert out[0] >= 1 and out[1] is True and out[2] >= 1, out


def test_starting_the_engine_thread_releases_the_builders_team(monkeypatch):
    from tests.fakes import fake_engine

    calls: list[str] = []
    monkeypatch.setattr("streamkv.engine.async_engine.release_thread_team",
                        lambda: calls.append(threading.current_thread().name) or True)
    engine = AsyncEngine(fake_engine()[0])
    assert calls == []
    engine.start()
    try:
        assert calls == [threading.current_thread().name]  # the builder's thread, before the engine's starts
    finally:
        engine.shutdown(timeout=0.1)
