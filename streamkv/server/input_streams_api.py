"""/v1/input_streams: requests whose prompt streams in (append / update / finish), over HTTP and WebSocket.

::

    POST /v1/input_streams                {"prompt": "..."} | {"messages": [...]}  -> 201 {"id": "istr_..."}
                                          (+ "kv_write" / "kv_read": applied at finish)
    POST /v1/input_streams/{id}/append    {"text": "..."}   -> {"tokens": N, "computed": M}
    POST /v1/input_streams/{id}/update    {"text": "..."}   -> {"tokens": N, "lcp": K, "invalidated": J}
    POST /v1/input_streams/{id}/finish    {"stream": false} -> text_completion | chat.completion (or SSE)
                                          (+ "text": a last piece, appended first)
    GET  /v1/input_streams/{id}           -> state;   DELETE -> abort
    WS   /v1/input_streams/{id}/ws        frames {"type": "append"|"update"|"finish", ...}

Every change runs on the engine thread between two steps; the arrived input is prefilled
while more is coming (``streamkv.inputs``).
"""
from __future__ import annotations

import json
import secrets
import time
from contextlib import aclosing
from typing import Annotated, Any, AsyncIterator

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from streamkv.engine.async_inputs import AsyncInputStream
from streamkv.engine.outputs import RequestOutput
from streamkv.errors import InputStreamNotFoundError, StreamKVError
from streamkv.server.errors import APIError, error_body, status_of
from streamkv.server.generation import (check_model, check_output, failure, finish_reason, kv_options, last_output,
                                        make_params, until_disconnected)
from streamkv.server.openai_api import (ChunkEnds, chat_chunks, chat_logprobs, completion_chunks, completion_logprobs,
                                        sampling_fields, stream_sse, usage)
from streamkv.server.protocol import ChatMessage, StreamOptions, _Body, _Sampling, message_text
from streamkv.server.state import ServerState
from streamkv.server.structured import compile_guided, guided_spec

router = APIRouter(prefix="/v1/input_streams")


class OpenInput(_Sampling):
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None  # chat form (wins over max_tokens)
    # an int (alternatives per token, /v1/completions' form) or, with messages, true + top_logprobs
    logprobs: StrictBool | Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None  # refused with a 400 (see _open_params), never ignored
    tool_choice: StrictStr | dict[str, Any] | None = None
    kv_write: dict[str, Any] | None = None  # KV policies, applied once the input is finished
    kv_read: dict[str, Any] | None = None


class InputText(_Body):
    text: StrictStr


class FinishInput(_Body):
    text: StrictStr | None = None  # the last piece of input: appended with the finish (both, or neither)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_request_fields(cls, data: Any) -> Any:
        """The request's fields are fixed at open: one sent at finish is a 400, not silently
        ignored (other unknown fields are ignored, as on every route)."""
        late = _late_fields(data)
        if late:
            raise ValueError(late)
        return data


# fields of the open body that finish refuses (``model`` may be repeated: any client sends it)
_OPEN_ONLY = frozenset(OpenInput.model_fields) - {"stream", "stream_options", "model"}


def _late_fields(data: Any) -> str | None:
    """The error for open-only fields in a finish body or frame, None when it has none."""
    late = sorted(k for k in data if k in _OPEN_ONLY) if isinstance(data, dict) else []
    if not late:
        return None
    return (f"{', '.join(late)} cannot change at finish: the request's fields are set when the input "
            "is opened (finish takes stream and stream_options)")


def _state(request: Request | WebSocket) -> ServerState:
    return request.app.state.streamkv


