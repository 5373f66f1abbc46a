"""The Ray Serve cluster end to end (2 replicas of the embedded model, 1 thread each, one
shared session dir): same answers as one server, stable ownership, forced migration with
SSE and WebSocket subscriptions kept, a killed replica's sessions recovered with every
acknowledged push, stateless traffic served through the failure."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from streamkv.client import Client
from tests.server_harness import ServerProcess, free_port

ray = pytest.importorskip("ray", reason="the cluster needs Ray Serve: pip install 'streamkv[cluster]'")

ENGINE = {"kv_cache_memory": 128 << 20, "checkpoint_idle_s": 0.2}
SPEC = {"system": "You track readings.", "retention_tokens": 400}
QUESTION = "What is the latest reading?"
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from streamkv.cluster import serve_app
    from streamkv.cluster.config import ClusterConfig
    from streamkv.server.config import ServerConfig

    opts = {**ENGINE, "session_dir": str(tmp_path_factory.mktemp("shared-sessions"))}
    # rebalance when a replica's pool is over 55% full (test_overload_moves_the_biggest_session)
    config = ClusterConfig(replicas=2, poll_interval_s=0.1, rebalance_kv_free=0.45, rebalance_interval_s=1.0)
    url = serve_app.start(config, opts, ServerConfig(port=free_port()))
    yield url
    serve_app.shutdown()


@pytest.fixture(scope="module")
def single():
    """One plain server with the replicas' flags (1 thread): the reference answers."""
    proc = ServerProcess("--kv-cache-memory", str(ENGINE["kv_cache_memory"]), "--threads", "1")
    yield proc.url
    proc.stop()


def _owned_by(replica: str, prefix: str) -> str:
    """A session id whose hash-ring owner is ``replica``."""
    from streamkv.cluster.ring import HashRing

    ring = HashRing(["replica-0", "replica-1"])
    return next(f"{prefix}-{i:04d}" for i in range(1000) if ring.lookup(f"{prefix}-{i:04d}") == replica)


def _fill(client: Client, session_id: str | None, n: int) -> tuple[object, list[dict]]:
    sess = client.create_session(**SPEC, **({"id": session_id} if session_id else {}))
    acks = [sess.push([f"reading {i}: {10 + 3 * i} units"]) for i in range(n)]
    return sess, acks


def _wait_version(sess, version: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            stats = sess.stats()
            if stats["data_version"] >= version:
                return stats
        except Exception:  # 503 while it moves: retryable by contract
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"version {version} not reached")
        time.sleep(0.1)


def _collect(sess, events: list[dict]) -> None:
    try:
        for e in sess.events(timeout=60):
            events.append(e)
    except httpx.HTTPError:
        pass  # the client closed at the end of the test


def _replica_of(client: Client, session_id: str) -> str:
    return next(s["replica"] for s in client.list_sessions() if s["id"] == session_id)


def test_same_answers_as_one_server(cluster, single):
    with Client(cluster) as c, Client(single) as one:
        for prompt in ("The capital of France is", "def fibonacci(n):", "Three colours are"):
            body = {**COMPLETION, "prompt": prompt}
            via = c.request("POST", "/v1/completions", json=body)["choices"][0]["text"]
            assert via == one.request("POST", "/v1/completions", json=body)["choices"][0]["text"]
        chat = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 10, "temperature": 0}
        assert c.request("POST", "/v1/chat/completions", json=chat)["choices"][0]["message"] == \
            one.request("POST", "/v1/chat/completions", json=chat)["choices"][0]["message"]
        ours, _ = _fill(c, None, 6)
        ref, _ = _fill(one, None, 6)
        _wait_version(ours, 6)
        _wait_version(ref, 6)
        assert ours.query(QUESTION, max_tokens=12).answer == ref.query(QUESTION, max_tokens=12).answer
        served = {r["name"]: r for r in c.request("GET", "/v1/cluster")["replicas"]}
        assert set(served) == {"replica-0", "replica-1"} and all(r["live"] for r in served.values())


def test_ownership_is_stable_and_follows_the_ring(cluster):
    with Client(cluster) as c:
        for replica in ("replica-0", "replica-1"):
            sid = _owned_by(replica, f"own-{replica}")
            sess, _ = _fill(c, sid, 2)
            for _ in range(3):
                sess.push(["again"])
                assert _replica_of(c, sid) == replica
        with pytest.raises(Exception, match="409"):
            c.create_session(**SPEC, id=_owned_by("replica-0", "own-replica-0"))


