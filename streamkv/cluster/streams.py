"""Subscriptions that outlive a move: the ingress keeps the client's one SSE stream or
WebSocket and re-subscribes at the session's new owner.

A replica ends a session's event stream with a ``migrated`` event (SSE) or close code 1012
(WebSocket) when it releases the session, and the stream breaks when the replica dies.
Either way the ingress resolves the owner again (waiting for a move in progress), and
subscribes there, which adopts the session if needed. Event ids restart on the new owner;
the relayed ``migrated`` event marks the seam. A WebSocket push whose ack was lost in a
failure is answered with a retryable error frame (503): it may or may not have been logged.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import httpx
from fastapi import WebSocket, WebSocketDisconnect
from fastapi.responses import Response, StreamingResponse
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidMessage, InvalidStatus

from streamkv.cluster.proxy import Proxy
from streamkv.server.errors import APIError, error_body

RECONNECT_S = 0.2


async def _open_events(proxy: Proxy, session_id: str) -> httpx.Response:
    """An open upstream SSE response from the owner (failing over past refused replicas)."""
    for _ in range(len(proxy.router.replicas) + 5):
        r = await proxy.session_replica(session_id)
        try:
            req = proxy.client.build_request("GET", f"{r.url}/v1/sessions/{session_id}/events", headers=proxy.auth)
            resp = await proxy.client.send(req, stream=True)
            if resp.status_code != 503:
                return resp
            await resp.aclose()  # released there a moment ago (a move): ask the new owner
            await asyncio.sleep(RECONNECT_S)
        except httpx.ConnectError:
            proxy.mark_down(r)
        except (httpx.HTTPError, TypeError):  # TypeError: url None (restarting)
            await asyncio.sleep(RECONNECT_S)
    raise APIError(503, f"no replica could serve session {session_id!r}; retry", headers={"Retry-After": "1"})


async def session_events(proxy: Proxy, session_id: str) -> Response:
    first = await _open_events(proxy, session_id)
    if first.status_code != 200:
        body = await first.aread()
        await first.aclose()
        return Response(body, status_code=first.status_code, media_type="application/json")

    async def frames() -> AsyncIterator[str]:
        upstream: httpx.Response | None = first
        subscribed = False
        while True:
            if upstream is None:
                try:
                    upstream = await _open_events(proxy, session_id)
                except APIError:
                    await asyncio.sleep(RECONNECT_S)
                    continue
                if upstream.status_code != 200:  # deleted meanwhile
                    await upstream.aclose()
                    return
            try:
                async for frame in _sse_frames(upstream):
                    if frame.startswith(": subscribed"):
                        if subscribed:
                            continue
                        subscribed = True
                    yield frame
                    if "\nevent: deleted\n" in f"\n{frame}":
                        return
            except httpx.HTTPError:
                pass  # the owner died: resubscribe wherever the session lands
            finally:
                await upstream.aclose()
            upstream = None

    return StreamingResponse(frames(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse_frames(resp: httpx.Response) -> AsyncIterator[str]:
    """Whole SSE frames (``...\\n\\n``) of a response."""
    buf = ""
    async for text in resp.aiter_text():
        buf += text
        while "\n\n" in buf:
            frame, buf = buf.split("\n\n", 1)
            yield frame + "\n\n"


def _ws_url(http_url: str, path: str) -> str:
    return "ws" + http_url.removeprefix("http") + path


async def session_ws(proxy: Proxy, websocket: WebSocket, session_id: str) -> None:
    await websocket.accept()
    inbox: asyncio.Queue[str | None] = asyncio.Queue()
    reader = asyncio.ensure_future(_read_client(websocket, inbox))
    try:
        while not reader.done():  # done: the client left
            code = await _ws_round(proxy, websocket, session_id, inbox)
            if code is not None:
                await websocket.close(code=code)
                return
    except (WebSocketDisconnect, _ClientGone):
        pass
    finally:
        reader.cancel()


class _ClientGone(Exception):
    pass


async def _read_client(websocket: WebSocket, inbox: asyncio.Queue[str | None]) -> None:
    try:
        while True:
            inbox.put_nowait(await websocket.receive_text())
    except (WebSocketDisconnect, RuntimeError):
        inbox.put_nowait(None)


class _Tally:
    """Pushes sent upstream vs. answered (ack or error) on this connection."""

    def __init__(self) -> None:
        self.sent = self.answered = 0


async def _ws_round(proxy: Proxy, websocket: WebSocket, session_id: str, inbox: asyncio.Queue[str | None]) -> int | None:
    """One upstream connection. Returns a close code to end with, or None to reconnect."""
    try:
        r = await proxy.session_replica(session_id)
    except APIError:
        r = None
    if r is None or r.url is None:
        await asyncio.sleep(RECONNECT_S)
        return None
    tally = _Tally()
    pump: asyncio.Future | None = None
    try:
        async with connect(_ws_url(r.url, f"/v1/sessions/{session_id}/ws"), additional_headers=proxy.auth,
                           open_timeout=5.0) as up:
            pump = asyncio.ensure_future(_pump(inbox, up, tally))
            async for message in up:
                text = message if isinstance(message, str) else message.decode()
                if json.loads(text).get("type") in ("ack", "error"):
                    tally.answered += 1
                await websocket.send_text(text)
    except InvalidStatus:
        return 4404  # the replica refused the subscription: no such session
    except ConnectionClosed as exc:
        if exc.rcvd is not None and exc.rcvd.code == 4404:
            return 4404
    except ConnectionRefusedError:  # the process is gone (a timeout only means busy)
        proxy.mark_down(r)
    except (OSError, InvalidMessage):
        pass  # reconnect
    finally:
        if pump is not None:
            pump.cancel()
    if pump is not None and pump.done() and not pump.cancelled() and isinstance(pump.exception(), _ClientGone):
        raise _ClientGone
    for _ in range(tally.sent - tally.answered):  # acks lost with the replica: retryable
        await websocket.send_json({"type": "error", **error_body(503, "the session's replica failed or moved; "
                                                                      "retry this push")})
    await asyncio.sleep(RECONNECT_S)
    return None


async def _pump(inbox: asyncio.Queue[str | None], up: Any, tally: _Tally) -> None:
    while True:
        raw = await inbox.get()
        if raw is None:
            await up.close()
            raise _ClientGone
        tally.sent += 1
        await up.send(raw)


async def relay_ws(proxy: Proxy, websocket: WebSocket, path: str, replica: str | None) -> None:
    """A WebSocket relayed as is to one replica (streaming inputs: they do not migrate)."""
    r = proxy.router.replicas.get(replica or "")
    if r is None or r.url is None:
        await websocket.close(code=4404)
        return
    try:
        async with connect(_ws_url(r.url, path), additional_headers=proxy.auth, open_timeout=5.0) as up:
            await websocket.accept()
            inbox: asyncio.Queue[str | None] = asyncio.Queue()
            reader = asyncio.ensure_future(_read_client(websocket, inbox))
            pump = asyncio.ensure_future(_pump(inbox, up, _Tally()))
            try:
                async for message in up:
                    await websocket.send_text(message if isinstance(message, str) else message.decode())
                await websocket.close(code=up.close_code or 1000)
            finally:
                reader.cancel()
                pump.cancel()
    except InvalidStatus:
        await websocket.close(code=4404)
    except (OSError, ConnectionClosed, InvalidMessage, RuntimeError, WebSocketDisconnect):
        pass
