"""Span queries on one engine: parse -> optimize -> lower -> run as a task between engine steps.

How a ``plus`` runs from state S (P tokens), with the span cache (``cache.py``)::

    S ──fork──▶ A: [S | a a a]      each operand computed right after S, in parallel
      ──fork──▶ B: [S | b b]        (cached under key(S, operand))
    plus state: fork(A) + splice(B, rotated by +3) = [S | a a a | b b]   (cached under key(S, plus))

Only text no cached state covers is computed. An inner ``gen`` generates from its input's
state (an internal request), then its span (input + generation prompt + output) becomes a
state its parent reuses. The root ``gen`` is an ordinary request under the query's id, so
its outputs stream like any other; its final output carries ``metrics["spans"]`` (usage and
the inner outputs). Every sequence a span query creates is pinned: never preempted, so its
re-positioned KV is never recomputed as a plain causal prompt.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generator

from streamkv.errors import InvalidRequestError
from streamkv.kv.block_pool import OutOfBlocksError
from streamkv.sched.sequence import PriorityClass, Sequence, SeqStatus
from streamkv.spans.cache import SpanCache, State
from streamkv.spans.ir import Node
from streamkv.spans.lower import (ROOT_KEY, Piece, PlusPlan, Renderer, SpanPlan, check_ids, gen_key, layout,
                                  lower, state_key)
from streamkv.spans.rules import OptimizerOptions, optimize
from streamkv.spans.tasks import All, Done, Idle, Step, Task, TaskFailed, advance

if TYPE_CHECKING:
    from streamkv.ops.core import EngineCore

_RETRY_STEPS = 64  # steps a query waits for blocks (the cache trims meanwhile) before it fails
MAX_FRAGMENTS = 100_000


@dataclass
class Usage:
    prompt_tokens: int = 0
    computed_tokens: int = 0
    reused_tokens: int = 0
    repositioned_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Query:
    request_id: str
    plan: SpanPlan
    priority: int
    blocks: int = 0  # the most KV blocks it may hold at once (admission)
    admitted: bool = False
    task: Task = field(init=False)
    usage: Usage = field(default_factory=Usage)
    inner: list[dict[str, str]] = field(default_factory=list)
    held: list[State] = field(default_factory=list)  # cache uses to release at the end
    private: list[Sequence] = field(default_factory=list)  # streams to close at the end
    internal: set[str] = field(default_factory=set)
    final: Sequence | None = None
    submitted: float = field(default_factory=time.perf_counter)

    def report(self) -> dict[str, Any]:
        return {"usage": self.usage.as_dict(), "inner": list(self.inner), "submitted": self.submitted}


def _forks(plan: SpanPlan) -> int:
    """Streams a plan creates (each fork may copy one partial block)."""
    n = len(plan.segments) + (2 if plan.gen is not None else 0)
    return n + sum(1 + sum(_forks(o) for o in seg.operands) for seg in plan.segments if isinstance(seg, PlusPlan))


class SpanQueries:
    """The span-query subsystem of one engine (all calls on the engine thread)."""

    def __init__(self, engine: "EngineCore") -> None:
        self.engine = engine
        self.cache = SpanCache(engine.seq_ops, engine.kv)
        self.corpora: dict[str, dict[str, str]] = {}
        self._renderer: Renderer | None = None
        self._queries: dict[str, Query] = {}
        self._outputs: dict[str, Any] = {}  # finished internal requests, by id
        self._owner: dict[str, Query] = {}  # internal request id -> its query
        self._counter = 0
        self._steps = 0
        self._reserved = 0  # blocks admitted span queries may hold (see _admit)
        self._emit: list[Any] = []  # outputs made outside a step (aborts), returned by after_step

    # ------------------------------------------------------------------ intake
    @property
    def renderer(self) -> Renderer:
        if self._renderer is None:
            self._renderer = Renderer(self.engine.tokenizer)
        return self._renderer

    def plan(self, tree: Node, locality_k: int | None = None) -> tuple[Node, SpanPlan]:
        """Optimize and lower ``tree``; raises SpanQueryError / InvalidRequestError, no work done."""
        try:
            opts = OptimizerOptions(locality_k=locality_k, corpora=self.corpora)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        optimized = optimize(tree, opts)
        plan = lower(optimized, self.renderer, self.engine.max_model_len)
        check_ids(plan, self.engine.bundle.vocab_size)  # type: ignore[attr-defined]
        if self._need(plan) > self.engine.pool.num_blocks:
            raise InvalidRequestError(f"the query needs up to {plan.max_len()} tokens of KV, some of it twice "
                                      f"(operands and their placed copies): {self._need(plan)} blocks; the KV "
                                      f"cache holds {self.engine.pool.num_blocks}")
        return optimized, plan

    def _need(self, plan: SpanPlan) -> int:
        """Blocks a query may hold at once, at most: every span and its placed copy, plus one
        partial block copied per fork."""
        return self.engine.kv.blocks_for(2 * plan.max_len()) + _forks(plan) + 2

    def explain(self, tree: Node, locality_k: int | None = None) -> dict[str, Any]:
        optimized, plan = self.plan(tree, locality_k)
        return {"optimized": optimized, "plan": plan, "layout": layout(plan, lambda k: k in self.cache)}

    def submit(self, request_id: str, tree: Node, priority: int = 0, locality_k: int | None = None) -> Query:
        """Start a span query; its outputs come out of ``engine.step`` under ``request_id``."""
        if request_id in self._queries or request_id in getattr(self.engine, "_requests", {}):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        _, plan = self.plan(tree, locality_k)
        query = Query(request_id, plan, priority, blocks=self._need(plan))
        query.task = Task(self._run_root(query))
        self._queries[request_id] = query
        if self._admit(query):
            advance(query.task, self._ready)
            if query.task.error is not None:  # failed before any step: nothing queued
                self._end(query)
                raise query.task.error
        return query

    def _admit(self, query: Query) -> bool:
        """Admission: running span queries together may need at most the whole pool (their
        streams are pinned, so more could deadlock); later ones wait, in arrival order."""
        if query.admitted:
            return True
        for earlier in self._queries.values():  # arrival order
            if earlier is query:
                break
            if not earlier.admitted:
                return False
        if self._reserved + query.blocks > self.engine.pool.num_blocks:
            return False
        query.admitted = True
        self._reserved += query.blocks
        return True

    def add_corpus(self, name: str, fragments: dict[str, str]) -> dict[str, int]:
        """Register (or extend) corpus ``name``; returns its size. Fragments are tokenized
        now (bad text fails here) and computed, then cached, the first time a query uses them."""
        if not name or len(name) > 128:
            raise InvalidRequestError("a corpus name must have 1-128 characters")
        corpus = self.corpora.setdefault(name, {})
        if len(corpus) + len(fragments) > MAX_FRAGMENTS:
            raise InvalidRequestError(f"a corpus holds at most {MAX_FRAGMENTS} fragments")
        tokens = 0
        for fid, text in fragments.items():
            n = len(self.engine.tokenizer.encode(text))
            if n >= self.engine.max_model_len:
                raise InvalidRequestError(f"fragment {fid!r} has {n} tokens; the context is {self.engine.max_model_len}")
            tokens += n
        corpus.update(fragments)
        return {"fragments": len(corpus), "tokens_added": tokens}

    def cache_info(self) -> dict[str, Any]:
        st = self.cache.stats
        return {"entries": len(self.cache), "blocks": self.cache.held_blocks(), "hits": st.hits,
                "misses": st.misses, "evictions": st.evictions, "running": len(self._queries),
                "corpora": {name: len(c) for name, c in self.corpora.items()}}

    # ---------------------------------------------------------------- the loop
    def has_work(self) -> bool:
        return bool(self._queries or self._emit)

    def before_step(self) -> None:
        for query in list(self._queries.values()):
            if self._admit(query):
                self._emit.extend(self._advance(query))
        if self._queries:  # room for the span streams now waiting to compute, and some slack
            self.cache.trim(self._pending_blocks() + max(1, self.engine.pool.num_blocks // 8))

    def _pending_blocks(self) -> int:
        kv = self.engine.kv
        return sum(kv.growth_cost(s.seq_id, len(s.tokens)) if kv.has(s.seq_id) else kv.blocks_for(len(s.tokens))
                   for q in self._queries.values() if q.admitted for s in q.private
                   if s.status is not SeqStatus.FINISHED)

    def after_step(self, outputs: list[Any]) -> list[Any]:
        """Take internal requests' outputs; return the others (the final one with its report)."""
        self._steps += 1
        passed, self._emit = self._emit, []
        for out in outputs:
            if out.request_id in self._owner:
                if out.finished:
                    self._outputs[out.request_id] = out
                continue
            query = self._queries.get(out.request_id)
            if query is not None and out.finished:
                out.metrics["spans"] = query.report()
                self._end(query)
            passed.append(out)
        for query in list(self._queries.values()):
            if query.admitted:
                passed.extend(self._advance(query))
        return passed

    def abort(self, request_id: str) -> bool:
        query = self._queries.get(request_id)
        if query is None:
            return False
        query.task.gen.close()
        if query.final is not None and query.final.status is not SeqStatus.FINISHED:
            return False  # the engine aborts the final request itself; _end runs on its output
        self._end(query)
        out = self._error_output(query, None)
        out.finish_reason = "abort"
        self._emit.append(out)
        return True

    def _advance(self, query: Query) -> list[Any]:
        advance(query.task, self._ready)
        if query.task.error is None:
            return []
        error = query.task.error
        self._end(query)
        return [self._error_output(query, f"{type(error).__name__}: {error}")]

    def _end(self, query: Query) -> None:
        self._queries.pop(query.request_id, None)
        if query.admitted:
            query.admitted = False
            self._reserved -= query.blocks
        for rid in query.internal:
            self._owner.pop(rid, None)
            if self._outputs.pop(rid, None) is None:
                self.engine.abort(rid)
        for state in query.held:
            self.cache.release(state)
        for seq in query.private:
            self.engine.seq_ops.close(seq)

    def _error_output(self, query: Query, message: str | None) -> Any:
        from streamkv.engine.outputs import RequestOutput  # the output type (no engine import cycle)

        return RequestOutput(request_id=query.request_id, prompt=None, prompt_token_ids=[], token_ids=[],
                             text="", finished=True, finish_reason="error", error=message,
                             metrics={"spans": query.report()})

    def _ready(self, wait: Any) -> tuple[bool, Any]:
        if isinstance(wait, Idle):
            for seq in wait.seqs:
                if seq.status is SeqStatus.FINISHED:
                    raise TaskFailed(f"a span's stream ended before its KV was computed ({seq.finish_reason})")
            return all(self.engine.seq_ops.is_idle(s) for s in wait.seqs), None
        if isinstance(wait, Done):
            out = self._outputs.pop(wait.request_id, None)
            return out is not None, out
        if isinstance(wait, Step):  # until the next engine step has run
            return self._steps > wait.after, None
        raise TypeError(f"unknown wait {wait!r}")

    # --------------------------------------------------------------- execution
    def _run_root(self, query: Query) -> Generator[Any, Any, None]:
        plan = query.plan
        state = yield from self._segments(query, plan, State(ROOT_KEY, None, 0))
        suffix = list(plan.gen.prompt)  # type: ignore[union-attr]
        query.usage.prompt_tokens = state.length + len(suffix)
        query.usage.computed_tokens += len(suffix) or 1
        seq = yield from self._fork_request(query, query.request_id, state, suffix, plan.gen.params)  # type: ignore[union-attr]
        query.final = seq

    def _segments(self, query: Query, plan: SpanPlan, state: State) -> Generator[Any, Any, State]:
        for seg in plan.segments:
            if isinstance(seg, Piece):
                state = yield from self._extend(query, state, seg)
            else:
                state = yield from self._plus(query, state, seg)
        return state

    def _extend(self, query: Query, state: State, piece: Piece) -> Generator[Any, Any, State]:
        key = state_key(state.key, piece.key)
        hit = self._take(query, key, state.volatile)
        if hit is not None:
            query.usage.reused_tokens += len(piece.ids)
            return hit
        stream = yield from self._stream(query, state, list(piece.ids))
        query.usage.computed_tokens += len(piece.ids)
        return (yield from self._cached(query, State(key, stream, state.length + len(piece.ids),
                                                     volatile=state.volatile)))

    def _plus(self, query: Query, state: State, plus: PlusPlan) -> Generator[Any, Any, State]:
        key = state_key(state.key, plus.key)
        volatile = state.volatile or not plus.reproducible
        hit = self._take(query, key, volatile)
        if hit is not None:
            query.usage.reused_tokens += hit.length - state.length
            return hit
        ops: list[State] = yield All([self._operand(query, op, state) for op in plus.operands])
        stream = yield from self._stream(query, ops[0], [])
        parts = [(op.stream, state.length, op.length - state.length) for op in ops[1:]]
        for attempt in range(_RETRY_STEPS + 1):
            try:
                query.usage.repositioned_tokens += self.engine.seq_ops.splice(stream, parts)  # type: ignore[arg-type]
                break
            except OutOfBlocksError:
                if attempt == _RETRY_STEPS:
                    raise
                yield from self._wait_for_blocks(sum(p[2] for p in parts))
        return (yield from self._cached(query, State(key, stream, len(stream.tokens), volatile=volatile)))

    def _operand(self, query: Query, plan: SpanPlan, base: State) -> Generator[Any, Any, State]:
        state = yield from self._segments(query, plan, base)
        if plan.gen is None:
            return state
        gen = plan.gen
        key = state_key(state.key, gen_key(gen))
        volatile = state.volatile or not gen.cacheable
        hit = self._take(query, key, volatile)
        if hit is not None:
            query.inner.append({"path": plan.path, "text": hit.text or ""})
            query.usage.reused_tokens += hit.length - state.length
            return hit
        self._counter += 1
        rid = f"{query.request_id}/{plan.path}#{self._counter}"
        self._owner[rid] = query
        query.internal.add(rid)
        yield from self._fork_request(query, rid, state, list(gen.prompt), gen.params)
        out = yield Done(rid)
        if out.error or out.finish_reason in ("error", "abort"):
            raise TaskFailed(f"inner gen {plan.path} failed: {out.error or out.finish_reason}")
        query.inner.append({"path": plan.path, "text": out.text})
        ids = list(gen.prompt) + list(out.token_ids)
        query.usage.computed_tokens += 2 * len(ids)  # the gen, then its span
        stream = yield from self._stream(query, state, ids)
        return (yield from self._cached(query, State(key, stream, state.length + len(ids), text=out.text,
                                                     volatile=volatile)))

    # ----------------------------------------------------------------- helpers
    def _take(self, query: Query, key: bytes, volatile: bool = False) -> State | None:
        if volatile:
            return None
        hit = self.cache.take(key)
        if hit is not None:
            query.held.append(hit)
        return hit

    def _cached(self, query: Query, state: State) -> Generator[Any, Any, State]:
        if state.stream is not None and not self.engine.seq_ops.is_idle(state.stream):
            yield Idle([state.stream])
        if state.volatile:  # a sampled output's span: this query's alone (closed at its end)
            return state
        if state.stream is not None:
            query.private.remove(state.stream)  # the cache owns it now (or closes a duplicate)
        kept = self.cache.put(state)
        query.held.append(kept)
        return kept

    def _stream(self, query: Query, base: State, suffix: list[int]) -> Generator[Any, Any, Sequence]:
        """A new pinned stream over ``base`` + ``suffix`` (computed by the scheduler), the
        query's own until it is cached (closed if the query ends first)."""
        ops = self.engine.seq_ops
        for attempt in range(_RETRY_STEPS + 1):
            try:
                if base.stream is None:
                    stream = ops.open(suffix, klass=PriorityClass.POOL)
                else:
                    stream = ops.fork(base.stream, base.length, suffix, klass=PriorityClass.POOL)
                query.private.append(stream)
                return stream
            except InvalidRequestError as exc:
                if "full" not in str(exc) or attempt == _RETRY_STEPS:
                    raise
                yield from self._wait_for_blocks(1)
        raise AssertionError("unreachable")

    def _fork_request(self, query: Query, rid: str, state: State, suffix: list[int],
                      params: Any) -> Generator[Any, Any, Sequence]:
        for attempt in range(_RETRY_STEPS + 1):
            try:
                seq = self.engine.add_fork_request(rid, state.stream, state.length, suffix, params,  # type: ignore[arg-type]
                                                   priority=query.priority, klass=PriorityClass.POOL)
                seq.pinned = True  # re-positioned KV must never be recomputed as a causal prompt
                return seq
            except InvalidRequestError as exc:
                if "full" not in str(exc) or attempt == _RETRY_STEPS:
                    raise
                yield from self._wait_for_blocks(1)
        raise AssertionError("unreachable")

    def _wait_for_blocks(self, tokens: int) -> Generator[Any, Any, None]:
        need = self.engine.kv.blocks_for(tokens) + 1
        if self.cache.trim(need) == 0 and self.engine.pool.num_free < need:
            yield Step(self._steps)  # one engine step: running requests finish and free blocks
