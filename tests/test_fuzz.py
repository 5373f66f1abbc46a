"""Fuzzing the HTTP API with schemathesis (optional; the dev extras install it).

Every route of the server's own OpenAPI schema gets generated requests, valid and invalid:
there must be no 5xx and no hang (each request is bounded by a timeout), and afterwards the
server answers a known prompt exactly as before. Session, flash and input-stream routes get
real ids (a session and an input stream created first); the SSE subscription route is left
out (it streams until the client leaves, by design; tests/test_server_sessions.py covers it).

``make test`` runs a short pass; ``make fuzz`` a long one (STREAMKV_FUZZ_EXAMPLES=10 with the
coverage phase: ~2,500 requests) and requires at least STREAMKV_FUZZ_MIN_REQUESTS of them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.server_harness import ServerProcess

pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[dev]')")

EXAMPLES = int(os.environ.get("STREAMKV_FUZZ_EXAMPLES", "10"))
PHASES = os.environ.get("STREAMKV_FUZZ_PHASES", "examples,fuzzing")
MIN_REQUESTS = int(os.environ.get("STREAMKV_FUZZ_MIN_REQUESTS", "150"))
KNOWN = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def _requests(url: str) -> tuple[float, int]:
    """Requests the server counted, and how many label sets count them (bounded: route templates)."""
    lines = [line for line in httpx.get(url + "/metrics").text.split("\n") if line.startswith("streamkv_requests_total{")]
    return sum(float(line.rsplit(" ", 1)[-1]) for line in lines), len(lines)


def test_fuzzed_requests_give_no_5xx_and_no_hang(tmp_path):
    exe = shutil.which("schemathesis", path=os.path.dirname(sys.executable)) or shutil.which("schemathesis")
    if exe is None:
        pytest.skip("the schemathesis command is not on PATH")
    srv = ServerProcess("--max-model-len", "256", "--kv-cache-memory", str(128 << 20), "--max-waiting", "64")
    try:
        before = httpx.post(srv.url + "/v1/completions", json=KNOWN, timeout=60).json()["choices"][0]["text"]
        sid = httpx.post(srv.url + "/v1/sessions", json={"system": "Fuzz.", "retention_tokens": 128}).json()["id"]
        httpx.post(f"{srv.url}/v1/sessions/{sid}/data", json={"records": ["reading 1: 5"]})
        stream = httpx.post(srv.url + "/v1/input_streams", json={"prompt": "Once"}).json()["id"]
        config = tmp_path / "schemathesis.toml"
        config.write_text(f'''request-timeout = 60.0
[parameters]
session_id = "{sid}"
stream_id = "{stream}"
[[operations]]
include-path = "/v1/sessions/{{session_id}}/events"
enabled = false
''')
        cmd = [exe, "--config-file", str(config), "run", srv.url + "/openapi.json", "--checks", "not_a_server_error",
               "--max-examples", str(EXAMPLES), "--phases", PHASES, "--workers", "1", "--seed", "7",
               "--continue-on-failure", "--no-color"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        report = run.stdout[-6000:] + run.stderr[-2000:]
        assert run.returncode == 0, report
        sent, series = _requests(srv.url)
        assert sent >= MIN_REQUESTS, f"only {sent:.0f} requests reached the server\n{report}"
        assert series <= 40 * 8, f"{series} metric label sets: paths leak into labels"
        after = httpx.post(srv.url + "/v1/completions", json=KNOWN, timeout=60).json()["choices"][0]["text"]
        assert after == before
        print(f"fuzzing: {sent:.0f} requests, no 5xx, no hang")
    finally:
        assert srv.stop() == 0
