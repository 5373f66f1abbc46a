"""Flash queries over HTTP: registration routes, flash_ready over SSE and WebSocket in
version order, flash hits without model work, and the response cache mark."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from streamkv.client import Client
from tests.server_harness import ServerProcess, idle_steps, metric

Q1, Q2 = "What is the latest reading?", "Is it rising?"


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--kv-cache-memory", str(256 << 20), "--response-cache-entries", "16")
    yield proc
    assert proc.stop() == 0


def _wait(pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def test_flash_routes_events_and_hits(server):
    from websockets.sync.client import connect

    with Client(server.url) as c:
        info = c.request("POST", "/v1/sessions", json={"system": "Sensor log.", "retention_tokens": 800,
                                                        "flash": [{"question": Q1, "max_tokens": 10}]})
        sid = info["id"]
        assert [q["question"] for q in info["flash_questions"]] == [Q1]
        reg = c.request("POST", f"/v1/sessions/{sid}/flash", json={"question": Q2, "max_tokens": 6})
        assert reg["id"].startswith("fq_")
        sse: list[dict] = []

        def listen() -> None:
            for ev in c.session(sid).events(timeout=120):
                sse.append(ev)
                if ev["event"] == "flash_ready" and ev["data_version"] == 5 and ev["question"] == Q2:
                    return

        t = threading.Thread(target=listen, daemon=True)
        t.start()
        time.sleep(0.5)
        ws_events: list[dict] = []
        with connect(server.url.replace("http", "ws") + f"/v1/sessions/{sid}/ws") as ws:
            for i in range(5):  # faster than evaluation: some versions are skipped
                ws.send(json.dumps({"type": "push", "records": [f"reading {i}: {i * 3}"]}))
            deadline = time.monotonic() + 120
            while not any(e.get("event") == "flash_ready" and e["data_version"] == 5 and e["question"] == Q2
                          for e in ws_events):
                frame = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
                if frame["type"] == "event":
                    ws_events.append(frame)
        t.join(60)
        for events in (sse, ws_events):
            flash = [e for e in events if e["event"] == "flash_ready"]
            for q in (Q1, Q2):
                versions = [e["data_version"] for e in flash if e["question"] == q]
                assert versions == sorted(set(versions)) and versions[-1] == 5
            assert [e["data_version"] for e in flash] == sorted(e["data_version"] for e in flash)
            assert set(flash[0]) >= {"question_id", "question", "answer", "confidence", "data_version"}
        sess = c.session(sid)
        _wait(lambda: sess.stats()["data_version"] == 5)
        hit = sess.query(Q1, max_tokens=10)
        assert hit.source == "flash" and hit.data_version == 5 and hit.usage["computed_prompt_tokens"] == 0
        last = [e for e in sse if e["event"] == "flash_ready" and e["question"] == Q1][-1]
        assert hit.answer == last["answer"]
        plain = sess.query("Tell me the latest reading.", max_tokens=10)
        assert plain.source == "session"
        listing = c.request("GET", f"/v1/sessions/{sid}/flash")
        assert len(listing["data"]) == 2 and listing["stats"]["pending"] <= 2
        assert listing["data"][0]["latest"]["data_version"] == 5
        c.request("DELETE", f"/v1/sessions/{sid}/flash/{reg['id']}")
        assert len(c.request("GET", f"/v1/sessions/{sid}/flash")["data"]) == 1
        for bad in ({"question": ""}, {"question": Q1}, {"question": "x", "max_tokens": 0}, {"max_tokens": 3}):
            assert httpx.post(server.url + f"/v1/sessions/{sid}/flash", json=bad).status_code == 400
        assert httpx.delete(server.url + f"/v1/sessions/{sid}/flash/fq_nope").status_code == 400
        assert httpx.post(server.url + "/v1/sessions/sess_nope/flash", json={"question": "x"}).status_code == 404
        sess.delete()


def test_flash_hit_needs_no_model_step(server):
    """A flash hit is answered from the cache without the engine: 30 hits run no model step
    (asserted in steps, not seconds: machines differ; the benchmark reports latency)."""
    with Client(server.url) as c:
        sess = c.create_session(system="Log.", retention_tokens=500, flash=[{"question": Q1, "max_tokens": 6}])
        sess.push(["reading 1: 10"])
        # the pushed version's answer, not version 0's (the system prompt alone): a query while
        # version 1's batch ran waited for it, no hit, and the step count moved (a loaded CPU's
        # slow step passed for idle)
        _wait(lambda: (c.request("GET", f"/v1/sessions/{sess.id}/flash")["data"][0]["latest"] or {})
              .get("data_version") == 1)
        steps, hits = idle_steps(server.url), metric(server.url, "streamkv_flash_hits_total")
        for _ in range(30):
            answer = sess.query(Q1, max_tokens=6)
            assert answer.source == "flash" and answer.usage["computed_prompt_tokens"] == 0
        assert metric(server.url, "streamkv_flash_hits_total") == hits + 30
        assert metric(server.url, "streamkv_engine_steps_total") == steps, "a flash hit ran a model step"
        sess.delete()


def test_response_cache_marks_hits(server):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    again = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert "cached" not in first and again["cached"] is True
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    metrics = httpx.get(server.url + "/metrics").text
    assert "streamkv_response_cache_hits_total 1.0" in metrics


def test_a_flash_question_with_a_response_format_answers_in_it(server):
    pytest.importorskip("xgrammar")
    choice = {"guided_choice": ["rising", "falling", "flat"]}
    with Client(server.url) as c:
        info = c.request("POST", "/v1/sessions", json={"system": "Sensor log.", "retention_tokens": 400,
                                                        "flash": [{"question": "Trend?", "max_tokens": 6, **choice}]})
        sid = info["id"]
        assert info["flash_questions"][0]["guided"]["kind"] == "choice"
        schema = {"type": "object", "properties": {"last": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["last"]}
        c.request("POST", f"/v1/sessions/{sid}/flash", json={"question": "Last reading?", "max_tokens": 20,
                                                              "guided_json": schema})
        sess = c.session(sid)
        sess.push([f"reading {i}: {i * 3}" for i in range(4)])
        _wait(lambda: all(q.get("latest") and q["latest"]["data_version"] == 1
                          for q in c.request("GET", f"/v1/sessions/{sid}/flash")["data"]))
        answers = {q["question"]: q["latest"]["answer"] for q in c.request("GET", f"/v1/sessions/{sid}/flash")["data"]}
        assert answers["Trend?"] in ("rising", "falling", "flat")
        assert set(json.loads(answers["Last reading?"])) == {"last"}
        bad = httpx.post(server.url + f"/v1/sessions/{sid}/flash", json={"question": "y", "guided_regex": "(ab"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
        sess.delete()