@router.post("", status_code=201)
async def open_input(body: OpenInput, request: Request) -> dict[str, Any]:
    state = _state(request)
    check_model(body.model, state.model_name)
    if body.n != 1:
        raise APIError(400, "input streams generate one choice (n=1)", param="n")
    for name in ("stream", "stream_options"):  # an answer's delivery is chosen when it starts
        if name in body.model_fields_set and getattr(body, name) not in (None, False):
            raise APIError(400, f"{name} goes with finish (the answer starts there), not with open", param=name)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of 'prompt' or 'messages'")
    if any(m.tool_calls for m in body.messages or []):  # the stream's template renders text turns only
        raise APIError(400, "input streams take text messages; a turn with tool_calls goes to "
                            "/v1/chat/completions", param="messages")
    guided, field = guided_spec(body)
    opened, fit = _open_params(body, state.limits.max_model_len)
    params = make_params(guided=guided, **opened, **sampling_fields(body))
    await compile_guided(state.engine, guided, field)
    messages = None if body.messages is None else [
        {"role": "system" if m.role == "developer" else m.role, "content": message_text(m.content)}
        for m in body.messages]
    rid = f"istr_{secrets.token_hex(12)}"
    handle = await state.engine.open_input(rid, body.prompt, messages, params, body.priority, kv_options(state, body),
                                           fit_max_tokens=fit)
    info = await handle.info()
    return {"id": rid, "object": "input_stream", "kind": "chat" if messages else "completion", **info}


def _open_params(body: OpenInput, context: int) -> tuple[dict[str, Any], bool]:
    """``max_tokens`` and ``logprobs`` from the open body, read as /v1/completions reads them
    (a prompt) or /v1/chat/completions (messages); a field the stream cannot honour is a 400.
    The flag: the input must leave room for all of ``max_tokens`` (an explicit one, or a prompt
    stream's default 16, as on /v1/completions); "the rest of the context" is what it leaves."""
    chat = body.messages is not None
    if body.tools or body.tool_choice not in (None, "none"):
        raise APIError(400, "input streams do not take tools (the growing message is rendered without tool "
                            "schemas); send the final messages to /v1/chat/completions",
                       param="tools" if body.tools else "tool_choice")
    for name in ("max_completion_tokens", "top_logprobs"):
        if not chat and getattr(body, name) is not None:
            raise APIError(400, f"{name} is a chat field: this stream has a prompt (as /v1/completions)", param=name)
    if isinstance(body.logprobs, bool) and not chat:
        raise APIError(400, "logprobs is an integer 0-5 for a prompt stream (as /v1/completions)", param="logprobs")
    if body.top_logprobs is not None and body.logprobs is not True:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs is True else (None if body.logprobs is False else body.logprobs)
    chosen = body.max_completion_tokens is not None
    requested = body.max_completion_tokens if chosen else body.max_tokens
    param = "max_completion_tokens" if chosen else "max_tokens"
    if requested is not None and not 1 <= requested < context:
        raise APIError(400, f"{param} must be in [1, {context - 1}] (the context is {context} tokens), "
                            f"got {requested}", param=param)
    # a prompt stream reads /v1/completions' default: 16 when absent, the rest of the context
    # when sent as null (it took 16 for both)
    whole = requested is None and (chat or "max_tokens" in body.model_fields_set)
    return {"max_tokens": requested or (context if whole else 16), "logprobs": logprobs}, not whole


@router.get("/{stream_id}")
async def get_input(stream_id: str, request: Request) -> dict[str, Any]:
    info = await _state(request).engine.call(lambda e: e.inputs.get(stream_id).info())
    return {"id": stream_id, "object": "input_stream", **info}


@router.delete("/{stream_id}")
async def delete_input(stream_id: str, request: Request) -> dict[str, Any]:
    def drop(e: Any) -> None:
        e.inputs.get(stream_id)  # 404 / 409 first
        e.abort(stream_id)

    await _state(request).engine.call(drop)
    return {"id": stream_id, "object": "input_stream", "deleted": True}


@router.post("/{stream_id}/append")
async def append_input(stream_id: str, body: InputText, request: Request) -> dict[str, int]:
    return await (await _handle(request, stream_id)).append(body.text)


@router.post("/{stream_id}/update")
async def update_input(stream_id: str, body: InputText, request: Request) -> dict[str, int]:
    return await (await _handle(request, stream_id)).update(body.text)


