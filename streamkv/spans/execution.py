"""How a span query computes, as generators the task driver (``tasks.py``) resumes between steps.

How a ``plus`` runs from state S (P tokens), with the span cache (``cache.py``)::

    S ──fork──▶ A: [S | a a a]      each operand computed right after S, in parallel
      ──fork──▶ B: [S | b b]        (cached under key(S, operand))
    plus state: fork(A) + splice(B, rotated by +3) = [S | a a a | b b]   (cached under key(S, plus))

Only text no cached state covers is computed, and consecutive such pieces in one sequence
(a ``Run``; the state after each piece is still cached, as a fork of that sequence). An inner
``gen`` generates from its input's state (an internal request whose prefill is the input's
uncached pieces and the generation prompt together: one step, not one per piece), then its
span (input + generation prompt + output) becomes a state its parent reuses. The root ``gen``
is an ordinary request under the query's id.
Every sequence a span query creates is pinned: never preempted, so its re-positioned KV is
never recomputed as a plain causal prompt.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class Run:
    """Text pieces after ``base`` that no cached state covers, computed by one sequence::

        base ── piece 1 ──┬── piece 2 ──┬──▶ ids = piece 1 + piece 2
                          ends[0]       ends[1]   (key of the state after each piece, its end in ids)
    """

    base: State
    ids: list[int] = field(default_factory=list)
    ends: list[tuple[bytes, int]] = field(default_factory=list)

    @property
    def key(self) -> bytes:
        return self.ends[-1][0] if self.ends else self.base.key

    @property
    def length(self) -> int:
        return self.base.length + len(self.ids)


def _root(state: State) -> dict[str, Any]:
    """The root fields of a state forked from ``state``: the assembled plus whose blocks it
    shares (``state`` itself, or ``state``'s root) and that plus's length."""
    if state.assembled:
        return {"root": state.key, "root_length": state.length}
    return {"root": state.root, "root_length": state.root_length}


def _on(base: State, key: bytes | None = None) -> dict[str, Any]:
    """The fields of a state computed on ``base`` (or on ``key``, text computed on ``base``):
    its base, and the plus it shares blocks with, after whose rows its host copy starts."""
    return {"base": key or base.key, **_root(base)}


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

    def _segments(self, query: Query, plan: SpanPlan, state: State,
                  leave_tail: bool = False) -> Generator[Any, Any, Any]:
        """The state after ``plan``'s segments. Text pieces no cached state covers are
        computed together, a run of them by one sequence (a later piece's hit covers the ones
        before it). With ``leave_tail`` the trailing run is returned uncomputed (a ``Run``) for
        the gen after it to compute in its own request."""
        run = Run(state)
        for seg in plan.segments:
            if isinstance(seg, Piece):
                run = self._add_piece(query, run, seg)
                continue
            state = yield from self._compute(query, run)
            state = yield from self._plus(query, state, seg)
            run = Run(state)
        if leave_tail:
            return run
        return (yield from self._compute(query, run))

    def _add_piece(self, query: Query, run: Run, piece: Piece) -> Run:
        key = state_key(run.key, piece.key)
        hit = self._take(query, key, run.base.volatile)
        if hit is not None:
            query.usage.reused_tokens += len(run.ids) + len(piece.ids)
            return Run(hit)
        run.ids.extend(piece.ids)
        run.ends.append((key, len(run.ids)))
        return run

    def _compute(self, query: Query, run: Run) -> Generator[Any, Any, State]:
        """Compute ``run`` as a stream; the state after each of its pieces is cached."""
        if not run.ids:
            return run.base
        stream = yield from self._stream(query, run.base, run.ids)
        query.usage.computed_tokens += len(run.ids)
        state = yield from self._cached(query, State(run.key, stream, run.length, volatile=run.base.volatile,
                                                     **_on(run.base)))
        yield from self._keep_ends(query, run, state.stream, run.ends[:-1])  # type: ignore[arg-type]
        return state

    def _keep_ends(self, query: Query, run: Run, seq: Sequence, ends: list[tuple[bytes, int]]) -> Generator[Any, Any, None]:
        """Cache the state after each listed piece of ``run`` as a fork of ``seq``, which
        computed the run (its KV rows are the same bits whichever step computed them)."""
        if run.base.volatile:
            return
        for key, end in ends:
            stream = yield from self._stream(query, State(key, seq, run.base.length + end), [])
            yield from self._cached(query, State(key, stream, run.base.length + end, **_on(run.base)))

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
                                                     base=ops[0].key, inner=tuple(texts[p] for p in paths),
                                                     assembled=True, **_root(ops[0]))))

    def _operand(self, query: Query, plan: SpanPlan, base: State) -> Generator[Any, Any, State]:
        if plan.gen is None:
            return (yield from self._segments(query, plan, base))
        run: Run = yield from self._segments(query, plan, base, leave_tail=True)
        if run.base.stream is None and run.ids:  # nothing to fork a request from: a stream first
            run = Run((yield from self._compute(query, run)))
        gen = plan.gen
        key = state_key(run.key, gen_key(gen))
        volatile = run.base.volatile or not gen.cacheable
        hit = self._take(query, key, volatile)
        if hit is not None:
            query.inner.append({"path": plan.path, "text": hit.text or ""})
            query.usage.reused_tokens += hit.length - run.base.length
            return hit
        self.counter += 1
        rid = f"{query.request_id}/{plan.path}#{self.counter}"
        self.owner[rid] = query
        query.internal.add(rid)
        # the run's pieces and the generation prompt are one prefill of the request
        req = yield from self._fork_request(query, rid, run.base, run.ids + list(gen.prompt), gen.params,
                                            keep_kv=True)
        query.kept.append(req)
        out = yield Done(rid)
        if out.error or out.finish_reason in ("error", "abort"):
            raise TaskFailed(f"inner gen {plan.path} failed: {out.error or out.finish_reason}", retry=out.retry)
        query.inner.append({"path": plan.path, "text": out.text})
        yield from self._keep_ends(query, run, req, run.ends)
        # the span is the request's own KV, as written (prompt, then decode): a stream forks it
        # and computes only the last sampled token, which has no KV yet
        rest = req.tokens[req.num_computed:]
        stream = yield from self._stream(query, State(key, req, req.num_computed), rest)
        self.engine.seq_ops.release_kv(req)
        query.usage.computed_tokens += len(run.ids) + len(gen.prompt) + len(out.token_ids)
        return (yield from self._cached(query, State(key, stream, len(req.tokens), text=out.text,
                                                     volatile=volatile, **_on(run.base, run.key))))

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
