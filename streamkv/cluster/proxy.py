"""The ingress's HTTP side: classify a request, pick its replica, forward it, relay the answer.

A request that could not *connect* never reached a replica, so it is retried on the next
choice (the replica is marked down). One that failed after that may have had an effect, so
the client gets a retryable 503 (``Retry-After``), never a guessed answer.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from typing import Any, AsyncIterator, Protocol

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from streamkv.cluster.config import ClusterConfig
from streamkv.cluster.input_routes import InputRoutes
from streamkv.cluster.routing import NoReplicaError, ReplicaView, Router
from streamkv.server.errors import APIError, error_response
from streamkv.sessions.session import new_session_id

log = logging.getLogger("streamkv.cluster")
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length",
       "proxy-authorization", "proxy-authenticate"}
RETRY = {"Retry-After": "1"}


class Directory(Protocol):
    """Where each replica answers now (Ray: asks its deployment; waits while it restarts)."""

    async def url(self, name: str) -> str: ...


class Owners(Protocol):
    """The shared owner table (Ray: the named actor)."""

    async def set(self, session_id: str, replica: str | None) -> None: ...

    async def load(self) -> dict[str, str]: ...


class Unreachable(Exception):
    """The replica refused the connection: the request never reached it."""


def unavailable(message: str) -> APIError:
    return APIError(503, message, headers=RETRY)


class Proxy:
    def __init__(self, config: ClusterConfig, directory: Directory, owners: Owners, api_key: str | None = None,
                 input_ttl_s: float = 300.0) -> None:
        self.config = config
        self.router = Router(config.names, prefix_affinity=config.prefix_affinity, slack=config.affinity_slack)
        self.directory = directory
        self.owners = owners
        self.auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.moving: dict[str, asyncio.Event] = {}
        self.inputs = InputRoutes(input_ttl_s)  # open input streams' replicas (they do not migrate)
        self._checks: set[asyncio.Future] = set()  # input_state tasks after WebSocket relays
        self.corpora: dict[str, bytes] = {}  # replayed to a replica that comes (back) up
        self.counts: Counter[str] = Counter()
        self.last_rebalance = 0.0
        self._poller: asyncio.Task | None = None
        self._ready: asyncio.Event | None = None
        self._aio: Any = None  # aiohttp.ClientSession, made in the serving loop

    # ------------------------------------------------------------------ health
    async def start(self) -> None:
        """Load the owner table, poll once and keep polling (every request calls it; the
        first does the work, concurrent ones wait for it)."""
        if self._ready is None:
            ready = self._ready = asyncio.Event()
            try:
                self.router.overrides.update(await self.owners.load())
                await self.poll_once()
            except BaseException:
                self._ready = None  # the next request tries again
                ready.set()
                raise
            self._poller = asyncio.ensure_future(self._poll_forever())
            ready.set()
            return
        await self._ready.wait()
        if self._ready is None:  # the first caller failed: try again
            await self.start()

    async def _poll_forever(self) -> None:
        from streamkv.cluster.moves import rebalance  # moves builds on this module

        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            try:
                self.inputs.prune()
                await self.poll_once()
                if await rebalance(self) is not None:
                    self.counts["rebalances"] += 1
            except Exception:  # the loop must outlive any one bad poll or move
                log.exception("replica poll or rebalance failed")

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(r) for r in self.router.replicas.values()))

    async def _poll(self, r: ReplicaView) -> None:
        if r.url is None:
            try:
                r.url = await asyncio.wait_for(self.directory.url(r.name), timeout=max(1.0, self.config.poll_interval_s))
            except Exception:
                return  # restarting
        try:
            resp = await self.client.get(r.url + "/metrics", headers=self.auth, timeout=5.0)
        except httpx.ConnectError:  # refused: the process is gone (a timeout only means busy)
            self.mark_down(r)
            return
        except httpx.HTTPError:
            return  # slow, not gone
        if resp.status_code == 200:
            r.observe_metrics(resp.text)
            if not r.live:
                await self._came_up(r)

    def mark_down(self, r: ReplicaView) -> None:
        if r.live:
            log.warning("replica %s at %s is unreachable: its sessions fail over", r.name, r.url)
            self.counts["replica_down"] += 1
        r.live, r.url = False, None

    async def _came_up(self, r: ReplicaView) -> None:
        """Before a replica takes work again: hand back sessions it still holds that are owned
        elsewhere now (it was unreachable, not dead), and replay the registered corpora."""
        try:
            await self._release_foreign(r)
            for name, body in self.corpora.items():
                await self._call(r, "POST", f"/v1/corpora/{name}", content=body)
            r.live = True
            await self._release_foreign(r)  # sessions that failed over while the first pass ran
        except (Unreachable, httpx.HTTPError, NoReplicaError, ValueError):
            return  # try again at the next poll
        log.info("replica %s is up at %s", r.name, r.url)

    async def _release_foreign(self, r: ReplicaView) -> None:
        """Have ``r`` release every session it holds that the table assigns elsewhere."""
        for s in await self.sessions_on(r):
            if self.router.assigned(s["id"]) != r.name or s["id"] in self.moving:
                await self._call(r, "POST", f"/v1/sessions/{s['id']}/release")

    async def sessions_on(self, r: ReplicaView) -> list[dict[str, Any]]:
        """The sessions ``r`` holds (its ``GET /v1/sessions`` data); raises Unreachable on refusal."""
        data: list[dict[str, Any]] = (await self._call(r, "GET", "/v1/sessions")).json().get("data", [])
        return data

    async def _call(self, r: ReplicaView, method: str, path: str, **kw: Any) -> httpx.Response:
        """One internal request to a replica (auth added); raises Unreachable on refusal."""
        if r.url is None:
            raise Unreachable(r.name)
        try:
            return await self.client.request(method, r.url + path, headers={**self.auth, **kw.pop("headers", {})},
                                             **kw)
        except httpx.ConnectError:
            self.mark_down(r)
            raise Unreachable(r.name) from None
        except httpx.ConnectTimeout:
            raise Unreachable(r.name) from None

    # ----------------------------------------------------------------- routing
    async def session_replica(self, session_id: str, new: bool = False) -> ReplicaView:
        """The session's owner, after any migration of it in progress (recording a failover)."""
        moving = self.moving.get(session_id)
        if moving is not None:
            try:
                await asyncio.wait_for(moving.wait(), self.config.move_timeout_s)
            except asyncio.TimeoutError:
                raise unavailable(f"session {session_id!r} is being moved; retry") from None
        try:
            name, moved = self.router.owner(session_id, new)
        except NoReplicaError as exc:
            raise unavailable(str(exc)) from None
        r = self.router.replicas[name]
        if moved and not new:  # failover: the successor takes the session from the dir now
            try:
                adopted = await self._call(r, "POST", f"/v1/sessions/{session_id}/adopt")
            except (Unreachable, httpx.HTTPError):
                raise unavailable(f"replica {name} could not take session {session_id!r} over; retry") from None
            if adopted.status_code == 404:
                return r  # no such session anywhere: the request gets its 404 there
            self.counts["failovers"] += 1
        if moved:
            await self.set_owner(session_id, name)
        return r

    async def set_owner(self, session_id: str, name: str) -> None:
        natural = self.router.ring.lookup(session_id)
        await self._write_owner(session_id, None if name == natural else name)
        self.router.set_owner(session_id, name)

    async def forget_session(self, session_id: str) -> None:
        """A deleted session needs no owner-table entry."""
        if session_id in self.router.overrides:
            await self._write_owner(session_id, None)
            self.router.overrides.pop(session_id, None)

    async def _write_owner(self, session_id: str, owner: str | None) -> None:
        """The shared owner table's entry (None: the ring's choice); a 503 while its actor restarts."""
        try:
            await self.owners.set(session_id, owner)
        except Exception as exc:  # the owner table's actor is restarting
            raise unavailable(f"the owner table is unavailable ({type(exc).__name__}); retry") from None

    def stateless_replica(self, key: str | None) -> ReplicaView:
        try:
            return self.router.replicas[self.router.least_loaded(key)]
        except NoReplicaError as exc:
            raise unavailable(str(exc)) from None

    # -------------------------------------------------------------- forwarding
    def _http(self) -> Any:
        """The aiohttp session of the forwarding hop (about half httpx's per-request cost here;
        created in the ingress's event loop; aiohttp comes with ray[serve])."""
        import aiohttp

        if self._aio is None:
            self._aio = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0),
                                              connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        return self._aio

    async def forward(self, request: Request, r: ReplicaView, body: bytes, path: str | None = None,
                      idempotent: bool = False) -> Response:
        """Send the request to ``r`` and relay its answer (SSE streamed, the rest whole).
        ``idempotent``: a failure before the answer's head (a kept-alive connection to a
        replica that just died) raises Unreachable too, so the caller retries elsewhere."""
        import aiohttp

        if r.url is None:
            raise Unreachable(r.name)
        url = r.url + (path or request.url.path) + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw
                   if k.decode("latin-1").lower() not in HOP]
        r.inflight += 1
        try:
            resp = await self._http().request(request.method, url, headers=headers, data=body, allow_redirects=False,
                                              skip_auto_headers=("User-Agent", "Accept-Encoding"))
        except BaseException as exc:  # cancelled too (the client left): the count must come back
            r.inflight -= 1
            if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError):
                self.mark_down(r)  # refused: never delivered, the replica is gone
                raise Unreachable(r.name) from None
            if isinstance(exc, (aiohttp.ClientConnectorError, asyncio.TimeoutError)) or (
                    idempotent and isinstance(exc, aiohttp.ClientError)):
                raise Unreachable(r.name) from None
            if isinstance(exc, aiohttp.ClientError):
                raise unavailable(f"replica {r.name} failed while taking the request; retry") from None
            raise
        self.counts[f"routed:{r.name}"] += 1
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP}
        out_headers["x-streamkv-replica"] = r.name
        if resp.content_type == "text/event-stream":
            return StreamingResponse(self._relay(resp, r), status_code=resp.status, headers=out_headers)
        try:
            content = await resp.read()
        except aiohttp.ClientError:
            raise unavailable(f"replica {r.name} failed while answering; retry") from None
        finally:
            r.inflight -= 1
            resp.release()
        return Response(content, status_code=resp.status, headers=out_headers)

    async def _relay(self, resp: Any, r: ReplicaView) -> AsyncIterator[bytes]:
        import aiohttp

        try:
            async for chunk in resp.content.iter_any():
                yield chunk
        except aiohttp.ClientError:  # the replica died mid-stream: say so, retryably
            body = {"error": {"message": f"replica {r.name} failed mid-stream; retry", "type": "service_unavailable",
                              "param": None, "code": 503}}
            yield f"event: error\ndata: {json.dumps(body)}\n\n".encode()
        finally:
            r.inflight -= 1
            resp.release()

    async def to_session(self, request: Request, session_id: str, body: bytes, new: bool = False) -> Response:
        """Forward to the owner. A refused connection (never delivered) fails over; a replica
        that released the session while the request was on its way (503 ``session_moved``,
        nothing applied) sends it on to the new owner."""
        for _ in range(3):
            r = await self.session_replica(session_id, new)
            try:
                resp = await self.forward(request, r, body)
            except Unreachable:
                continue
            if not (resp.status_code == 503 and b'"session_moved"' in resp.body):
                return resp
            await asyncio.sleep(0.05)
        raise unavailable(f"session {session_id!r} could not be reached; retry")

    async def to_any(self, request: Request, body: bytes, key: str | None = None) -> Response:
        return (await self._to_any(request, body, key))[0]

    async def _to_any(self, request: Request, body: bytes, key: str | None) -> tuple[Response, ReplicaView]:
        for _ in range(2 * len(self.router.replicas)):  # a dead replica: a stale connection, then a refusal
            r = self.stateless_replica(key)
            try:
                return await self.forward(request, r, body, idempotent=True), r
            except Unreachable:
                self.counts["retries"] += 1
        raise unavailable("no replica could take the request; retry")

    # ---------------------------------------------------------- special routes
    async def create_session(self, request: Request, body: bytes) -> Response:
        """The ingress names the session (unless the client did), so it knows the owner."""
        try:
            fields = json.loads(body or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return await self.to_any(request, body)  # the replica answers the 400
        if not isinstance(fields, dict) or not isinstance(fields.get("id", ""), str):
            return await self.to_any(request, body)
        fields.setdefault("id", new_session_id())
        return await self.to_session(request, fields["id"], json.dumps(fields).encode(), new=True)

    async def list_sessions(self) -> dict[str, Any]:
        data: list[Any] = []
        for r in [self.router.replicas[n] for n in self.router.live_names()]:
            try:
                data += [{**s, "replica": r.name} for s in await self.sessions_on(r)]
            except (Unreachable, httpx.HTTPError, ValueError):
                continue
        return {"object": "list", "data": data}

    async def create_input(self, request: Request, body: bytes) -> Response:
        resp, r = await self._to_any(request, body, None)
        if resp.status_code == 201:
            self.inputs.add(json.loads(resp.body)["id"], r.name)
        return resp

    async def to_input(self, request: Request, stream_id: str, body: bytes) -> Response:
        name = self.inputs.get(stream_id)
        if name is None and self.inputs.is_closed(stream_id):
            return error_response(409, f"input stream {stream_id!r} is closed", param="id")
        if name is None:
            return error_response(404, f"input stream {stream_id!r} does not exist", param="id")
        try:
            resp = await self.forward(request, self.router.replicas[name], body)
        except Unreachable:
            self.inputs.lost(stream_id)
            raise unavailable(f"the replica holding input stream {stream_id!r} failed; open a new one") from None
        self._settle_input(stream_id, resp.status_code, request.method == "DELETE" or request.url.path.endswith("/finish"))
        return resp

    def _settle_input(self, stream_id: str, status: int, closing: bool) -> None:
        """Stop routing a stream its replica no longer has open (404: lost; 409, or a finish or
        DELETE it took: closed, so later calls get 409 here, as on one server)."""
        if status == 404:
            self.inputs.lost(stream_id)
        elif status == 409 or (closing and status < 400):
            self.inputs.close(stream_id)

    def check_input_later(self, stream_id: str) -> None:
        """:meth:`input_state` as a task of its own (kept referenced until it ends)."""
        task = asyncio.ensure_future(self.input_state(stream_id))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def input_state(self, stream_id: str) -> None:
        """After a WebSocket relay ends: ask the replica whether the stream is still open (a
        finish sent over the socket closed it without passing :meth:`to_input`)."""
        r = self.router.replicas.get(self.inputs.open.get(stream_id, ""))
        if r is None or r.url is None:
            return
        try:
            resp = await self.client.get(f"{r.url}/v1/input_streams/{stream_id}", headers=self.auth, timeout=5.0)
        except httpx.HTTPError:
            return  # unreachable: the next call finds out
        self._settle_input(stream_id, resp.status_code, closing=False)

    async def fan_out(self, request: Request, body: bytes, remember: str | None = None) -> Response:
        """The same request to every live replica (corpora, the span cache): the first answer,
        or every answer of a GET, by replica."""
        answers: dict[str, Any] = {}
        first: Response | None = None
        for name in self.router.live_names():
            try:
                resp = await self.forward(request, self.router.replicas[name], body)
            except Unreachable:
                continue
            first = first or resp
            if request.method == "GET" and resp.status_code == 200:
                answers[name] = json.loads(resp.body)
        if first is None:
            raise unavailable("no replica is up")
        if remember is not None and first.status_code < 300:
            self.corpora[remember] = body
        return JSONResponse({"object": "list", "replicas": answers}) if request.method == "GET" else first

    def status(self) -> dict[str, Any]:
        return {"object": "cluster", "replicas": [r.to_dict() for r in self.router.replicas.values()],
                "overrides": len(self.router.overrides), "moving": sorted(self.moving),
                "input_streams": len(self.inputs), "time": time.time()}

    def metrics_text(self) -> str:
        lines = ["# TYPE streamkv_cluster_replicas_live gauge",
                 f"streamkv_cluster_replicas_live {len(self.router.live_names())}",
                 "# TYPE streamkv_cluster_routed_total counter"]
        lines += [f'streamkv_cluster_routed_total{{replica="{n}"}} {self.counts[f"routed:{n}"]}'
                  for n in self.router.replicas]
        for key in ("migrations", "rebalances", "failovers", "replica_down", "retries"):
            lines += [f"# TYPE streamkv_cluster_{key}_total counter", f"streamkv_cluster_{key}_total {self.counts[key]}"]
        return "\n".join(lines) + "\n"
