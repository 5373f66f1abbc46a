"""Pure-ASGI middleware: body size limit (413), API key (401), access log and request metrics."""
from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any, Callable

from streamkv.server.errors import error_body

log = logging.getLogger("streamkv.access")
OPEN_PATHS = frozenset({"/health", "/ui", "/ui/app.js", "/ui/style.css"})  # no data behind these


async def _send_error(send: Callable, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


class GuardMiddleware:
    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, metrics: Any) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "websocket" and self.api_key and not self._authorized(scope):
            await receive()  # the websocket.connect message
            await send({"type": "websocket.close", "code": 1008, "reason": "missing or invalid API key"})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500, "started": False, "logged": False}
        path = scope.get("path", "")

        async def send_logged(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                status["logged"] = True
                self._log(scope, path, status["code"], start)

        if self.api_key and path not in OPEN_PATHS and not self._authorized(scope):
            await _send_error(send_logged, 401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                              [(b"www-authenticate", b"Bearer")])
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body:
            await _send_error(send_logged, 413, f"request body of {declared} bytes exceeds the limit of "
                                                f"{self.max_body} bytes")
            return
        received = {"n": 0, "over": False, "answered": False}

        async def receive_limited() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                received["n"] += len(message.get("body", b""))
                if received["n"] > self.max_body:
                    received["over"] = True
                    raise _TooLarge()
            return message

        async def send_guarded(message: dict) -> None:
            # the framework turns a failed body read into its own 400: answer 413 instead
            if received["over"]:
                if not received["answered"]:
                    received["answered"] = True
                    await _send_error(send_logged, 413, f"request body exceeds the limit of {self.max_body} bytes")
                return
            await send_logged(message)

        failed = False
        try:
            await self.app(scope, receive_limited, send_guarded)
        except _TooLarge:
            await send_guarded({})
        except Exception:
            failed = True
            raise
        finally:  # a response begun and never ended: the client left mid-stream (no line, no count
            if status["started"] and not status["logged"]:  # before; a plain request's is a 499),
                self._log(scope, path, 500 if failed else 499, start)  # or the route failed mid-stream

    def _authorized(self, scope: dict) -> bool:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        key = headers.get(b"x-api-key", b"").decode("latin-1")
        token = auth[7:] if auth.lower().startswith("bearer ") else key
        return bool(token) and hmac.compare_digest(token.encode(), self.api_key.encode())  # type: ignore[union-attr]

    def _log(self, scope: dict, path: str, status: int, start: float) -> None:
        state = scope.get("state") or {}
        tokens = f"{state['tokens_in']}+{state['tokens_out']}" if "tokens_in" in state else "-"
        # the route's template (``/v1/sessions/{session_id}``), never the raw path: a label per
        # session id or per fuzzed path would grow the metrics without bound
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        self.metrics.requests.labels(route=route, status=str(status)).inc()
        log.info("%s %s %d tokens=%s %.1fms", scope.get("method", "-"), path, status, tokens,
                 (time.perf_counter() - start) * 1e3)


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers") or []:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
