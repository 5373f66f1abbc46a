"""Prometheus metrics, one registry per server (no process-global state)."""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("streamkv_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("streamkv_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("streamkv_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("streamkv_time_to_first_token_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("streamkv_time_per_output_token_seconds", "mean time per output token after "
                              "the first", buckets=LATENCY_BUCKETS, registry=r)
        running = Gauge("streamkv_requests_running", "requests holding KV (session and span streams are not counted)",
                        registry=r)
        running.set_function(lambda: engine.num_running)
        waiting = Gauge("streamkv_requests_waiting", "sequences waiting to be scheduled", registry=r)
        waiting.set_function(lambda: engine.num_waiting)
        pool = engine.engine.pool
        used = Gauge("streamkv_kv_blocks_used", "KV blocks referenced by live sequences", registry=r)
        used.set_function(lambda: pool.num_used)
        free = Gauge("streamkv_kv_blocks_free", "KV blocks on the free list (incl. cached)", registry=r)
        free.set_function(lambda: pool.num_free)
        hit = Gauge("streamkv_prefix_cache_hit_rate", "prefix-cache block hits / block lookups", registry=r)
        hit.set_function(lambda: pool.prefix_hits / pool.prefix_queries if pool.prefix_queries else 0.0)
        pre = Gauge("streamkv_preemptions", "sequences preempted so far", registry=r)
        pre.set_function(lambda: engine.engine.scheduler.num_preemptions)
        waits = Gauge("streamkv_fork_block_waits", "session questions that waited for a free KV block "
                      "for their fork, so far", registry=r)
        waits.set_function(lambda: engine.fork_waits)
        parked = Gauge("streamkv_forks_waiting_for_blocks", "session questions waiting for a free KV block "
                       "for their fork now", registry=r)
        parked.set_function(lambda: engine.num_parked)
        restarts = Gauge("streamkv_fork_restarts", "session questions failed for want of KV blocks before their "
                         "first token and made to wait again, so far", registry=r)
        restarts.set_function(lambda: engine.fork_restarts)
        sessions = engine.engine.sessions.sessions
        live = Gauge("streamkv_sessions", "live sessions", registry=r)
        live.set_function(lambda: len(sessions))
        r.register(_EngineCounters(engine.engine))

    def observe_request(self, prompt_tokens: int, output_tokens: int, metrics: dict[str, float]) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        arrival, first, finish = (metrics.get(k, 0.0) for k in ("arrival_time", "first_token_time", "finish_time"))
        if first and arrival:
            self.ttft.observe(max(0.0, first - arrival))
        if finish and first and output_tokens > 1:
            self.tpot.observe(max(0.0, (finish - first) / (output_tokens - 1)))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCounters:
    """Monotonic engine totals exported as Prometheus counters (read at scrape time)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        e = self.engine
        yield CounterMetricFamily("streamkv_engine_busy_seconds", "wall time the engine spent in model steps",
                                  value=e.stats.busy_s)
        yield CounterMetricFamily("streamkv_engine_steps", "model steps the engine ran", value=e.stats.steps)
        yield from _kv_policy_metrics(e.kv_totals)
        yield CounterMetricFamily("streamkv_response_cache_hits", "stateless requests answered from the "
                                  "response cache", value=e.responses.hits)
        inputs = e.inputs.stats
        for name, value, doc in (("opened", inputs.opened, "streaming-input requests opened"),
                                 ("finished", inputs.finished, "streaming-input requests whose input finished"),
                                 ("expired", inputs.expired, "streaming-input requests aborted by the TTL")):
            yield CounterMetricFamily(f"streamkv_input_streams_{name}", doc, value=value)
        yield CounterMetricFamily("streamkv_input_appends", "appends to streaming inputs", value=inputs.appends)
        yield CounterMetricFamily("streamkv_input_updates", "updates of streaming inputs", value=inputs.updates)
        yield CounterMetricFamily("streamkv_tokens_invalidated", "computed prompt rows dropped by input "
                                  "changes (LCP invalidation)", value=inputs.tokens_invalidated)
        kinds = CounterMetricFamily("streamkv_preemptions_by_kind", "preempted sequences by kind",
                                    labels=["kind"])
        for kind, n in e.scheduler.preemptions_by_kind.items():
            kinds.add_metric([kind], n)
        yield kinds
        yield CounterMetricFamily("streamkv_swap_bytes", "KV bytes copied to and from the host swap space",
                                  value=getattr(e.kv_ops, "swap_bytes", 0))
        yield GaugeMetricFamily("streamkv_input_streams_open", "streaming inputs still receiving input",
                                value=e.inputs.num_open)
        policy = GaugeMetricFamily("streamkv_queue_policy", "the scheduler's queue policy (value 1)",
                                   labels=["policy", "max_wait_s"])
        policy.add_metric([e.scheduler.policy.name, str(e.scheduler.policy.max_wait_s)], 1)
        yield policy
        yield from _scheduler_metrics(e.scheduler)
        yield CounterMetricFamily("streamkv_flash_hits", "session queries answered from the flash cache",
                                  value=e.sessions.flash.hits.value)
        yield from _span_metrics(e.spans)
        yield from _gap_metrics(e.gaps)


def _gap_metrics(gaps: Any) -> Any:
    """Engine-side decode stalls (``engine/token_gaps.py``), seconds."""
    from prometheus_client.core import HistogramMetricFamily

    yield HistogramMetricFamily("streamkv_inter_token_gap_seconds", "each sequence's gap between two tokens emitted "
                                "in different steps (engine thread)", buckets=gaps.gaps.cumulative(),
                                sum_value=gaps.gaps.total)
    yield HistogramMetricFamily("streamkv_step_interval_seconds", "time between two model steps' ends while the "
                                "engine had work (engine thread)", buckets=gaps.intervals.cumulative(),
                                sum_value=gaps.intervals.total)


def _kv_policy_metrics(t: Any) -> Any:
    """Totals of finished requests with a KV policy (``engine/kv_policies.py``)."""
    from prometheus_client.core import CounterMetricFamily

    for name, doc, value in [
            ("tokens_seen", "KV rows computed by requests with a write policy", t.tokens_seen),
            ("tokens_kept", "KV rows those requests still held at the end", t.tokens_kept),
            ("compressions", "prompts compressed by a write policy", t.compressions),
            ("compress_seconds", "time spent selecting and moving compressed rows", t.compress_s),
            ("read_steps", "steps of requests with a read policy", t.reads.steps),
            ("read_rows", "KV rows those steps read (averaged over layers, summed over steps)", t.reads.rows_read),
            ("read_rows_full", "KV rows those steps would have read without the policy", t.reads.rows_full),
            ("pages_scored", "pages a read policy scored (summed over layers)", t.reads.pages_scored),
            ("pages_picked", "pages a read policy picked (summed over layers)", t.reads.pages_picked),
            ("recall_samples", "sampled layer-steps measuring the exact attention mass kept", t.reads.recall_n),
            ("recall_sum", "sum of those samples' kept share (divide by recall_samples)", t.reads.recall_sum)]:
        yield CounterMetricFamily(f"streamkv_kv_policy_{name}", doc, value=value)


def _scheduler_metrics(scheduler: Any) -> Any:
    """Prefill chunking, admission, grouped prefill, and prompt-lookup speculation
    (``sched/speculation.py``): drafts and the current cap."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    chunk = GaugeMetricFamily("streamkv_prefill_chunk_tokens", "prompt rows per sequence in the latest step "
                              "(adaptive: budget / sequences prefilling, clamped)", labels=["chunking"])
    chunk.add_metric([scheduler.config.chunking], scheduler.chunk)
    yield chunk
    adm = scheduler.admission
    yield CounterMetricFamily("streamkv_admission_deferred_requests", "(request, step) pairs a new request waited "
                              "for the cell budget", value=adm.stats.deferred_requests if adm else 0)
    yield CounterMetricFamily("streamkv_admission_deferred_chunks", "prompt chunks held back above the high-water "
                              "mark", value=adm.stats.deferred_chunks if adm else 0)
    yield GaugeMetricFamily("streamkv_admission_charged_tokens", "projected KV tokens of admitted sequences "
                            "(cell budget)", value=adm.stats.charged_tokens if adm else 0)
    gate = scheduler.fork_gate.stats if scheduler.fork_gate is not None else None
    yield CounterMetricFamily("streamkv_fork_gate_deferred", "(fork, step) pairs a question's fork waited at its fork "
                              "point for the pool to hold its answer", value=gate.deferred if gate else 0)
    yield GaugeMetricFamily("streamkv_fork_gate_reserved_blocks", "blocks the started question forks may still take "
                            "(as of the latest step or finish)", value=gate.reserved if gate else 0)
    cad = scheduler.cadence.stats if scheduler.cadence is not None else None
    yield CounterMetricFamily("streamkv_cadence_capped_steps", "steps whose prompt rows the decode cadence capped",
                              value=cad.capped_steps if cad else 0)
    yield GaugeMetricFamily("streamkv_cadence_prompt_cap_tokens", "prompt rows at context 0 a step with decoders may carry "
                            "(decode cadence; 0: off or not learned yet)", value=cad.cap if cad else 0)
    grp = scheduler.groups.stats if scheduler.groups is not None else None
    for key, attr, doc in (("followers", "followers", "requests admitted after waiting for a leader's shared blocks"),
                           ("deferred_steps", "deferred_steps", "(follower, step) pairs spent waiting for a leader"),
                           ("tokens_saved", "tokens_saved", "prompt tokens followers aliased from their leaders "
                                                            "instead of computing them")):
        yield CounterMetricFamily(f"streamkv_grouped_prefill_{key}", doc, value=getattr(grp, attr) if grp else 0)

    st = scheduler.spec_stats
    name = scheduler.speculator.name if scheduler.speculator is not None else "none"
    for key, value, doc in (("steps", st.steps, "sequence-steps that verified drafts"),
                            ("drafts_proposed", st.proposed, "draft tokens verified"),
                            ("drafts_accepted", st.accepted,
                             "draft tokens the verification accepted (a stop token or string may then cut some "
                             "from the output)")):
        yield CounterMetricFamily(f"streamkv_spec_{key}", doc, value=value)
    cap = GaugeMetricFamily("streamkv_spec_cap", "drafts per sequence the load allowed in the latest step",
                            labels=["speculation"])
    cap.add_metric([name], st.cap)
    yield cap


def _span_metrics(spans: Any) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    st = spans.cache.stats
    for name, value, doc in (("hits", st.hits, "span-cache lookups that found a computed state"),
                             ("misses", st.misses, "span-cache lookups that computed the state"),
                             ("evictions", st.evictions, "cached span states dropped for room"),
                             ("offloads", st.offloads, "cached span states moved from the pool to host memory"),
                             ("restores", st.restores, "span-cache hits restored from host memory")):
        yield CounterMetricFamily(f"streamkv_span_cache_{name}", doc, value=value)
    yield GaugeMetricFamily("streamkv_span_cache_entries", "computed span states cached", value=len(spans.cache))
    yield GaugeMetricFamily("streamkv_span_cache_host_bytes", "bytes of cached span states in host memory",
                            value=spans.cache.host_used)
    yield GaugeMetricFamily("streamkv_span_queries_running", "span queries in progress", value=spans.num_running)
    yield CounterMetricFamily("streamkv_span_queries", "span queries ended", value=spans.queries_ended)
    tokens = CounterMetricFamily("streamkv_span_tokens", "tokens of ended span queries, by kind", labels=["kind"])
    for kind in ("computed", "reused", "repositioned"):
        tokens.add_metric([kind], getattr(spans.totals, f"{kind}_tokens"))
    yield tokens
