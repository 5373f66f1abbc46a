"""KV policies over a live server: ``kv_write`` / ``kv_read`` on /v1/completions,
/v1/chat/completions and /v1/messages (plain and streamed), the server defaults
(``--kv-write``), the ``streamkv.kv`` report, 400s for bad policies, and the Prometheus totals."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.server_harness import ServerProcess, metric

DOC = " ".join(f"Line {i}: the code word for day {i} is {['amber', 'birch', 'cedar', 'delta'][i % 4]}{i}."
               for i in range(60)) + "\nWhat is the code word for day 7?"
SNAP = {"policy": "snapstream", "budget_tokens": 128, "sink_tokens": 16, "window_tokens": 64,
        "observation_tokens": 16}
QUEST = {"policy": "quest", "budget_tokens": 256, "sink_tokens": 16, "recent_tokens": 64}
T0 = {"temperature": 0, "max_tokens": 20}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", "2048", "--kv-write", json.dumps(SNAP))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def _plain(kv: dict) -> dict:
    """A report without its timing (which differs between runs)."""
    return {k: v for k, v in kv.items() if k != "compress_ms"}


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_the_server_default_compresses_and_reports(http, server):
    body = http.post("/v1/completions", json={"prompt": DOC, **T0}).json()
    kv = body["streamkv"]["kv"]
    assert kv["compressed"] and kv["tokens_kept"] == 16 + 128 + 64 < kv["tokens_seen"]
    assert kv["write"]["policy"] == "snapstream" and kv["compress_ms"] > 0
    off = http.post("/v1/completions", json={"prompt": DOC, **T0, "kv_write": {"policy": "none"}}).json()
    assert "streamkv" not in off  # the default turned off: an exact request
    assert metric(server.url, "streamkv_kv_policy_compressions_total") >= 1
    assert metric(server.url, "streamkv_kv_policy_tokens_kept_total") < metric(
        server.url, "streamkv_kv_policy_tokens_seen_total")


def test_every_route_takes_both_policies_streamed_or_not(http):
    msgs = [{"role": "user", "content": DOC}]
    model = http.get("/v1/models").json()["data"][0]["id"]
    for kv in ({"kv_write": {"policy": "streaming_llm", "sink_tokens": 8, "window_tokens": 120}},
               {"kv_write": {"policy": "none"}, "kv_read": QUEST}):
        plain = http.post("/v1/chat/completions", json={"messages": msgs, **T0, **kv}).json()
        report = plain["streamkv"]["kv"]
        assert ("write" in report) == ("kv_read" not in kv) and ("read" in report) == ("kv_read" in kv)
        chunks = _sse(http.post("/v1/chat/completions", json={"messages": msgs, **T0, **kv, "stream": True}))
        assert _plain(chunks[-1]["streamkv"]["kv"]) == _plain(report)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == plain["choices"][0]["message"]["content"]  # streamed = unstreamed, bit for bit
        msg = http.post("/v1/messages", json={"model": model, "max_tokens": 20, "temperature": 0,
                                              "messages": msgs, **kv}).json()
        assert _plain(msg["streamkv"]["kv"]) == _plain(report) and msg["content"][0]["text"] == text
        done = [json.loads(line[6:]) for line in http.post(
            "/v1/messages", json={"model": model, "max_tokens": 20, "temperature": 0, "messages": msgs, **kv,
                                  "stream": True}).text.splitlines() if line.startswith("data: ")]
        assert _plain([d for d in done if d["type"] == "message_delta"][0]["streamkv"]["kv"]) == _plain(report)
    assert report["pages_scored"] > report["pages_picked"] > 0
    assert report["tokens_read_per_step"] < report["tokens_seen"]


def test_quest_reports_the_attention_mass_it_kept(http, server):
    long = {**T0, "max_tokens": 40, "ignore_eos": True}
    out = http.post("/v1/completions", json={"prompt": DOC, **long, "kv_write": {"policy": "none"},
                                             "kv_read": QUEST}).json()["streamkv"]["kv"]
    assert 0.0 < out["attention_recall"] <= 1.0
    assert out["kv_bytes_read_per_token"] < out["tokens_seen"] * (out["kv_bytes_read_per_token"] /
                                                                  out["tokens_read_per_step"])
    assert metric(server.url, "streamkv_kv_policy_recall_samples_total") >= 1


def _stream(http, body: dict, pieces: list[str]) -> dict:
    r = http.post("/v1/input_streams", json={"prompt": pieces[0], **T0, **body})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    for piece in pieces[1:]:
        assert http.post(f"/v1/input_streams/{sid}/append", json={"text": piece}).status_code == 200
    return http.post(f"/v1/input_streams/{sid}/finish", json={"stream": False}).json()


def test_streaming_inputs_take_the_default_and_their_own_policies_at_finish(http):
    """An input stream compresses under the server default once its input is final, like a
    completion of the final prompt; its own ``{"policy": "none"}`` keeps it exact, and its own
    kv_read adds page reads."""
    pieces = [DOC[:200], DOC[200:700], DOC[700:]]
    for body in ({}, {"kv_write": {"policy": "none"}}, {"kv_read": QUEST}):
        ref = http.post("/v1/completions", json={"prompt": DOC, **T0, **body}).json()
        done = _stream(http, body, pieces)
        assert done["choices"][0]["text"] == ref["choices"][0]["text"]
        if body.get("kv_write") == {"policy": "none"}:
            assert "kv" not in done["streamkv"] and "streamkv" not in ref
        else:
            assert _plain(done["streamkv"]["kv"]) == _plain(ref["streamkv"]["kv"])
            assert done["streamkv"]["kv"]["compressed"] and ("read" in done["streamkv"]["kv"]) == ("kv_read" in body)
    r = http.post("/v1/input_streams", json={"prompt": "x", **T0, "kv_write": {"policy": "zip"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_write"


def test_a_request_reads_pages_among_the_rows_the_default_kept(http):
    small = {**QUEST, "budget_tokens": 128}  # of the 208 rows kept: 16 sinks, the 64-row ring, 3 of 8 pages
    body = {"prompt": DOC, **T0, "ignore_eos": True, "kv_read": small}
    kv = http.post("/v1/completions", json=body).json()["streamkv"]["kv"]
    assert kv["compressed"] and kv["read"]["policy"] == "quest" and kv["tokens_kept"] == 16 + 128 + 64
    assert kv["tokens_read_per_step"] == 128 and kv["pages_scored"] > kv["pages_picked"] > 0
    chunks = _sse(http.post("/v1/completions", json={**body, "stream": True}))
    assert _plain(chunks[-1]["streamkv"]["kv"]) == _plain(kv)


@pytest.mark.parametrize("kv,param", [({"kv_write": {"policy": "snapstream", "budget_tokens": -1}}, "kv_write"),
                                      ({"kv_write": {"policy": "zip"}}, "kv_write"),
                                      ({"kv_read": {"policy": "quest", "budget_tokens": 10}}, "kv_read"),
                                      ({"kv_read": {**QUEST, "rescore": 1}}, "kv_read"),
                                      ({"kv_write": "snapstream"}, None),
                                      # a list or object as the name was a 500 (unhashable in the registry)
                                      ({"kv_write": {"policy": ["snapstream"]}}, "kv_write"),
                                      ({"kv_read": {"policy": {"name": "quest"}}}, "kv_read")])
def test_bad_policies_are_400s_naming_the_field(http, kv, param):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **T0, **kv})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param and param in err["message"]


def test_a_bad_server_default_is_refused_at_start():
    import subprocess
    import sys

    from tests.server_harness import ROOT

    run = subprocess.run([sys.executable, "-m", "streamkv.cli", "serve", "--kv-write",
                          '{"policy": "snapstream", "pool_kernel": 4}'], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0 and "pool_kernel" in run.stderr
