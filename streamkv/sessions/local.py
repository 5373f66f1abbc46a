"""In-process sessions on the synchronous ``LLM``: ``llm.session(system=...)``.

The engine only advances while some call steps it, so ``push`` returns at once and
ingestion progresses during later ``query`` / ``ingest`` calls (or ``llm.step()``).
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from streamkv.errors import QueueFullError
from streamkv.sampling.params import SamplingParams
from streamkv.sessions.spec import SessionSpec

if TYPE_CHECKING:
    from streamkv.ops.core import EngineCore as Engine

_ids = itertools.count()


@dataclass
class SessionAnswer:
    answer: str
    data_version: int
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, int]
    latency_s: float
    source: str = "session"
    prompt_token_ids: list[int] = field(default_factory=list)
    confidence: dict[str, Any] | None = None


class LocalSession:
    """A live session driven in-process (same semantics as the HTTP routes)."""

    def __init__(self, engine: Engine, spec: SessionSpec) -> None:
        self._engine = engine
        self.id = engine.sessions.create(spec).id
        self._events: deque[dict[str, Any]] = deque()
        engine.sessions.get(self.id).listeners.append(self._events.append)

    def push(self, records: list[str]) -> dict[str, Any]:
        """Queue records as one data version; returns ``{"data_version": v, ...}`` at once.

        With ``overflow="block"`` a full queue makes this step the engine until there is room.
        """
        manager = self._engine.sessions
        while True:
            try:
                return manager.push(self.id, records)
            except QueueFullError:
                if manager.get(self.id).spec.overflow != "block" or not manager.has_work():
                    raise
                self._engine.step()

    def ingest(self) -> int:
        """Step the engine until every queued record has KV; returns the data version."""
        manager, stalled = self._engine.sessions, 0
        while manager.get(self.id).data.queue or manager.has_work():
            before = self._progress()
            self._engine.step()
            stalled = stalled + 1 if self._progress() == before else 0
            if stalled > 100:
                raise RuntimeError("ingestion cannot progress: the KV cache is full of other live work")
        return self.data_version

    def _progress(self) -> tuple[int, ...]:
        return tuple(s.stream.num_computed if s.stream is not None else -1
                     for s in self._engine.sessions.sessions.values()) + (self._engine.stats.steps,)

    def register_flash(self, question: str, max_tokens: int = 16, temperature: float = 0.0) -> str:
        """Register a flash question (answered after every update); returns its id."""
        manager = self._engine.sessions
        return manager.flash.register(manager.get(self.id), question, max_tokens, temperature).id

    def unregister_flash(self, question_id: str) -> None:
        manager = self._engine.sessions
        manager.flash.unregister(manager.get(self.id), question_id)

    def query(self, question: str, max_tokens: int = 64, temperature: float = 0.0, **sampling: Any) -> SessionAnswer:
        """Answer at the newest fully ingested version (ingestion keeps running meanwhile).

        A registered flash question is served from the flash cache (``source="flash"``; an
        in-flight evaluation of the current version is awaited, not duplicated); with the
        session's ready-position exit on, a qualifying ready token answers (``"ready"``).
        """
        t0 = time.perf_counter()
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, **sampling)
        instant = self._instant(question, t0)
        if instant is not None:
            return instant
        rid = f"session-query-{next(_ids)}"
        info = self._engine.sessions.query(self.id, rid, question, params)
        out = self._engine.run_to_completion([rid])[rid]
        if out.error:
            raise RuntimeError(out.error)
        return SessionAnswer(out.text, info["data_version"], list(out.token_ids), out.finish_reason,
                             {"prompt_tokens": info["prompt_tokens"], "completion_tokens": len(out.token_ids),
                              "computed_prompt_tokens": info["computed_prompt_tokens"]},
                             time.perf_counter() - t0, prompt_token_ids=info["prompt_token_ids"])

    def _instant(self, question: str, t0: float) -> SessionAnswer | None:
        manager = self._engine.sessions
        session = manager.get(self.id)
        landed: list[Any] = []
        kind, ans = manager.flash.lookup(session, question, landed.append)
        while kind == "wait" and not landed:
            self._engine.step()
        ans = landed[0] if landed else ans
        if ans is not None:
            usage = {"prompt_tokens": ans.prompt_tokens, "completion_tokens": len(ans.token_ids),
                     "computed_prompt_tokens": 0}
            return SessionAnswer(ans.answer, ans.data_version, list(ans.token_ids), ans.finish_reason, usage,
                                 time.perf_counter() - t0, source="flash", confidence=ans.confidence)
        ready = manager.ready_forks.exit_answer(session)
        if ready is None:
            return None
        return SessionAnswer(ready["answer"], ready["data_version"], [ready["token_id"]], "stop",
                             {"prompt_tokens": 0, "completion_tokens": 1, "computed_prompt_tokens": 0},
                             time.perf_counter() - t0, source="ready",
                             confidence={"first": ready["gap"], "min": ready["gap"]})

    def flash_answers(self) -> dict[str, Any]:
        """Newest cached answer of every registered question."""
        flash = self._engine.sessions.get(self.id).flash
        return {qid: next(reversed(per.values())) for qid, per in flash.cache.items() if per}

    @property
    def data_version(self) -> int:
        return self._engine.sessions.get(self.id).data.data_version

    def stats(self) -> dict[str, Any]:
        return self._engine.sessions.stats(self.id)

    def layout(self) -> dict[str, Any]:
        return self._engine.sessions.layout(self.id)

    def events(self) -> Iterator[dict[str, Any]]:
        """Events emitted so far and not yet read (``data_updated``, ``evicted``, ...)."""
        while self._events:
            yield self._events.popleft()

    def close(self) -> None:
        self._engine.sessions.delete(self.id)