@router.post("/{stream_id}/finish")
async def finish_input(stream_id: str, request: Request, body: FinishInput | None = None) -> Any:
    state, body = _state(request), body or FinishInput()
    handle = await _handle(request, stream_id)
    # the last piece and the finish in one change: refused (a 400: past the context, or a
    # write policy that cannot hold it), the input stays open as it was
    info = await handle.finish(body.text or None)
    chat = info["chat"]
    head = {"id": stream_id, "created": int(time.time()), "model": state.model_name,
            "object": "chat.completion" if chat else "text_completion"}
    if body.stream:
        return stream_sse(_sse(state, request, head, handle, chat, info,
                               bool(body.stream_options and body.stream_options.include_usage)))
    last = await until_disconnected(request, last_output(handle.outputs()))  # a client gone: aborted, 499
    if last is None:
        raise APIError(500, "the engine returned no output")
    check_output(last)
    state.observe(last, request)
    return _final_body(state, head, last, chat, info)


async def _handle(request: Request | WebSocket, stream_id: str) -> AsyncInputStream:
    engine = _state(request).engine
    handle = engine.input_stream(stream_id)
    # a socket asks the engine even with a handle: the handle outlives the input while its
    # answer runs, and a socket accepted then answered every frame with a 409
    if handle is None or isinstance(request, WebSocket):
        await engine.call(lambda e: e.inputs.get(stream_id))  # closed: 409, unknown: 404
    if handle is None:
        raise InputStreamNotFoundError(f"input stream {stream_id!r} was not opened over HTTP")
    return handle


def _extension(out: RequestOutput) -> dict[str, Any]:
    return {"events": [{"event": name, "t": round(t, 6)} for name, t in out.events],
            "tokens_invalidated": int(out.metrics.get("tokens_invalidated", 0)),
            "num_preemptions": int(out.metrics.get("num_preemptions", 0)),
            **({"kv": out.kv} if out.kv is not None else {})}


def _usage(out: RequestOutput, info: dict[str, int]) -> dict[str, int]:
    return {**usage(len(out.prompt_token_ids), len(out.token_ids)), "computed_prompt_tokens": info["computed"]}


def _final_body(state: ServerState, head: dict[str, Any], out: RequestOutput, chat: bool,
                info: dict[str, int]) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text, "refusal": None},
                  "logprobs": chat_logprobs(out.logprobs, state.tokenizer) if out.logprobs is not None else None,
                  "finish_reason": finish_reason(out)}
    else:
        choice = {"index": 0, "text": out.text, "logprobs": completion_logprobs(out.logprobs, state.tokenizer),
                  "finish_reason": finish_reason(out)}
    return {**head, "choices": [choice], "usage": _usage(out, info), "streamkv": _extension(out)}


async def _sse(state: ServerState, request: Request, head: dict[str, Any], handle: AsyncInputStream, chat: bool,
               info: dict[str, int], include_usage: bool) -> AsyncIterator[str]:
    last: list[RequestOutput] = []

    async def pairs() -> AsyncIterator[tuple[int, RequestOutput]]:
        async for out in handle.outputs():
            last[:] = [out]
            yield 0, out

    # the chunks a plain request's stream has: the extension on the finished choice's chunk (a
    # chunk of its own, with no choices, broke clients reading choices[0]: review), the usage
    # chunk only if asked for, with what the stream computed
    ends = ChunkEnds(extension=lambda out: {"streamkv": _extension(out)},
                     usage=lambda counted: _usage(last[0], info) if last else counted)
    if chat:
        head = {**head, "object": "chat.completion.chunk"}
        chunks = chat_chunks(state, request, head, pairs(), 1, info["tokens"], include_usage, ends=ends)
    else:
        chunks = completion_chunks(state, request, head, pairs(), include_usage, info["tokens"], ends=ends)
    async for chunk in chunks:
        yield chunk