def test_forced_migration_keeps_version_answer_and_subscriptions(cluster):
    with Client(cluster) as c:
        sess, acks = _fill(c, _owned_by("replica-0", "move"), 8)
        c.request("POST", f"/v1/sessions/{sess.id}/flash", json={"question": "How many readings?", "max_tokens": 8})
        _wait_version(sess, 8)
        before = sess.query(QUESTION, max_tokens=12)
        events: list[dict] = []
        sse = threading.Thread(target=_collect, args=(sess, events), daemon=True)
        sse.start()
        ws_frames: list[dict] = []
        from websockets.sync.client import connect

        ws = connect(cluster.replace("http", "ws") + f"/v1/sessions/{sess.id}/ws")  # noqa: SIM115
        time.sleep(0.5)
        moved = sess.migrate()
        assert (moved["from"], moved["to"], moved["data_version"]) == ("replica-0", "replica-1", 8)
        assert _replica_of(c, sess.id) == "replica-1"
        after = sess.query(QUESTION, max_tokens=12)
        assert (after.answer, after.data_version) == (before.answer, before.data_version)
        # the same WebSocket, now relayed to replica-1: a push is acknowledged and logged there
        ws.send(json.dumps({"type": "push", "records": ["reading 8: 34 units"]}))
        deadline = time.monotonic() + 30
        while not any(f.get("type") == "ack" for f in ws_frames) and time.monotonic() < deadline:
            ws_frames.append(json.loads(ws.recv(timeout=30)))
        assert next(f for f in ws_frames if f["type"] == "ack")["data_version"] == 9
        ws.close()
        _wait_version(sess, 9)
        deadline = time.monotonic() + 30
        while not any(e["event"] == "flash_ready" and e["data_version"] == 9 for e in events):
            assert time.monotonic() < deadline, events  # the flash question moved with the session
            time.sleep(0.1)
        assert any(e["event"] == "data_updated" and e["data_version"] == 9 for e in events)
        kinds = [e["event"] for e in events]
        assert "migrated" in kinds and kinds.index("migrated") < len(kinds) - 1  # the one stream went on
        with pytest.raises(Exception, match="400"):
            sess.migrate(to="replica-1")  # already there
        with pytest.raises(Exception, match="400"):
            sess.migrate(to="replica-7")


def test_a_killed_replica_loses_no_acknowledged_record(cluster):
    """SIGKILL replica-0 right after acknowledged pushes: its sessions come back on replica-1
    from snapshot + log; stateless requests keep being served; Serve restarts replica-0."""
    with Client(cluster, timeout=60) as c:
        sess, acks = _fill(c, _owned_by("replica-0", "kill"), 6)
        _wait_version(sess, 6)
        time.sleep(0.5)  # idle: a snapshot at version 6
        acks += [sess.push([f"late {i}: {i} units"]) for i in range(4)]  # in the log only
        assert [a["data_version"] for a in acks] == list(range(1, 11))
        from streamkv.cluster.serve_app import local_replica_pid

        pid = local_replica_pid("replica-0")
        assert pid is not None, "no process titled as replica-0 on this node"
        os.kill(pid, signal.SIGKILL)
        statuses = [c.http.post("/v1/completions", json=COMPLETION).status_code for _ in range(3)]
        assert statuses == [200, 200, 200]  # refused connections are retried on replica-1
        assert _wait_version(sess, 10)["data_version"] == 10
        assert _replica_of(c, sess.id) == "replica-1"
        assert sess.query(QUESTION, max_tokens=12).data_version == 10
        metrics = httpx.get(cluster + "/metrics").text
        assert re.search(r"^streamkv_cluster_failovers_total [1-9]", metrics, re.M), metrics
        assert re.search(r"^streamkv_cluster_replica_down_total [1-9]", metrics, re.M), metrics


