"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from streamkv.errors import InvalidRequestError
from streamkv.server import tools as tools_mod
from streamkv.server.errors import APIError, error_body, status_of
from streamkv.server.generation import (chat_prompt_ids, check_model, check_output, finish_reason, kv_extension,
                                        kv_options, make_params, new_id, per_choice, resolve_max_tokens, run_all,
                                        stream_all, token_text)
from streamkv.server.protocol import ChatCompletionRequest, CompletionRequest, message_text
from streamkv.server.state import ServerState
from streamkv.server.structured import compile_guided, guided_spec

router = APIRouter()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI usage; ``cached``: prompt tokens whose KV came from the prefix cache
    (``prompt_tokens_details.cached_tokens``)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def cached_prompt_tokens(cached: dict[int, int], n: int) -> int:
    """Prefix-cache tokens of the prompts behind choice indexes ``i`` (prompt ``i // n``): per
    prompt, the fewest any of its ``n`` choices had (a prompt is counted once in usage)."""
    per_prompt: dict[int, int] = {}
    for i, c in cached.items():
        per_prompt[i // n] = min(c, per_prompt.get(i // n, c))
    return sum(per_prompt.values())


def _cache_mark(outs: list[Any]) -> dict[str, Any]:
    """``"cached": true`` when every choice came from the response cache."""
    return {"cached": True} if outs and all(o.cached for o in outs) else {}


def sampling_fields(req: Any) -> dict[str, Any]:
    return dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop,
                stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens)


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.streamkv
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                        "owned_by": "streamkv", "max_model_len": state.limits.max_model_len}]}


# ------------------------------------------------------------------ completions
def _completion_prompts(req: CompletionRequest, state: ServerState) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        batch: list[Any] = [p]
    elif p and all(isinstance(t, int) for t in p):
        batch = [p]
    else:
        batch = list(p)
    if not batch:
        raise APIError(400, "prompt must not be empty", param="prompt")
    out = []
    for item in batch:
        try:
            ids = state.engine.engine.check_prompt(item)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="prompt") from None
        out.append(ids)
    return out


def completion_logprobs(lps_in: list[Any] | None, tokenizer: Any, pos: int = 0) -> dict[str, Any] | None:
    """The ``logprobs`` object of a completion choice; ``pos``: the text offset of the first
    token (a stream's chunk starts where the text sent before it ends)."""
    if lps_in is None:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    for lp in lps_in:
        text = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        lps.append(lp.logprob)
        tops.append({token_text(tokenizer, t): v for t, v in lp.top})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.streamkv
    check_model(req.model, state.model_name)
    prompts = _completion_prompts(req, state)
    guided, field = guided_spec(req)
    base = make_params(max_tokens=resolve_max_tokens(req.max_tokens, max(len(p) for p in prompts), state.limits),
                       logprobs=req.logprobs, guided=guided, **sampling_fields(req))
    await compile_guided(state.engine, guided, field)
    flat_prompts = [p for p in prompts for _ in range(req.n)]
    flat_params = [c for p in prompts for c in per_choice(base, req.n, state, p)]
    kv = kv_options(state, req)
    rid, created = new_id("cmpl"), int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        outputs = await stream_all(state.engine, rid, flat_prompts, flat_params, req.priority, kv)
        return stream_sse(completion_chunks(state, request, head, outputs, include_usage,
                                            sum(len(p) for p in prompts), req.n))
    outs = await run_all(state.engine, rid, flat_prompts, flat_params, req.priority, kv, client=request)
    choices = []
    for i, out in enumerate(outs):
        check_output(out)
        state.observe(out, request)
        choices.append({"index": i, "text": out.text, "logprobs": completion_logprobs(out.logprobs, state.tokenizer),
                        "finish_reason": finish_reason(out)})
    totals = usage(sum(len(p) for p in prompts), sum(len(o.token_ids) for o in outs),
                   cached_prompt_tokens({i: o.num_cached_tokens for i, o in enumerate(outs)}, req.n))
    return {**head, "choices": choices, "usage": totals, **_cache_mark(outs), **kv_extension(outs)}


