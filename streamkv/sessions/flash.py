"""Flash queries: registered questions answered after every data update, before anyone asks.

Per session, evaluations run in *batches*, one batch = every registered question at one data
version, each on its own copy-on-write fork at FLASH priority::

    data_updated v3 ──▶ batch(v3): q1 q2 q3 in flight ──▶ flash_ready q1,q2,q3 @v3
    data_updated v4, v5 (while batch v3 runs)           (v4 is skipped: stale)
    batch(v3) done ──▶ batch(v5) ...

So at most one evaluation per question is pending, answers arrive in version order, and no
stale version is evaluated after a newer one exists. Answers are cached by (question, version).
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from streamkv.errors import InvalidRequestError
from streamkv.sampling.grammar import GuidedSpec
from streamkv.sampling.params import SamplingParams
from streamkv.sched.sequence import PriorityClass

if TYPE_CHECKING:
    from streamkv.engine.outputs import RequestOutput
    from streamkv.sessions.manager import SessionManager
    from streamkv.sessions.session import Session

CACHE_VERSIONS = 4  # answers kept per question (newest versions)
MAX_QUESTIONS = 64


class HitTotal:
    """A monotonic, thread-safe counter (flash hits over all sessions, deleted ones included)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self) -> None:
        with self._lock:
            self.value += 1


def normalize(question: str) -> str:
    return " ".join(question.split()).casefold()


@dataclass
class FlashQuestion:
    id: str
    question: str
    max_tokens: int = 16
    temperature: float = 0.0
    guided: GuidedSpec | None = None  # a structured answer (response_format / guided_*)

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, logprobs=2, guided=self.guided)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "question": self.question, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "guided": self.guided.to_dict() if self.guided else None}


@dataclass
class FlashAnswer:
    question_id: str
    question: str
    answer: str
    token_ids: list[int]
    data_version: int
    confidence: dict[str, float | None]
    finish_reason: str | None
    prompt_tokens: int
    eval_ms: float

    def event(self) -> dict[str, Any]:
        return {"question_id": self.question_id, "question": self.question, "answer": self.answer,
                "confidence": self.confidence, "data_version": self.data_version}


@dataclass
class FlashState:
    """Registered questions, the batch in flight and the answer cache of one session."""

    questions: OrderedDict[str, FlashQuestion] = field(default_factory=OrderedDict)
    index: dict[str, str] = field(default_factory=dict)  # normalized text -> id; replaced, never mutated
    cache: dict[str, OrderedDict[int, FlashAnswer]] = field(default_factory=dict)
    batch_version: int | None = None
    inflight: dict[str, str] = field(default_factory=dict)  # request id -> question id
    to_start: list[str] = field(default_factory=list)  # question ids of the batch not started yet
    changed: bool = False  # a question was registered while the batch ran: its version is not evaluated
    batch_started: float = 0.0
    batch_answers: list[FlashAnswer] = field(default_factory=list)
    evaluated_version: int = -1
    waiters: list[tuple[str, int, Callable[[FlashAnswer], None]]] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=lambda: {"batches": 0, "evaluations": 0,
                                                              "versions_skipped": 0, "hits": 0})
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_hit(self, total: HitTotal) -> None:
        """Hits are counted from the engine thread and the HTTP event loop: under a lock."""
        with self.lock:
            self.counters["hits"] += 1
        total.add()
    def find(self, question: str) -> FlashQuestion | None:
        """Thread-safe read: the index dict is swapped whole on every change."""
        qid = self.index.get(normalize(question))
        return self.questions.get(qid) if qid is not None else None

    def reindex(self) -> None:
        self.index = {normalize(q.question): q.id for q in self.questions.values()}

    def cached(self, question_id: str, version: int) -> FlashAnswer | None:
        """Thread-safe read (dict lookups only): used by the HTTP fast path."""
        per = self.cache.get(question_id)
        return per.get(version) if per is not None else None

    def store(self, ans: FlashAnswer) -> None:
        per = self.cache.setdefault(ans.question_id, OrderedDict())
        per[ans.data_version] = ans
        while len(per) > CACHE_VERSIONS:
            per.popitem(last=False)


