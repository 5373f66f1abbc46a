"""Anthropic-compatible ``POST /v1/messages`` (plain and streamed)."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from streamkv.engine.outputs import RequestOutput
from streamkv.errors import InvalidRequestError
from streamkv.server import tools as tools_mod
from streamkv.server.errors import APIError, status_of
from streamkv.server.generation import (chat_prompt_ids, check_model, check_output, kv_extension, kv_options,
                                       make_params, new_id, resolve_max_tokens, run_all, stream_all)
from streamkv.server.protocol import MessagesRequest, message_text
from streamkv.server.state import ServerState
from streamkv.server.structured import compile_guided

router = APIRouter()


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


def _stop_reason(out: RequestOutput, calls: list[Any] = ()) -> tuple[str, str | None]:
    if out.finish_reason == "length":
        return "max_tokens", None
    if out.stop_str is not None:
        return "stop_sequence", out.stop_str
    return ("tool_use" if calls else "end_turn"), None


def _prompt(req: MessagesRequest, state: ServerState, tools: list[Any], choice: Any) -> list[int]:
    try:
        messages = tools_mod.anthropic_messages(req.messages)
        if req.system:
            messages.insert(0, {"role": "system", "content": message_text(req.system)})
        rendered = tools_mod.render(messages, tools, choice)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="messages") from None
    return chat_prompt_ids(state.engine, rendered)


def _content(out: RequestOutput, tools: list[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Content blocks of an output: its text, then a ``tool_use`` block per parsed call."""
    if not tools:
        return [{"type": "text", "text": out.text}], []
    text, calls = tools_mod.parse_calls(out.text, tools)
    blocks = ([{"type": "text", "text": text}] if text or not calls else []) + [c.anthropic() for c in calls]
    return blocks, calls


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request) -> Any:
    state: ServerState = request.app.state.streamkv
    check_model(req.model, state.model_name)
    try:
        tools, choice = tools_mod.anthropic_tools(req.tools, req.tool_choice)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="tool_choice" if "tool_choice" in str(exc) else "tools") from None
    ids = _prompt(req, state, tools, choice)
    guided = tools_mod.constraint(choice, tools)
    params = make_params(max_tokens=resolve_max_tokens(req.max_tokens, len(ids), state.limits),
                         temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                         stop=tuple(req.stop_sequences or ()), guided=guided)
    await compile_guided(state.engine, guided, "tools")
    tools = tools if choice != "none" else []
    kv = kv_options(state, req)
    mid = new_id("msg").replace("-", "_")
    message = {"id": mid, "type": "message", "role": "assistant", "model": state.model_name}
    if req.stream:
        outputs = await stream_all(state.engine, mid, [ids], [params], 0, kv)
        return StreamingResponse(_events(state, request, message, ids, outputs, tools),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    (out,) = await run_all(state.engine, mid, [ids], [params], 0, kv, client=request)
    check_output(out)
    state.observe(out, request)
    content, calls = _content(out, tools)
    reason, seq = _stop_reason(out, calls)
    return {**message, "content": content, "stop_reason": reason,
            "stop_sequence": seq, "usage": {"input_tokens": len(ids), "output_tokens": len(out.token_ids)},
            **kv_extension([out])}


# Anthropic's error types by status (an in-band ``error`` event)
_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
                503: "overloaded_error"}


async def _events(state: ServerState, request: Request, message: dict[str, Any], ids: list[int],
                  outputs: AsyncIterator[tuple[int, Any]], tools: list[Any]) -> AsyncIterator[str]:
    """Block 0 is text (with tools, held back where a ``<tool_call>`` may start); parsed calls
    follow as ``tool_use`` blocks, each with its input as one ``input_json_delta``."""
    yield _event("message_start", {"message": {**message, "content": [], "stop_reason": None,
                                               "stop_sequence": None,
                                               "usage": {"input_tokens": len(ids), "output_tokens": 0}}})
    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    sent = 0
    try:
        async for _, out in outputs:
            check_output(out)
            upto = len(out.text) - (tools_mod.held_back(out.text) if tools and not out.finished else 0)
            text, calls = out.text[sent:upto], []
            if out.finished and tools:
                text, calls = tools_mod.parse_calls(out.text[sent:], tools)
            if text:
                yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
            sent = max(sent, upto)
            if out.finished:
                state.observe(out, request)
                reason, seq = _stop_reason(out, calls)
                yield _event("content_block_stop", {"index": 0})
                for k, call in enumerate(calls, start=1):
                    block = call.anthropic()
                    yield _event("content_block_start", {"index": k, "content_block": {**block, "input": {}}})
                    yield _event("content_block_delta", {"index": k, "delta": {"type": "input_json_delta",
                                                                               "partial_json": call.arguments}})
                    yield _event("content_block_stop", {"index": k})
                yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                               "usage": {"output_tokens": len(out.token_ids)},
                                               **kv_extension([out])})
                yield _event("message_stop", {})
    except Exception as exc:  # the response has started: report in-band
        status, text = status_of(exc)
        yield _event("error", {"error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": text}})
