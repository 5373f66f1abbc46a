"""Flash queries over HTTP: /v1/sessions/{id}/flash, and answers that need no model work.

``instant_answer`` is the query fast path: it runs on the event loop and reads the session's
flash cache and ready-position answer directly (the engine thread only ever swaps whole
dicts or adds keys there), so a flash hit does not wait for an engine step.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request

from streamkv.engine.async_engine import AsyncEngine
from streamkv.server.session_protocol import FlashSpec
from streamkv.server.structured import compile_guided, guided_spec
from streamkv.server.state import ServerState
from streamkv.sessions.flash import FlashAnswer

router = APIRouter(prefix="/v1/sessions")
WAIT_TIMEOUT_S = 120.0


def _engine(request: Request) -> AsyncEngine:
    state: ServerState = request.app.state.streamkv
    return state.engine


@router.post("/{session_id}/flash", status_code=201)
async def register_flash(session_id: str, body: FlashSpec, request: Request) -> dict[str, Any]:
    guided, field = guided_spec(body)
    await compile_guided(_engine(request), guided, field)

    def reg(e: Any) -> dict[str, Any]:
        session = e.sessions.get(session_id)
        return e.sessions.flash.register(session, body.question, body.max_tokens, float(body.temperature),
                                         guided=guided).to_dict()

    return await _engine(request).call(reg)


@router.get("/{session_id}/flash")
async def list_flash(session_id: str, request: Request) -> dict[str, Any]:
    def read(e: Any) -> dict[str, Any]:
        session = e.sessions.get(session_id)
        data = []
        for q in session.flash.questions.values():
            per = session.flash.cache.get(q.id)
            latest = next(reversed(per.values())).event() if per else None
            data.append({**q.to_dict(), "latest": latest})
        return {"object": "list", "data": data, "stats": e.sessions.flash.stats(session)}

    return await _engine(request).call(read)


@router.delete("/{session_id}/flash/{question_id}")
async def delete_flash(session_id: str, question_id: str, request: Request) -> dict[str, Any]:
    await _engine(request).call(lambda e: e.sessions.flash.unregister(e.sessions.get(session_id), question_id))
    return {"id": question_id, "object": "flash_question", "deleted": True}


def flash_result(ans: FlashAnswer, session_id: str, t0: float) -> dict[str, Any]:
    return {"object": "session.answer", "session_id": session_id, "answer": ans.answer,
            "data_version": ans.data_version, "finish_reason": ans.finish_reason, "source": "flash",
            "question_id": ans.question_id, "confidence": ans.confidence,
            "usage": {"prompt_tokens": ans.prompt_tokens, "completion_tokens": len(ans.token_ids),
                      "total_tokens": ans.prompt_tokens + len(ans.token_ids), "computed_prompt_tokens": 0},
            "latency_ms": (time.perf_counter() - t0) * 1000.0}


def ready_result(ready: dict[str, Any], session_id: str, t0: float) -> dict[str, Any]:
    return {"object": "session.answer", "session_id": session_id, "answer": ready["answer"],
            "data_version": ready["data_version"], "finish_reason": "stop", "source": "ready",
            "confidence": {"first": ready["gap"], "min": ready["gap"]},
            "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1, "computed_prompt_tokens": 0},
            "latency_ms": (time.perf_counter() - t0) * 1000.0}


def instant_answer(engine: AsyncEngine, session_id: str, question: str, t0: float) -> dict[str, Any] | None:
    """A flash hit or ready-position exit for the current version, read without the engine thread."""
    manager = engine.engine.sessions
    session = manager.sessions.get(session_id)
    if session is None:
        return None
    kind, ans = manager.flash.lookup(session, question)
    if kind == "hit":
        return flash_result(ans, session_id, t0)
    ready = manager.ready_forks.exit_answer(session)
    return ready_result(ready, session_id, t0) if ready is not None else None


async def wait_for_flash(engine: AsyncEngine, session_id: str, question: str, t0: float) -> dict[str, Any] | None:
    """If an evaluation of this registered question at the current version is in flight,
    wait for it instead of duplicating it; None when there is nothing to wait for.

    Only a registered flash question can be in flight, and the registry is readable off the
    engine thread (``FlashState.find``): an ordinary question skips the engine round trip,
    which waits for the running step to end (commands are drained between steps), so a session
    question paid one or two step boundaries before its fork existed."""
    session = engine.engine.sessions.sessions.get(session_id)
    if session is not None and session.flash.find(question) is None:
        return None
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def ready(ans: FlashAnswer | None) -> None:
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(ans))

    kind, ans = await engine.call(lambda e: e.sessions.flash.lookup(e.sessions.get(session_id), question, ready))
    if kind == "hit":
        return flash_result(ans, session_id, t0)
    if kind == "miss":
        return None
    try:
        ans = await asyncio.wait_for(fut, WAIT_TIMEOUT_S)
    except asyncio.TimeoutError:  # the evaluation did not land in time: a plain question (it was a 500)
        return None
    return flash_result(ans, session_id, t0) if ans is not None else None
