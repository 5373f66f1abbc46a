"""``streamkv serve``: load the model, start the engine thread, run uvicorn, shut down cleanly."""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
from typing import Any, Iterator

import uvicorn

from streamkv.config import EngineConfig
from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.engine import Engine
from streamkv.loading.heap import freeze_loaded_heap
from streamkv.server.app import create_app
from streamkv.server.config import ServerConfig

log = logging.getLogger("streamkv.server")


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, so the process would die
    by the signal; we take the signals ourselves and exit 0 once in-flight work is done."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        def handle(sig: int, frame: Any) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True
            log.info("received %s: shutting down", signal.Signals(sig).name)

        previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def banner(engine: Engine, model_name: str, config: ServerConfig) -> str:
    """What ``streamkv serve`` prints at start: the URL, the model, its dtype and the kernels."""
    b = engine.bundle
    dtype = str(b.dtype).removeprefix("torch.")
    return (f"streamkv serving {model_name} at http://{config.host}:{config.port}\n"
            f"  dtype {dtype}, numerics {engine.config.runtime.numerics}, decode weights {b.decode_weights}, "
            f"context {b.max_model_len} tokens, KV pool {engine.pool.num_blocks} blocks of {engine.kv.block_size}\n"
            f"  kernels: {b.kernels.describe()}\n"
            f"  scheduling: {_scheduling(engine)}")


def _scheduling(engine: Engine) -> str:
    """The scheduler policies in force (speculation resolved from ``auto``)."""
    sched, cfg = engine.scheduler, engine.config.scheduler
    spec = sched.speculator
    spec_text = (f"speculation {spec.name} (draft budget {cfg.spec_draft_budget}, up to {cfg.spec_max_draft} each)"
                 if spec is not None else "speculation none")
    grouped = "on" if sched.groups is not None else "off"
    cadence = (f", decode cadence {cfg.stall_factor:g}x (questions {cfg.question_chunks})"
               if cfg.stall_factor is not None else "")
    return (f"{spec_text}, chunking {cfg.chunking}, admission {cfg.admission}, grouped prefill {grouped}{cadence}, "
            f"queue {cfg.queue_policy}, preemption {cfg.preemption}, fork gate {'on' if cfg.fork_gate else 'off'}")


def prepare_process(config: ServerConfig) -> str:
    """Ready this process for serving, once the engine and the app are built: set the thread
    switch interval and freeze the loaded heap out of the collector (``ServerConfig``'s
    ``switch_interval`` and ``gc_freeze``). Returns the banner line that says what was done.

    Why: the engine thread steps the model while uvicorn's event loop and the HTTP threads run
    Python beside it. Each torch op releases the GIL; with a busy Python thread beside it the
    engine waits up to one switch interval to take it back, after every op. On an AMD EPYC Zen 3
    (``benchmarks/gil_convoy.py --steps 80``) an 8-decoder step took 37-39 ms alone; beside one
    busy thread its p90 was 531 ms at CPython's 5 ms interval and 199-207 ms at 0.5-1 ms."""
    sys.setswitchinterval(config.switch_interval)
    frozen = f"{freeze_loaded_heap():,} objects frozen out of the collector" if config.gc_freeze else "gc freeze off"
    return f"  process: thread switch interval {config.switch_interval * 1e3:g} ms, {frozen}"


def serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Blocks until SIGINT/SIGTERM; in-flight requests get ``shutdown_timeout`` seconds."""
    engine = Engine(engine_config, show_progress=sys.stderr.isatty())
    aengine = AsyncEngine(engine, max_waiting=config.max_waiting).start()
    app = create_app(aengine, config)
    state = app.state.streamkv
    print(banner(engine, state.model_name, config) + "\n" + prepare_process(config), flush=True)
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=config.shutdown_timeout))
    try:
        server.run()
    finally:
        aengine.shutdown(timeout=config.shutdown_timeout)
        log.info("shut down")
    return 0
