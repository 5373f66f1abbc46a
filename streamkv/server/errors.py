"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from streamkv.errors import (EngineDeadError, InputStreamClosedError, InputStreamNotFoundError, InvalidRequestError,
                             KVCacheFullError, QueueFullError, SessionExistsError, SessionMovedError,
                             SessionNotFoundError)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error",
          499: "client_closed_request", 503: "service_unavailable", 500: "internal_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": None, "code": None}}


# the status of each engine error, here and in the exception handlers below
# (first match wins: KVCacheFullError is an InvalidRequestError, but a retryable one)
_STATUS: dict[type, int] = {KVCacheFullError: 503, InvalidRequestError: 400, QueueFullError: 429, SessionNotFoundError: 404,
                            SessionMovedError: 503, SessionExistsError: 409, InputStreamNotFoundError: 404,
                            InputStreamClosedError: 409, EngineDeadError: 503}


def status_of(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, message) of an error raised after a streaming response has started, reported
    in-band: an engine refusal keeps its 4xx / 503; anything else is a 500."""
    if isinstance(exc, APIError):
        return exc.status, exc.message
    status = next((code for kind, code in _STATUS.items() if isinstance(exc, kind)), None)
    return (status, str(exc)) if status is not None else (500, f"{type(exc).__name__}: {exc}")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    first = errs[0]
    if first.get("type") == "json_invalid":  # its loc is the offset in the body, not a field
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')}", None
    # the field's path: names and list indices, not the type tags pydantic adds per union branch
    # ("prompt.str", "temperature.int", "messages.0.content.str": review)
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _type_tag(p)]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def _type_tag(part: object) -> bool:
    """A pydantic loc part naming a type or validator (``str``, ``list[int]``,
    ``function-after[...]``, ``constrained-str``) rather than a field or an index."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "tuple", "set", "none", "any"})


def install_error_handlers(app: Any) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), getattr(exc, "param", None))

    @app.exception_handler(KVCacheFullError)
    async def _kv_full(_: Request, exc: KVCacheFullError) -> JSONResponse:  # no block for a fork now
        return error_response(503, str(exc), headers={"Retry-After": "1"})

    @app.exception_handler(QueueFullError)
    async def _full(_: Request, exc: QueueFullError) -> JSONResponse:
        retry = max(1, int(round(getattr(exc, "retry_after", 1.0))))
        return error_response(429, str(exc), headers={"Retry-After": str(retry)})

    @app.exception_handler(SessionNotFoundError)
    async def _no_session(_: Request, exc: SessionNotFoundError) -> JSONResponse:
        return error_response(404, str(exc), param="session_id")

    @app.exception_handler(SessionMovedError)
    async def _session_moved(_: Request, exc: SessionMovedError) -> JSONResponse:
        return error_response(503, str(exc), param="session_id", code="session_moved", headers={"Retry-After": "1"})

    @app.exception_handler(SessionExistsError)
    async def _session_exists(_: Request, exc: SessionExistsError) -> JSONResponse:
        return error_response(409, str(exc), param="id")

    @app.exception_handler(InputStreamNotFoundError)
    async def _no_input(_: Request, exc: InputStreamNotFoundError) -> JSONResponse:
        return error_response(404, str(exc), param="id")

    @app.exception_handler(InputStreamClosedError)
    async def _input_closed(_: Request, exc: InputStreamClosedError) -> JSONResponse:
        return error_response(409, str(exc), param="id")

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}")
