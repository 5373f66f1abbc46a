"""/v1/sessions: live sessions over HTTP (create, push, query, events over SSE and WebSocket).

Every session call runs on the engine thread between two steps (``AsyncEngine.call``), so
it waits at most one engine step; a query then runs as a SESSION-class request.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from streamkv.engine.async_engine import AsyncEngine
from streamkv.errors import QueueFullError, SessionExistsError, SessionMovedError, StreamKVError
from streamkv.server.errors import APIError, error_body
from streamkv.server.flash_api import instant_answer, wait_for_flash
from streamkv.server.generation import failure, last_output, make_params, new_id, until_disconnected
from streamkv.server.session_protocol import CreateSession, PushData, SessionQuery
from streamkv.server.state import ServerState
from streamkv.server.structured import compile_guided, guided_spec
from streamkv.sessions.session import valid_session_id
from streamkv.sessions.spec import SessionSpec

router = APIRouter(prefix="/v1/sessions")
BLOCK_TIMEOUT_S = 30.0
KEEPALIVE_S = 15.0


def _engine(request: Request | WebSocket) -> AsyncEngine:
    state: ServerState = request.app.state.streamkv
    return state.engine


def _spec_param(message: str, fields: dict[str, Any]) -> str | None:
    """The spec field a validation message is about: the one it starts with (spec errors name
    their field first: ``kv_write snapstream: ...``, ``"evict": ...``), else None."""
    head = message.lstrip('"')
    return next((f for f in sorted(fields, key=len, reverse=True) if head.startswith(f)), None)


@router.post("", status_code=201)
async def create_session(body: CreateSession, request: Request) -> dict[str, Any]:
    fields = body.model_dump()
    flash = fields.pop("flash")
    session_id = fields.pop("id")
    if session_id is not None and not valid_session_id(session_id):
        raise APIError(400, "id must be 8-64 characters of [A-Za-z0-9_-]", param="id")
    try:
        spec = SessionSpec(**fields)
    except ValueError as exc:
        raise APIError(400, str(exc), param=_spec_param(str(exc), fields)) from None
    guided = [guided_spec(q) for q in flash]
    for g, field in guided:
        await compile_guided(_engine(request), g, field)

    def create(e: Any) -> dict[str, Any]:
        if session_id is not None and e.sessions.exists(session_id):
            raise SessionExistsError(f"session {session_id!r} already exists")
        session = e.sessions.create(spec, session_id)
        try:
            for q, (g, _) in zip(flash, guided):
                e.sessions.flash.register(session, q["question"], q["max_tokens"], float(q["temperature"]), guided=g)
        except Exception:
            e.sessions.delete(session.id)
            raise
        out = e.sessions.stats(session.id)
        out["flash_questions"] = [q.to_dict() for q in session.flash.questions.values()]
        return out

    return await _engine(request).call(create)


@router.get("")
async def list_sessions(request: Request) -> dict[str, Any]:
    data = await _engine(request).call(lambda e: [e.sessions.stats(sid) for sid in e.sessions.sessions])
    return {"object": "list", "data": data}


@router.get("/{session_id}")
async def get_session(session_id: str, request: Request, include_tokens: bool = False,
                      include_text: bool = False) -> dict[str, Any]:
    """``include_text``: each window record also carries its text, decoded from the stream's
    tokens (null while the session's KV is offloaded)."""
    def read(e: Any) -> dict[str, Any]:
        out = e.sessions.stats(session_id)
        layout = e.sessions.layout(session_id)
        if include_text:
            ids = layout["stream_ids"]
            for rec in layout["records"]:
                rec["text"] = None if ids is None else e.tokenizer.decode(ids[rec["start"]:rec["end"]])
        if not include_tokens:
            layout.pop("stream_ids", None)
        out["layout"] = layout
        return out

    return await _engine(request).call(read)


@router.delete("/{session_id}")
async def delete_session(session_id: str, request: Request) -> dict[str, Any]:
    await _engine(request).call(lambda e: e.sessions.delete(session_id))
    return {"id": session_id, "object": "session", "deleted": True}


@router.post("/{session_id}/release")
async def release_session(session_id: str, request: Request) -> dict[str, Any]:
    """Hand the session to --session-dir and forget it here: the source half of a migration
    (the cluster ingress then routes it to its new owner, which adopts it from the dir)."""
    stats = await _engine(request).call(lambda e: e.sessions.release(session_id))
    return {"id": session_id, "object": "session", "released": True, "data_version": stats["data_version"]}


@router.post("/{session_id}/adopt")
async def adopt_session(session_id: str, request: Request) -> dict[str, Any]:
    """Load the session from the shared --session-dir onto this replica (the target half of a
    migration, or a failover the ingress decided); a no-op when it is live here already."""
    def adopt(e: Any) -> dict[str, Any]:
        e.sessions.adopt(session_id)
        return e.sessions.stats(session_id)

    return await _engine(request).call(adopt)


@router.post("/{session_id}/data", status_code=202)
async def push_data(session_id: str, body: PushData, request: Request) -> dict[str, Any]:
    return await push_records(_engine(request), session_id, body.records)


async def push_records(engine: AsyncEngine, session_id: str, records: list[str]) -> dict[str, Any]:
    """Push under the session's overflow policy; ``block`` waits for room (up to 30 s)."""
    deadline = time.monotonic() + BLOCK_TIMEOUT_S
    policy: str | None = None
    while True:
        try:
            return await engine.call(lambda e: e.sessions.push(session_id, records))
        except QueueFullError:
            if policy is None:  # the spec is frozen: read it once
                policy = await engine.call(lambda e: e.sessions.get(session_id).spec.overflow)
            if policy != "block" or time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.02)


