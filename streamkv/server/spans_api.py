"""Span queries over HTTP (``streamkv.spans``).

::

    POST   /v1/spans             {"query": <tree>, "stream": false}  -> {"output", "inner", "usage"}
    POST   /v1/spans/explain     {"query": <tree>}                   -> optimized tree + layout (JSON and text)
    POST   /v1/spans/bulk        {"queries": [<tree>...], "order": "clustered"|"given"} -> results in input order
    POST   /v1/corpora/{name}    {"fragments": [{"id", "text"}], "prefix": <text node>} -> size; computes and
                                 caches each fragment after the prefix (as a retrieve after it needs them)
    GET    /v1/spans/cache       cache statistics;  DELETE: drop every unused cached span

Trees are checked (kinds, fields, depth, corpora, token counts) before any work: a bad
one is a 400 whose message starts with the offending node's path.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, StrictBool, StrictInt, StrictStr

from streamkv.engine.async_engine import AsyncEngine
from streamkv.sampling.params import SamplingParams
from streamkv.server.errors import APIError, error_body
from streamkv.server.generation import failure, last_output, new_id, until_disconnected
from streamkv.server.openai_api import completion_logprobs
from streamkv.server.protocol import _Body
from streamkv.spans import ir
from streamkv.spans.bulk import cluster_order
from streamkv.spans.lower import draw_layout

router = APIRouter(prefix="/v1")
MAX_BULK = 2000


class SpanBody(_Body):
    query: dict[str, Any]
    stream: StrictBool = False
    locality_k: Annotated[StrictInt, Field(ge=2)] | None = None
    priority: StrictInt = 0


class ExplainBody(_Body):
    query: dict[str, Any]
    locality_k: Annotated[StrictInt, Field(ge=2)] | None = None


class BulkBody(_Body):
    queries: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_BULK)]
    order: Literal["clustered", "given"] = "clustered"
    concurrency: Annotated[StrictInt, Field(ge=1, le=64)] = 4
    locality_k: Annotated[StrictInt, Field(ge=2)] | None = None


class FragmentIn(_Body):
    id: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    text: StrictStr


class CorpusBody(_Body):
    fragments: Annotated[list[FragmentIn], Field(min_length=1)]
    prepare: StrictBool = True
    prefix: dict[str, Any] | None = None  # text node(s) the fragments will follow in queries


def _engine(request: Request) -> AsyncEngine:
    return request.app.state.streamkv.engine


@router.post("/spans")
async def run_span(body: SpanBody, request: Request) -> Any:
    engine = _engine(request)
    tree = ir.parse(body.query)
    rid = new_id("span")
    t0 = time.perf_counter()
    outputs = _generate(engine, rid, tree, body.priority, body.locality_k)
    # a bad tree is a 400 before the response starts; the inner gens and the prefill all run
    # before the first output, so a client that leaves meanwhile aborts the query (499)
    first = await until_disconnected(request, outputs.__anext__())
    if body.stream:
        return StreamingResponse(_frames(rid, first, outputs, t0, engine.tokenizer), media_type="text/event-stream")

    async def rest() -> Any:
        last = first
        async for out in outputs:
            last = out
        return last
    return _result(rid, await until_disconnected(request, rest()), t0, engine.tokenizer)


def _generate(engine: AsyncEngine, rid: str, tree: ir.Node, priority: int,
              locality_k: int | None) -> AsyncIterator[Any]:
    def submit(e: Any) -> None:
        e.spans.submit(rid, tree, priority, locality_k)

    return engine.generate(rid, "", SamplingParams(), priority=priority, submit=submit)


def _failure(out: Any, what: str = "") -> APIError:
    """The error of a failed query (``what`` heads its message; 503 + Retry-After when it lacked
    room for RETRY_STEPS steps, else 500: ``generation.failure``)."""
    return failure(out, f"{what}span query failed")


def _result(rid: str, out: Any, t0: float, tokenizer: Any) -> dict[str, Any]:
    if out.finish_reason == "error":
        raise _failure(out)
    report = out.metrics.get("spans", {})
    usage = dict(report.get("usage", {}))
    usage["completion_tokens"] = len(out.token_ids)
    return {"id": rid, "object": "span_query", "output": out.text, "finish_reason": out.finish_reason,
            "inner": report.get("inner", []), "usage": usage, "latency_ms": (time.perf_counter() - t0) * 1000.0,
            **({"logprobs": completion_logprobs(out.logprobs, tokenizer)} if out.logprobs is not None else {})}


async def _frames(rid: str, first: Any, outputs: AsyncIterator[Any], t0: float, tokenizer: Any) -> AsyncIterator[str]:
    out = first
    try:
        while True:
            if out.finish_reason == "error":
                failed = _failure(out)
                yield f"data: {json.dumps(error_body(failed.status, failed.message))}\n\n"
                break
            if out.delta_text:
                yield f"data: {json.dumps({'id': rid, 'delta': out.delta_text}, ensure_ascii=False)}\n\n"
            if out.finished:
                yield f"data: {json.dumps(_result(rid, out, t0, tokenizer), ensure_ascii=False)}\n\n"
                break
            out = await outputs.__anext__()
        yield "data: [DONE]\n\n"
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]


@router.post("/spans/explain")
async def explain(body: ExplainBody, request: Request) -> dict[str, Any]:
    tree = ir.parse(body.query)
    info = await _engine(request).call(lambda e: e.spans.explain(tree, body.locality_k))
    return {"optimized": ir.to_json(info["optimized"]), "tree": ir.draw(info["optimized"]),
            "layout": info["layout"], "drawing": draw_layout(info["layout"])}


def _plan_at(e: Any, i: int, tree: ir.Node, locality_k: int | None) -> Any:
    """Query i's plan; its errors name the node under ``queries[i]`` (the planner says "query")."""
    try:
        return e.spans.plan(tree, locality_k)[1]
    except ir.SpanQueryError as exc:
        raise exc.under(f"queries[{i}]") from None