def confidence(out: RequestOutput) -> dict[str, float | None]:
    """Logit gap between the top two candidates at each answer token: first and minimum."""
    gaps = [lp.top[0][1] - lp.top[1][1] for lp in (out.logprobs or []) if len(lp.top) >= 2]
    return {"first": gaps[0] if gaps else None, "min": min(gaps) if gaps else None}


class FlashEvaluator:
    """Runs flash batches for every session of a manager (engine thread)."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager
        self.engine = manager.engine
        self._owner: dict[str, Session] = {}  # flash request id -> session
        self.hits = HitTotal()

    # ------------------------------------------------------------- registration
    def register(self, session: Session, question: str, max_tokens: int = 16, temperature: float = 0.0,
                 question_id: str | None = None, guided: GuidedSpec | None = None) -> FlashQuestion:
        flash = session.flash
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequestError("question must be a non-empty string")
        if len(flash.questions) >= MAX_QUESTIONS:
            raise InvalidRequestError(f"a session holds at most {MAX_QUESTIONS} flash questions")
        if flash.find(question) is not None:
            raise InvalidRequestError("this question is already registered")
        fq = FlashQuestion(question_id or "fq_" + secrets.token_urlsafe(9), question, max_tokens, temperature, guided)
        fq.params()  # validates max_tokens / temperature (InvalidRequestError)
        if guided is not None:
            self.engine.grammars.compile(guided)  # type: ignore[union-attr]  # a bad constraint: InvalidRequestError
        flash.questions[fq.id] = fq
        flash.reindex()
        flash.evaluated_version = -1  # evaluate the new question at the current version
        flash.changed = flash.batch_version is not None  # (the batch in flight does not answer it)
        self.manager.offload.flash_changed(session)
        return fq

    def unregister(self, session: Session, question_id: str) -> None:
        flash = session.flash
        if flash.questions.pop(question_id, None) is None:
            raise InvalidRequestError(f"flash question {question_id!r} does not exist")
        flash.cache.pop(question_id, None)
        flash.reindex()
        if question_id in flash.to_start:  # a batch still starting: it no longer waits for this one
            flash.to_start.remove(question_id)
            self._deliver_if_done(session)
        self.manager.offload.flash_changed(session)

    # ---------------------------------------------------------------- evaluation
    def schedule(self, session: Session) -> None:
        """Start a batch at the newest version when none is in flight, or go on starting the
        one begun (before a step). A question whose fork finds no room now is tried again
        before the next step, the ones started meanwhile running: a batch started whole or not
        at all aborted them, and a batch a full pool could never start whole preempted a running
        question for its first fork every step, so that question never finished (review)."""
        flash, data = session.flash, session.data
        if not flash.questions or session.stream is None:
            return
        if flash.batch_version is not None and flash.to_start and flash.batch_version != data.data_version:
            self.abort_all(session)  # begun at an older version: start over at the newest
        if flash.batch_version is None and flash.evaluated_version >= data.data_version:
            return
        if flash.batch_version is not None and not flash.to_start:
            return  # in flight
        ready = session.ready
        if ready is not None and (session.ready_version != data.data_version or not self.engine.seq_ops.is_idle(ready)):
            return  # fork from the computed ready sequence, exactly as a standard query does
        # (none open: refresh, just before, could not open one, or pressure closed it until the
        # next version; the forks take the stream, as a query does, with the same answer. A batch
        # that waited for one stepped the engine, doing nothing, until the next push: review)
        version = data.data_version
        if flash.batch_version is None:
            if flash.evaluated_version >= 0:
                flash.counters["versions_skipped"] += max(0, version - flash.evaluated_version - 1)
            flash.batch_version, flash.batch_started, flash.batch_answers = version, time.perf_counter(), []
            flash.to_start = [qid for qid in flash.questions if flash.cached(qid, version) is None]
            flash.counters["batches"] += 1
        while flash.to_start:
            fq = flash.questions.get(flash.to_start[0])
            if fq is not None:  # (one unregistered meanwhile is dropped)
                rid = f"flash-{session.id}-{fq.id}-{version}"
                try:
                    self.manager.start_query(session, rid, fq.question, fq.params(), PriorityClass.FLASH)
                except InvalidRequestError:
                    return  # no KV block for this fork now: tried again before the next step
                flash.inflight[rid] = fq.id
                self._owner[rid] = session
            flash.to_start.pop(0)
        self._deliver_if_done(session)  # (every fork started may have answered already)

    def collect(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Take finished flash outputs out of a step's outputs; returns the others."""
        rest = []
        for out in outputs:
            session = self._owner.get(out.request_id)
            if session is None:
                rest.append(out)
            elif out.finished:
                del self._owner[out.request_id]
                self._finished(session, out)
        return rest

    def _finished(self, session: Session, out: RequestOutput) -> None:
        flash = session.flash
        qid = flash.inflight.pop(out.request_id, None)
        fq = flash.questions.get(qid) if qid else None
        if fq is not None and out.finish_reason not in ("abort", "error"):
            flash.counters["evaluations"] += 1
            flash.batch_answers.append(FlashAnswer(
                fq.id, fq.question, out.text, list(out.token_ids), flash.batch_version or 0, confidence(out),
                out.finish_reason, len(out.prompt_token_ids), (time.perf_counter() - flash.batch_started) * 1e3))
        self._deliver_if_done(session)

    def _deliver_if_done(self, session: Session) -> None:
        """Deliver the batch once every question has started and answered."""
        if not session.flash.inflight and not session.flash.to_start:
            self._deliver(session)

    def _deliver(self, session: Session) -> None:
        flash = session.flash
        order = list(flash.questions)
        for ans in sorted(flash.batch_answers, key=lambda a: order.index(a.question_id) if a.question_id in order else 0):
            flash.store(ans)
            session.emit("flash_ready", **ans.event())
            for waiter in [w for w in flash.waiters if w[0] == ans.question_id and w[1] == ans.data_version]:
                flash.waiters.remove(waiter)
                waiter[2](ans)
        if flash.batch_version is not None and not flash.changed:
            flash.evaluated_version = flash.batch_version
        # a question registered while the batch ran leaves the version unevaluated: the next
        # batch, at the newest version, answers what has no answer there yet (that batch's
        # delivery marked the version evaluated without it, until the next push: review)
        flash.batch_version, flash.batch_answers, flash.changed = None, [], False
        for waiter in list(flash.waiters):  # evaluation failed: release waiters (they fall back)
            if waiter[1] <= flash.evaluated_version:
                flash.waiters.remove(waiter)
                waiter[2](None)  # type: ignore[arg-type]

    def abort_all(self, session: Session) -> None:
        """End the batch: its forks still running are aborted, and stay owned until their abort
        output comes (:meth:`collect` takes it; it came out of ``engine.step`` as a client's);
        every waiter is released with None (it falls back to a plain question; a deleted
        session's waited for its timeout)."""
        flash = session.flash
        for rid in list(flash.inflight):
            if not self.engine.abort(rid):
                self._owner.pop(rid, None)
        flash.inflight.clear()
        flash.to_start.clear()
        flash.batch_version, flash.batch_answers = None, []
        waiters, flash.waiters = flash.waiters, []
        for waiter in waiters:
            waiter[2](None)  # type: ignore[arg-type]

    # ------------------------------------------------------------------- lookup
    def lookup(self, session: Session, question: str,
               on_ready: Callable[[FlashAnswer | None], None] | None = None) -> tuple[str, FlashAnswer | None]:
        """``("hit", answer)``, ``("wait", None)`` (``on_ready`` fires when the in-flight
        evaluation of the current version lands) or ``("miss", None)``.

        Without ``on_ready`` it only reads (plus the locked hit count), so the HTTP event loop
        may call it off the engine thread.
        """
        flash = session.flash
        fq = flash.find(question)
        if fq is None:
            return "miss", None
        version = session.data.data_version
        ans = flash.cached(fq.id, version)
        if ans is not None:
            flash.count_hit(self.hits)
            return "hit", ans
        if (flash.batch_version == version and (fq.id in flash.inflight.values() or fq.id in flash.to_start)
                and on_ready is not None):
            flash.waiters.append((fq.id, version, on_ready))
            return "wait", None
        return "miss", None

    def stats(self, session: Session) -> dict[str, Any]:
        flash = session.flash
        return {"questions": len(flash.questions), "pending": len(flash.inflight) + len(flash.to_start),
                "batch_version": flash.batch_version, "evaluated_version": flash.evaluated_version,
                **flash.counters}
