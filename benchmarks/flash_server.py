"""HTTP plumbing of the flash-query benchmark: a `streamkv serve` subprocess, a keep-alive
client with timed queries, per-session SSE listeners and an engine-idle wait.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from common import REPO, wait_http_ok  # benchmarks/ is on sys.path (flash_queries.py puts it there)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m streamkv.cli serve` on 127.0.0.1:port, log in `log_path`."""

    def __init__(self, port: int, args: list[str], log_path: Path, timeout: float = 300.0) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "streamkv.cli", "serve", "--port", str(port), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        if wait_http_ok(self.proc, self.url + "/health", timeout, f"server (log: {self.log_path})"):
            return
        self.stop()
        raise RuntimeError(f"server did not become ready in {timeout:.0f} s; log: {self.log_path}")

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


# --------------------------------------------------------------------------- client
@dataclass
class Timed:
    """One timed query: client round trip (ms) and the server's answer."""

    ms: float
    body: dict[str, Any]

    @property
    def source(self) -> str:
        return self.body.get("source", "?")

    @property
    def server_ms(self) -> float:
        return float(self.body.get("latency_ms") or 0.0)


class Api:
    """Persistent (keep-alive) HTTP client: connection setup is not in the timings."""

    def __init__(self, url: str, timeout: float = 300.0) -> None:
        self.http = httpx.Client(base_url=url, timeout=timeout)

    def call(self, method: str, path: str, **kw: Any) -> Any:
        r = self.http.request(method, path, **kw)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path} -> HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def create_session(self, spec: dict[str, Any]) -> str:
        return self.call("POST", "/v1/sessions", json=spec)["id"]

    def delete_session(self, sid: str) -> None:
        self.call("DELETE", f"/v1/sessions/{sid}")

    def push(self, sid: str, records: list[str]) -> int:
        return int(self.call("POST", f"/v1/sessions/{sid}/data", json={"records": records})["data_version"])

    def query(self, sid: str, question: str, max_tokens: int) -> Timed:
        body = {"question": question, "max_tokens": max_tokens, "temperature": 0.0}
        t0 = time.perf_counter()
        r = self.http.post(f"/v1/sessions/{sid}/query", json=body)
        ms = (time.perf_counter() - t0) * 1e3
        if r.status_code >= 400:
            raise RuntimeError(f"query -> HTTP {r.status_code}: {r.text[:500]}")
        return Timed(ms, r.json())

    def stats(self, sid: str) -> dict[str, Any]:
        return self.call("GET", f"/v1/sessions/{sid}")

    def flash(self, sid: str) -> dict[str, Any]:
        return self.call("GET", f"/v1/sessions/{sid}/flash")

    def tokenize(self, **body: Any) -> list[int]:
        return self.call("POST", "/tokenize", json=body)["tokens"]

    def detokenize(self, ids: list[int]) -> str:
        return self.call("POST", "/detokenize", json={"tokens": ids})["prompt"]

    def metric(self, name: str, text: str | None = None) -> float | None:
        """A sample value without labels from /metrics (Prometheus text; ``text``: a scrape
        already read)."""
        text = self.http.get("/metrics").text if text is None else text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def busy_s(self) -> float:
        return self.metric("streamkv_engine_busy_seconds_total") or 0.0

    def wait_idle(self, quiet_s: float = 0.15, poll_s: float = 0.03, timeout: float = 300.0) -> float:
        """Until streamkv_engine_busy_seconds stops moving for quiet_s (no model step ran):
        ingestion, ready forks and flash batches are all done. Returns the busy value."""
        deadline = time.monotonic() + timeout
        last, since = self.busy_s(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(poll_s)
            cur = self.busy_s()
            if cur != last:
                last, since = cur, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return cur
        raise TimeoutError("the engine did not go idle")

    def close(self) -> None:
        self.http.close()


# --------------------------------------------------------------------------- events
@dataclass
class Event:
    t: float  # time.perf_counter() at arrival
    kind: str
    data: dict[str, Any] = field(default_factory=dict)


class EventLog:
    """Every SSE event of one session, stamped on arrival, in a background thread."""

    def __init__(self, url: str, sid: str) -> None:
        self.url, self.sid = url, sid
        self.events: list[Event] = []
        self.cond = threading.Condition()
        self.subscribed = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if not self.subscribed.wait(30):
            raise RuntimeError(f"could not subscribe to the events of {sid}")

    def _run(self) -> None:
        kind = ""
        try:
            with httpx.Client(base_url=self.url, timeout=httpx.Timeout(10.0, read=None)) as http:
                with http.stream("GET", f"/v1/sessions/{self.sid}/events") as resp:
                    for line in resp.iter_lines():
                        self.subscribed.set()
                        if line.startswith("event:"):
                            kind = line[6:].strip()
                        elif line.startswith("data:"):
                            self._add(Event(time.perf_counter(), kind, json.loads(line[5:].strip())))
                            if kind == "deleted":
                                return
        except httpx.HTTPError:
            pass
        finally:
            self.subscribed.set()

    def _add(self, ev: Event) -> None:
        with self.cond:
            self.events.append(ev)
            self.cond.notify_all()

    def wait_for(self, pred: Callable[[list[Event]], Any], timeout: float = 300.0) -> Any:
        """Block until pred(events) is truthy; returns its value."""
        with self.cond:
            value = self.cond.wait_for(lambda: pred(self.events), timeout)
        if not value:
            raise TimeoutError(f"session {self.sid}: the awaited event did not come in {timeout:.0f} s")
        return value

    def first(self, kind: str, version: int, question: str | None = None) -> Event | None:
        for ev in self.events:
            if ev.kind == kind and ev.data.get("data_version", -1) >= version and \
                    (question is None or ev.data.get("question") == question):
                return ev
        return None

    def data_updated(self, version: int, timeout: float = 300.0) -> Event:
        return self.wait_for(lambda _: self.first("data_updated", version), timeout)

    def flash_ready(self, version: int, questions: list[str], timeout: float = 300.0) -> list[Event]:
        """The flash_ready events of every question at `version` (or later)."""
        def done(_: list[Event]) -> list[Event] | None:
            evs = [self.first("flash_ready", version, q) for q in questions]
            return evs if all(evs) else None
        return self.wait_for(done, timeout)

    def join(self, timeout: float = 5.0) -> None:
        self.thread.join(timeout)
