"""Shared plumbing of the generation routes: limits, sampling params, fan-out over n choices."""
from __future__ import annotations

import asyncio
import secrets
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Sequence, TypeVar

from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.outputs import RequestOutput
from streamkv.errors import InvalidRequestError
from streamkv.sampling.params import SamplingParams, prompt_seed
from streamkv.server.errors import APIError


T = TypeVar("T")


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"model {requested!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def resolve_max_tokens(requested: int | None, prompt_len: int, limits: Limits, param: str = "max_tokens") -> int:
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {limits.max_model_len} tokens; "
                            f"the prompt has {prompt_len} tokens.", param="messages" if param != "max_tokens"
                       else "prompt", code="context_length_exceeded")
    if requested is None:
        return room
    if requested < 1:
        raise APIError(400, f"{param} must be at least 1, got {requested}", param=param)
    if requested > room:
        raise APIError(400, f"This model's maximum context length is {limits.max_model_len} tokens. However, "
                            f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                            f"{requested} for the completion).", param=param, code="context_length_exceeded")
    return requested


def make_params(**kwargs: Any) -> SamplingParams:
    """SamplingParams from request fields (None means default); bad values -> 400."""
    clean = {k: v for k, v in kwargs.items() if v is not None}
    try:
        return SamplingParams(**clean)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def chat_prompt_ids(engine: AsyncEngine, messages: list[dict[str, str]]) -> list[int]:
    """Render the chat template and tokenize + validate like the engine will; bad input -> 400."""
    try:
        return engine.engine.check_prompt(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="messages") from None


def per_choice(params: SamplingParams, n: int, state: Any = None, ids: Sequence[int] = ()) -> list[SamplingParams]:
    """n choices: a seeded request gives choice i the seed ``seed + i`` (distinct yet reproducible).
    With ``--seed-from-prompt`` an unseeded sampled request's seed is FNV-1a(``ids``) (the engine
    does that for n = 1; for n > 1 it is set here, so the choices still differ)."""
    from dataclasses import replace

    if (n > 1 and params.seed is None and not params.greedy and state is not None
            and state.engine.engine.config.cache.seed_from_prompt):
        params = replace(params, seed=prompt_seed(ids))
    if params.seed is None or n == 1:
        return [params] * n
    return [replace(params, seed=(params.seed + i) % (2 ** 64)) for i in range(n)]


def kv_options(state: Any, req: Any) -> dict[str, Any]:
    """The request's ``kv_write`` / ``kv_read`` (checked now: a 400 naming the problem)."""
    kv = {"kv_write": req.kv_write, "kv_read": req.kv_read}
    try:
        state.engine.engine.kv_policies.resolve(**kv)
    except InvalidRequestError as exc:
        param = "kv_read" if str(exc).startswith("kv_read") else "kv_write"
        raise APIError(400, str(exc), param=param) from None
    return kv


