"""Span queries on one engine: parse -> optimize -> lower -> run as a task between engine steps.

::

    submit(tree) ─▶ plan (rules.py, lower.py) ─▶ Query (admitted while the pool can hold it)
    engine.step():  before_step ─▶ tasks resume (execution.py) ─▶ model step ─▶ after_step
                    (internal requests' outputs are taken; the answer passes with its report)

The root ``gen``'s outputs stream like any other request's; its final output carries
``metrics["spans"]`` (usage and the inner outputs).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamkv.errors import InvalidRequestError, KVCacheFullError, check_unicode
from streamkv.kv.block_pool import OutOfBlocksError
from streamkv.sched.sequence import SeqStatus
from streamkv.spans.cache import SpanCache
from streamkv.spans.execution import RETRY_STEPS, Execution
from streamkv.spans.ir import Gen, Node, SpanQueryError, inner_gens, kind_of, with_origins
from streamkv.spans.lower import Renderer, SpanPlan, check_ids, layout, lower, lower_prepare
from streamkv.spans.query import Query, Usage, forks, held_rows
from streamkv.spans.rules import OptimizerOptions, optimize
from streamkv.spans.tasks import Done, Idle, Step, Task, TaskFailed, advance

if TYPE_CHECKING:
    from streamkv.ops.core import EngineCore

MAX_FRAGMENTS = 100_000


class SpanQueries:
    """The span-query subsystem of one engine (all calls on the engine thread)."""

    def __init__(self, engine: "EngineCore") -> None:
        self.engine = engine
        per_token = getattr(engine.kv_ops, "bytes_per_block", 0) // engine.kv.block_size
        self.cache = SpanCache(engine.seq_ops, engine.kv, host_bytes=engine.config.cache.span_host_bytes,
                               bytes_per_token=per_token)
        self.corpora: dict[str, dict[str, str]] = {}
        self._renderer: Renderer | None = None
        self._queries: dict[str, Query] = {}
        self._outputs: dict[str, Any] = {}  # finished internal requests, by id
        self._owner: dict[str, Query] = {}  # internal request id -> its query
        self._steps = 0
        self._reserved = 0  # blocks admitted span queries may hold (see _admit)
        self.run = Execution(engine, self.cache, self._owner, lambda: self._steps)
        self._emit: list[Any] = []  # outputs made outside a step (aborts), returned by after_step
        self.totals = Usage()  # over every ended query (Prometheus)
        self.queries_ended = 0

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
        sent = kind_of(tree)  # a root that is not a gen is named as sent (the optimizer unwraps a one-child seq)
        tree = with_origins(tree)  # paths in plans and errors: the client's
        for inner in inner_gens(tree):
            if dict(inner.sampling).get("logprobs") is not None:
                raise SpanQueryError(inner.origin or "query", "logprobs are returned for the root gen only "
                                                                "(an inner gen's text is in the report's inner)")
        optimized = optimize(tree, opts)
        if not isinstance(optimized, Gen):  # (seq(gen) and plus(gen) unwrap to their gen: they run)
            raise SpanQueryError("query", f"the root must be a gen or chat node, got {sent}")
        plan = lower(optimized, self.renderer, self.engine.max_model_len)
        check_ids(plan, self.engine.bundle.vocab_size)  # type: ignore[attr-defined]
        need = self._need(plan)
        if need > self.engine.pool.num_blocks:
            raise SpanQueryError("query", f"the query needs up to {held_rows(plan)} rows of KV at once ({plan.max_len()} "
                                      f"tokens, operands also as their placed copies, once per plus level): "
                                      f"{need} blocks; the KV cache holds {self.engine.pool.num_blocks}")
        return optimized, plan

    def _need(self, plan: SpanPlan) -> int:
        """Blocks a query may hold at once, at most: its states' rows (:func:`held_rows`), plus
        one partial block copied per fork."""
        return self.engine.kv.blocks_for(held_rows(plan)) + forks(plan) + 2

    def explain(self, tree: Node, locality_k: int | None = None) -> dict[str, Any]:
        optimized, plan = self.plan(tree, locality_k)
        return {"optimized": optimized, "plan": plan, "layout": layout(plan, lambda k: k in self.cache)}

    def submit(self, request_id: str, tree: Node, priority: int = 0, locality_k: int | None = None) -> Query:
        """Start a span query; its outputs come out of ``engine.step`` under ``request_id``."""
        if request_id in self._queries or self.engine.has_request(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        _, plan = self.plan(tree, locality_k)
        query = Query(request_id, plan, priority, blocks=self._need(plan))
        query.task = Task(self.run.run_root(query))
        self._queries[request_id] = query
        if self._admit(query):
            advance(query.task, self._ready)
            if query.task.error is not None:  # failed before any step: nothing queued
                self._end(query)
                raise query.task.error
        return query

    def prepare(self, request_id: str, corpus: str, prefix: Node | None = None) -> Query:
        """Compute and cache every fragment of ``corpus`` right after ``prefix`` (text; None:
        the bare start), as a query whose ``retrieve`` follows that prefix will need them.
        Ends with a finished output under ``request_id`` carrying the usage."""
        if corpus not in self.corpora:
            raise InvalidRequestError(f"unknown corpus {corpus!r}")
        if request_id in self._queries or self.engine.has_request(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        plan, ops, blocks = self._prepare_plan(self.corpora[corpus], prefix)
        query = Query(request_id, plan, 0, blocks=blocks)
        query.task = Task(self.run.run_prepare(query, ops))
        self._queries[request_id] = query
        if self._admit(query):
            self._emit.extend(self._advance(query))
        return query

    def _prepare_plan(self, fragments: dict[str, str], prefix: Node | None) -> tuple[SpanPlan, list[SpanPlan], int]:
        """The preparation's plan, one operand per fragment and its KV blocks; raises
        SpanQueryError / InvalidRequestError for a prefix or fragment that cannot run."""
        plan, ops = lower_prepare(prefix, fragments, self.renderer, self.engine.max_model_len)
        for op in ops:
            check_ids(op, self.engine.bundle.vocab_size)  # type: ignore[attr-defined]
        budget = max(self._need(SpanPlan(plan.segments + o.segments, "x")) for o in ops)
        blocks = max(budget, self.engine.pool.num_blocks // 4)
        if blocks > self.engine.pool.num_blocks:
            raise InvalidRequestError("a fragment and the prefix do not fit the KV cache")
        return plan, ops, blocks

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

    def add_corpus(self, name: str, fragments: dict[str, str], prepare_after: Node | None = None,
                   check_prepare: bool = False) -> dict[str, int]:
        """Register (or extend) corpus ``name``; returns its size. Fragments are tokenized
        now (bad text fails here) and computed, then cached, the first time a query uses them.
        With ``check_prepare``, a preparation after ``prepare_after`` must be possible too
        (prefix and every fragment): nothing is registered when it is not."""
        if not name or len(name) > 128:
            raise InvalidRequestError("a corpus name must have 1-128 characters")
        corpus = self.corpora.get(name, {})
        if len(corpus.keys() | fragments.keys()) > MAX_FRAGMENTS:
            raise InvalidRequestError(f"a corpus holds at most {MAX_FRAGMENTS} fragments")
        tokens = 0
        for fid, text in fragments.items():  # every fragment is checked before any is added
            check_unicode(text, f"fragment {fid!r}")
            n = len(self.engine.tokenizer.encode(text))
            if n == 0:  # a zero-token span has no KV to compute or reuse (its prepare never finished)
                raise InvalidRequestError(f"fragment {fid!r} is empty: it tokenizes to no tokens")
            if n >= self.engine.max_model_len:
                raise InvalidRequestError(f"fragment {fid!r} has {n} tokens; the context is {self.engine.max_model_len}")
            tokens += n
        if check_prepare:
            self._prepare_plan({**corpus, **fragments}, prepare_after)
        self.corpora[name] = {**corpus, **fragments}
        return {"fragments": len(self.corpora[name]), "tokens_added": tokens}

    def cache_info(self) -> dict[str, Any]:
        st = self.cache.stats
        return {"entries": len(self.cache), "blocks": self.cache.held_blocks(), "hits": st.hits,
                "misses": st.misses, "evictions": st.evictions, "host_entries": self.cache.host_entries(),
                "host_bytes": self.cache.host_used, "offloads": st.offloads, "restores": st.restores,
                "running": len(self._queries),
                "corpora": {name: len(c) for name, c in self.corpora.items()}}

    @property
    def num_running(self) -> int:
        return len(self._queries)

    # ---------------------------------------------------------------- the loop
    def has_work(self) -> bool:
        return bool(self._queries or self._emit)

    def before_step(self) -> None:
        for query in list(self._queries.values()):
            if self._admit(query):
                self._emit.extend(self._advance(query))
        if len(self.cache):
            self._make_room()

    def _make_room(self) -> None:
        """Evict unused cached spans while others need the blocks: the span streams waiting to
        compute (plus 1/8 of the pool as slack), and any waiting request, which cached spans
        must never starve."""
        kv, pool = self.engine.kv, self.engine.pool
        demand = self._pending_blocks() + max(1, pool.num_blocks // 8) if self._queries else 0
        # a request with a write policy also holds its layout's blocks at the compression point
        waiting = [kv.blocks_for(len(s.tokens) + 1) + s.extra_blocks(s.write_point, kv.block_size)
                   for s in self.engine.scheduler.seqs.values() if s.status is SeqStatus.WAITING and not s.pinned]
        demand = min(pool.num_blocks, max([demand, *waiting]))
        if demand > pool.num_free:
            self.cache.trim(demand)

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
            owner = self._owner.get(out.request_id)
            if owner is not None:
                if out.finished and self._queries.get(owner.request_id) is owner:
                    self._outputs[out.request_id] = out
                elif out.finished:  # the abort :meth:`_end` asked for: its last output
                    del self._owner[out.request_id]
                continue
            query = self._queries.get(out.request_id)
            if query is not None and out.finished:
                out.metrics["spans"] = query.report()
                self._end(query)
            passed.append(out)
        for query in list(self._queries.values()):
            if query.admitted:
                passed.extend(self._advance(query))
        passed.extend(self._fail_stalled())
        return passed

    def _fail_stalled(self) -> list[Any]:
        """A query whose pinned sequences find no block while nothing at all runs waits for
        blocks that only other pinned holders (busy sessions, other queries' streams) could
        free, maybe never: after RETRY_STEPS such steps in a row the latest such query fails
        as retryable (a 503 with Retry-After) and gives its blocks back, so the others and
        the requests behind it go on."""
        stalled = self.engine.scheduler.stalled
        victim: Query | None = None
        for query in self._queries.values():  # arrival order: the latest over the bound fails
            hit = bool(stalled) and not stalled.isdisjoint(query.seq_ids())
            query.stalled_steps = query.stalled_steps + 1 if hit else 0
            if query.stalled_steps > RETRY_STEPS:
                victim = query
        if victim is None:
            return []
        message = (f"KVCacheFullError: the query's KV found no free block for {RETRY_STEPS} steps; "
                   f"the rest of the KV cache is held by sessions or other span queries")
        victim.task.gen.close()
        victim.stalled_steps = 0
        if victim.final is not None and victim.final.status is not SeqStatus.FINISHED:
            self.engine.fail(victim.request_id, message, retry=True)  # its output ends the query
            return []
        self._end(victim)
        out = self._error_output(victim, message)
        out.retry = True
        return [out]

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
        if query.task.done and query.task.error is None and query.plan.gen is None:  # a preparation
            self._end(query)
            out = self._error_output(query, None)
            out.finish_reason = "stop"
            return [out]
        if query.task.error is None:
            return []
        error = query.task.error
        self._end(query)
        out = self._error_output(query, f"{type(error).__name__}: {error}")
        out.retry = isinstance(error, (KVCacheFullError, OutOfBlocksError)) or getattr(error, "retry", False)
        return [out]

    def _end(self, query: Query) -> None:
        if self._queries.pop(query.request_id, None) is not None:
            self.queries_ended += 1
            for name, value in query.usage.as_dict().items():
                setattr(self.totals, name, getattr(self.totals, name) + value)
        if query.admitted:
            query.admitted = False
            self._reserved -= query.blocks
        for rid in query.internal:  # one still running stays owned until its abort output comes (after_step)
            if self._outputs.pop(rid, None) is not None or not self.engine.abort(rid):
                self._owner.pop(rid, None)
        for req in query.kept:  # inner gens' KV not taken over (the query failed or was aborted)
            self.engine.seq_ops.release_kv(req)
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