def test_a_replica_killed_mid_stream_ends_the_stream_with_a_retryable_error(cluster):
    """SSE generation relayed from a replica that dies: the tokens so far, then an error event
    (503, retry), never a truncated stream that looks finished or a wrong answer."""
    from streamkv.cluster.serve_app import local_replica_pid

    with Client(cluster) as c:
        _wait_all_live(c)
        body = {**COMPLETION, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with c.http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(x for x in lines if x.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"] is not None
            pid = local_replica_pid(resp.headers["x-streamkv-replica"])
            assert pid is not None, f"no process titled as {resp.headers['x-streamkv-replica']} on this node"
            os.kill(pid, signal.SIGKILL)
            rest = list(lines)
        assert "data: [DONE]" not in rest
        error = json.loads(next(x for x in rest if x.startswith("data: {\"error\"")).removeprefix("data: "))
        assert error["error"]["code"] == 503 and "retry" in error["error"]["message"]
        assert c.http.post("/v1/completions", json=COMPLETION).status_code == 200  # the other replica serves


def _wait_all_live(c: Client, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(r["live"] for r in c.request("GET", "/v1/cluster")["replicas"]):
        assert time.monotonic() < deadline, "a replica did not come (back) up"
        time.sleep(0.2)


def test_drain_input_streams_and_errors(cluster):
    with Client(cluster) as c:
        _wait_all_live(c)  # after the kill test, Serve restarts replica-0
        sess, _ = _fill(c, _owned_by("replica-1", "drain"), 3)
        _wait_version(sess, 3)
        out = c.request("POST", "/v1/cluster/replicas/replica-1/drain")
        assert sess.id in [m["id"] for m in out["moved"]] and all(m["to"] == "replica-0" for m in out["moved"])
        assert _replica_of(c, sess.id) == "replica-0" and sess.stats()["data_version"] == 3
        new = c.create_session(**SPEC, id=_owned_by("replica-1", "drain-new"))  # never on a draining replica
        assert _replica_of(c, new.id) == "replica-0"
        c.request("POST", "/v1/cluster/replicas/replica-1/undrain")
        with pytest.raises(Exception, match="409"):  # the last replica up cannot be drained
            c.request("POST", "/v1/cluster/replicas/replica-1/drain")
            c.request("POST", "/v1/cluster/replicas/replica-0/drain")
        c.request("POST", "/v1/cluster/replicas/replica-1/undrain")
        # a streaming input lives on the replica that opened it: every call finds it there
        http = c.http
        sid = http.post("/v1/input_streams", json={"prompt": "The capital of France", "max_tokens": 6,
                                                   "temperature": 0}).json()["id"]
        assert http.post(f"/v1/input_streams/{sid}/append", json={"text": " is"}).status_code == 200
        assert c.request("GET", "/v1/cluster")["input_streams"] == 1
        done = http.post(f"/v1/input_streams/{sid}/finish", json={"stream": False}).json()
        assert c.request("GET", "/v1/cluster")["input_streams"] == 0  # a finished stream is forgotten
        assert http.post(f"/v1/input_streams/{sid}/append", json={"text": "x"}).status_code == 409  # but closed
        from websockets.sync.client import connect

        ws_url = cluster.replace("http", "ws") + "/v1/input_streams/{}/ws"
        with connect(ws_url.format(sid)) as ws:  # a socket on it: the error frame and 4409, as on one server
            assert json.loads(ws.recv(timeout=30))["error"]["type"] == "conflict_error"
            with pytest.raises(Exception) as closed:
                ws.recv(timeout=30)
            assert closed.value.rcvd.code == 4409
        other = http.post("/v1/input_streams", json={"prompt": "The capital of Italy", "max_tokens": 4,
                                                     "temperature": 0}).json()["id"]
        with connect(ws_url.format(other)) as ws:  # finished over the socket: the ingress forgets it too
            ws.send(json.dumps({"type": "finish", "text": " is"}))
            while not json.loads(ws.recv(timeout=60)).get("finished"):
                pass
        deadline = time.monotonic() + 10
        while c.request("GET", "/v1/cluster")["input_streams"]:
            assert time.monotonic() < deadline, "a stream finished over a socket stayed routed"
            time.sleep(0.1)
        ref = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 6,
                                                 "temperature": 0}).json()
        assert done["choices"][0]["text"] == ref["choices"][0]["text"]
        assert http.post("/v1/input_streams/istr_nope/append", json={"text": "x"}).status_code == 404
        assert http.post("/v1/sessions/nope-not-here/migrate", json={}).status_code == 404
        assert http.post(f"/v1/sessions/{sess.id}/release").status_code == 404  # the ingress's own step only
        assert http.post(f"/v1/sessions/{sess.id}/adopt").status_code == 404
        assert http.post("/v1/sessions", content=b"{bad json").status_code == 400
        assert http.get("/v1/sessions/../../etc/passwd").status_code in (400, 404)


def test_overload_moves_a_session_to_the_emptier_replica(cluster):
    """Two sessions filling ~60% of replica-0's 128 MiB pool (the test cluster rebalances below
    45% free): one moves to replica-1, once; moving the other too would not help."""
    with Client(cluster) as c:
        _wait_all_live(c)
        sessions, versions = [], []
        for k in range(2):
            sess = c.create_session(system="You track readings.", retention_tokens=2400,
                                    id=_owned_by("replica-0", f"big{k}"))
            for i in range(0, 140, 20):
                recs = [f"reading {j}: sensor {j % 7} reports {j * 13 % 101} units" for j in range(i, i + 20)]
                version = sess.push(recs)["data_version"]
            sessions.append(sess)
            versions.append(version)
        deadline = time.monotonic() + 120
        while "replica-1" not in [_replica_of(c, s.id) for s in sessions]:
            assert time.monotonic() < deadline, c.request("GET", "/v1/cluster")
            time.sleep(0.5)
        for sess, version in zip(sessions, versions):
            assert _wait_version(sess, version)["data_version"] == version
        time.sleep(2.0)  # past the next rebalance window (1 s here): nothing moves back or on
        assert sorted(_replica_of(c, s.id) for s in sessions) == ["replica-0", "replica-1"]
        assert re.search(r"^streamkv_cluster_rebalances_total 1$", httpx.get(cluster + "/metrics").text, re.M)
        for sess in sessions:
            sess.delete()
