"""/v1/input_streams over a live server: open, append, update, finish (JSON, SSE, WebSocket),
the errors (404, 409, 400, 429), TTL expiry and the Prometheus counters."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.server_harness import ServerProcess, abandon, assert_left_request_stopped, metric

TEXT = ("Page one: the river Loire flows through Orleans and Tours. Page two: Chambord was built for "
        "Francis I. Question: who was Chambord built for?")
T0 = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--dtype", "float32", "--max-input-streams", "3", "--input-stream-ttl-s", "3",
                        "--max-model-len", "512", "--queue-policy", "lcas", "--max-wait-s", "2")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _open(http, **body) -> str:
    r = http.post("/v1/input_streams", json={**T0, **body})
    assert r.status_code == 201, r.text
    assert r.json()["id"].startswith("istr_")
    return r.json()["id"]


def test_append_update_finish_equals_plain_completion(http, server):
    ref = http.post("/v1/completions", json={"prompt": TEXT, **T0}).json()["choices"][0]["text"]
    sid = _open(http, prompt=TEXT[:30])
    r = http.post(f"/v1/input_streams/{sid}/append", json={"text": TEXT[30:100] + " junk tail"})
    assert r.status_code == 200 and set(r.json()) >= {"tokens", "computed"}
    r = http.post(f"/v1/input_streams/{sid}/update", json={"text": TEXT[:100]})
    body = r.json()
    assert r.status_code == 200 and body["lcp"] <= body["tokens"] and body["invalidated"] >= 0
    http.post(f"/v1/input_streams/{sid}/append", json={"text": TEXT[100:]})
    time.sleep(0.3)  # let the engine prefill what arrived
    done = http.post(f"/v1/input_streams/{sid}/finish", json={"stream": False}).json()
    assert done["object"] == "text_completion" and done["choices"][0]["text"] == ref
    assert done["usage"]["computed_prompt_tokens"] > 0
    assert done["usage"]["computed_prompt_tokens"] < done["usage"]["prompt_tokens"]
    events = [e["event"] for e in done["streamkv"]["events"]]
    assert events[0] == "queued" and "input_appended" in events and "input_updated" in events
    assert events[-1] == "finished"
    r = http.post(f"/v1/input_streams/{sid}/append", json={"text": "more"})
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error"
    assert metric(server.url, "streamkv_input_appends_total") >= 2
    assert metric(server.url, "streamkv_tokens_invalidated_total") >= 0  # exported (timing decides the count)
    assert metric(server.url, "streamkv_swap_bytes_total") == 0  # no --swap-space here


def test_chat_stream_finish_over_sse_equals_chat_completion(http):
    msgs = [{"role": "user", "content": TEXT}]
    ref = http.post("/v1/chat/completions", json={"messages": msgs, **T0}).json()
    sid = _open(http, messages=[{"role": "user", "content": TEXT[:50]}])
    http.post(f"/v1/input_streams/{sid}/append", json={"text": TEXT[50:]})
    finish = {"stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", f"/v1/input_streams/{sid}/finish", json=finish) as resp:
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == ref["choices"][0]["message"]["content"]
    # the chunks of a plain stream: the extension rides the finished choice's chunk, every
    # chunk before the usage one has "usage": null, and only the usage chunk has no choices
    # (the extension came in a chunk of its own with "choices": [] and no usage: review)
    assert [c for c in chunks if not c["choices"]] == [chunks[-1]] and "streamkv" not in chunks[-1]
    assert chunks[-2]["choices"][0]["finish_reason"] and chunks[-2]["streamkv"]["events"][-1]["event"] == "finished"
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    usages = [c["usage"] for c in chunks if c.get("usage")]  # there were two, with different fields
    assert len(usages) == 1 and usages[0] is chunks[-1]["usage"], usages
    assert usages[0]["completion_tokens"] == ref["usage"]["completion_tokens"] and "computed_prompt_tokens" in usages[0]
    sid = _open(http, prompt=TEXT)
    with http.stream("POST", f"/v1/input_streams/{sid}/finish", json={"stream": True}) as resp:
        plain = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
    assert all(c["choices"] and "usage" not in c for c in plain)  # no usage asked: no usage chunk
    assert plain[-1]["choices"][0]["finish_reason"] and plain[-1]["streamkv"]["events"][-1]["event"] == "finished"


def test_websocket_frames(server, http):
    from websockets.sync.client import connect

    sid = _open(http, prompt="Once upon a time")
    with connect(server.url.replace("http", "ws") + f"/v1/input_streams/{sid}/ws") as ws:
        ws.send(json.dumps({"type": "append", "text": " there was a"}))
        assert json.loads(ws.recv())["type"] == "ack"
        ws.send("not json")
        assert json.loads(ws.recv())["error"]["code"] is None
        ws.send(b"\xff\xfe")  # binary frames: read as UTF-8 JSON (they crashed the handler)
        assert json.loads(ws.recv())["type"] == "error"
        ws.send(json.dumps({"type": "append", "text": ""}).encode())
        assert json.loads(ws.recv())["type"] == "ack"
        ws.send(json.dumps({"type": "update", "text": "Once upon a time there lived a"}))
        ack = json.loads(ws.recv())
        assert ack["op"] == "update" and "lcp" in ack
        ws.send(json.dumps({"type": "finish", "max_tokens": 2}))  # fixed at open: refused, input kept
        err = json.loads(ws.recv())
        assert err["type"] == "error" and "max_tokens" in err["error"]["message"], err
        ws.send(json.dumps({"type": "finish"}))
        frames = []
        while not frames or not frames[-1]["finished"]:
            frames.append(json.loads(ws.recv()))
    ref = http.post("/v1/completions", json={"prompt": "Once upon a time there lived a", **T0}).json()
    assert frames[-1]["text"] == ref["choices"][0]["text"]
    # unknown and finished ids: an error frame with the status, then a close with 4000 + status
    # (a close before the handshake reached the client as a bare HTTP 403)
    from websockets.exceptions import ConnectionClosed

    for rid, status in (("istr_nope", 404), (sid, 409)):
        with connect(server.url.replace("http", "ws") + f"/v1/input_streams/{rid}/ws") as ws:
            err = json.loads(ws.recv())
            assert err["type"] == "error" and err["error"]["message"], err
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv()
            assert closed.value.rcvd.code == 4000 + status


def test_a_socket_that_leaves_keeps_the_input_and_an_answer_it_does_not_own(server, http):
    """Any WebSocket that closed aborted the request: input it had sent (and acknowledged) was
    thrown away, and an answer another client was finishing over HTTP was dropped while that
    client waited forever. A socket that only sends changes now leaves the input alone."""
    import threading

    from websockets.sync.client import connect

    params = {"temperature": 0, "max_tokens": 96, "ignore_eos": True}  # long enough to close during it
    ref = http.post("/v1/completions", json={"prompt": TEXT, **params}).json()["choices"][0]["text"]
    url = server.url.replace("http", "ws") + "/v1/input_streams/{}/ws"
    sid = _open(http, prompt=TEXT[:40], **params)
    with connect(url.format(sid)) as ws:  # sends a change, then leaves (a normal close)
        ws.send(json.dumps({"type": "append", "text": TEXT[40:80]}))
        assert json.loads(ws.recv())["type"] == "ack"
    r = http.post(f"/v1/input_streams/{sid}/append", json={"text": TEXT[80:]})
    assert r.status_code == 200, r.text  # was 409 "closed (abort)"
    done: dict = {}

    def finish() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            done["r"] = c.post(f"/v1/input_streams/{sid}/finish", json={"stream": False})

    t = threading.Thread(target=finish)
    with connect(url.format(sid)) as watcher:  # another socket on the stream, closed during the answer
        t.start()
        deadline = time.monotonic() + 30
        while http.get(f"/v1/input_streams/{sid}").status_code != 409:  # finished: its answer is running
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # a socket opened now, the input finished and its answer running, is refused as on an
        # input whose answer is done (it was accepted, and answered each frame with a 409)
        from websockets.exceptions import ConnectionClosed

        with connect(url.format(sid)) as late:
            assert json.loads(late.recv(timeout=30))["error"]["type"], "an error frame"
            with pytest.raises(ConnectionClosed) as closed:
                late.recv(timeout=30)
            assert closed.value.rcvd.code == 4409
        watcher.close()
    t.join(90)
    assert "r" in done, "the HTTP finish never answered"
    assert done["r"].status_code == 200, done["r"].text
    assert done["r"].json()["choices"][0]["text"] == ref


def test_a_socket_that_leaves_during_its_own_answer_aborts_it(server, http):
    from websockets.sync.client import connect

    sid = _open(http, prompt="Once upon a time", temperature=0, max_tokens=400, ignore_eos=True)
    with connect(server.url.replace("http", "ws") + f"/v1/input_streams/{sid}/ws") as ws:
        ws.send(json.dumps({"type": "finish"}))
        assert json.loads(ws.recv())["type"] == "output"
    assert_left_request_stopped(server.url)


def test_structured_output_applies_to_the_finished_stream(http):
    """guided_regex / response_format were accepted and ignored: the finished stream gives what
    /v1/completions gives for the final prompt under the same constraint."""
    body = {"max_tokens": 8, "temperature": 0, "guided_regex": "[0-9]{3}-[0-9]{4}"}
    ref = http.post("/v1/completions", json={"prompt": "My phone number is", **body})
    assert ref.status_code == 200, ref.text
    sid = _open(http, prompt="My phone", **body)
    http.post(f"/v1/input_streams/{sid}/append", json={"text": " number is"})
    done = http.post(f"/v1/input_streams/{sid}/finish", json={"stream": False}).json()
    text = done["choices"][0]["text"]
    assert text == ref.json()["choices"][0]["text"] and len(text) == 8 and text[3] == "-", text
    r = http.post("/v1/input_streams", json={"prompt": "x", "guided_regex": "(unclosed"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text


def test_chat_fields_are_read_as_chat_completions_reads_them(http):
    # max_completion_tokens and logprobs=true + top_logprobs were ignored or refused, tools
    # silently dropped: now the chat form is honoured and tools are a 400
    msgs = [{"role": "user", "content": TEXT}]
    body = {"temperature": 0, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2}
    ref = http.post("/v1/chat/completions", json={"messages": msgs, **body}).json()
    r = http.post("/v1/input_streams", json={"messages": [{"role": "user", "content": TEXT[:30]}], **body})
    assert r.status_code == 201, r.text
    http.post(f"/v1/input_streams/{r.json()['id']}/append", json={"text": TEXT[30:]})
    done = http.post(f"/v1/input_streams/{r.json()['id']}/finish", json={}).json()
    assert done["usage"]["completion_tokens"] == 5 == ref["usage"]["completion_tokens"]
    assert done["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    got, want = done["choices"][0]["logprobs"]["content"], ref["choices"][0]["logprobs"]["content"]
    assert [len(t["top_logprobs"]) for t in got] == [2] * 5 and got == want
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for bad, param in (({"messages": msgs, "tools": [tool]}, "tools"),
                       ({"messages": msgs, "tool_choice": "required"}, "tool_choice"),
                       ({"messages": msgs, "top_logprobs": 2}, "top_logprobs"),
                       ({"messages": msgs, "max_completion_tokens": 0}, "max_completion_tokens"),
                       ({"prompt": "x", "logprobs": True}, "logprobs"),
                       ({"prompt": "x", "max_completion_tokens": 5}, "max_completion_tokens")):
        r = http.post("/v1/input_streams", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_a_finish_may_carry_the_last_piece_of_input(server, http):
    from websockets.sync.client import connect

    ref = http.post("/v1/completions", json={"prompt": TEXT, **T0}).json()["choices"][0]["text"]
    sid = _open(http, prompt=TEXT[:40])
    r = http.post(f"/v1/input_streams/{sid}/finish", json={"text": " word" * 600})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]  # refused, still open
    done = http.post(f"/v1/input_streams/{sid}/finish", json={"text": TEXT[40:]})  # was dropped
    assert done.status_code == 200 and done.json()["choices"][0]["text"] == ref, done.text
    before = [metric(server.url, m) for m in ("streamkv_prompt_tokens_total", "streamkv_generation_tokens_total")]
    sid = _open(http, prompt=TEXT[:40])
    with connect(server.url.replace("http", "ws") + f"/v1/input_streams/{sid}/ws") as ws:
        ws.send(json.dumps({"type": "finish", "text": TEXT[40:]}))
        frames = []
        while not frames or not frames[-1]["finished"]:
            frames.append(json.loads(ws.recv()))
    assert frames[-1]["text"] == ref
    after = [metric(server.url, m) for m in ("streamkv_prompt_tokens_total", "streamkv_generation_tokens_total")]
    # a WebSocket answer is counted like an HTTP one (it was missing from the metrics)
    assert after[0] - before[0] == done.json()["usage"]["prompt_tokens"]
    assert after[1] - before[1] == done.json()["usage"]["completion_tokens"]


def test_errors_and_limits(http):
    assert http.post("/v1/input_streams/istr_nope/append", json={"text": "x"}).status_code == 404
    assert http.post("/v1/input_streams", json={"prompt": "a", "messages": []}).status_code == 400
    assert http.post("/v1/input_streams", json={"prompt": "a", "n": 2}).status_code == 400
    assert http.post("/v1/input_streams", json={"messages": [{"role": "assistant", "content": "x"}]}).status_code == 400
    for late in ({"stream": True}, {"stream_options": {"include_usage": True}}):  # was ignored (201)
        r = http.post("/v1/input_streams", json={"prompt": "a", **late})
        assert r.status_code == 400 and "goes with finish" in r.json()["error"]["message"], r.text
    for bad in (0, -1, 512, 10**9):  # max_tokens 0 ran as the default (16); past the context ran truncated
        r = http.post("/v1/input_streams", json={"prompt": "a", "max_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    call = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    r = http.post("/v1/input_streams", json={"messages": [  # the stream's template would drop the call
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": call},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}, {"role": "user", "content": "So?"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    sid = _open(http, prompt="hello")
    r = http.post(f"/v1/input_streams/{sid}/append", json={"text": " word" * 600})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert http.get(f"/v1/input_streams/{sid}").json()["tokens"] < 10  # earlier input kept
    assert http.post(f"/v1/input_streams/{sid}/append", json={"text": 5}).status_code == 400
    for late in ({"temperature": 0.9}, {"max_tokens": 3, "stream": False}, {"kv_write": {"policy": "snapkv"}}):
        r = http.post(f"/v1/input_streams/{sid}/finish", json=late)  # was ignored: the answer ran unchanged
        assert r.status_code == 400 and "set when the input is opened" in r.json()["error"]["message"], r.text
    assert http.get(f"/v1/input_streams/{sid}").status_code == 200  # refused before finishing: still open
    others = [_open(http, prompt="x") for _ in range(2)]
    r = http.post("/v1/input_streams", json={"prompt": "one too many"})
    assert r.status_code == 429 and r.headers.get("retry-after")
    for rid in [sid, *others]:
        assert http.delete(f"/v1/input_streams/{rid}").status_code == 200
    assert http.post(f"/v1/input_streams/{sid}/append", json={"text": "x"}).status_code == 409


def test_input_must_leave_room_for_an_explicit_max_tokens(http):
    """With max_tokens 400 in a 512-token context, input past 112 tokens is refused (it ran and
    was cut short at the context: 1,747 of 1,900 tokens, where /v1/completions says 400), at
    append and at finish alike, and the stream keeps its input; null asks for what is left."""
    sid = _open(http, prompt="hello", max_tokens=400)
    r = http.post(f"/v1/input_streams/{sid}/append", json={"text": " word" * 150})
    assert r.status_code == 400 and "400 completion tokens" in r.json()["error"]["message"], r.text
    assert http.post(f"/v1/input_streams/{sid}/append", json={"text": " word" * 60}).status_code == 200
    r = http.post(f"/v1/input_streams/{sid}/finish", json={"text": " word" * 60})
    assert r.status_code == 400 and "context is 512" in r.json()["error"]["message"], r.text
    got = http.get(f"/v1/input_streams/{sid}").json()
    assert got.get("tokens", 1 << 20) < 70, got  # refused: nothing appended
    assert http.delete(f"/v1/input_streams/{sid}").status_code == 200
    sid = _open(http, prompt="hello", max_tokens=None)
    assert http.post(f"/v1/input_streams/{sid}/append", json={"text": " word" * 150}).status_code == 200
    assert http.delete(f"/v1/input_streams/{sid}").status_code == 200


def test_abandoned_streams_expire(http, server):
    sid = _open(http, prompt="left alone")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = http.get(f"/v1/input_streams/{sid}")
        if r.status_code != 200:
            break
        time.sleep(0.5)
    assert r.status_code == 409 and "expired" in r.json()["error"]["message"]
    assert metric(server.url, "streamkv_input_streams_expired_total") >= 1


def test_a_client_that_leaves_a_plain_finish_aborts_the_answer(http, server):
    """A non-streamed finish whose client gave up kept generating to max_tokens (holding its KV
    blocks); the route now sees the disconnect (0.25 s poll) and aborts the answer."""
    sid = _open(http, prompt=TEXT, temperature=0, max_tokens=400, ignore_eos=True)
    abandon(server.url, f"/v1/input_streams/{sid}/finish", {})


def test_a_failed_answer_over_the_websocket_is_an_error_frame():
    # it went out as an ordinary last output with finish_reason "stop" and no error
    import asyncio
    from types import SimpleNamespace

    from streamkv.engine.outputs import RequestOutput
    from streamkv.server.input_streams_api import _ws_answer

    sent, seen = [], []

    class Handle:
        async def outputs(self):
            yield RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], token_ids=[], text="",
                                finished=True, finish_reason="error", error="KVCacheFullError: full", retry=True)

    async def send_json(frame):
        sent.append(frame)

    state = SimpleNamespace(observe=lambda out, req: seen.append(out))
    ws = SimpleNamespace(send_json=send_json, app=SimpleNamespace(state=SimpleNamespace(streamkv=state)))
    asyncio.run(_ws_answer(ws, Handle()))
    assert [f["type"] for f in sent] == ["error"], sent
    assert sent[0]["error"]["type"] == "service_unavailable"  # retryable: the 503 kind
    assert "KVCacheFullError" in sent[0]["error"]["message"] and not seen



def test_open_reads_max_tokens_as_completions_and_chat_completions_do():
    # absent: 16 for a prompt (as /v1/completions), the rest of the context for messages; an
    # explicit null on a prompt stream took 16, where /v1/completions takes the rest (review)
    from streamkv.server.input_streams_api import OpenInput, _open_params

    def read(**body: object) -> tuple[int, bool]:  # (max_tokens, must it fit beside the input)
        opened, fit = _open_params(OpenInput(**body), 512)
        return opened["max_tokens"], fit

    assert read(prompt="x") == (16, True) and read(prompt="x", max_tokens=7) == (7, True)
    assert read(prompt="x", max_tokens=None) == (512, False)
    assert read(messages=[{"role": "user", "content": "x"}]) == (512, False)
    assert read(messages=[{"role": "user", "content": "x"}], max_completion_tokens=9) == (9, True)


def test_a_socket_reports_an_engine_error_with_the_status_http_gives_it():
    # a full KV cache and a stopped engine were 400s over the WebSocket (HTTP: 503, retryable)
    from streamkv.errors import (EngineDeadError, InputStreamClosedError, InputStreamNotFoundError,
                                 InvalidRequestError, KVCacheFullError, QueueFullError)
    from streamkv.server.input_streams_api import _status

    cases = {KVCacheFullError("x"): 503, EngineDeadError("x"): 503, InputStreamNotFoundError("x"): 404,
             InputStreamClosedError("x"): 409, QueueFullError("x", 1.0): 429, InvalidRequestError("x"): 400}
    assert {type(e).__name__: _status(e) for e in cases} == {type(e).__name__: s for e, s in cases.items()}
