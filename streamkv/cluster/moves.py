"""Moving sessions between replicas through the shared session dir.

::

    migrate(id, to):   moving[id] = Event          requests for id wait on it (503 after move_timeout_s)
                       source  POST /release        KV snapshot at the newest complete version + log closed
                       owners  id -> to             (Ray actor, then the Router's copy)
                       target  POST /adopt          snapshot + replay of newer logged pushes, KV resident
                       moving[id].set()             waiting requests go to the target

A failed source is skipped (its acknowledged pushes are in the log already); the target
adopts from the dir alone. Drain = migrate every session the replica lists, after it stops
taking new work.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from streamkv.cluster.proxy import Proxy, Unreachable, unavailable
from streamkv.cluster.routing import NoReplicaError
from streamkv.server.errors import APIError
from streamkv.sessions.session import valid_session_id


async def migrate(proxy: Proxy, session_id: str, to: str | None = None) -> dict[str, Any]:
    if not valid_session_id(session_id):
        raise APIError(404, f"session {session_id!r} does not exist", param="session_id")
    router = proxy.router
    if to is not None and to not in router.replicas:
        raise APIError(400, f"unknown replica {to!r}; replicas: {', '.join(router.replicas)}", param="to")
    if session_id in proxy.moving:
        raise APIError(409, f"session {session_id!r} is already being moved")
    try:
        source = router.owner(session_id)[0]  # no wait, no failover record: the move decides
        target = to or router.successor(session_id, exclude=source)
    except NoReplicaError as exc:
        raise unavailable(str(exc)) from None
    if target == source:
        raise APIError(400, f"session {session_id!r} already lives on {source}", param="to")
    if not router.replicas[target].up:
        raise unavailable(f"replica {target} is not up")
    done = proxy.moving[session_id] = asyncio.Event()  # before any await: one move at a time
    t0 = time.perf_counter()
    try:
        adopted = await _move(proxy, session_id, source, target)
    finally:
        proxy.moving.pop(session_id, None)
        done.set()
    proxy.counts["migrations"] += 1
    return {"id": session_id, "object": "session.migration", "from": source, "to": target,
            "data_version": adopted["data_version"], "seconds": round(time.perf_counter() - t0, 4)}


async def _move(proxy: Proxy, session_id: str, source: str, target: str) -> dict[str, Any]:
    """Release on ``source``, record ``target``, adopt there; on failure the source takes the
    session back (explicitly: it refuses a session it released otherwise)."""
    router = proxy.router
    try:
        released = await _release(proxy, source, session_id)
        await proxy.set_owner(session_id, target)
        adopted = await proxy._call(router.replicas[target], "POST", f"/v1/sessions/{session_id}/adopt")
        if adopted.status_code == 200:
            return adopted.json()
        failure = f"replica {target} could not adopt session {session_id!r} ({adopted.status_code})"
        missing = adopted.status_code == 404 and released is None
    except (Unreachable, httpx.HTTPError, ValueError) as exc:
        failure, missing = f"the move of session {session_id!r} failed ({type(exc).__name__})", False
    await proxy.set_owner(session_id, source)
    if missing:
        raise APIError(404, f"session {session_id!r} does not exist", param="session_id")
    try:
        await proxy._call(router.replicas[source], "POST", f"/v1/sessions/{session_id}/adopt")
    except (Unreachable, httpx.HTTPError):
        pass  # the source is gone too: the next request fails it over
    raise unavailable(failure + "; retry")


async def _release(proxy: Proxy, source: str, session_id: str) -> dict[str, Any] | None:
    """The source's release answer; None when it does not hold the session (on disk only,
    or never existed) or is down (its log is already durable)."""
    r = proxy.router.replicas[source]
    if not r.live:
        return None
    try:
        resp = await proxy._call(r, "POST", f"/v1/sessions/{session_id}/release")
    except Unreachable:
        return None
    if resp.status_code == 404:
        return None
    try:
        body = resp.json()
    except ValueError:
        body = {}
    if resp.status_code != 200:
        raise APIError(resp.status_code, body.get("error", {}).get("message", "release failed"))
    return body


async def drain(proxy: Proxy, name: str) -> dict[str, Any]:
    """Stop giving ``name`` new work and move its sessions to their successors."""
    r = proxy.router.replicas.get(name)
    if r is None:
        raise APIError(404, f"unknown replica {name!r}", param="name")
    if not [n for n in proxy.router.up_names() if n != name]:
        raise APIError(409, f"draining {name} would leave no replica up")
    r.draining = True
    moved: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        listed = await proxy.sessions_on(r) if r.live else []
    except (Unreachable, httpx.HTTPError, ValueError):
        listed = []  # gone: its sessions fail over on their next request
    for s in listed:
        try:
            moved.append(await migrate(proxy, s["id"]))
        except APIError as exc:  # keep draining the rest; the caller sees which ones stayed
            failed.append({"id": s["id"], "status": exc.status, "message": exc.message})
    return {"object": "cluster.drain", "replica": name, "moved": moved, "failed": failed,
            "seconds": round(time.perf_counter() - t0, 4)}


async def rebalance(proxy: Proxy) -> dict[str, Any] | None:
    """Overload: move the session holding the most KV in the pool off the fullest replica
    (called from the ingress's poll loop, at most every ``rebalance_interval_s``)."""
    pair = proxy.router.overloaded(proxy.config.rebalance_kv_free)
    now = time.monotonic()
    if pair is None or now - proxy.last_rebalance < proxy.config.rebalance_interval_s:
        return None
    proxy.last_rebalance = now
    source, target = pair
    listed = await proxy.sessions_on(proxy.router.replicas[source])
    resident = [s for s in listed if s["kv"]["where"] == "pool" and s["id"] not in proxy.moving]
    if not resident:
        return None
    biggest = max(resident, key=lambda s: s["kv"]["blocks"])
    src, dst = proxy.router.replicas[source], proxy.router.replicas[target]
    if dst.kv_free - biggest["kv"]["blocks"] / max(1.0, dst.kv_blocks) <= src.kv_free:
        return None  # the target would end up as full as the source is: no ping-pong
    return await migrate(proxy, biggest["id"], target)


def undrain(proxy: Proxy, name: str) -> dict[str, Any]:
    r = proxy.router.replicas.get(name)
    if r is None:
        raise APIError(404, f"unknown replica {name!r}", param="name")
    r.draining = False
    return {"object": "cluster.replica", **r.to_dict()}