def kv_extension(outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """``{"streamkv": {"kv": ...}}`` for requests with a KV policy (a list with several choices)."""
    reports = [o.kv for o in outs]
    if all(r is None for r in reports):
        return {}
    return {"streamkv": {"kv": reports[0] if len(reports) == 1 else reports}}


async def run_all(engine: AsyncEngine, base_id: str, prompts: Sequence[Any], params: Sequence[SamplingParams],
                  priority: int, kv: dict[str, Any] | None = None, *, client: Any) -> list[RequestOutput]:
    """Non-streaming: final output of every (prompt, params) pair, in order. A ``client`` (the
    HTTP request) that disconnects first aborts them all (499; they ran to their end before)."""
    admission = engine.admit(len(prompts))

    async def one(i: int) -> RequestOutput:
        last = await last_output(engine.generate(f"{base_id}-{i}", prompts[i], params[i], priority, kv=kv,
                                                 admitted=admission))
        if last is None:
            raise APIError(500, "the engine returned no output")
        return last

    async def every() -> list[RequestOutput]:
        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    try:
        return await until_disconnected(client, every())
    finally:
        admission.release()


_ACCEPTED = object()  # a choice's mark in stream_all()'s queue: the engine accepted it


async def stream_all(engine: AsyncEngine, base_id: str, prompts: Sequence[Any], params: Sequence[SamplingParams],
                     priority: int, kv: dict[str, Any] | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Streaming: starts every choice and returns once the engine has accepted them all, so that
    a refusal (a validation error, a full queue) raises here, before a response has started, and
    gets its status; then the iterator yields ``(choice index, output)`` as they come. A refusal
    of one choice aborts the others; closing the iterator aborts every choice."""
    admission = engine.admit(len(prompts))
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in engine.generate(f"{base_id}-{i}", prompts[i], params[i], priority, kv=kv, admitted=admission,
                                             on_accept=lambda: queue.put_nowait((i, _ACCEPTED))):
                await queue.put((i, out))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(prompts))]
    pending, early = set(range(len(prompts))), []
    try:
        while pending:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is _ACCEPTED:
                pending.discard(i)
            else:                 # an accepted choice's output while another is not yet accepted
                early.append((i, item))
    except BaseException:
        _cancel(tasks)
        raise
    finally:
        admission.release()  # every accepted choice took its place; the others never will
    return _Choices(queue, tasks, early)


def _cancel(tasks: list[asyncio.Future]) -> None:
    for t in tasks:
        try:
            t.cancel()
        except RuntimeError:  # the loop is closed: nothing left to abort
            pass


class _Choices:
    """A streamed request's running choices: ``async for (index, output)``. Running out of
    outputs, an error, closing it, or dropping it (a response body that never started because
    the client left first) cancels every choice's task, which aborts its request."""

    def __init__(self, queue: asyncio.Queue, tasks: list[asyncio.Future],
                 early: list[tuple[int, RequestOutput]]) -> None:
        self._queue, self._early, self._remaining = queue, early, len(tasks)
        self._finalizer = weakref.finalize(self, _cancel, tasks)

    def __aiter__(self) -> "_Choices":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._remaining:
            self._finalizer()
            raise StopAsyncIteration
        try:
            i, item = self._early.pop(0) if self._early else await self._queue.get()
        except BaseException:
            self._finalizer()
            raise
        if isinstance(item, Exception):
            self._finalizer()
            raise item
        if item.finished:
            self._remaining -= 1
        return i, item

    async def aclose(self) -> None:
        self._finalizer()


async def until_disconnected(request: Any, work: Awaitable[T], poll_s: float = 0.25) -> T:
    """``work``'s result, unless the client disconnects first: then the work is cancelled (its
    engine requests aborted) and a 499 raised. For non-streaming routes (``run_all``, span
    queries and bulks): without it an abandoned request ran to its end, holding its KV blocks."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "the client closed the request")
    finally:
        task.cancel()


async def last_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """The final output of a request's stream (None if it yielded none); with
    :func:`until_disconnected`, a client that leaves closes the stream, which aborts the request."""
    last = None
    async for out in outputs:
        last = out
    return last


def failure(out: RequestOutput, what: str = "generation failed") -> APIError:
    """A failed output's error (``what`` heads its message): a 503 with Retry-After when it failed
    for room (``out.retry``: KV blocks held by others too long; retry later), else a 500."""
    if out.retry:
        return APIError(503, f"{what}, retry later: {out.error}", headers={"Retry-After": "1"})
    return APIError(500, f"{what}: {out.error}")


def check_output(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise failure(out)


def token_text(tokenizer: Any, token_id: int) -> str:
    raw = tokenizer.token_bytes(token_id)
    if raw:
        return raw.decode("utf-8", errors="replace")
    return tokenizer.decode([token_id], skip_special_tokens=False)


def finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    return "length" if out.finish_reason == "length" else "stop"
