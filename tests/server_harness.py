"""Starts a real ``streamkv serve`` subprocess on a free 127.0.0.1 port for tests."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    """One sample of a Prometheus metric (no labels) from the server's /metrics."""
    text = httpx.get(url + "/metrics", headers=headers).text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def assert_left_request_stopped(url: str, headers: dict[str, str] | None = None) -> None:
    """After a client gave up on a long request: once the disconnect is seen (the routes poll every
    0.25 s) and the abort has gone through the engine, the engine takes no more steps (the request
    left running would step for seconds more)."""
    time.sleep(1.5)
    before = metric(url, "streamkv_engine_steps_total", headers)
    time.sleep(1.5)
    assert metric(url, "streamkv_engine_steps_total", headers) == before, "the abandoned request kept running"


def idle_steps(url: str, timeout: float = 60.0) -> float:
    """The engine's step count once it stops changing (three equal reads 0.2 s apart)."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        seen = (seen + [metric(url, "streamkv_engine_steps_total")])[-3:]
        if len(seen) == 3 and seen[0] == seen[-1]:
            return seen[-1]
        time.sleep(0.2)
    raise AssertionError(f"the engine kept stepping: {seen}")


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "streamkv.cli", "serve", "--port", str(self.port), *args]
        fd, self.log_path = tempfile.mkstemp(prefix="streamkv-test-server-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
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