@router.post("/{session_id}/query")
async def query_session(session_id: str, body: SessionQuery, request: Request) -> Any:
    engine = _engine(request)
    t0 = time.perf_counter()
    guided, field = guided_spec(body)
    params = make_params(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                         top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=body.stop, guided=guided)
    await compile_guided(engine, guided, field)
    instant = None if guided else instant_answer(engine, session_id, body.question, t0)
    if instant is None and guided is None:
        instant = await wait_for_flash(engine, session_id, body.question, t0)
    if instant is not None:
        return _instant_stream(instant) if body.stream else instant
    rid = new_id("squery")
    info: dict[str, Any] = {}

    def submit(e: Any) -> None:  # runs again if the engine fails the fork for want of blocks
        info.update(e.sessions.query(session_id, rid, body.question, params, count=not info))

    outputs = engine.generate(rid, "", params, submit=submit, again=True)
    state: ServerState = request.app.state.streamkv
    if body.stream:
        first = await _first(outputs)  # errors (404, 400, 429) surface before the 200
        frames = _stream(first, outputs, info, session_id, t0, lambda out: state.observe(out, request))
        return StreamingResponse(frames, media_type="text/event-stream")
    last = await until_disconnected(request, last_output(outputs))  # a client gone: aborted, 499
    if last is None:
        raise APIError(500, "query failed: no output")
    if last.error:  # 503 when no KV block came for its fork (retryable), else 500
        raise failure(last, "query failed")
    state.observe(last, request)
    return _answer(last, info, session_id, t0)


def _instant_stream(result: dict[str, Any]) -> StreamingResponse:
    async def frames() -> AsyncIterator[str]:
        delta = {"delta": result["answer"], "data_version": result["data_version"]}
        yield f"data: {json.dumps(delta, ensure_ascii=False)}\n\n"
        yield f"data: {json.dumps(result, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream")


async def _first(outputs: AsyncIterator[Any]) -> Any:
    return await outputs.__anext__()


def _usage(info: dict[str, Any], completion: int) -> dict[str, int]:
    return {"prompt_tokens": info.get("prompt_tokens", 0), "completion_tokens": completion,
            "total_tokens": info.get("prompt_tokens", 0) + completion,
            "computed_prompt_tokens": info.get("computed_prompt_tokens", 0)}


def _answer(out: Any, info: dict[str, Any], session_id: str, t0: float) -> dict[str, Any]:
    return {"object": "session.answer", "session_id": session_id, "answer": out.text,
            "data_version": info.get("data_version"), "finish_reason": out.finish_reason, "source": "session",
            "usage": _usage(info, len(out.token_ids)), "latency_ms": (time.perf_counter() - t0) * 1000.0}


