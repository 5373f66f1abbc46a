"""Hostile and malformed requests get the right 4xx and an OpenAI-style error body."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.server_harness import ServerProcess, abandon, metric

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--dtype", "float32", "--api-key", KEY, "--max-body-bytes", "65536",
                        "--max-waiting", "2", "--max-num-seqs", "2", "--max-num-batched-tokens", "64")
    yield srv
    assert srv.stop(signal.SIGINT) == 0


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]


def _check_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "type" in body["error"]


def _matrix(model: str) -> list[tuple[str, str, object, int]]:
    chat = "/v1/chat/completions"
    comp = "/v1/completions"
    msgs = [{"role": "user", "content": "hi"}]
    return [
        (comp, "raw", b"{not json", 400),
        (comp, "raw", b"\xff\xfe\xfa invalid utf-8", 400),
        (comp, "raw", b'{"model": "m", "prompt": "\xc3\x28"}', 400),
        (comp, "raw", b"[1, 2, 3]", 400),
        (comp, "raw", b"", 400),
        (comp, "json", {"model": model}, 400),
        (comp, "json", {"model": model, "prompt": "hi", "max_tokens": "10"}, 400),
        (comp, "json", {"model": model, "prompt": "hi", "max_tokens": 0}, 400),
        (comp, "json", {"model": model, "prompt": "hi", "max_tokens": -5}, 400),
        (comp, "json", {"model": model, "prompt": "hi", "max_tokens": 10 ** 30}, 400),
        (comp, "json", {"model": model, "prompt": "hi", "temperature": -1}, 400),
        (comp, "json", {"model": model, "prompt": "hi", "temperature": 1e308}, 400),
        (comp, "json", {"model": model, "prompt": "hi", "top_p": 7}, 400),
        (comp, "json", {"model": model, "prompt": "hi", "n": 1000}, 400),
        (comp, "json", {"model": model, "prompt": "hi", "logprobs": 50}, 400),
        (comp, "json", {"model": model, "prompt": [10 ** 12]}, 400),
        (comp, "json", {"model": model, "prompt": [1] * 9000}, 400),
        (comp, "json", {"model": model, "prompt": ""}, 400),
        (comp, "json", {"model": model, "prompt": {"text": "hi"}}, 400),
        (comp, "json", {"model": model, "prompt": "hi", "stop": 5}, 400),
        (comp, "json", {"model": model, "prompt": "hi", "seed": "abc"}, 400),
        (comp, "json", {"model": "no-such-model", "prompt": "hi"}, 404),
        (chat, "json", {"model": model, "messages": []}, 400),
        (chat, "json", {"model": model, "messages": [{"role": "wizard", "content": "x"}]}, 400),
        (chat, "json", {"model": model, "messages": "hello"}, 400),
        (chat, "json", {"model": model, "messages": msgs, "top_logprobs": 99, "logprobs": True}, 400),
        (chat, "json", {"model": model, "messages": msgs, "max_completion_tokens": 0}, 400),
        (chat, "json", {"model": model, "messages": [{"role": "user", "content": "x " * 9000}]}, 400),
        ("/v1/messages", "json", {"model": model, "messages": msgs}, 400),
        ("/detokenize", "json", {"tokens": [-1]}, 400),
        ("/tokenize", "json", {}, 400),
        (comp, "raw", b'{"model": "m", "prompt": "' + b"a" * 200_000 + b'"}', 413),
    ]


def test_bad_input_matrix_then_normal_request(server, model):
    cases = _matrix(model)
    assert len(cases) >= 20
    for path, kind, body, status in cases:
        if kind == "raw":
            r = httpx.post(server.url + path, content=body, headers={**AUTH, "Content-Type": "application/json"})
        else:
            r = httpx.post(server.url + path, json=body, headers=AUTH)
        _check_error(r, status)
    ok = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                    json={"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_api_key_required(server, model):
    _check_error(httpx.get(server.url + "/v1/models"), 401)
    _check_error(httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    _check_error(httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "x"}), 401)
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_chunked_oversize_body_rejected(server):
    def gen():
        for _ in range(100):
            yield b"x" * 4096

    r = httpx.post(server.url + "/v1/completions", content=gen(), headers=AUTH)
    _check_error(r, 413)


def test_too_many_waiting_gets_429(server, model):
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(12)))

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert 429 in codes and 200 in codes, [(r.status_code, r.text[:200]) for r in responses]
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.headers.get("retry-after") and limited.json()["error"]["type"] == "rate_limit_error"
    assert all(json.loads(r.text)["choices"][0]["text"] for r in responses if r.status_code == 200)


def test_streams_over_the_waiting_limit_get_429_before_they_start(server, model):
    """A refused streamed request gets its status (429 + Retry-After) before any event, on every
    route: it was a 200 whose stream broke off (/v1/messages) or carried an in-band 500 (the
    OpenAI routes). The accepted ones stream to their end."""
    ask = "Tell me a long story."
    routes = [("/v1/completions", {"prompt": ask, "ignore_eos": True}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": ask}], "ignore_eos": True}),
              ("/v1/messages", {"messages": [{"role": "user", "content": ask}]})]

    async def one(c: httpx.AsyncClient, path: str, extra: dict) -> tuple[str, int, str | None, str]:
        body = {"model": model, "max_tokens": 48, "temperature": 0, "stream": True, **extra}
        async with c.stream("POST", path, json=body) as r:
            return path, r.status_code, r.headers.get("retry-after"), (await r.aread()).decode()

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*(one(c, *routes[i % 3]) for i in range(12)))

    results = asyncio.run(run())
    assert {code for _, code, _, _ in results} == {200, 429}, [(p, c) for p, c, _, _ in results]
    for path, code, retry, text in results:
        if code == 429:
            assert retry and json.loads(text)["error"]["type"] == "rate_limit_error", (path, text)
        elif path == "/v1/messages":
            assert "event: message_stop" in text and "event: error" not in text, text
        else:
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_a_client_that_leaves_a_plain_request_aborts_it(server, model, route):
    """A non-streamed request whose client gave up kept generating to max_tokens and held its KV
    blocks (logged as a 200 afterwards); it is now aborted within a poll (499 in the log)."""
    body = {"model": model, "max_tokens": 600, "temperature": 0, "ignore_eos": True}
    if route == "/v1/completions":
        body["prompt"] = "Count from one to a thousand:"
    else:  # /v1/messages has no ignore_eos: a long prompt (64-token chunks here) outlasts the client
        body["messages"] = [{"role": "user", "content": "Count from one to a thousand. " * 300}]
    abandon(server.url, route, body, AUTH)


def test_utilities(server):
    t = httpx.post(server.url + "/tokenize", headers=AUTH, json={"prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0
    d = httpx.post(server.url + "/detokenize", headers=AUTH, json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,  # 4 tokens: 3 gaps, engine-side
               json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    metrics = httpx.get(server.url + "/metrics", headers=AUTH).text
    for name in ("streamkv_requests_total", "streamkv_time_to_first_token_seconds_bucket",
                 "streamkv_kv_blocks_free", "streamkv_prefix_cache_hit_rate", "streamkv_preemptions",
                 "streamkv_requests_waiting", "streamkv_fork_block_waits 0.0",
                 "streamkv_forks_waiting_for_blocks 0.0", "streamkv_fork_restarts 0.0",
                 'streamkv_inter_token_gap_seconds_bucket{le="0.001"}', 'streamkv_step_interval_seconds_bucket{le="+Inf"}'):
        assert name in metrics
    assert metric(server.url, "streamkv_inter_token_gap_seconds_count", AUTH) >= 3
    assert metric(server.url, "streamkv_step_interval_seconds_sum", AUTH) > 0


def test_access_log_line_per_request(server, model):
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": model, "prompt": "Hello there", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    usage = r.json()["usage"]
    expected = f"POST /v1/completions 200 tokens={usage['prompt_tokens']}+{usage['completion_tokens']} "
    deadline = time.time() + 5
    while expected not in server.log_text() and time.time() < deadline:
        time.sleep(0.1)
    assert expected in server.log_text()
    assert "GET /health 200 tokens=-" in server.log_text()


def test_a_client_that_leaves_a_stream_is_logged_and_counted_as_499(server, model):
    # the response had begun, so its last body message never went out: no access-log line and
    # no streamkv_requests_total sample at all (helper-69: 126 dropped streams of a soak uncounted)
    before = metric(server.url, "streamkv_requests_total", AUTH, where='status="499"')
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60, headers=AUTH) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
        frames = 0
        for line in r.iter_lines():
            frames += line.startswith("data: ")
            if frames >= 3:
                break
    deadline = time.time() + 30
    while metric(server.url, "streamkv_requests_total", AUTH, where='status="499"') == before:
        assert time.time() < deadline, "the dropped stream was never counted"
        time.sleep(0.1)
    assert "POST /v1/completions 499 " in server.log_text()


@pytest.mark.parametrize("fails", [False, True], ids=["client-left", "route-failed"])
def test_a_response_begun_and_never_ended_is_counted_once(fails):
    # a route that failed after its first body chunk was counted as 499, the client's doing
    from streamkv.server.middleware import GuardMiddleware

    seen: list[dict] = []

    class Counter:
        def labels(self, **labels):
            seen.append(labels)
            return self

        def inc(self) -> None:
            pass

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        if fails:
            raise RuntimeError("the engine died mid-stream")

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    guard = GuardMiddleware(app, None, 1 << 20, type("Metrics", (), {"requests": Counter()})())
    scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": []}
    if fails:
        with pytest.raises(RuntimeError):
            asyncio.run(guard(scope, receive, send))
    else:
        asyncio.run(guard(scope, receive, send))
    assert [s["status"] for s in seen] == ["500" if fails else "499"]
