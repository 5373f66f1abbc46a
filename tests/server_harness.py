"""Starts a real ``streamkv serve`` subprocess on a free 127.0.0.1 port for tests."""
from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str, headers: dict[str, str] | None = None, where: str | None = None) -> float:
    """A Prometheus metric from the server's /metrics: its one unlabelled sample, or with ``where``
    (a label pair, e.g. ``status="499"``) the sum of its labelled samples that carry it (a route
    label may hold braces, ``{session_id}``: the labels are matched to the line's last ``}``)."""
    text = httpx.get(url + "/metrics", headers=headers).text
    if where is not None:
        return sum(float(v) for v in re.findall(rf"^{name}\{{.*{re.escape(where)}.*\}} (\S+)$", text, re.M))
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def busy(url: str, headers: dict[str, str] | None = None) -> float:
    """Requests running or waiting plus span queries in progress, as the engine holds them when
    /metrics is read (a server without span queries has no such gauge: 0)."""
    text = httpx.get(url + "/metrics", headers=headers).text
    names = ("streamkv_requests_running", "streamkv_requests_waiting", "streamkv_span_queries_running")
    return sum(float(m.group(1)) for n in names if (m := re.search(rf"^{n} (\S+)$", text, re.M)))


def assert_left_request_stopped(url: str, headers: dict[str, str] | None = None, settle_s: float = 1.5,
                                window_s: float = 1.5, max_steps: int = 8, timeout: float = 60.0) -> None:
    """After a client gave up on a long request (its route saw the disconnect): the abort goes
    through the engine within ``max_steps`` steps (0-2 measured; a request left running takes
    hundreds), nothing is left running or waiting, and the engine then takes no step for
    ``window_s``. Waiting for the gauges, not for ``settle_s`` alone: on a loaded 2-core machine a
    span query's abort, which reaches the engine after the step in flight and the executor's next
    turn, came after two slow first steps, 1.5 s after its 499."""
    steps = lambda: metric(url, "streamkv_engine_steps_total", headers)  # noqa: E731
    seen = steps()
    time.sleep(settle_s)
    deadline = time.monotonic() + timeout
    while busy(url, headers):
        assert time.monotonic() < deadline, "the abandoned request is still running"
        time.sleep(0.1)
    before = steps()
    assert before - seen <= max_steps, f"the abandoned request ran {before - seen:.0f} more steps"
    time.sleep(window_s)
    assert steps() == before, "the abandoned request kept running"


def abandon(url: str, path: str, body: dict, headers: dict[str, str] | None = None, timeout: float = 120.0,
            settle_s: float = 1.5, window_s: float = 1.5) -> None:
    """Posts ``body`` to ``path`` over a raw socket, closes the socket once the engine has stepped
    for it, then waits for the route to log a 499 and checks the engine stopped stepping.

    No wall-clock guess: the client leaves after the request is seen running, and the 499 proves
    the route aborted it rather than finishing it (a 200 here means the request was too short)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())

    def aborted() -> float:  # requests logged as 499 (client closed the request), any route
        return metric(url, "streamkv_requests_total", headers, where='status="499"')

    before_499, before = aborted(), metric(url, "streamkv_engine_steps_total", headers)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{head}"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    deadline = time.monotonic() + timeout
    while metric(url, "streamkv_engine_steps_total", headers) < before + 2:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.02)
    sock.close()
    while aborted() == before_499:
        assert time.monotonic() < deadline, "no 499 logged: the request finished before the client left"
        time.sleep(0.1)
    assert_left_request_stopped(url, headers, settle_s, window_s)


def idle_steps(url: str, timeout: float = 60.0) -> float:
    """The engine's step count once it stops changing (three equal reads 0.2 s apart)."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        seen = (seen + [metric(url, "streamkv_engine_steps_total")])[-3:]
        if len(seen) == 3 and seen[0] == seen[-1]:
            return seen[-1]
        time.sleep(0.2)
    raise AssertionError(f"the engine kept stepping: {seen}")


class _Forked:
    """A server forked by the zygote: the part of ``subprocess.Popen`` the harness uses."""

    def __init__(self, zygote: "_Zygote", pid: int) -> None:
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.ask({"op": "poll", "pid": self.pid})["rc"]
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


class _Zygote:
    """``tests/server_zygote.py``, started on first use: it forks servers with their imports
    done (a start to /health: ~7.3 s as a new process, ~3.5 s forked; 2-vCPU AMD EPYC Zen 3).
    ``STREAMKV_TEST_ZYGOTE=0`` starts every server as a new process instead."""

    _one: "_Zygote | None" = None

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "server_zygote.py")], cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert "ready" in json.loads(self.proc.stdout.readline()), "the server zygote did not start"
        atexit.register(self.close)

    @classmethod
    def get(cls) -> "_Zygote | None":
        if os.environ.get("STREAMKV_TEST_ZYGOTE", "1") == "0":
            return None
        if cls._one is None or cls._one.proc.poll() is not None:
            cls._one = cls()
        return cls._one

    def ask(self, request: dict) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = json.loads(self.proc.stdout.readline())
        if "error" in reply:
            raise RuntimeError(f"server zygote: {reply['error']}")
        return reply

    def spawn(self, argv: list[str], log: str) -> _Forked:
        return _Forked(self, self.ask({"op": "spawn", "argv": argv, "log": log})["pid"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = ["serve", "--port", str(self.port), *args]
        fd, self.log_path = tempfile.mkstemp(prefix="streamkv-test-server-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        zygote = None if env else _Zygote.get()  # a changed environment: read at import too
        if zygote is not None:
            self.proc: subprocess.Popen | _Forked = zygote.spawn(argv, self.log_path)
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "streamkv.cli", *argv], cwd=ROOT,
                                         env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                         stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("server did not become ready")

    def log_text(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, sig: int = 15, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
