"""The ingress HTTP app: the single server's routes, each sent where it belongs.

=================================  ==========================================================
route                              goes to
=================================  ==========================================================
POST /v1/sessions                  the new id's owner (the ingress names it if the client did not)
GET  /v1/sessions                  every live replica, merged
/v1/sessions/{id}/events (SSE)     the owner, re-subscribed across moves (streams.py)
/v1/sessions/{id}/ws               the owner, reconnected across moves (streams.py)
POST /v1/sessions/{id}/migrate     the ingress itself (moves.py)
/v1/sessions/{id}/...              the owner
/v1/input_streams/{id}/...         the replica that opened it
/v1/corpora/{name}, /v1/spans/cache every live replica
/health, /metrics, /v1/cluster...  the ingress itself
anything else                      the least-loaded replica
=================================  ==========================================================
"""
from __future__ import annotations

import hmac
import json
from typing import Any, Callable

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictStr

from streamkv.cluster import moves, streams
from streamkv.cluster.proxy import Proxy
from streamkv.server.errors import APIError, error_body, install_error_handlers
from streamkv.sessions.session import valid_session_id

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
_AFFINE = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
INTERNAL = ("release", "adopt")  # replica routes only the ingress calls


class MigrateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: StrictStr | None = None


def _key_ok(request: Request | WebSocket, api_key: str | None) -> bool:
    return not api_key or hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {api_key}")


def _check_key(request: Request | WebSocket, api_key: str | None) -> None:
    if not _key_ok(request, api_key):
        raise APIError(401, "missing or wrong API key (Authorization: Bearer KEY)")


def affinity_key(body: bytes) -> str | None:
    """The system prompt (or the first 512 characters of the prompt) of a generation request."""
    try:
        fields = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(fields, dict):
        return None
    if isinstance(fields.get("system"), str):
        return fields["system"]
    msgs = fields.get("messages")
    if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict) and isinstance(msgs[0].get("content"), str):
        return msgs[0]["content"]
    return fields["prompt"][:512] if isinstance(fields.get("prompt"), str) else None


def create_ingress_app(get_proxy: Callable[[], Proxy], api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="streamkv cluster", version="0.1.0")
    install_error_handlers(app)

    async def proxy_for(request: Request | WebSocket, own: bool = False) -> Proxy:
        if own:
            _check_key(request, api_key)
        proxy = get_proxy()
        await proxy.start()
        return proxy

    @app.get("/health")
    async def health(request: Request) -> Response:
        proxy = await proxy_for(request)
        return Response(status_code=200 if proxy.router.up_names() else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        proxy = await proxy_for(request, own=True)
        return Response(proxy.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/cluster")
    async def cluster(request: Request) -> dict[str, Any]:
        return (await proxy_for(request, own=True)).status()

    @app.post("/v1/cluster/replicas/{name}/drain")
    async def drain(name: str, request: Request) -> dict[str, Any]:
        return await moves.drain(await proxy_for(request, own=True), name)

    @app.post("/v1/cluster/replicas/{name}/undrain")
    async def undrain(name: str, request: Request) -> dict[str, Any]:
        return moves.undrain(await proxy_for(request, own=True), name)

    @app.post("/v1/sessions/{session_id}/migrate")
    async def migrate(session_id: str, request: Request, body: MigrateBody | None = None) -> dict[str, Any]:
        proxy = await proxy_for(request, own=True)
        return await moves.migrate(proxy, session_id, body.to if body else None)

    @app.get("/v1/sessions/{session_id}/events")
    async def events(session_id: str, request: Request) -> Response:
        proxy = await proxy_for(request, own=True)
        return await streams.session_events(proxy, session_id)

    @app.websocket("/v1/sessions/{session_id}/ws")
    async def session_ws(websocket: WebSocket, session_id: str) -> None:
        if not _key_ok(websocket, api_key):
            await websocket.close(code=4401)
            return
        await streams.session_ws(await proxy_for(websocket), websocket, session_id)

    @app.websocket("/v1/input_streams/{stream_id}/ws")
    async def input_ws(websocket: WebSocket, stream_id: str) -> None:
        if not _key_ok(websocket, api_key):
            await websocket.close(code=4401)
            return
        proxy = await proxy_for(websocket)
        if proxy.inputs.is_closed(stream_id):  # as one server answers a finished input's socket
            await websocket.accept()
            await websocket.send_json({"type": "error", **error_body(409, f"input stream {stream_id!r} is closed")})
            await websocket.close(code=4409)
            return
        try:
            with proxy.inputs.relaying(stream_id):
                await streams.relay_ws(proxy, websocket, f"/v1/input_streams/{stream_id}/ws",
                                       proxy.inputs.get(stream_id))
        finally:  # a finish over the socket closed it there (a task of its own: this one may be cancelled)
            proxy.check_input_later(stream_id)

    @app.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def anything(path: str, request: Request) -> Response:
        if not path.startswith("ui"):  # the page itself is open, as on one server
            _check_key(request, api_key)  # before the ingress acts on the request's behalf
        return await route(await proxy_for(request), request, "/" + path)

    return app


async def route(proxy: Proxy, request: Request, path: str) -> Response:
    body = await request.body()
    parts = path.strip("/").split("/")
    if parts[:2] == ["v1", "sessions"]:
        if len(parts) == 2:
            if request.method == "POST":
                return await proxy.create_session(request, body)
            return JSONResponse(await proxy.list_sessions())
        if not valid_session_id(parts[2]):
            raise APIError(404, f"session {parts[2]!r} does not exist", param="session_id")
        if len(parts) > 3 and parts[3] in INTERNAL:
            raise APIError(404, f"/{parts[3]} is the cluster's own step of a migration; use /migrate")
        resp = await proxy.to_session(request, parts[2], body)
        if request.method == "DELETE" and len(parts) == 3 and resp.status_code == 200:
            await proxy.forget_session(parts[2])
        return resp
    if parts[:2] == ["v1", "input_streams"]:
        if len(parts) == 2 and request.method == "POST":
            return await proxy.create_input(request, body)
        if len(parts) > 2:
            return await proxy.to_input(request, parts[2], body)
    if parts[:2] == ["v1", "corpora"] and len(parts) == 3 and request.method == "POST":
        return await proxy.fan_out(request, body, remember=parts[2])
    if parts == ["v1", "spans", "cache"]:
        return await proxy.fan_out(request, body)
    key = affinity_key(body) if proxy.config.prefix_affinity and path in _AFFINE else None
    return await proxy.to_any(request, body, key)
