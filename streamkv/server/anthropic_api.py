"""Anthropic-compatible ``POST /v1/messages`` (plain and streamed)."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from streamkv.engine.outputs import RequestOutput
from streamkv.server.errors import APIError
from streamkv.server.generation import (chat_prompt_ids, check_model, check_output, kv_extension, kv_options,
                                       make_params, new_id, resolve_max_tokens, run_all, stream_all)
from streamkv.server.protocol import MessagesRequest, message_text
from streamkv.server.state import ServerState

router = APIRouter()


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


def _stop_reason(out: RequestOutput) -> tuple[str, str | None]:
    if out.finish_reason == "length":
        return "max_tokens", None
    if out.stop_str is not None:
        return "stop_sequence", out.stop_str
    return "end_turn", None


def _prompt(req: MessagesRequest, state: ServerState) -> list[int]:
    messages = [{"role": m.role, "content": message_text(m.content)} for m in req.messages]
    if req.system:
        messages.insert(0, {"role": "system", "content": message_text(req.system)})
    return chat_prompt_ids(state.engine, messages)


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request) -> Any:
    state: ServerState = request.app.state.streamkv
    check_model(req.model, state.model_name)
    ids = _prompt(req, state)
    params = make_params(max_tokens=resolve_max_tokens(req.max_tokens, len(ids), state.limits),
                         temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                         stop=tuple(req.stop_sequences or ()))
    kv = kv_options(state, req)
    mid = new_id("msg").replace("-", "_")
    message = {"id": mid, "type": "message", "role": "assistant", "model": state.model_name}
    if req.stream:
        return StreamingResponse(_events(state, request, message, mid, ids, params, kv), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    (out,) = await run_all(state.engine, mid, [ids], [params], 0, kv)
    check_output(out)
    state.observe(out, request)
    reason, seq = _stop_reason(out)
    return {**message, "content": [{"type": "text", "text": out.text}], "stop_reason": reason,
            "stop_sequence": seq, "usage": {"input_tokens": len(ids), "output_tokens": len(out.token_ids)},
            **kv_extension([out])}


async def _events(state: ServerState, request: Request, message: dict[str, Any], mid: str, ids: list[int],
                  params: Any, kv: dict[str, Any]) -> AsyncIterator[str]:
    yield _event("message_start", {"message": {**message, "content": [], "stop_reason": None,
                                               "stop_sequence": None,
                                               "usage": {"input_tokens": len(ids), "output_tokens": 0}}})
    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    try:
        async for _, out in stream_all(state.engine, mid, [ids], [params], 0, kv):
            check_output(out)
            if out.delta_text:
                yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                           "text": out.delta_text}})
            if out.finished:
                state.observe(out, request)
                reason, seq = _stop_reason(out)
                yield _event("content_block_stop", {"index": 0})
                yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                               "usage": {"output_tokens": len(out.token_ids)},
                                               **kv_extension([out])})
                yield _event("message_stop", {})
    except APIError as exc:
        yield _event("error", {"error": {"type": "api_error", "message": exc.message}})
