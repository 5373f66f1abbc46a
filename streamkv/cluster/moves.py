"""Moving sessions between replicas through the shared session dir.

::

    migrate(id, to):   moving[id] = Event          requests for id wait on it (503 after move_timeout_s)
                       source  POST /release        KV snapshot at the newest complete version + log closed
                       owners  id -> to             (Ray actor, then the Router's copy)
                       target  GET  /v1/sessions/id adopt: snapshot + replay of newer logged pushes, KV resident
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

REBALANCE_S = 5.0


async def migrate(proxy: Proxy, session_id: str, to: str | None = None) -> dict[str, Any]:
    if not valid_session_id(session_id):
        raise APIError(404, f"session {session_id!r} does not exist", param="session_id")
    router = proxy.router
    if to is not None and to not in router.replicas:
        raise APIError(400, f"unknown replica {to!r}; replicas: {', '.join(router.replicas)}", param="to")
    if session_id in proxy.moving:
        raise APIError(409, f"session {session_id!r} is already being moved")
    source = (await proxy.session_replica(session_id)).name
    try:
        target = to or router.successor(session_id, exclude=source)
    except NoReplicaError as exc:
        raise unavailable(str(exc)) from None
    if target == source:
        raise APIError(400, f"session {session_id!r} already lives on {source}", param="to")
    if not router.replicas[target].up:
        raise unavailable(f"replica {target} is not up")
    done = proxy.moving[session_id] = asyncio.Event()
    t0 = time.perf_counter()
    try:
        released = await _release(proxy, source, session_id)
        previous = router.overrides.get(session_id)
        await proxy.set_owner(session_id, target)
        adopted = await proxy._call(router.replicas[target], "GET", f"/v1/sessions/{session_id}")
        if adopted.status_code != 200:
            await proxy.owners.set(session_id, previous)
            router.overrides.pop(session_id, None) if previous is None else router.set_owner(session_id, previous)
            if adopted.status_code == 404 and released is None:
                raise APIError(404, f"session {session_id!r} does not exist", param="session_id")
            raise unavailable(f"replica {target} could not adopt session {session_id!r} "
                              f"({adopted.status_code}); retry")
    except (Unreachable, httpx.HTTPError) as exc:
        raise unavailable(f"the move of session {session_id!r} failed ({type(exc).__name__}); retry") from None
    finally:
        del proxy.moving[session_id]
        done.set()
    proxy.counts["migrations"] += 1
    return {"id": session_id, "object": "session.migration", "from": source, "to": target,
            "data_version": adopted.json()["data_version"], "seconds": round(time.perf_counter() - t0, 4)}


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
    if resp.status_code != 200:
        raise APIError(resp.status_code, resp.json().get("error", {}).get("message", "release failed"))
    return resp.json()


async def drain(proxy: Proxy, name: str) -> dict[str, Any]:
    """Stop giving ``name`` new work and move its sessions to their successors."""
    r = proxy.router.replicas.get(name)
    if r is None:
        raise APIError(404, f"unknown replica {name!r}", param="name")
    if not [n for n in proxy.router.up_names() if n != name]:
        raise APIError(409, f"draining {name} would leave no replica up")
    r.draining = True
    moved, t0 = [], time.perf_counter()
    listed = (await proxy._call(r, "GET", "/v1/sessions")).json().get("data", []) if r.live else []
    for s in listed:
        moved.append(await migrate(proxy, s["id"]))
    return {"object": "cluster.drain", "replica": name, "moved": moved, "seconds": round(time.perf_counter() - t0, 4)}


async def rebalance(proxy: Proxy) -> dict[str, Any] | None:
    """Overload: move the session holding the most KV in the pool off the fullest replica
    (called from the ingress's poll loop, at most every ``REBALANCE_S``)."""
    pair = proxy.router.overloaded(proxy.config.rebalance_kv_free)
    now = time.monotonic()
    if pair is None or now - proxy.last_rebalance < REBALANCE_S:
        return None
    proxy.last_rebalance = now
    source, target = pair
    listed = (await proxy._call(proxy.router.replicas[source], "GET", "/v1/sessions")).json().get("data", [])
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
