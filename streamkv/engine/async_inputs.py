"""Streaming-input requests on the :class:`AsyncEngine` (the HTTP routes use these).

Every change runs on the engine thread between two steps (``AsyncEngine.call``); the
request's outputs reach ``sink`` (registered at open), once its input is finished.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, AsyncIterator

from streamkv.engine.outputs import RequestOutput
from streamkv.errors import EngineDeadError

if TYPE_CHECKING:
    from streamkv.engine.async_engine import AsyncEngine


class AsyncInputStream:
    """Handle of one open input: ``append``, ``update``, ``finish``, ``outputs``, ``result``."""

    def __init__(self, engine: "AsyncEngine", request_id: str) -> None:
        self._engine = engine
        self.request_id = request_id
        self._sink: asyncio.Queue | None = None
        self._consumed = False

    async def append(self, text: str) -> dict[str, int]:
        rid = self.request_id
        return await self._engine.call(lambda e: e.inputs.append(rid, text).info())

    async def update(self, text: str) -> dict[str, int]:
        rid = self.request_id

        def run(e: Any) -> dict[str, int]:
            stream, lcp, dropped = e.inputs.update(rid, text)
            return {**stream.info(), "lcp": lcp, "invalidated": dropped}

        return await self._engine.call(run)

    async def info(self) -> dict[str, int]:
        rid = self.request_id
        return await self._engine.call(lambda e: e.inputs.get(rid).info())

    async def finish(self, text: str | None = None) -> dict[str, Any]:
        """Complete the input (generation starts), after ``text`` if given (appended only if
        the input can finish with it); outputs then come from :meth:`outputs`.

        Returns the stream's counts, ``computed`` being the prompt tokens that already had
        KV when the input finished, and ``chat`` (the input is a chat's last message).
        """
        rid, loop, sink = self.request_id, asyncio.get_running_loop(), asyncio.Queue()

        def run(e: Any) -> dict[str, Any]:
            stream = e.inputs.finish(rid, text)
            self._engine.attach_sink(rid, loop, sink)  # outputs go to the finishing caller's loop
            return {**stream.info(), "computed": stream.computed_at_finish, "chat": stream.is_chat}

        info = await self._engine.call(run)
        self._sink = sink
        return info

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; leaving early (client gone) aborts it."""
        if self._consumed or self._sink is None:
            raise RuntimeError("outputs() of an input stream can be read once, after finish()")
        self._consumed, sink = True, self._sink
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._engine.abort(self.request_id)

    async def result(self) -> RequestOutput:
        """Finish the input and wait for the final output."""
        await self.finish()
        last = None
        async for out in self.outputs():
            last = out
        if last is None:
            raise EngineDeadError("the engine returned no output")
        return last

    def abort(self) -> None:
        self._engine.abort(self.request_id)
