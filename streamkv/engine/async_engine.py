"""Thread-owned engine with an asyncio front end.

One daemon thread owns the :class:`Engine` and runs its step loop; every other thread talks
to it through a command queue. Outputs flow back to each request's ``asyncio.Queue`` via
``loop.call_soon_threadsafe``. No engine state is touched outside the owner thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence as Seq

from streamkv.engine.async_inputs import AsyncInputStream
from streamkv.engine.block_waits import BlockWaits
from streamkv.engine.engine import Engine
from streamkv.engine.outputs import RequestOutput
from streamkv.errors import (EngineDeadError, InputStreamClosedError, InvalidRequestError, KVCacheFullError,
                             QueueFullError)
from streamkv.native.omp import release_thread_team
from streamkv.sampling.params import SamplingParams

log = logging.getLogger(__name__)


__all__ = ["AsyncEngine", "QueueFullError"]

# put on a request's sink once the engine thread has accepted it (add_request returned): a
# refusal, if any, always comes before it
_ACCEPTED = object()
# a step that ran nothing (every request waits for blocks or input) changes nothing until a
# command or time does: the loop waits this long for a command instead of spinning a core
_IDLE_WAIT_S = 0.005
# A submitted fork (a session question) that finds no free block waits for one (block_waits.py):
# it is tried again after each step while other work runs (forks before it give their blocks back
# as they finish), and fails with the same retryable error once no work is left or after this many
# seconds.
_BLOCK_WAIT_S = 30.0


@dataclass
class _Add:
    request_id: str
    prompt: str | Seq[int]
    params: SamplingParams
    priority: int
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue
    submit: Any = None  # optional fn(engine) that adds ``request_id`` itself (session queries)
    kv: dict[str, Any] | None = None  # kv_write / kv_read of the request (Engine.add_request)
    again: bool = False  # ``submit`` may run again while the request has produced nothing
    accepted: bool = False  # _ACCEPTED was delivered (a second run does not deliver it again)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn(engine)`` on the owner thread and resolve ``future`` with its result."""

    fn: Any
    loop: asyncio.AbstractEventLoop | None
    future: Any  # asyncio.Future, or concurrent.futures.Future when ``loop`` is None


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="streamkv-engine", daemon=True)
        self.num_waiting = 0
        self.num_running = 0
        self.num_queued = 0  # submitted, no output yet (owned by the event loop that calls generate)
        self._reserved = 0  # places admitted requests hold for sequences not yet submitted (admit)
        self.accepting = True
        self.last_step_time = 0.0
        self._inputs: dict[str, AsyncInputStream] = {}  # open on the event loop side, by request id
        self._waits = BlockWaits()  # submits waiting for a free block (engine thread)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def start(self) -> "AsyncEngine":
        """Start the engine thread. The calling thread (which built the engine) first hands its
        OpenMP team back: idle beside the engine thread's team it made every parallel region of
        every step slower (a batch-1 decode step 14.6-17.8 ms against 7.2-8.8 on the 2-core Zen 4;
        ``native/omp.py``)."""
        release_thread_team()
        self._thread.start()
        return self

    # --------------------------------------------------------------- client side
    def admit(self, n: int) -> "Admission":
        """Reserve queue places for a request of ``n`` sequences (prompts x choices) before any is
        queued, or refuse it whole: a 400 (InvalidRequestError) when the queue could never hold
        them all, a 429 (QueueFullError) when it cannot now. Each of its ``generate(...,
        admitted=...)`` calls takes one place; ``release()`` returns those never taken. (Checked
        one by one, a request of more sequences than the limit was refused on every retry.)"""
        if self.max_waiting is not None:
            if n > self.max_waiting:
                raise InvalidRequestError(f"this request makes {n} sequences (prompts x n); the server queues at "
                                          f"most {self.max_waiting} (--max-waiting)")
            if self.num_queued + self._reserved + n > self.max_waiting:
                raise QueueFullError(f"{self.num_queued + self._reserved} requests are already waiting; {n} more "
                                     f"would pass the limit ({self.max_waiting})")
        self._reserved += n
        return Admission(self, n)

    async def generate(self, request_id: str, prompt: str | Seq[int], params: SamplingParams,
                       priority: int = 0, submit: Any = None, kv: dict[str, Any] | None = None,
                       on_accept: Any = None, admitted: "Admission | None" = None,
                       again: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; raises the engine's validation error, if any.
        ``on_accept()``, when given, is called once the engine has accepted the request, before
        its first output (a refusal raises instead, and never calls it).

        ``submit(engine)``, when given, adds ``request_id`` itself on the engine thread
        instead of ``add_request`` (e.g. a session query forking a session's KV); with
        ``again``, a request the engine fails for want of KV blocks before its first output is
        submitted again once blocks free up (until ``_BLOCK_WAIT_S`` after it arrived) instead of
        failing: ``submit`` must then be safe to run twice.
        Cancelling the consuming task (client disconnect) aborts the request. ``kv``:
        ``{"kv_write": ..., "kv_read": ...}`` policies of the request.
        """
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        if not self.accepting:
            raise EngineDeadError("server is shutting down")
        (admitted or self.admit(1)).take()  # its reserved place becomes this request's queued count
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Add(request_id, prompt, params, priority, loop, sink, submit, kv, again))
        self.num_queued += 1
        queued, finished = True, False
        try:
            while True:
                item = await sink.get()
                if item is _ACCEPTED:
                    if on_accept is not None:
                        on_accept()
                    continue
                if queued:
                    self.num_queued -= 1
                    queued = False
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if queued:
                self.num_queued -= 1
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def open_input(self, request_id: str, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                         params: SamplingParams | None = None, priority: int = 0,
                         kv: dict[str, Any] | None = None, fit_max_tokens: bool = False) -> AsyncInputStream:
        """Open a streaming-input request (see ``streamkv.inputs``; ``kv``: its ``kv_write`` /
        ``kv_read``; ``fit_max_tokens``: input must leave room for ``params.max_tokens``);
        raises its validation error."""
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        if not self.accepting:
            raise EngineDeadError("server is shutting down")
        if kv is not None and (not isinstance(kv, dict) or not set(kv) <= {"kv_write", "kv_read"}):
            raise InvalidRequestError(f"kv must be a dict with kv_write and/or kv_read, got {kv!r}")
        await self.call(lambda engine: engine.inputs.open(request_id, prompt, messages, params, priority,
                                                          fit_max_tokens=fit_max_tokens, **(kv or {})))
        handle = AsyncInputStream(self, request_id)
        self._inputs[request_id] = handle
        return handle

    def attach_sink(self, request_id: str, loop: asyncio.AbstractEventLoop, sink: asyncio.Queue) -> None:
        """Route ``request_id``'s outputs to ``sink`` (engine thread only)."""
        self._sinks[request_id] = (loop, sink)

    def input_stream(self, request_id: str) -> AsyncInputStream | None:
        """The handle of an input opened through :meth:`open_input` (None once it is gone)."""
        return self._inputs.get(request_id)

    def forget_input(self, request_id: str) -> None:
        self._inputs.pop(request_id, None)

    async def call(self, fn: Any) -> Any:
        """Run ``fn(engine)`` on the engine thread (for stats and state queries)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._commands.put(_Call(fn, loop, fut))
        return await fut

    def call_blocking(self, fn: Any, timeout: float | None = None) -> Any:
        """Run ``fn(engine)`` on the engine thread from a non-async thread and wait."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, None, fut))
        return fut.result(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish until ``timeout``, abort the rest,
        then persist sessions (with ``--session-dir``)."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self._sinks and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        for rid in list(self._sinks):
            self.abort(rid)
        time.sleep(0.1)
        if self._thread.is_alive() and self._dead is None:
            try:
                self.call_blocking(lambda e: e.sessions.close(), timeout=60.0)
            except Exception:
                log.exception("could not persist sessions at shutdown")
        self._stop.set()
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    # --------------------------------------------------------------- owner side
    def _run(self) -> None:
        try:
            idle = False  # the last step ran nothing: wait a moment for a command, do not spin
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished(), wait=_IDLE_WAIT_S if idle else 0.0)
                idle = self._turn()
        except BaseException as exc:  # the loop itself broke: fail everything, loudly
            log.exception("engine loop died")
            self._dead = exc
            for rid in list(self._sinks):
                self._deliver(rid, EngineDeadError(f"engine stopped: {exc}"), True)
        self._fail_parked(EngineDeadError(f"engine stopped: {self._dead}" if self._dead else "server is shutting down"))

    def _turn(self) -> bool:
        """Between two command drains: maintenance, one step, its outputs routed, the parked
        submits tried again. Returns whether the step ran nothing."""
        self.engine.sessions.maintain()
        self.engine.inputs.maintain()
        idle = False
        if self.engine.has_unfinished():
            t, steps = time.perf_counter(), self.engine.stats.steps
            outputs = self.engine.step()
            self.last_step_time = time.perf_counter() - t
            idle = not outputs and self.engine.stats.steps == steps
            self._route(outputs)
        self._retry_parked()
        self.num_waiting = self.engine.scheduler.num_waiting
        self.num_running = self.engine.scheduler.num_running
        return idle

    def _drain(self, block: bool, wait: float = 0.0) -> None:
        """Handle the queued commands; ``block``: wait up to 0.5 s for one (nothing to step),
        else up to ``wait`` seconds."""
        try:
            timeout = 0.5 if block else wait
            cmd = self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            if cmd.submit is not None and self._waits.parked:  # behind the forks already waiting for a block
                self._waits.park(cmd, time.monotonic() + _BLOCK_WAIT_S)
            else:
                self._add(cmd, time.monotonic() + _BLOCK_WAIT_S)
        elif isinstance(cmd, _Abort):
            if self._unpark(cmd.request_id) or self.engine.abort(cmd.request_id):
                # whoever still waits for its outputs (not always the aborting side: a finished
                # input's answer may be read by another client) gets an error, never silence
                self._deliver(cmd.request_id, InputStreamClosedError(f"request {cmd.request_id!r} was aborted"), True)
        elif isinstance(cmd, _Call):
            result: Any = None
            error: Exception | None = None
            try:
                result = cmd.fn(self.engine)
            except Exception as exc:
                error = exc
            if cmd.loop is None:
                if error is not None:
                    cmd.future.set_exception(error)
                else:
                    cmd.future.set_result(result)
                return
            try:
                cmd.loop.call_soon_threadsafe(_resolve, cmd.future, result, error)
            except RuntimeError:  # the caller's loop is closed
                pass

    def _add(self, cmd: _Add, deadline: float, retry: bool = False) -> bool:
        """Add ``cmd``'s request; a submit that finds no free block is parked until ``deadline``
        while other work runs (``retry``: it was parked before). Returns whether it was added."""
        try:
            if cmd.submit is not None:
                cmd.submit(self.engine)
            else:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, priority=cmd.priority,
                                        **(cmd.kv or {}))
        except KVCacheFullError as exc:
            if cmd.submit is not None and self.engine.has_unfinished() and time.monotonic() < deadline:
                self._waits.park(cmd, deadline, first=not retry)
            else:
                _put(cmd.loop, cmd.sink, exc)
            return False
        except Exception as exc:
            _put(cmd.loop, cmd.sink, exc)
            return False
        self._sinks[cmd.request_id] = (cmd.loop, cmd.sink)
        self._waits.accepted(cmd, deadline)
        if not cmd.accepted:
            cmd.accepted = True
            self._deliver(cmd.request_id, _ACCEPTED, False)
        return True

    def _route(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their requests' sinks, or park a fresh ``again`` submit that
        the engine failed for want of blocks once more (``BlockWaits.restart``)."""
        for out in outputs:
            if self._waits.restart(out, self.engine.has_unfinished(), time.monotonic()):
                self._sinks.pop(out.request_id, None)
            else:
                self._deliver(out.request_id, out, out.finished)

    def _retry_parked(self) -> None:
        """Try the parked submits again, oldest first (after a step: finished work gave blocks
        back); the first that still finds none keeps its place and every later one waits too."""
        if not self._waits.parked:
            return
        parked = self._waits.take()
        for i, (cmd, deadline) in enumerate(parked):
            if not self._add(cmd, deadline, retry=True) and self._waits.parked:  # parked again: no block yet
                self._waits.parked.extend(parked[i + 1:])
                return

    @property
    def num_parked(self) -> int:
        """Submits waiting for a free block now."""
        return len(self._waits.parked)

    @property
    def fork_waits(self) -> int:
        """Submits that have waited for a free block so far."""
        return self._waits.waits

    @property
    def fork_restarts(self) -> int:
        """Accepted questions failed for want of blocks before their first token and parked again."""
        return self._waits.restarts

    def _unpark(self, request_id: str) -> bool:
        """Drop a parked submit (its client left); True if there was one."""
        cmd = self._waits.unpark(request_id)
        if cmd is not None:
            _put(cmd.loop, cmd.sink, InputStreamClosedError(f"request {request_id!r} was aborted"))
        return cmd is not None

    def _fail_parked(self, error: Exception) -> None:
        for cmd, _ in self._waits.take():
            _put(cmd.loop, cmd.sink, error)

    def _deliver(self, request_id: str, item: Any, last: bool) -> None:
        if last:
            self._inputs.pop(request_id, None)
        target = self._sinks.pop(request_id, None) if last else self._sinks.get(request_id)
        if target is not None:
            _put(*target, item)


def _put(loop: asyncio.AbstractEventLoop, sink: asyncio.Queue, item: Any) -> None:
    """Hand ``item`` to a request's sink from the engine thread (a closed loop: nobody listens)."""
    try:
        loop.call_soon_threadsafe(sink.put_nowait, item)
    except RuntimeError:
        pass


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


@dataclass
class Admission:
    """Queue places ``AsyncEngine.admit`` reserved for one request's sequences (event loop only)."""

    engine: AsyncEngine
    left: int

    def take(self) -> None:
        if self.left:
            self.left -= 1
            self.engine._reserved -= 1

    def release(self) -> None:
        """Give back the places of sequences that never started (the request ended first)."""
        self.engine._reserved -= self.left
        self.left = 0
