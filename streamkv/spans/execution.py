"""How a span query computes, as generators the task driver (``tasks.py``) resumes between steps.

How a ``plus`` runs from state S (P tokens), with the span cache (``cache.py``)::

    S ──fork──▶ A: [S | a a a]      each operand computed right after S, in parallel
      ──fork──▶ B: [S | b b]        (cached under key(S, operand))
    plus state: fork(A) + splice(B, rotated by +3) = [S | a a a | b b]   (cached under key(S, plus))

Only text no cached state covers is computed. An inner ``gen`` generates from its input's
state (an internal request), then its span (input + generation prompt + output) becomes a
state its parent reuses. The root ``gen`` is an ordinary request under the query's id.
Every sequence a span query creates is pinned: never preempted, so its re-positioned KV is
never recomputed as a plain causal prompt.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Generator

from streamkv.errors import KVCacheFullError
from streamkv.kv.block_pool import OutOfBlocksError
from streamkv.sched.sequence import PriorityClass, Sequence
from streamkv.spans.cache import SpanCache, State
from streamkv.spans.lower import ROOT_KEY, Piece, PlusPlan, SpanPlan, gen_key, inner_paths, state_key
from streamkv.spans.query import Query
from streamkv.spans.tasks import All, Done, Idle, Step, TaskFailed

if TYPE_CHECKING:
    from streamkv.ops.core import EngineCore

RETRY_STEPS = 64  # steps a query waits for blocks (the cache trims meanwhile) before it fails


class Execution:
    """The computation of span queries on one engine; ``owner`` maps internal request ids
    (inner gens) to their query, ``steps()`` counts engine steps (for ``Step`` waits)."""

    def __init__(self, engine: "EngineCore", cache: SpanCache, owner: dict[str, Query],
                 steps: Callable[[], int]) -> None:
        self.engine = engine
        self.cache = cache
        self.owner = owner
        self.steps = steps
        self.counter = 0

    def run_root(self, query: Query) -> Generator[Any, Any, None]:
        plan = query.plan
        state = yield from self._segments(query, plan, State(ROOT_KEY, None, 0))
        suffix = list(plan.gen.prompt)  # type: ignore[union-attr]
        query.usage.prompt_tokens = state.length + len(suffix)
        query.usage.computed_tokens += len(suffix) or 1
        seq = yield from self._fork_request(query, query.request_id, state, suffix, plan.gen.params)  # type: ignore[union-attr]
        query.final = seq

    def run_prepare(self, query: Query, ops: list[SpanPlan]) -> Generator[Any, Any, None]:
        state = yield from self._segments(query, query.plan, State(ROOT_KEY, None, 0))
        bs, budget = self.engine.kv.block_size, query.blocks // 2
        batch: list[SpanPlan] = []
        for i, op in enumerate(ops):
            batch.append(op)
            size = sum(-(-o.max_len() // bs) + 1 for o in batch)
            if size < budget and i + 1 < len(ops):
                continue
            done: list[State] = yield All([self._operand(query, o, state) for o in batch])
            for st in done:  # cached: evictable again once computed (only the batch is held)
                query.held.remove(st)
                self.cache.release(st)
            batch = []
        query.usage.prompt_tokens = state.length + sum(o.max_len() for o in ops)

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
                                                     volatile=state.volatile, base=state.key)))

    def _plus(self, query: Query, state: State, plus: PlusPlan) -> Generator[Any, Any, State]:
        key = state_key(state.key, plus.key)
        volatile = state.volatile or not plus.reproducible
        hit = self._take(query, key, volatile)
        paths = inner_paths(plus)
        if hit is not None:
            # the same key, so the same gens in the same canonical order: this query's paths
            query.inner.extend({"path": p, "text": t} for p, t in zip(paths, hit.inner))
            query.usage.reused_tokens += hit.length - state.length
            return hit
        ops: list[State] = yield All([self._operand(query, op, state) for op in plus.operands])
        texts = {e["path"]: e["text"] for e in query.inner}
        stream = yield from self._stream(query, ops[0], [])
        parts = [(op.stream, state.length, op.length - state.length) for op in ops[1:]]
        query.usage.repositioned_tokens += yield from self._with_blocks(
            lambda: self.engine.seq_ops.splice(stream, parts), sum(p[2] for p in parts))  # type: ignore[arg-type]
        return (yield from self._cached(query, State(key, stream, len(stream.tokens), volatile=volatile,
                                                     base=ops[0].key, inner=tuple(texts[p] for p in paths))))

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
        self.counter += 1
        rid = f"{query.request_id}/{plan.path}#{self.counter}"
        self.owner[rid] = query
        query.internal.add(rid)
        req = yield from self._fork_request(query, rid, state, list(gen.prompt), gen.params, keep_kv=True)
        query.kept.append(req)
        out = yield Done(rid)
        if out.error or out.finish_reason in ("error", "abort"):
            raise TaskFailed(f"inner gen {plan.path} failed: {out.error or out.finish_reason}")
        query.inner.append({"path": plan.path, "text": out.text})
        # the span is the request's own KV, as written (prompt, then decode): a stream forks it
        # and computes only the last sampled token, which has no KV yet
        rest = req.tokens[req.num_computed:]
        stream = yield from self._stream(query, State(key, req, req.num_computed), rest)
        self.engine.seq_ops.release_kv(req)
        query.usage.computed_tokens += len(gen.prompt) + len(out.token_ids)
        return (yield from self._cached(query, State(key, stream, len(req.tokens), text=out.text,
                                                     volatile=volatile, base=state.key)))

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

        def make() -> Sequence:
            if base.stream is None:
                return ops.open(suffix, klass=PriorityClass.POOL)
            return ops.fork(base.stream, base.length, suffix, klass=PriorityClass.POOL)

        stream = yield from self._with_blocks(make, len(suffix))
        query.private.append(stream)
        return stream

    def _fork_request(self, query: Query, rid: str, state: State, suffix: list[int],
                      params: Any, keep_kv: bool = False) -> Generator[Any, Any, Sequence]:
        def make() -> Sequence:
            return self.engine.add_fork_request(rid, state.stream, state.length, suffix, params,  # type: ignore[arg-type]
                                                priority=query.priority, klass=PriorityClass.POOL)

        seq = yield from self._with_blocks(make, len(suffix))
        seq.pinned = True  # re-positioned KV must never be recomputed as a causal prompt
        seq.keep_kv = keep_kv
        return seq

    def _with_blocks(self, make: Callable[[], Any], tokens: int) -> Generator[Any, Any, Any]:
        """``make()``, retried while the pool has no block for it (the cache trims meanwhile,
        running requests finish); fails after RETRY_STEPS steps."""
        for attempt in range(RETRY_STEPS + 1):
            try:
                return make()
            except (KVCacheFullError, OutOfBlocksError):
                if attempt == RETRY_STEPS:
                    raise
                yield from self._wait_for_blocks(tokens)
        raise AssertionError("unreachable")

    def _wait_for_blocks(self, tokens: int) -> Generator[Any, Any, None]:
        need = self.engine.kv.blocks_for(tokens) + 1
        trimmed = self.cache.trim(need)
        if self.engine.pool.num_free < need:
            self.engine.seq_ops.reclaim(need)  # inputs waiting for text never finish: they make room
        if trimmed == 0 and self.engine.pool.num_free < need:
            yield Step(self.steps())  # one engine step: running requests finish and free blocks