# ----------------------------------------------------------------- websocket
@router.websocket("/{stream_id}/ws")
async def input_ws(websocket: WebSocket, stream_id: str) -> None:
    """Frames in: ``{"type": "append"|"update", "text": ...}``, ``{"type": "finish"}`` (with an
    optional last ``"text"``). Frames out:
    ``{"type": "ack", ...}`` per change, ``{"type": "error", "error": {...}}`` (the stream is
    unchanged), and after finish ``{"type": "output", "delta_text": ..., ...}`` until ``finished``."""
    try:
        handle = await _handle(websocket, stream_id)
    except StreamKVError as exc:
        # accepted first: a close before the handshake reaches the client as a bare HTTP 403
        await websocket.accept()
        await websocket.send_json({"type": "error", **error_body(_status(exc), str(exc))})
        await websocket.close(code=4000 + _status(exc), reason=str(exc)[:120])
        return
    await websocket.accept()
    try:
        while True:
            frame = await _ws_frame(websocket, handle)
            if frame is None:
                break
    except WebSocketDisconnect:
        # A socket gone while it reads its answer has aborted it (the outputs' iterator, closed
        # early, does). A socket that only sent changes leaves the input as it is: what it sent
        # was acknowledged, and another client may be finishing it; idle inputs expire (TTL).
        return
    await websocket.close()


async def _ws_frame(websocket: WebSocket, handle: AsyncInputStream) -> dict[str, Any] | None:
    """Handle one frame; returns None once the request finished (its outputs were sent)."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    try:
        raw = message["text"] if message.get("text") is not None else (message.get("bytes") or b"").decode()
        frame = json.loads(raw)  # a binary frame is read as UTF-8 JSON too (it crashed the handler)
        if not isinstance(frame, dict) or frame.get("type") not in ("append", "update", "finish"):
            raise APIError(400, "frames must be JSON objects with type 'append', 'update' or 'finish'")
        kind = frame["type"]
        if kind == "finish":
            late = _late_fields(frame)
            if late:
                raise APIError(400, late)
            last = frame.get("text")  # the last piece, with the finish in one change (as over HTTP)
            await handle.finish(InputText.model_validate({"text": last}).text if last is not None else None)
            await _ws_answer(websocket, handle)
            return None
        text = InputText.model_validate({"text": frame.get("text")}).text
        ack = await (handle.append(text) if kind == "append" else handle.update(text))
        reply = {"type": "ack", "op": kind, **ack}
    except (json.JSONDecodeError, UnicodeDecodeError):
        reply = {"type": "error", **error_body(400, "frame is not valid JSON")}
    except ValidationError:
        reply = {"type": "error", **error_body(400, "text must be a string")}
    except APIError as exc:
        reply = {"type": "error", **error_body(exc.status, exc.message)}
    except StreamKVError as exc:
        reply = {"type": "error", **error_body(_status(exc), str(exc))}
    await websocket.send_json(reply)
    return reply


async def _ws_answer(websocket: WebSocket, handle: AsyncInputStream) -> None:
    """Send the finished input's outputs as ``output`` frames (a failed answer ends with an
    ``error`` frame instead) and count it in the server's metrics, as the HTTP finish does."""
    async with aclosing(handle.outputs()) as outputs:  # left early (client gone): aborted
        async for out in outputs:
            if out.finished and out.finish_reason == "error":
                err = failure(out)
                await websocket.send_json({"type": "error", **error_body(err.status, err.message)})
                return
            if out.finished:
                _state(websocket).observe(out, websocket)
            await websocket.send_json({"type": "output", "delta_text": out.delta_text,
                                       "finished": out.finished, "finish_reason": finish_reason(out),
                                       **({"text": out.text, "streamkv": _extension(out)} if out.finished else {})})


def _status(exc: StreamKVError) -> int:
    """The status an HTTP call gets for ``exc`` (a full KV cache or a stopped engine: 503, not 400)."""
    return status_of(exc)[0]
