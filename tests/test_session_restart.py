"""Acceptance 5: with --session-dir, sessions and acknowledged data survive SIGTERM and
SIGKILL, and answer the same question identically afterwards; offload/restore is exact."""
from __future__ import annotations

import signal
import time

import pytest

from streamkv import LLM, SamplingParams
from streamkv.client import Client
from tests.server_harness import ServerProcess

QUESTION = "What is the latest reading?"


def _serve(session_dir: str) -> ServerProcess:
    return ServerProcess("--session-dir", session_dir, "--kv-cache-memory", str(128 << 20),
                         "--checkpoint-idle-s", "0.2")


def _wait_version(sess, version: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while sess.stats()["data_version"] < version:
        if time.monotonic() > deadline:
            raise AssertionError("not ingested")
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_session_survives_a_restart(tmp_path, sig):
    proc = _serve(str(tmp_path))
    try:
        with Client(proc.url) as c:
            sess = c.create_session(system="You track readings.", retention_tokens=120, evict_tokens=40)
            for i in range(12):
                sess.push([f"reading {i}: {10 + 3 * i} units", f"note {i}: stable"])
            _wait_version(sess, 12)
            before = sess.query(QUESTION, max_tokens=16)
            stats = sess.stats(include_tokens=True)
            assert stats["evictions"] > 0
            time.sleep(1.0)  # idle: the KV snapshot is written
    finally:
        code = proc.stop(sig=sig)
    assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    proc = _serve(str(tmp_path))
    try:
        with Client(proc.url) as c:
            sess = c.session(sess.id)
            after_stats = sess.stats(include_tokens=True)
            assert after_stats["data_version"] == 12
            after = sess.query(QUESTION, max_tokens=16)
            assert after.answer == before.answer and after.data_version == before.data_version
            assert after_stats["layout"]["stream_ids"] is None or \
                after_stats["layout"]["stream_ids"] == stats["layout"]["stream_ids"]
            assert sess.stats(include_tokens=True)["layout"]["stream_ids"] == stats["layout"]["stream_ids"]
            assert after_stats["records"]["evicted"] == stats["records"]["evicted"]
            sess.push(["reading 12: 46 units"])
            _wait_version(sess, 13)
    finally:
        assert proc.stop() == 0


def test_acknowledged_but_unsnapshotted_pushes_are_replayed(tmp_path):
    """SIGKILL right after pushes are acknowledged (before any KV snapshot): the push log
    re-ingests them; the session reaches the same data version and layout."""
    proc = ServerProcess("--session-dir", str(tmp_path), "--kv-cache-memory", str(128 << 20),
                         "--checkpoint-idle-s", "3600")
    try:
        with Client(proc.url) as c:
            sess = c.create_session(system="Log.", retention_tokens=2000)
            for i in range(5):
                assert sess.push([f"event {i} happened"])["data_version"] == i + 1
            _wait_version(sess, 5)
            before = sess.stats(include_tokens=True)["layout"]["stream_ids"]
    finally:
        proc.stop(sig=signal.SIGKILL)
    proc = ServerProcess("--session-dir", str(tmp_path), "--kv-cache-memory", str(128 << 20))
    try:
        with Client(proc.url) as c:
            sess = c.session(sess.id)
            _wait_version(sess, 5)
            assert sess.stats(include_tokens=True)["layout"]["stream_ids"] == before
    finally:
        assert proc.stop() == 0


def test_offload_to_host_and_disk_restores_exactly(tmp_path):
    llm = LLM(dtype="float32", session_dir=str(tmp_path), host_offload_bytes=0)
    engine = llm.engine
    s = llm.session("Facts.", retention_tokens=500)
    s.push(["the sky is green today", "the grass is blue"])
    s.ingest()
    params = SamplingParams(max_tokens=12, temperature=0)
    first = s.query("What color is the sky?", max_tokens=12)
    session = engine.sessions.get(s.id)
    engine.sessions.offload.offload(session)
    assert session.where == "disk" and session.stream is None  # host budget 0: spilled to disk
    assert s.stats()["kv"]["where"] == "disk"
    events = [e["event"] for e in s.events()]
    assert "offloaded" in events
    again = s.query("What color is the sky?", max_tokens=12)
    assert again.answer == first.answer and again.token_ids == first.token_ids
    assert session.where == "pool"
    engine.check_integrity()
    del params
