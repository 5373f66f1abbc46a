"""The synchronous engine: one thread calls :meth:`Engine.step` in a loop.

One step = ``Scheduler.schedule()`` -> ``runner.execute(plan)`` -> ``Scheduler.update()``
-> detokenize / stop strings -> outputs. Requests are validated when added, so a bad
request is rejected with :class:`InvalidRequestError` before it can reach the loop; a
failure inside a step fails only the requests of that step.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Sequence as Seq

from streamkv.config import EngineConfig
from streamkv.engine.factory import ModelBundle, build_bundle
from streamkv.engine.intake import PromptChecks
from streamkv.engine.kv_policies import KVPolicies, KVPolicyTotals, PolicySpec, kv_report
from streamkv.engine.outputs import RequestOutput
from streamkv.engine.response_cache import ResponseCache
from streamkv.engine.step_log import StepLog
from streamkv.engine.token_gaps import TokenGaps
from streamkv.errors import InvalidRequestError
from streamkv.inputs.manager import InputStreams
from streamkv.kv.block_pool import BlockPool
from streamkv.kv.host_pool import HostPool
from streamkv.kv.manager import KVManager
from streamkv.loading.heap import release_freed_heap
from streamkv.policies.read import ReadPolicy
from streamkv.ops.seq_ops import SeqOps
from streamkv.sampling.detokenizer import IncrementalDetokenizer
from streamkv.sampling.params import SamplingParams, prompt_seed
from streamkv.sched.plan import StepOutput, StepPlan, TokenLogprobs
from streamkv.sched.preemption import PreemptionPolicy, make_preemption
from streamkv.sched.scheduler import Scheduler
from streamkv.sched.sequence import PriorityClass, Sequence
from streamkv.sessions.manager import SessionManager
from streamkv.spans.executor import SpanQueries

log = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    seq: Sequence
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    arrival: float
    first_token: float | None = None
    last_token: float | None = None  # the step that emitted its latest token (token_gaps.py)
    reported_tokens: int = 0
    error: str | None = None
    extra: dict = field(default_factory=dict)
    cache_key: object = None


STALL_STEPS = 64  # empty steps in a row a waiting fork may stall before its request fails (retryable)


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    step_errors: int = 0
    busy_s: float = 0.0  # wall time inside model steps (schedule + execute + update)


class Engine(PromptChecks):
    """Owns scheduler, KV manager and runner; not thread-safe (one owner thread)."""

    def __init__(self, config: EngineConfig | None = None, bundle: ModelBundle | None = None,
                 show_progress: bool = False) -> None:
        self.config = config or EngineConfig()
        if bundle is None:
            bundle = build_bundle(self.config, show_progress=show_progress)
            release_freed_heap()  # the load's temporaries, gone with its locals (heap.py: ~1 GB)
        self.bundle = bundle
        self.tokenizer = self.bundle.tokenizer
        self.max_model_len = self.bundle.max_model_len
        cc = self.config.cache
        self.pool = BlockPool(self.bundle.num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.kv_ops = getattr(self.bundle.runner, "kv_ops", None)
        self.grammars = getattr(self.bundle.runner, "grammars", None)  # structured outputs (None: unsupported)
        self.kv = KVManager(self.pool, HostPool(self._host_blocks()))
        self.scheduler = Scheduler(self.config.scheduler, self.kv, speculator=self.config.scheduler.make_speculator(
            self.config.runtime.numerics))
        self.seq_ops = SeqOps(self.scheduler, self.kv, self.kv_ops, self.max_model_len, itertools.count(),
                              getattr(self.bundle.runner, "recent", None))
        self.stats = EngineStats()
        self.gaps = TokenGaps()  # decode stalls, engine-side
        self.step_log = StepLog(self.config.runtime.step_log) if self.config.runtime.step_log else None
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._pending: list[RequestOutput] = []
        # final outputs kept for an in-process owner that steps the engine only now and then
        # (``LLM.open_input`` handles): whoever steps first must not lose another's answer
        self._kept: dict[str, RequestOutput | None] = {}
        self._dropped: deque[str] = deque()  # handles gone: abort and forget at the next step (drop_output)
        self._quiet = 0  # steps in a row that computed no new row
        self.responses = ResponseCache(cc.response_cache_entries)
        self.sessions = SessionManager(self)
        self.inputs = InputStreams(self)
        self.spans = SpanQueries(self)
        self.scheduler.preemption = self._preemption()
        self.kv_policies = KVPolicies.from_config(self.config.kv_policies)
        self.kv_totals = KVPolicyTotals()

    def _host_blocks(self) -> int:
        """Swap space in blocks (0 without ``swap_space`` or a runner that can swap)."""
        per_block = getattr(self.kv_ops, "bytes_per_block", 0)
        n = self.config.cache.swap_space // per_block if per_block else 0
        if n:
            self.kv_ops.attach_host(n)  # type: ignore[union-attr]
        return n

    def _preemption(self) -> PreemptionPolicy:
        name = self.config.scheduler.preemption
        if name == "swap" and not self.kv.host.num_blocks:  # (cost, the default, recomputes without it too)
            log.warning("preemption swap without swap space (--swap-space BYTES): every victim is recomputed")
        if name != "cost" or not self.kv.host.num_blocks:
            return make_preemption(name)
        from streamkv.engine.profile import load_or_measure

        return make_preemption(name, load_or_measure(self))

    # ----------------------------------------------------------------- intake
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    priority: int = 0, klass: PriorityClass = PriorityClass.POOL,
                    partial: bool = False, kv_write: PolicySpec = None, kv_read: PolicySpec = None) -> Sequence | None:
        """Validate and queue a request; raises InvalidRequestError and queues nothing on bad input.

        ``partial``: a streaming-input request (``streamkv.inputs``) whose prompt (possibly
        still empty) will change through :attr:`seq_ops`; it never answers from the response
        cache. ``kv_write`` / ``kv_read``: the request's KV policies (``{"policy": ...}``
        objects; None: the server defaults). Returns the queued sequence (None for a
        response-cache hit).
        """
        params = self._check_request(request_id, params, priority)
        if partial and (kv_write is not None or kv_read is not None):
            raise InvalidRequestError("a streaming input's kv_write / kv_read are given to InputStreams.open")
        # a streaming input's policies apply at finish (``streamkv.inputs``): exact KV until then
        write, read = (None, None) if partial else self.kv_policies.resolve(kv_write, kv_read)
        text, ids = self.tokenize_prompt(prompt) if not (partial and not prompt) else (None, [])
        self._validate_ids(ids, allow_empty=partial)
        self.check_write_fits(len(ids), params.max_tokens, write)
        if self.config.cache.seed_from_prompt and params.seed is None and not params.greedy and not partial:
            params = replace(params, seed=prompt_seed(ids))  # identical requests, identical outputs
        lossy = write is not None or read is not None  # approximate KV: never a response-cache entry
        key = None if partial or lossy else self.responses.key(ids, params)
        hit = None if partial else self.responses.get(key, request_id, time.perf_counter())
        if hit is not None:
            hit.prompt = text
            self._pending.append(hit)
            return None
        seq = self._new_seq(ids, params, priority, klass)
        seq.partial = partial
        seq.write, seq.read, seq.read_from = write, read, len(ids)  # read: the answer's rows; the prompt is exact
        self.scheduler.add(self._register(request_id, text, seq, key))
        return seq

    def add_fork_request(self, request_id: str, parent: Sequence, num_tokens: int, suffix: Seq[int],
                         params: SamplingParams | None = None, priority: int = 0,
                         klass: PriorityClass = PriorityClass.SESSION, read: ReadPolicy | None = None,
                         read_from: int | None = None) -> Sequence:
        """Generate from ``parent.tokens[:num_tokens] + suffix``, sharing the parent's KV.

        The first ``num_tokens`` tokens must already have KV: they are forked copy-on-write
        (DESIGN.md section 3), so only ``suffix`` is computed and the parent keeps running.
        Raises InvalidRequestError (nothing queued) on bad input or when the KV pool has no
        block for the copy. With ``read``, the fork's own rows from ``read_from`` (default: the
        fork point) attend only to the pages that read policy picks (lossy, so the fork's KV
        never enters the prefix cache); the rows before it are exact.
        """
        params = self._check_request(request_id, params, priority)
        ids = list(parent.tokens[:num_tokens]) + [int(t) for t in suffix]
        self._validate_ids(ids)
        if self.config.cache.seed_from_prompt and params.seed is None and not params.greedy:
            params = replace(params, seed=prompt_seed(ids))  # as add_request does (session questions)
        seq = self._new_seq(ids, params, priority, klass)
        seq.cacheable = parent.cacheable and read is None
        read_from = num_tokens if read_from is None else read_from
        if not num_tokens <= read_from <= len(ids):
            raise InvalidRequestError(f"read_from must be in [{num_tokens}, {len(ids)}], got {read_from}")
        seq.read, seq.read_from = read, read_from
        self.seq_ops.fork_kv(parent, seq, min(num_tokens, len(ids) - 1))
        self.scheduler.add_running(self._register(request_id, None, seq))
        return seq

    def _check_request(self, request_id: str, params: SamplingParams | None, priority: int) -> SamplingParams:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"a request id is a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        if params.guided is not None:
            if self.grammars is None:
                raise InvalidRequestError("structured outputs are not available with this runner")
            self.grammars.compile(params.guided)  # a cache hit when the server compiled it already
        return params

    def _new_seq(self, ids: list[int], params: SamplingParams, priority: int, klass: PriorityClass) -> Sequence:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        return Sequence(seq_id=self.seq_ops.next_id(), tokens=list(ids), num_prompt_tokens=len(ids),
                        params=params, max_len=self.max_model_len, stop_ids=frozenset(stop_ids),
                        priority=priority, klass=klass, events=[])

    def _register(self, request_id: str, text: str | None, seq: Sequence, cache_key: object = None) -> Sequence:
        params = seq.params
        req = _Request(request_id, text, seq, IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output),
            [] if params.logprobs is not None else None, time.perf_counter(), cache_key=cache_key)
        self._requests[request_id] = req
        self._by_seq[seq.seq_id] = req
        self.stats.prompt_tokens += len(seq.tokens)
        return seq

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def abort(self, request_id: str) -> bool:
        if self.spans.abort(request_id):  # a span query still computing its spans
            return True
        req = self._requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req.seq.seq_id, "abort")
        self._pending.append(self._finish(req))
        return True

    def fail(self, request_id: str, message: str, retry: bool = False) -> bool:
        """End a request with an error (``retry``: for want of room, so it may succeed later);
        its output comes out of the next step. False when unknown."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        req.error = message
        self.scheduler.finish(req.seq.seq_id, "error")
        out = self._finish(req)
        out.retry = retry
        self._pending.append(out)
        return True

    # ------------------------------------------------------------------- loop
    def has_unfinished(self) -> bool:
        # open streaming inputs with all their arrived tokens computed wait for input, not steps
        return (bool(self._pending) or self.sessions.has_work() or self.spans.has_work()
                or len(self._requests) > self.inputs.num_idle())

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of requests that progressed or ended."""
        self._release_dropped()
        outputs, self._pending = self._pending, []
        self.sessions.before_step()
        self.spans.before_step()
        outputs = self.spans.after_step(self.sessions.after_step(outputs + self._step()))
        self._fail_stalled()
        if not self.has_unfinished():
            self.gaps.idle()
        if self._kept:
            for out in outputs:
                if out.finished and out.request_id in self._kept:
                    self._kept[out.request_id] = out
        return outputs

    def _fail_stalled(self) -> None:
        """A request whose fork waits for blocks (never dropped: its parent's rows are nothing a
        prefill gives back) fails as retryable (a 503 with Retry-After) once STALL_STEPS steps in
        a row computed no new row, the latest such request first, then the next after as many
        quiet steps again: the rest of the pool is held by pinned KV (sessions, other such forks) that
        only its release can unblock. Steps that only recompute rows do not count as progress
        (a fork that could not grow truncated itself and recomputed, step after step, while the
        forks whose copied blocks it needed waited behind it). (Span queries' own sequences
        are their executor's.)"""
        if self.scheduler.progressed:
            self._quiet = 0
            return
        self._quiet += 1
        # requests' forks waiting now (a plain request that truncated itself holds nothing of a
        # session's: failing it frees nothing)
        # and forks the fork gate holds at their fork point: each holds a copied block the
        # others may lack (sched/fork_gate.py)
        waiting = [self._by_seq[sid] for sid in self.scheduler.starved | self.scheduler.gated if sid in self._by_seq
                   and not self._by_seq[sid].seq.pinned and self._by_seq[sid].seq.forked_rows]
        if self._quiet > STALL_STEPS and waiting:
            req = max(waiting, key=lambda r: r.arrival)
            self._quiet = 0  # the next one only after as many quiet steps: the fork that needed
            # the block may first recompute rows it had (not progress) before it computes new ones
            self.fail(req.request_id, f"KVCacheFullError: no KV block for {STALL_STEPS} steps; the rest of "
                                      f"the KV cache is held by sessions and their queries", retry=True)

    def keep_output(self, request_id: str) -> None:
        """Keep ``request_id``'s final output until :meth:`run_to_completion` asks for it,
        whichever call steps the engine when it finishes."""
        self._kept[request_id] = None

    def drop_output(self, request_id: str) -> None:
        """Nobody will ask for ``request_id``'s output (its handle was dropped or aborted): abort
        it at the next step if it still runs, and forget its kept output. Safe from a garbage
        collector's finalizer, which may run in the middle of a step: it only queues the id."""
        self._dropped.append(request_id)

    def _release_dropped(self) -> None:
        while self._dropped:
            rid = self._dropped.popleft()
            self._kept.pop(rid, None)
            self.abort(rid)

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.empty and not plan.released:
            return outputs
        try:
            return self._run_plan(plan, outputs)
        finally:
            self.stats.busy_s += time.perf_counter() - t0

    def _run_plan(self, plan: StepPlan, outputs: list[RequestOutput]) -> list[RequestOutput]:
        try:
            if self.kv_ops is not None:
                self.kv_ops.flush()  # deferred KV moves (span splices) land before the model reads
            t0, wall = time.perf_counter(), time.time()
            result = self.bundle.runner.execute(plan)
            seconds = time.perf_counter() - t0
            self.scheduler.observe_step(plan, seconds)
        except Exception as exc:  # a broken step fails its own requests, not the engine
            log.exception("engine step failed")
            self.stats.step_errors += 1
            return outputs + self._fail(plan, f"{type(exc).__name__}: {exc}")
        if self.step_log is not None:  # (after the try: a log that cannot be written fails no request)
            self.step_log.record(plan, wall, seconds, self.scheduler.seqs)
        self.stats.steps += 1
        now = time.perf_counter()
        self.gaps.step_end(now)
        touched: dict[str, _Request] = {}
        events = self.scheduler.update(plan, result)
        left = Counter(seq.seq_id for seq, _ in events)  # a speculating sequence emits several tokens
        for seq, token in events:
            left[seq.seq_id] -= 1
            if left[seq.seq_id] < 0:
                continue  # cut by a stop string below
            req = self._by_seq[seq.seq_id]
            stopped = self._on_token(req, token, result, now)
            touched[req.request_id] = req
            if stopped and left[seq.seq_id] > 0:  # a stop string ended it: drop the tokens after it
                del seq.tokens[len(seq.tokens) - left[seq.seq_id]:]
                left[seq.seq_id] = -1
        for req in touched.values():
            outputs.append(self._finish(req) if req.seq.finished else self._snapshot(req))
        for seq_id in plan.released:  # finished while scheduling (longer than the whole pool)
            req = self._by_seq.get(seq_id)
            if req is not None and req.request_id not in touched and req.seq.finished:
                outputs.append(self._finish(req))
        return outputs

    def _on_token(self, req: _Request, token: int | None, result: StepOutput, now: float) -> bool:
        """Count and detokenize one emitted token; True when it completed a stop string."""
        seq = req.seq
        self.stats.generated_tokens += 1
        if req.first_token is None:
            req.first_token = now
        elif req.last_token is not None:  # (none between two tokens of one step: 0 s)
            self.gaps.gap(now - req.last_token)
        req.last_token = now
        if req.logprobs is not None and seq.seq_id in result.logprobs:
            req.logprobs.append(result.logprobs[seq.seq_id])
        if token is None or (seq.finish_reason == "stop" and token in seq.stop_ids):
            return False
        if not req.detok.add(token):
            return False
        if not seq.finished:
            self.scheduler.finish(seq.seq_id, "stop")
        elif seq.finish_reason == "length":  # the stop string completed on the last token allowed
            seq.finish_reason = "stop"
        return True

    def _fail(self, plan: StepPlan, message: str) -> list[RequestOutput]:
        """The plan's requests fail; the ones it only swapped out recompute (``step_failed``)."""
        self.scheduler.step_failed(plan)
        out = []
        for item in plan.seqs:
            req = self._by_seq.get(item.seq_id)
            if req is not None:
                req.error = message
                self.scheduler.finish(item.seq_id, "error")
                out.append(self._finish(req))
        return out

    # ---------------------------------------------------------------- outputs
    def _snapshot(self, req: _Request) -> RequestOutput:
        seq = req.seq
        tokens = seq.tokens[seq.num_prompt_tokens:]
        delta_ids = tokens[req.reported_tokens:]
        req.reported_tokens = len(tokens)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=seq.tokens[:seq.num_prompt_tokens],
            token_ids=list(tokens), text=req.detok.text, delta_text=req.detok.take_delta(),
            delta_token_ids=delta_ids, finished=seq.finished, finish_reason=seq.finish_reason,
            stop_str=req.detok.matched_stop,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens, error=req.error,
            kv=kv_report(seq, getattr(self.kv_ops, "bytes_per_block", 0) // self.kv.block_size),
            metrics={"arrival_time": req.arrival, "first_token_time": req.first_token or 0.0,
                     "num_preemptions": seq.num_preemptions, "tokens_invalidated": seq.tokens_invalidated},
            events=[(name, t - seq.arrival) for name, t in seq.events or ()])

    def _finish(self, req: _Request) -> RequestOutput:
        req.detok.finish()
        self.kv_totals.add(req.seq)
        self._requests.pop(req.request_id, None)
        self._by_seq.pop(req.seq.seq_id, None)
        out = self._snapshot(req)
        out.finished = True
        out.metrics["finish_time"] = time.perf_counter()
        self.responses.put(req.cache_key, out)
        return out

    # ---------------------------------------------------------------- helpers
    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def run_to_completion(self, request_ids: Seq[str]) -> dict[str, RequestOutput]:
        wanted = set(request_ids)
        done = {rid: out for rid in wanted if (out := self._kept.get(rid)) is not None}
        while wanted - done.keys():
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
        for rid in done:
            self._kept.pop(rid, None)
        return done