async def _stream(first: Any, outputs: AsyncIterator[Any], info: dict[str, Any], session_id: str,
                  t0: float, observe: Any) -> AsyncIterator[str]:
    out = first
    try:
        while True:
            if out.error:
                err = failure(out, "query failed")
                yield f"data: {json.dumps(error_body(err.status, err.message))}\n\n"
                return
            if out.delta_text:
                yield f"data: {json.dumps({'delta': out.delta_text, 'data_version': info.get('data_version')})}\n\n"
            if out.finished:
                observe(out)
                yield f"data: {json.dumps(_answer(out, info, session_id, t0), ensure_ascii=False)}\n\n"
                yield "data: [DONE]\n\n"
                return
            out = await outputs.__anext__()
    finally:
        await outputs.aclose()


# ------------------------------------------------------------------- events
async def _subscribe(engine: AsyncEngine, session_id: str) -> tuple[asyncio.Queue, Any]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def listener(event: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    await engine.call(lambda e: e.sessions.get(session_id).listeners.append(listener))
    return queue, listener


async def _unsubscribe(engine: AsyncEngine, session_id: str, listener: Any) -> None:
    def drop(e: Any) -> None:
        session = e.sessions.sessions.get(session_id)
        if session is not None and listener in session.listeners:
            session.listeners.remove(listener)

    try:
        await engine.call(drop)
    except Exception:
        pass


@router.get("/{session_id}/events")
async def session_events(session_id: str, request: Request) -> StreamingResponse:
    engine = _engine(request)
    queue, listener = await _subscribe(engine, session_id)

    async def frames() -> AsyncIterator[str]:
        try:
            yield ": subscribed\n\n"
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                yield f"id: {event['id']}\nevent: {event['event']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
                if event["event"] in ("deleted", "migrated"):
                    return
        finally:
            await _unsubscribe(engine, session_id, listener)

    return StreamingResponse(frames(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.websocket("/{session_id}/ws")
async def session_ws(websocket: WebSocket, session_id: str) -> None:
    """Frames in: ``{"type": "push", "records": [...]}``; frames out: ``{"type": "ack", ...}``,
    ``{"type": "error", "error": {...}}`` and every session event (``{"type": "event", ...}``)."""
    engine = _engine(websocket)
    try:
        queue, listener = await _subscribe(engine, session_id)
    except SessionMovedError as exc:  # 1012 "service restart": reconnect (the ingress does)
        await websocket.accept()
        await websocket.close(code=1012, reason=str(exc)[:120])
        return
    except StreamKVError as exc:
        await websocket.close(code=4404, reason=str(exc)[:120])
        return
    await websocket.accept()
    sender = asyncio.ensure_future(_forward_events(websocket, queue))
    try:
        while True:
            raw = await websocket.receive_text()
            await websocket.send_json(await _ws_frame(engine, session_id, raw))
    except (WebSocketDisconnect, RuntimeError):  # RuntimeError: closed by the sender (migrated)
        pass
    finally:
        sender.cancel()
        await _unsubscribe(engine, session_id, listener)


async def _forward_events(websocket: WebSocket, queue: asyncio.Queue) -> None:
    while True:
        event = await queue.get()
        await websocket.send_json({"type": "event", **event})
        if event["event"] == "migrated":  # 1012 "service restart": reconnect (the ingress does)
            await websocket.close(code=1012, reason="session migrated")
            return


async def _ws_frame(engine: AsyncEngine, session_id: str, raw: str) -> dict[str, Any]:
    try:
        frame = json.loads(raw)
        if not isinstance(frame, dict) or frame.get("type") != "push":
            return {"type": "error", **error_body(400, "frames must be JSON objects with type 'push'")}
        body = PushData.model_validate({"records": frame.get("records")})
        return {"type": "ack", **await push_records(engine, session_id, body.records)}
    except json.JSONDecodeError:
        return {"type": "error", **error_body(400, "frame is not valid JSON")}
    except ValidationError as exc:
        return {"type": "error", **error_body(400, f"records: {exc.errors()[0].get('msg', 'invalid')}")}
    except QueueFullError as exc:
        return {"type": "error", **error_body(429, str(exc))}
    except SessionMovedError as exc:  # released here meanwhile: nothing applied, retry
        return {"type": "error", **error_body(503, str(exc))}
    except StreamKVError as exc:
        status = 404 if isinstance(exc, KeyError) else 400
        return {"type": "error", **error_body(status, str(exc))}



