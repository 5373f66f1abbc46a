"""One engine replica: the ordinary streamkv engine and HTTP app, served by uvicorn on a free
port of this process, so every route (SSE and WebSocket included) works unchanged; the
ingress proxies to it. As a Ray Serve deployment, Serve starts it, health-checks it and
restarts it when its process dies (a new port: the ingress asks for the URL again)."""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import uvicorn

from streamkv.config import EngineConfig
from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.engine import Engine
from streamkv.server.app import create_app
from streamkv.server.config import ServerConfig
from streamkv.server.run import prepare_process


class ReplicaServer:
    """Engine + server on ``host``:free port; ``url`` once it accepts connections."""

    def __init__(self, engine_options: dict[str, Any], server_options: dict[str, Any], host: str = "127.0.0.1") -> None:
        self.config = config = ServerConfig(**server_options)
        self.engine = AsyncEngine(Engine(EngineConfig.from_flat(**engine_options)), max_waiting=config.max_waiting).start()
        app = create_app(self.engine, config)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=config.shutdown_timeout))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="streamkv-replica-http")
        self._thread.start()
        deadline = time.monotonic() + 60.0
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the replica's HTTP server did not start")
            time.sleep(0.01)

    def healthy(self) -> bool:
        return self.engine.alive and self._thread.is_alive()

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10.0)
        self.engine.shutdown(timeout=5.0)


def replica_deployment(name: str, num_cpus: float) -> Any:
    """A Ray Serve deployment of one :class:`ReplicaServer` named ``name`` (one Serve replica:
    the ingress addresses each engine by name, which is what session ownership needs)."""
    from ray import serve

    @serve.deployment(name=name, num_replicas=1, ray_actor_options={"num_cpus": num_cpus},
                      health_check_period_s=1.0, health_check_timeout_s=60.0, graceful_shutdown_timeout_s=5.0)
    class EngineReplica:
        def __init__(self, engine_options: dict[str, Any], server_options: dict[str, Any]) -> None:
            import ray

            self.server = ReplicaServer(engine_options, server_options, host=ray.util.get_node_ip_address())
            # this actor's process serves only this replica (ReplicaServer alone leaves the
            # process as it is: a test or an embedding program owns its own process)
            print(prepare_process(self.server.config), flush=True)

        def url(self) -> str:
            return self.server.url

        def pid(self) -> int:
            return os.getpid()

        def check_health(self) -> None:
            if not self.server.healthy():
                raise RuntimeError("the replica's engine loop or HTTP server stopped")

        def __del__(self) -> None:
            server = getattr(self, "server", None)
            if server is not None:
                server.stop()

    return EngineReplica