@router.post("/spans/bulk")
async def bulk(body: BulkBody, request: Request) -> dict[str, Any]:
    engine = _engine(request)
    trees = [ir.parse(q, f"queries[{i}]") for i, q in enumerate(body.queries)]
    plans = await engine.call(lambda e: [_plan_at(e, i, t, body.locality_k) for i, t in enumerate(trees)])
    order = cluster_order(plans) if body.order == "clustered" else list(range(len(trees)))
    gate = asyncio.Semaphore(body.concurrency)
    t0 = time.perf_counter()

    async def one(i: int) -> dict[str, Any]:
        async with gate:
            last = None
            async for out in _generate(engine, new_id("span"), trees[i], 0, body.locality_k):
                last = out
            return _result(last.request_id, last, t0, engine.tokenizer)

    tasks = {i: asyncio.ensure_future(one(i)) for i in order}  # created (and admitted) in execution order

    async def gather() -> dict[int, dict[str, Any]]:
        try:
            return {i: await t for i, t in tasks.items()}
        finally:  # a failed query, or the client gone: the others stop too
            for t in tasks.values():
                t.cancel()
    results = await until_disconnected(request, gather())
    return {"object": "span_bulk", "order": order, "results": [results[i] for i in range(len(trees))],
            "elapsed_ms": (time.perf_counter() - t0) * 1000.0}


@router.post("/corpora/{name}")
async def add_corpus(name: str, body: CorpusBody, request: Request) -> dict[str, Any]:
    frags = {f.id: f.text for f in body.fragments}
    if len(frags) != len(body.fragments):
        raise APIError(400, "fragment ids must be unique", param="fragments")
    prefix = ir.parse(body.prefix, "prefix") if body.prefix is not None else None
    engine = _engine(request)
    # a prefix or fragment the preparation cannot run is refused before the corpus changes
    info = await engine.call(lambda e: e.spans.add_corpus(name, frags, prefix, check_prepare=body.prepare))
    out: dict[str, Any] = {"object": "corpus", "name": name, **info}
    if body.prepare:  # compute and cache every fragment after the prefix now
        rid = new_id("prep")
        outputs = engine.generate(rid, "", SamplingParams(), submit=lambda e: e.spans.prepare(rid, name, prefix))
        last = await until_disconnected(request, last_output(outputs))  # a client gone: aborted, 499
        if last is None:
            raise APIError(500, f"preparing corpus {name!r} failed: no output")
        if last.finish_reason == "error":
            raise _failure(last, f"preparing corpus {name!r}: ")
        out["prepared"] = last.metrics["spans"]["usage"]
    return out


@router.get("/spans/cache")
async def cache_stats(request: Request) -> dict[str, Any]:
    return await _engine(request).call(lambda e: e.spans.cache_info())


@router.delete("/spans/cache")
async def clear_cache(request: Request) -> dict[str, Any]:
    return {"evicted": await _engine(request).call(lambda e: e.spans.cache.clear())}
