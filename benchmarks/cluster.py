"""streamkv on Ray Serve: 1 vs 2 replicas, routing overhead, migration time, kill cycles.

    .venv/bin/python benchmarks/cluster.py                      # every part (~15 min on 2 cores)
    .venv/bin/python benchmarks/cluster.py --parts overhead,migration --kill-cycles 5

Parts (each starts its own local Ray cluster of the embedded model, 1 thread per replica):

* ``overhead``   the same small request straight to a replica vs through the ingress, p50/p90
                 (HAProxy ingress, and Ray Serve's Python proxy for comparison);
* ``throughput`` aggregate output tok/s and session-query latency, 1 vs 2 replicas, the same
                 offered load (closed loop, ``--clients`` generation clients + one session client);
* ``affinity``   stateless requests with shared system prompts, prefix affinity on vs off;
* ``migration``  forced migration time vs session size (first move writes the snapshot;
                 the move back finds it current);
* ``kills``      ``--kill-cycles`` SIGKILLs of the replica that owns a session being pushed to
                 without pause; every acknowledged record must be in the session afterwards.

No peer runs here: the comparison is streamkv against itself (1 vs N replicas); the single-
server peers' numbers are in benchmarks/serving.py and throughput.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import REPO, fmt, machine_info, md_table, nearest_rank, write_json  # noqa: E402
from streamkv.cluster.ring import HashRing  # noqa: E402

PORT = 8031
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def start(replicas: int, haproxy: bool = True, **engine) -> str:
    from streamkv.cluster import serve_app
    from streamkv.cluster.config import ClusterConfig
    from streamkv.server.config import ServerConfig

    if not haproxy:
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "0"
    opts = {"kv_cache_memory": 512 << 20, "session_dir": tempfile.mkdtemp(prefix="streamkv-bench-cluster-"), **engine}
    return serve_app.start(ClusterConfig(replicas=replicas, haproxy=haproxy), opts, ServerConfig(port=PORT))


def stop() -> None:
    from streamkv.cluster import serve_app

    serve_app.shutdown()
    for var in ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_HAPROXY_STATS_PORT",
                "RAY_SERVE_HAPROXY_METRICS_PORT"):
        os.environ.pop(var, None)
    time.sleep(2.0)


def replica_urls(url: str) -> dict[str, str]:
    return {r["name"]: r["url"] for r in httpx.get(url + "/v1/cluster").json()["replicas"]}


def wait_live(url: str, n: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if sum(r["live"] for r in httpx.get(url + "/v1/cluster", timeout=5).json()["replicas"]) == n:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{n} replicas did not come up")


def lat_ms(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


# ------------------------------------------------------------------------------- parts
def part_overhead(args: argparse.Namespace) -> dict:
    rows = {}
    for haproxy in (True, False):
        url = start(2, haproxy=haproxy)
        wait_live(url, 2)
        direct = replica_urls(url)["replica-0"]
        body = {"prompt": "Hello there, general Kenobi."}
        with httpx.Client(timeout=30) as c:
            for base in (direct, url):  # warm both paths
                lat_ms(lambda: c.post(base + "/tokenize", json=body), 50)
            d = lat_ms(lambda: c.post(direct + "/tokenize", json=body), args.overhead_n)
            v = lat_ms(lambda: c.post(url + "/tokenize", json=body), args.overhead_n)
        rows["haproxy" if haproxy else "serve-proxy"] = {
            "direct_p50_ms": nearest_rank(d, 50), "direct_p90_ms": nearest_rank(d, 90),
            "ingress_p50_ms": nearest_rank(v, 50), "ingress_p90_ms": nearest_rank(v, 90),
            "overhead_p50_ms": nearest_rank(v, 50) - nearest_rank(d, 50)}
        stop()
    return rows


async def _closed_loop(urls: list[str], clients: int, duration: float, body: dict, sessions: list[str]) -> dict:
    """``clients`` generation clients (client k on ``urls[k % len(urls)]``) and, with
    ``sessions``, one client asking a session question every 0.5 s."""
    stop_at = time.monotonic() + duration
    tokens, errors, q_lat = [0], [0], []
    async with httpx.AsyncClient(base_url=urls[0], timeout=300) as c:
        async def generator(k: int) -> None:
            url = urls[k % len(urls)]
            while time.monotonic() < stop_at:
                r = await c.post(url + "/v1/completions", json=body)
                if r.status_code == 200:
                    tokens[0] += r.json()["usage"]["completion_tokens"]
                else:
                    errors[0] += 1

        async def questioner() -> None:
            i = 0
            while sessions and time.monotonic() < stop_at:
                t0 = time.perf_counter()
                r = await c.post(f"/v1/sessions/{sessions[i % len(sessions)]}/query",
                                 json={"question": "What is the latest reading?", "max_tokens": 8})
                if r.status_code == 200:
                    q_lat.append((time.perf_counter() - t0) * 1e3)
                i += 1
                await asyncio.sleep(0.5)

        t0 = time.monotonic()
        await asyncio.gather(*(generator(k) for k in range(clients)), questioner())
        wall = time.monotonic() - t0
    return {"output_tok_s": tokens[0] / wall, "errors": errors[0], "queries": len(q_lat),
            "query_p50_ms": nearest_rank(q_lat, 50), "query_p99_ms": nearest_rank(q_lat, 99)}


def _make_sessions(url: str, n: int, records: int) -> list[str]:
    ids = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for s in range(n):
            sid = c.post("/v1/sessions", json={"system": "You track readings.", "retention_tokens": 3000}).json()["id"]
            for i in range(0, records, 20):
                c.post(f"/v1/sessions/{sid}/data",
                       json={"records": [f"reading {j}: {WORDS[j % 26]} {j * 7 % 101} units" for j in range(i, i + 20)]})
            ids.append(sid)
        for sid in ids:
            while c.get(f"/v1/sessions/{sid}").json()["data_version"] < records // 20:
                time.sleep(0.2)
    return ids


def part_throughput(args: argparse.Namespace) -> dict:
    body = {"prompt": " ".join(WORDS) + " Continue the list:", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True}
    rows = {}
    for n in (1, 2):
        url = start(n)
        wait_live(url, n)
        sessions = _make_sessions(url, 4, 100)
        asyncio.run(_closed_loop([url], args.clients, 5.0, body, sessions))  # warm-up
        rows[f"{n} replica{'s' * (n > 1)}"] = asyncio.run(_closed_loop([url], args.clients, args.duration, body,
                                                                       sessions))
        stop()
    for n in (1, 2):  # the machine's own limit: plain servers, no Ray, no ingress, the client splits
        procs = [_plain_server(PORT + 1 + i) for i in range(n)]
        urls = [f"http://127.0.0.1:{PORT + 1 + i}" for i in range(n)]
        try:
            asyncio.run(_closed_loop(urls, args.clients, 5.0, body, []))
            rows[f"{n} plain server{'s' * (n > 1)} (no Ray)"] = asyncio.run(
                _closed_loop(urls, args.clients, args.duration, body, []))
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
    for name, r in rows.items():  # each against its own 1-process row
        r["speedup"] = r["output_tok_s"] / rows["1 plain server (no Ray)" if "plain" in name else "1 replica"][
            "output_tok_s"]
    return rows


def _plain_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "streamkv.cli", "serve", "--port", str(port), "--threads", "1",
                             "--kv-cache-memory", str(512 << 20)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    raise RuntimeError(f"plain server on {port} did not start")


def part_affinity(args: argparse.Namespace) -> dict:
    # more system prompts than one replica's prefix cache holds (48 x ~600 tokens vs ~22k cached tokens)
    systems = [f"You are assistant {k}. " + " ".join(WORDS[(k * 7 + i * (k % 5 + 1)) % 26] for i in range(400))
               for k in range(48)]
    rows = {}
    for affinity in (False, True):
        from streamkv.cluster import serve_app
        from streamkv.cluster.config import ClusterConfig
        from streamkv.server.config import ServerConfig

        opts = {"kv_cache_memory": 512 << 20, "session_dir": tempfile.mkdtemp(prefix="streamkv-bench-cluster-")}
        url = serve_app.start(ClusterConfig(replicas=2, prefix_affinity=affinity), opts, ServerConfig(port=PORT))
        wait_live(url, 2)
        rows["affinity on" if affinity else "affinity off"] = asyncio.run(_affinity_load(url, systems, args))
        stop()
    return rows


async def _affinity_load(url: str, systems: list[str], args: argparse.Namespace) -> dict:
    stop_at = time.monotonic() + args.duration
    done, cached, prompt, lat = [0], [0], [0], []
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        async def client(k: int) -> None:
            i = k
            while time.monotonic() < stop_at:
                body = {"messages": [{"role": "system", "content": systems[i % len(systems)]},
                                     {"role": "user", "content": f"Question {i}: which word comes first?"}],
                        "max_tokens": 8, "temperature": 0}
                t0 = time.perf_counter()
                r = await c.post("/v1/chat/completions", json=body)
                if r.status_code == 200:
                    lat.append((time.perf_counter() - t0) * 1e3)
                    usage = r.json()["usage"]
                    done[0] += 1
                    prompt[0] += usage["prompt_tokens"]
                    cached[0] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                i += 7

        t0 = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(args.clients)))
        wall = time.monotonic() - t0
    return {"requests_s": done[0] / wall, "cached_fraction": cached[0] / max(1, prompt[0]),
            "p50_ms": nearest_rank(lat, 50), "p99_ms": nearest_rank(lat, 99)}


def _fill_tokens(c: httpx.Client, sid: str, tokens: int) -> int:
    """Push records until the session holds at least ``tokens`` tokens; returns its version."""
    n = version = 0
    while True:
        stats = c.get(f"/v1/sessions/{sid}").json()
        if stats["data_version"] >= version and stats["tokens"]["total"] >= tokens:
            return version
        if stats["data_version"] >= version:
            recs = [f"reading {n + j}: {WORDS[(n + j) % 26]} {(n + j) * 7 % 101} units" for j in range(20)]
            version = c.post(f"/v1/sessions/{sid}/data", json={"records": recs}).json()["data_version"]
            n += 20
        else:
            time.sleep(0.1)


def part_migration(args: argparse.Namespace) -> dict:
    url = start(2, checkpoint_idle_s=3600.0)  # every first move writes its snapshot
    wait_live(url, 2)
    rows = {}
    with httpx.Client(base_url=url, timeout=300) as c:
        for size in args.sizes:
            sid = c.post("/v1/sessions", json={"system": "You track readings.", "retention_tokens": size + 1024}).json()["id"]
            version = _fill_tokens(c, sid, size)
            while c.get(f"/v1/sessions/{sid}").json()["data_version"] < version:
                time.sleep(0.2)
            stats = c.get(f"/v1/sessions/{sid}").json()
            t0 = time.perf_counter()
            first = c.post(f"/v1/sessions/{sid}/migrate", json={}).json()
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            back = c.post(f"/v1/sessions/{sid}/migrate", json={}).json()
            t_back = time.perf_counter() - t0
            q = c.post(f"/v1/sessions/{sid}/query", json={"question": "What is the latest reading?", "max_tokens": 8})
            rows[size] = {"tokens": stats["tokens"]["total"], "kv_bytes": stats["kv"]["bytes"], "first_move_s": first["seconds"], "first_client_s": t_first,
                          "back_move_s": back["seconds"], "back_client_s": t_back,
                          "query_after_ok": q.status_code == 200 and q.json()["data_version"] == version}
    stop()
    return rows


def part_kills(args: argparse.Namespace) -> dict:
    from streamkv.cluster.serve_app import local_replica_pid

    url = start(2, checkpoint_idle_s=0.2)
    wait_live(url, 2)
    acked: list[tuple[int, str]] = []
    failures = {"retryable": 0, "other": 0}
    done = threading.Event()
    with httpx.Client(base_url=url, timeout=60) as c:
        sid = c.post("/v1/sessions", json={"system": "Log.", "retention_tokens": 6000,
                                           "max_queue_tokens": 65536}).json()["id"]

        def pusher() -> None:
            n = 0
            with httpx.Client(base_url=url, timeout=60) as pc:
                while not done.is_set():
                    rec = f"record {n} {WORDS[n % 26]}"
                    try:
                        r = pc.post(f"/v1/sessions/{sid}/data", json={"records": [rec]})
                    except httpx.HTTPError:
                        failures["other"] += 1
                        time.sleep(0.05)
                        continue
                    if r.status_code == 202:
                        acked.append((r.json()["data_version"], rec))
                        n += 1
                    else:
                        failures["retryable" if r.status_code in (429, 503) else "other"] += 1
                        time.sleep(0.05)
                    time.sleep(0.05)

        t = threading.Thread(target=pusher, daemon=True)
        t.start()
        ring = HashRing(["replica-0", "replica-1"])
        cycle_s: list[float] = []
        first_s: list[float] = []
        for cycle in range(args.kill_cycles):
            wait_live(url, 2)
            time.sleep(1.0)
            owner = next((s["replica"] for s in c.get("/v1/sessions").json()["data"] if s["id"] == sid),
                         ring.lookup(sid))
            pid = local_replica_pid(owner)
            while pid is None:  # Serve is still starting its process
                time.sleep(0.2)
                pid = local_replica_pid(owner)
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            before, first = len(acked), None
            while len(acked) <= before + 3:  # pushes acknowledged again, by the successor
                if first is None and len(acked) > before:
                    first = time.monotonic() - t0
                if time.monotonic() - t0 > 180:
                    raise RuntimeError(f"no push acknowledged for 180 s after killing {owner}")
                time.sleep(0.01)
            cycle_s.append(time.monotonic() - t0)
            first_s.append(first if first is not None else cycle_s[-1])
            print(f"  kill {cycle + 1}/{args.kill_cycles}: {owner} pid {pid}; first push acknowledged after "
                  f"{first_s[-1]:.2f} s, 4 after {cycle_s[-1]:.2f} s", flush=True)
        done.set()
        t.join()
        last = acked[-1][0]
        while c.get(f"/v1/sessions/{sid}").json()["data_version"] < last:
            time.sleep(0.2)
        layout = c.get(f"/v1/sessions/{sid}", params={"include_text": "true"}).json()["layout"]
    stop()
    versions = [v for v, _ in acked]
    texts = [rec.get("text", "").strip() for rec in layout["records"]]
    expected = [r for _, r in acked][-len(texts):]
    missing = [r for r in expected if r not in texts]
    return {"cycles": args.kill_cycles, "acknowledged": len(acked), "duplicate_versions": len(versions) - len(set(versions)),
            "versions_increasing": versions == sorted(versions), "records_in_window": len(texts),
            "acknowledged_missing_from_window": len(missing), "retryable_errors": failures["retryable"],
            "other_errors": failures["other"], "first_ack_p50_s": nearest_rank(first_s, 50),
            "first_ack_max_s": max(first_s) if first_s else None, "four_acks_p50_s": nearest_rank(cycle_s, 50),
            "four_acks_max_s": max(cycle_s) if cycle_s else None}


# ------------------------------------------------------------------------------ report
def report(res: dict) -> str:
    m = res["machine"]
    out = [f"machine: {m['cpu']['model']} ({', '.join(m['cpu']['flags'])}), {m['cores']} cores; 1 thread per replica"]
    if "overhead" in res:
        out += ["", "### Routing overhead (POST /tokenize, sequential)", md_table(
            ["ingress", "direct p50 ms", "via ingress p50 ms", "overhead p50 ms", "via ingress p90 ms"],
            [[k, f"{v['direct_p50_ms']:.2f}", f"{v['ingress_p50_ms']:.2f}", f"{v['overhead_p50_ms']:.2f}",
              f"{v['ingress_p90_ms']:.2f}"] for k, v in res["overhead"].items()])]
    if "throughput" in res:
        out += ["", "### 1 vs 2 replicas (closed loop)", md_table(
            ["replicas", "output tok/s", "vs 1", "session query p50 ms", "p99 ms", "errors"],
            [[k, f"{v['output_tok_s']:.1f}", f"{v['speedup']:.2f}x", fmt(v["query_p50_ms"] if v["queries"] else None),
              fmt(v["query_p99_ms"] if v["queries"] else None), v["errors"]] for k, v in res["throughput"].items()])]
    if "affinity" in res:
        out += ["", "### Prefix affinity (48 system prompts of ~400 words)", md_table(
            ["routing", "requests/s", "cached prompt fraction", "p50 ms", "p99 ms"],
            [[k, f"{v['requests_s']:.2f}", f"{v['cached_fraction']:.2f}", f"{v['p50_ms']:.0f}", f"{v['p99_ms']:.0f}"]
             for k, v in res["affinity"].items()])]
    if "migration" in res:
        out += ["", "### Migration vs session size", md_table(
            ["tokens", "KV MiB", "first move s (snapshot written)", "client s", "move back s", "answer after"],
            [[v["tokens"], f"{v['kv_bytes'] / 2**20:.1f}", f"{v['first_move_s']:.3f}", f"{v['first_client_s']:.3f}",
              f"{v['back_move_s']:.3f}", "ok" if v["query_after_ok"] else "WRONG"] for k, v in res["migration"].items()])]
    if "kills" in res:
        k = res["kills"]
        out += ["", "### Kill cycles", md_table(list(k), [list(k.values())])]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="overhead,throughput,affinity,migration,kills")
    ap.add_argument("--overhead-n", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 2048, 4096])
    ap.add_argument("--kill-cycles", type=int, default=20)
    args = ap.parse_args()
    res: dict = {"machine": machine_info(), "args": vars(args)}
    print(f"machine: {res['machine']['cpu']}", flush=True)
    parts = {"overhead": part_overhead, "throughput": part_throughput, "affinity": part_affinity,
             "migration": part_migration, "kills": part_kills}
    path = write_json("cluster", res)
    for name in args.parts.split(","):
        print(f"== {name}", flush=True)
        res[name] = parts[name](args)
        print(report({"machine": res["machine"], name: res[name]}), flush=True)
        path.write_text(json.dumps(res, indent=1, default=str) + "\n")  # kept if a later part fails
    print("\n" + report(res) + f"\n\nresults: {path}")


if __name__ == "__main__":
    main()
