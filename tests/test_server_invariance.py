"""Over HTTP, in the default configuration: a streamed request equals the same request
unstreamed, a repeated request (prefix-cache hit) equals the first, and a request that shares
its steps with concurrent others equals it alone: tokens and logprobs, bit for bit."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_harness import ServerProcess

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers.",
           "Why is the sky blue?"]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    yield srv
    assert srv.stop() == 0


def _body(text: str, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 20, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "stream": stream}


def _plain(url: str, text: str) -> list:
    r = httpx.post(url + "/v1/chat/completions", json=_body(text, False), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["content"]


def _streamed(url: str, text: str) -> list:
    items: list = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=_body(text, True), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"]
            if choice and choice[0].get("logprobs"):
                items.extend(choice[0]["logprobs"]["content"])
    return items


def test_streamed_equals_unstreamed_and_repeated_equals_first(server):
    for text in PROMPTS:
        first = _plain(server.url, text)
        assert first and all(len(item["top_logprobs"]) == 3 for item in first)
        assert _streamed(server.url, text) == first, f"streamed differs: {text!r}"
        assert _plain(server.url, text) == first, f"repeated (prefix-cache hit) differs: {text!r}"


def test_concurrent_requests_equal_their_solo_runs(server):
    solo = {text: _plain(server.url, text) for text in PROMPTS}
    jobs = PROMPTS * 4
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: (_streamed if job[0] % 2 else _plain)(server.url, job[1]), enumerate(jobs)))
    for text, out in zip(jobs, outs):
        assert out == solo[text], f"differs when sharing steps: {text!r}"