@dataclass(frozen=True)
class ChunkEnds:
    """What a stream's ends carry: ``extension(out)``, the fields a finished choice's chunk adds
    (the ``streamkv`` extension); ``usage(counted)``, the usage chunk's body from the one counted
    over the choices (an input stream's adds what it computed)."""

    extension: Callable[[Any], dict[str, Any]] = lambda out: kv_extension([out])
    usage: Callable[[dict[str, Any]], dict[str, Any]] = lambda counted: counted


async def completion_chunks(state: ServerState, request: Request, head: dict[str, Any],
                            outputs: AsyncIterator[tuple[int, Any]], include_usage: bool,
                            prompt_tokens: int, n: int = 1, ends: ChunkEnds | None = None) -> AsyncIterator[str]:
    """SSE ``text_completion`` chunks of ``(choice index, output)`` pairs (``n`` choices per prompt);
    ``ends``: what a finished choice's chunk and the usage chunk carry (default: the KV report,
    the usage counted here)."""
    ends = ends or ChunkEnds()
    completion_tokens = 0
    cached: dict[int, int] = {}
    sent: dict[int, int] = {}
    offset: dict[int, int] = {}  # by choice: the text offset after the tokens sent so far
    async for i, out in outputs:
        check_output(out)
        if not (out.delta_text or out.finished):
            continue
        lp = None
        if out.logprobs is not None:
            lp = completion_logprobs(out.logprobs[sent.get(i, 0):], state.tokenizer, offset.get(i, 0))
            sent[i] = len(out.logprobs)
            offset[i] = offset.get(i, 0) + sum(len(t) for t in lp["tokens"])
        chunk = {**head, "choices": [{"index": i, "text": out.delta_text, "logprobs": lp,
                                      "finish_reason": finish_reason(out)}]}
        if include_usage:
            chunk["usage"] = None
        if out.finished:
            completion_tokens += len(out.token_ids)
            cached[i] = out.num_cached_tokens
            state.observe(out, request)
            chunk.update(ends.extension(out))
        yield _sse(chunk)
    if include_usage:
        yield _sse({**head, "choices": [], "usage": ends.usage(usage(prompt_tokens, completion_tokens,
                                                                      cached_prompt_tokens(cached, n)))})


# ------------------------------------------------------------- chat completions
def _chat_tools(req: ChatCompletionRequest) -> tuple[list[tools_mod.Tool], Any]:
    """The request's tools and resolved ``tool_choice`` (400 on bad ones)."""
    try:
        tools = tools_mod.parse_tools(req.tools)
        return tools, tools_mod.resolve_choice(req.tool_choice, tools)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="tool_choice" if "tool_choice" in str(exc) else "tools") from None


def _chat_prompt(req: ChatCompletionRequest, state: ServerState, tools: list[Any], choice: Any) -> list[int]:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m.content),
                 "tool_calls": [(c.function.name, c.function.arguments) for c in m.tool_calls or []]}
                for m in req.messages]
    try:
        rendered = tools_mod.render(messages, tools, choice)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="messages") from None
    return chat_prompt_ids(state.engine, rendered)


def _chat_message(out: Any, tools: list[Any], choice: Any) -> tuple[dict[str, Any], str | None]:
    """The assistant message of an output (its tool calls parsed) and its finish reason."""
    if not tools or choice == "none":
        return {"role": "assistant", "content": out.text, "refusal": None}, finish_reason(out)
    content, calls = tools_mod.parse_calls(out.text, tools)
    msg: dict[str, Any] = {"role": "assistant", "content": content or None, "refusal": None}
    if calls:
        msg["tool_calls"] = [c.openai() for c in calls]
    return msg, "tool_calls" if calls and out.finish_reason == "stop" else finish_reason(out)


