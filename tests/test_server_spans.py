"""/v1/spans, /v1/spans/explain, /v1/spans/bulk and /v1/corpora over a live server: results
equal the offline engine's shape, permutation invariance, reuse counters, SSE, and 400s that
name the node path before any work."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.server_harness import ServerProcess, abandon

DOCS = [{"kind": "fragment", "text": t} for t in (
    "Document A: the river Loire flows through Orleans, Tours and Nantes.\n",
    "Document B: the chateau of Chambord was built for Francis I.\n",
    "Document C: owls hunt at night.\n")]


def rag(docs, question="Which document is about a king?", **sampling):
    return {"kind": "gen", "max_tokens": 8, "temperature": 0, **sampling, "input": {"kind": "seq", "children": [
        {"kind": "system", "text": "Answer from the documents."},
        {"kind": "plus", "children": docs},
        {"kind": "user", "text": question}]}}


@pytest.fixture(scope="module")
def http():
    srv = ServerProcess("--dtype", "float32", "--max-model-len", "1024")
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c
    assert srv.stop() == 0


def test_span_query_reuses_permuted_operands(http):
    http.delete("/v1/spans/cache")
    a = http.post("/v1/spans", json={"query": rag(DOCS)})
    assert a.status_code == 200, a.text
    b = http.post("/v1/spans", json={"query": rag(DOCS[::-1])}).json()
    a = a.json()
    assert a["object"] == "span_query" and a["output"] == b["output"] and a["output"]
    assert a["usage"]["computed_tokens"] > b["usage"]["computed_tokens"]
    assert b["usage"]["reused_tokens"] > 0
    assert set(a["usage"]) >= {"prompt_tokens", "computed_tokens", "reused_tokens", "repositioned_tokens",
                               "completion_tokens"}
    stats = http.get("/v1/spans/cache").json()
    assert stats["entries"] > 0 and stats["hits"] > 0
    assert {"host_entries", "host_bytes", "offloads", "restores"} <= stats.keys()  # the host tier (idle here)
    text = http.get("/metrics").text
    assert re.search(r"^streamkv_span_cache_restores_total \d", text, re.M)
    assert re.search(r"^streamkv_span_cache_host_bytes \d", text, re.M)
    assert re.search(r"^streamkv_span_cache_hits_total [1-9]", text, re.M)
    assert re.search(r'^streamkv_span_tokens_total\{kind="reused"\} [1-9]', text, re.M)
    assert re.search(r"^streamkv_span_queries_total [1-9]", text, re.M)
    assert re.search(r"^streamkv_requests_running 0\.0$", text, re.M)  # cached span streams are not requests


def test_inner_outputs_are_returned(http):
    inner = [{"kind": "gen", "max_tokens": 4, "temperature": 0, "input": {"kind": "user", "text": q}}
             for q in ("Name a colour.", "Name a fruit.")]
    http.delete("/v1/spans/cache")
    r = http.post("/v1/spans", json={"query": rag(inner, "Repeat both.")})
    assert r.status_code == 200, r.text
    first = {i["path"]: i["text"] for i in r.json()["inner"]}
    assert sorted(first) == ["query.input.children[1].children[0]", "query.input.children[1].children[1]"]
    # again, and permuted: the whole plus is a cache hit, and each inner text still comes back,
    # under this query's own paths
    again = http.post("/v1/spans", json={"query": rag(inner, "Repeat both.")}).json()
    assert {i["path"]: i["text"] for i in again["inner"]} == first
    swapped = http.post("/v1/spans", json={"query": rag(inner[::-1], "Repeat both.")}).json()
    assert {i["path"]: i["text"] for i in swapped["inner"]} == {
        "query.input.children[1].children[0]": first["query.input.children[1].children[1]"],
        "query.input.children[1].children[1]": first["query.input.children[1].children[0]"]}
    assert swapped["usage"]["reused_tokens"] > 0


def test_streaming_span_query_sends_deltas_then_the_result(http):
    plain = http.post("/v1/spans", json={"query": rag(DOCS[:2])}).json()
    with http.stream("POST", "/v1/spans", json={"query": rag(DOCS[:2]), "stream": True}) as r:
        assert r.status_code == 200
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    body = [json.loads(f) for f in frames[:-1]]
    assert "".join(f.get("delta", "") for f in body[:-1]) == plain["output"] == body[-1]["output"]


def test_explain_shows_the_layout_and_hits(http):
    http.post("/v1/spans", json={"query": rag(DOCS[:2])})
    r = http.post("/v1/spans/explain", json={"query": rag(DOCS[:2])})
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["optimized"]["kind"] == "gen" and "plus" in info["tree"]
    ops = [row for row in info["layout"] if row["kind"] == "operand"]
    assert len(ops) == 2 and all(row["cached"] for row in ops)
    assert ops[0]["computed_at"] == ops[1]["computed_at"] and ops[0]["placed_at"] != ops[1]["placed_at"]
    assert "placed@" in info["drawing"]


def test_corpus_and_retrieve(http):
    r = http.post("/v1/corpora/wiki", json={"fragments": [{"id": str(i), "text": d["text"]} for i, d in enumerate(DOCS)]})
    assert r.status_code == 200 and r.json()["fragments"] == 3
    q = rag([{"kind": "retrieve", "corpus": "wiki", "ids": ["2", "0"]}])
    got = http.post("/v1/spans", json={"query": q}).json()
    assert got["output"] == http.post("/v1/spans", json={"query": rag([DOCS[0], DOCS[2]])}).json()["output"]
    prep = http.post("/v1/corpora/notes", json={"fragments": [{"id": "x", "text": DOCS[1]["text"]}],
                                                "prefix": {"kind": "system", "text": "Answer from the documents."}})
    assert prep.status_code == 200, prep.text
    done = prep.json()["prepared"]  # computed now, or already cached by an earlier query
    assert done["computed_tokens"] + done["reused_tokens"] > 0
    again = http.post("/v1/spans", json={"query": rag([{"kind": "retrieve", "corpus": "notes", "ids": ["x"]}])})
    assert again.json()["usage"]["reused_tokens"] > 0
    dup = http.post("/v1/corpora/wiki", json={"fragments": [{"id": "x", "text": "a"}, {"id": "x", "text": "b"}]})
    assert dup.status_code == 400
    # a preparation that cannot run is refused before the corpus changes: a new corpus is not
    # registered, an existing one keeps its text
    bad = {"kind": "plus", "children": [{"kind": "fragment", "text": "x"}]}
    r = http.post("/v1/corpora/ghost", json={"fragments": [{"id": "a", "text": "Doc A."}], "prefix": bad})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prefix:"), r.text
    ghost = http.post("/v1/spans", json={"query": rag([{"kind": "retrieve", "corpus": "ghost", "ids": ["a"]}])})
    assert ghost.status_code == 400 and "unknown corpus 'ghost'" in ghost.text
    before = http.post("/v1/spans/explain", json={"query": q}).json()["tree"]
    r = http.post("/v1/corpora/wiki", json={"fragments": [{"id": "2", "text": "Changed."}], "prefix": bad})
    assert r.status_code == 400, r.text
    assert http.post("/v1/spans/explain", json={"query": q}).json()["tree"] == before


def test_bulk_runs_in_clustered_order_and_returns_input_order(http):
    queries = [rag([DOCS[0], DOCS[1]]), rag([DOCS[2]]), rag([DOCS[1], DOCS[0]], "Who?"), rag([DOCS[2], DOCS[0]])]
    r = http.post("/v1/spans/bulk", json={"queries": queries, "order": "clustered", "concurrency": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(body["order"]) == [0, 1, 2, 3] and body["order"][:2] == [0, 2]
    single = http.post("/v1/spans", json={"query": queries[1]}).json()["output"]
    assert body["results"][1]["output"] == single


@pytest.mark.parametrize("query, status, words", [
    ({"kind": "gen", "max_tokens": 2}, 400, "query: a gen node needs an 'input'"),
    ({"kind": "seq", "children": [{"kind": "wat", "text": "x"}]}, 400, "query.children[0]: unknown kind"),
    (rag([{"kind": "retrieve", "corpus": "nope", "ids": ["1"]}]), 400, "unknown corpus 'nope'"),
    (rag([{"kind": "fragment", "text": "word " * 1200}]), 400, "the context is 1024"),
    ({"kind": "user", "text": "x"}, 400, "the root must be a gen"),
    (rag(DOCS, logprobs=True), 400, "query: logprobs must be an integer"),
    (rag([{"kind": "gen", "max_tokens": True, "input": {"kind": "user", "text": "x"}}]), 400,
     "query.input.children[1].children[0]: max_tokens must be an integer"),
    # paths of the client's tree, not of the optimized one (flatten_seq renumbered this to children[2])
    ({"kind": "gen", "max_tokens": 2, "input": {"kind": "seq", "children": [
        {"kind": "seq", "children": [{"kind": "system", "text": "A"}, {"kind": "user", "text": "B"}]},
        {"kind": "plus", "children": [{"kind": "fragment", "text": ""}, {"kind": "fragment", "text": "x"}]}]}},
     400, "query.input.children[1].children[0]: a plus operand must not be empty"),
    (rag(DOCS, "ab\ud800"), 400, "query.input.children[2]: text is not valid Unicode: a lone surrogate at character 2"),
    (rag([{"kind": "gen", "logprobs": 2, "input": {"kind": "user", "text": "x"}}]), 400,
     "query.input.children[1].children[0]: logprobs are returned for the root gen only"),
])
def test_bad_trees_are_400_with_the_node_path(http, query, status, words):
    def post(route, body):  # ASCII JSON: a lone surrogate travels as its \ud800 escape
        return http.post(route, content=json.dumps(body), headers={"content-type": "application/json"})

    r = post("/v1/spans", {"query": query})
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    e = post("/v1/spans/explain", {"query": query})
    assert e.status_code == status and words in e.json()["error"]["message"]
    # in a bulk request, behind a good query, the path names the query: queries[1]...
    b = post("/v1/spans/bulk", {"queries": [rag(DOCS[:1]), query]})
    assert b.status_code == status, b.text
    assert words.replace("query", "queries[1]", 1) in b.json()["error"]["message"]


def test_inner_paths_name_the_clients_nodes_and_the_root_returns_logprobs(http):
    ig = lambda t: {"kind": "gen", "max_tokens": 4, "temperature": 0, "input": {"kind": "seq", "children": [  # noqa: E731
        {"kind": "system", "text": "Summarize."}, {"kind": "fragment", "text": t}, {"kind": "user", "text": "Summary:"}]}}
    query = {"kind": "gen", "max_tokens": 4, "temperature": 0, "logprobs": 2, "input": {"kind": "seq", "children": [
        {"kind": "plus", "children": [ig("The cat sat.\n"), ig("Rain fell.\n")]}, {"kind": "user", "text": "Which?"}]}}
    r = http.post("/v1/spans", json={"query": query})
    assert r.status_code == 200, r.text
    body = r.json()  # the shared system message moved in front of the plus (distribute_plus)
    assert sorted(e["path"] for e in body["inner"]) == [f"query.input.children[0].children[{i}]" for i in (0, 1)]
    lp = body["logprobs"]  # accepted and dropped before; /v1/completions' shape
    assert len(lp["tokens"]) == body["usage"]["completion_tokens"] and all(len(t) == 2 for t in lp["top_logprobs"])
    with http.stream("POST", "/v1/spans", json={"query": query, "stream": True}) as resp:
        frames = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert frames[-1]["logprobs"] == lp and frames[-1]["output"] == body["output"]
    bad = {"fragments": [{"id": "ok", "text": "fine"}, {"id": "bad", "text": "a\ud800"}]}
    r = http.post("/v1/corpora/uni", content=json.dumps(bad), headers={"content-type": "application/json"})
    assert r.status_code == 400 and "fragment 'bad' is not valid Unicode" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route", ["/v1/spans/bulk", "/v1/spans", "/v1/spans:inner", "/v1/spans:inner-sse",
                                   "/v1/corpora/left"])
def test_a_client_that_leaves_a_plain_request_aborts_its_queries(http, route):
    """Non-streamed span queries, bulks and corpus preparations ran to their end after the client
    had gone (a bulk of thousands of queries would have): the routes watch for the disconnect.
    A query whose inner gens run before its first output (:inner) was not watched until then."""
    long = {"kind": "gen", "max_tokens": 600, "temperature": 0, "ignore_eos": True,
            "input": {"kind": "user", "text": "Count from one to a thousand."}}
    inner = {**long, "max_tokens": 300}  # two inner answers and the judge's prompt fit the context
    judge = rag([inner, {**inner, "input": {"kind": "user", "text": "Count from two to a thousand."}}])
    route, _, inner = route.partition(":")
    body = ({"queries": [long] * 4, "concurrency": 4} if route.endswith("bulk")
            else {"query": judge, "stream": inner.endswith("sse")} if inner else {"query": long}
            if route == "/v1/spans" else  # a corpus of 24 fragments of ~780 tokens
            {"fragments": [{"id": f"f{i}", "text": f"part {i}: " + "lorem ipsum dolor " * 110} for i in range(24)],
             "prepare": True})
    # a preparation steps through whole prompt chunks (a float32 chunk of the step budget can take
    # seconds on a loaded 2-core CI machine), so its check waits 6 s for the step in flight and
    # then watches 4 s (24 fragments of ~780 tokens: ~36 s here)
    corpus = route.startswith("/v1/corpora")
    abandon(str(http.base_url).rstrip("/"), route, body, settle_s=6.0 if corpus else 1.5,
            window_s=4.0 if corpus else 1.5)