def chat_logprobs(lps: list[Any], tokenizer: Any) -> dict[str, Any]:
    def entry(token_id: int, value: float) -> dict[str, Any]:
        return {"token": token_text(tokenizer, token_id), "logprob": value,
                "bytes": list(tokenizer.token_bytes(token_id))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps], "refusal": None}


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
    state: ServerState = request.app.state.streamkv
    check_model(req.model, state.model_name)
    tools, choice = _chat_tools(req)
    ids = _chat_prompt(req, state, tools, choice)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    guided, field = guided_spec(req)
    forced = tools_mod.constraint(choice, tools)
    if forced is not None and guided is not None:
        raise APIError(400, f"{field} cannot be combined with a required or named tool_choice", param=field)
    guided, field = (forced, "tools") if forced is not None else (guided, field)
    base = make_params(max_tokens=resolve_max_tokens(requested, len(ids), state.limits, param),
                       logprobs=logprobs, guided=guided, **sampling_fields(req))
    await compile_guided(state.engine, guided, field)
    params = per_choice(base, req.n, state, ids)
    kv = kv_options(state, req)
    rid, created = new_id("chatcmpl"), int(time.time())
    head = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        outputs = await stream_all(state.engine, rid, [ids] * req.n, params, req.priority, kv)
        return stream_sse(chat_chunks(state, request, {**head, "object": "chat.completion.chunk"}, outputs, req.n,
                                      len(ids), include_usage, tools if choice != "none" else []))
    outs = await run_all(state.engine, rid, [ids] * req.n, params, req.priority, kv, client=request)
    choices = []
    for i, out in enumerate(outs):
        check_output(out)
        state.observe(out, request)
        message, reason = _chat_message(out, tools, choice)
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(out.logprobs, state.tokenizer) if out.logprobs is not None else None,
                        "finish_reason": reason})
    cached = cached_prompt_tokens({i: o.num_cached_tokens for i, o in enumerate(outs)}, req.n)
    return {**head, "choices": choices, "usage": usage(len(ids), sum(len(o.token_ids) for o in outs), cached),
            **_cache_mark(outs), **kv_extension(outs)}


async def chat_chunks(state: ServerState, request: Request, head: dict[str, Any],
                      outputs: AsyncIterator[tuple[int, Any]], n: int, prompt_tokens: int,
                      include_usage: bool, tools: list[Any] = (), ends: ChunkEnds | None = None) -> AsyncIterator[str]:
    """SSE ``chat.completion.chunk``s of ``(choice index, output)`` pairs over ``n`` choices.
    With ``tools``, text that may start a ``<tool_call>`` is held back; at the end the calls go
    out as one ``tool_calls`` delta (finish reason ``tool_calls``). ``ends``: as for
    :func:`completion_chunks`."""
    ends = ends or ChunkEnds()
    extra = {"usage": None} if include_usage else {}
    for i in range(n):
        yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}], **extra})
    completion_tokens = 0
    cached: dict[int, int] = {}
    sent: dict[int, int] = {}
    sent_text: dict[int, int] = {}  # characters of each choice's text sent as content (tools)
    async for i, out in outputs:
        check_output(out)
        if not (out.delta_text or out.finished):
            continue
        lp = None
        if out.logprobs is not None:
            lp = chat_logprobs(out.logprobs[sent.get(i, 0):], state.tokenizer)
            sent[i] = len(out.logprobs)
        delta, reason = ({"content": out.delta_text} if out.delta_text else {}), finish_reason(out)
        if tools:
            delta, reason = _tool_delta(out, tools, sent_text, i)
        yield _sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                         "finish_reason": reason}], **extra,
                    **(ends.extension(out) if out.finished else {})})
        if out.finished:
            completion_tokens += len(out.token_ids)
            cached[i] = out.num_cached_tokens
            state.observe(out, request)
    if include_usage:
        yield _sse({**head, "choices": [], "usage": ends.usage(usage(prompt_tokens, completion_tokens,
                                                                      cached_prompt_tokens(cached, n)))})


def _tool_delta(out: Any, tools: list[Any], sent_text: dict[int, int], i: int) -> tuple[dict[str, Any], str | None]:
    """The delta of choice ``i`` when tools may be called: content up to a possible ``<tool_call>``;
    at the end, the rest and the parsed calls."""
    text, done = out.text, sent_text.get(i, 0)
    if not out.finished:
        upto = len(text) - tools_mod.held_back(text)
        sent_text[i] = max(done, upto)
        return ({"content": text[done:upto]} if upto > done else {}), None
    content, calls = tools_mod.parse_calls(text[done:], tools)
    delta: dict[str, Any] = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [c.openai(index=k) for k, c in enumerate(calls)]
    return delta, "tool_calls" if calls and out.finish_reason == "stop" else finish_reason(out)


def stream_sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:  # the response has started: report in-band
            yield _sse(error_body(*status_of(exc)))
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
