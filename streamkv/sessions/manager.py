"""Live sessions on one engine (DESIGN.md section 3, "Sessions").

Runs on the engine thread. Around every engine step:

* ``before_step``: feed each idle session stream its next batch of queued records
  (evicting + re-positioning the oldest records first when the window is full), rebuild
  the ``ready`` fork (snapshot + query prefix) after a new version, offload idle sessions
  when waiting requests lack KV blocks;
* ``after_step``: advance data versions from what the stream has computed and emit events.

A query forks the ``ready`` sequence (or the stream at its snapshot) copy-on-write, so it
computes only its question and answer and never waits for the ingestion backlog.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from streamkv.errors import (InvalidRequestError, KVCacheFullError, QueueFullError, SessionExistsError,
                             SessionMovedError, SessionNotFoundError)
from streamkv.kv.block_pool import OutOfBlocksError
from streamkv.sampling.params import SamplingParams
from streamkv.sched.fork_gate import gated
from streamkv.sched.sequence import PriorityClass, SeqStatus
from streamkv.sessions.flash import FlashEvaluator
from streamkv.sessions.offload import Offloader
from streamkv.sessions.ready import ReadyForks
from streamkv.sessions.session import Session, new_session_id, valid_session_id
from streamkv.sessions.spec import SessionLayout, SessionSpec
from streamkv.sessions.state import Record, SessionData

if TYPE_CHECKING:
    from streamkv.ops.core import EngineCore as Engine

log = logging.getLogger(__name__)

# a question whose fork cannot start now (the fork gate): the server's engine loop waits, retries
_NO_ROOM = "the KV cache is full: the questions already forked hold the blocks this one needs; retry later"
QUERY_RESERVE = 64  # context kept free after the window for the scaffold, question and answer
RELEASED_TTL_S = 60.0  # how long a released session is refused here unless explicitly adopted


class SessionManager:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config.sessions
        self.sessions: dict[str, Session] = {}
        # released id -> until when requests for it are refused (SessionMovedError) instead of
        # adopted: a request in flight to this replica during a migration must not take the
        # session back from the dir while its new owner holds it
        self.released: dict[str, float] = {}
        self.offload = Offloader(self)
        self.ready_forks = ReadyForks(engine)
        self.flash = FlashEvaluator(self)
        if not self.config.adopt_sessions:  # replicas sharing a dir adopt on first use (get)
            self.offload.recover()

    # ----------------------------------------------------------------- lifecycle
    def create(self, spec: SessionSpec, session_id: str | None = None, created: float | None = None) -> Session:
        if len(self.sessions) >= self.config.max_sessions:
            raise QueueFullError(f"{len(self.sessions)} sessions are live (limit {self.config.max_sessions})", 5.0)
        layout = SessionLayout.build(spec, self.engine.tokenizer)
        fixed = len(layout.frozen) + len(layout.prefix) + len(layout.suffix) + QUERY_RESERVE
        if fixed + spec.retention_tokens > self.engine.max_model_len:
            raise InvalidRequestError(
                f"retention_tokens={spec.retention_tokens} plus the session's fixed text and query reserve "
                f"({fixed} tokens) exceed the context ({self.engine.max_model_len}); lower retention_tokens")
        if self.engine.kv.blocks_for(len(layout.frozen) + spec.retention_tokens) > self.engine.pool.num_blocks:
            raise InvalidRequestError("the KV cache is smaller than one session window; raise --kv-cache-memory")
        if session_id is not None and session_id in self.sessions:
            raise SessionExistsError(f"session {session_id!r} already exists")
        session = Session(session_id or new_session_id(), SessionData(spec, layout))
        if created is not None:
            session.created = created
        session.stream = self.engine.seq_ops.open(layout.frozen, observe=spec.kv_write.observation if spec.kv_write else 0)
        self.sessions[session.id] = session
        self.offload.created(session)
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None and self.config.adopt_sessions and valid_session_id(session_id):
            if self.released.get(session_id, 0.0) > time.monotonic() and self.exists(session_id):
                raise SessionMovedError(f"session {session_id!r} moved to another replica; retry")
            session = self.offload.adopt(session_id)
        if session is None:
            raise SessionNotFoundError(f"session {session_id!r} does not exist")
        return session

    def adopt(self, session_id: str) -> Session:
        """Take a session from the shared dir now, even one released here moments ago (the
        cluster ingress calls this on the owner it chose)."""
        self.released.pop(session_id, None)
        session = self.sessions.get(session_id)
        if session is not None and self.offload.stale(session):  # left here by a failed or raced move
            self.offload.forget(session)
            session = None
        if session is None and valid_session_id(session_id):
            session = self.offload.adopt(session_id)
        if session is None:
            raise SessionNotFoundError(f"session {session_id!r} does not exist")
        return session

    def exists(self, session_id: str) -> bool:
        """Live here, or stored in the session dir (released, or there for a replica to adopt)."""
        store = self.offload.store
        return session_id in self.sessions or (store is not None and store.exists(session_id))

    def release(self, session_id: str) -> dict[str, Any]:
        """Hand a session over to the session dir and forget it here (a migration's source):
        its KV is snapshotted at the newest complete version, newer pushes are in the log, and
        subscribers get a ``migrated`` event. Queries already running finish on their forks."""
        if self.offload.store is None:
            raise InvalidRequestError("releasing a session needs --session-dir (where the next owner reads it)")
        session = self.get(session_id)
        out = self.stats(session_id)
        self.offload.release(session)
        self.offload.forget(session)
        now = time.monotonic()
        self.released = {k: t for k, t in self.released.items() if t > now}
        self.released[session_id] = now + RELEASED_TTL_S
        session.emit("migrated", data_version=session.data.data_version)
        session.listeners.clear()
        return out

    def delete(self, session_id: str) -> None:
        session = self.get(session_id)
        self.offload.forget(session)
        self.offload.deleted(session)
        session.emit("deleted")
        session.listeners.clear()

    def drop_kv(self, session: Session) -> None:
        for seq in (session.ready, session.stream):
            if seq is not None:
                self.engine.seq_ops.close(seq)
        session.ready = session.stream = None
        session.ready_version = -1

    # -------------------------------------------------------------------- data
    def push(self, session_id: str, records: list[str]) -> dict[str, Any]:
        """Queue records as one new data version; returns at once (the version to come)."""
        session = self.get(session_id)
        data = session.data
        ids = self._check_records(session, records)
        total = sum(len(x) for x in ids)
        if data.spec.overflow != "drop_oldest" and not data.fits(total):
            raise QueueFullError(f"session queue holds {data.queued_tokens} of {data.spec.max_queue_tokens} "
                                 f"tokens; {total} more do not fit", retry_after=1.0)
        try:  # restored now where the pool holds it, else queued while offloaded: `_bring_back`
            self.offload.ensure_resident(session)  # restores it before a step once there is room
        except QueueFullError:  # (refused with a 429, a push beside steady traffic retried for 40 s
            pass  # and more: the blocks a finishing request freed went to the next one first: review)
        version = data.next_version()
        dropped = data.accept([Record(version, x, t) for x, t in zip(ids, records)])
        data.counters.records_pushed += len(records)
        self.offload.logged(session, version, records, dropped)
        if dropped:
            session.emit("dropped", records=len(dropped), total_dropped=data.counters.records_dropped,
                         versions=sorted({r.version for r in dropped}))
        data.last_used = time.monotonic()
        return {"data_version": version, "accepted": len(records) - sum(r.version == version for r in dropped),
                "dropped": len(dropped), "queued_records": len(data.queue), "queued_tokens": data.queued_tokens}

    def _check_records(self, session: Session, records: Any) -> list[list[int]]:
        if not isinstance(records, list) or not records:
            raise InvalidRequestError("records must be a non-empty list of strings")
        spec, out = session.spec, []
        for i, rec in enumerate(records):
            if not isinstance(rec, str) or not rec:
                raise InvalidRequestError(f"records[{i}] must be a non-empty string")
            if len(rec) > spec.max_record_chars:
                raise InvalidRequestError(f"records[{i}] has {len(rec)} characters (limit {spec.max_record_chars})")
            ids = session.layout.record_ids(spec, self.engine.tokenizer, rec)
            if len(ids) > min(spec.record_window, spec.max_queue_tokens):
                raise InvalidRequestError(f"records[{i}] is {len(ids)} tokens, more than the session's record window "
                                          f"({spec.record_window}) or queue ({spec.max_queue_tokens})")
            out.append(ids)
        return out

    # ------------------------------------------------------------------- query
    def query(self, session_id: str, request_id: str, question: str, params: SamplingParams,
              count: bool = True) -> dict[str, Any]:
        """Start answering ``question`` at the newest complete version (a SESSION-class fork);
        ``count``: in the session's query counter (False when a question starts again)."""
        session = self.get(session_id)
        info = self.start_query(session, request_id, question, params, PriorityClass.SESSION)
        session.data.counters.queries += count
        return info

    def start_query(self, session: Session, request_id: str, question: str, params: SamplingParams,
                    klass: PriorityClass) -> dict[str, Any]:
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequestError("question must be a non-empty string")
        gate, sched = self.engine.scheduler.fork_gate, self.engine.scheduler
        if gate is not None and session.where != "pool" and any(gated(s) for s in sched.seqs.values()):
            n = session.data.snapshot_len()  # a restore whose fork could not start then: do not
            end = self._fork_end(n, len(session.layout.query_ids(self.engine.tokenizer, question)), params)
            restore = self.engine.kv.blocks_for(len(session.offloaded_tokens or ()))  # preempt for it: wait on host
            if not gate.room_for(sched.seqs.values(), n, end, extra=restore, spare=self.offload.spare_blocks(session, klass)):
                raise KVCacheFullError(_NO_ROOM)
        self.offload.ensure_resident(session, below=klass)
        data, layout = session.data, session.layout
        q_ids = self.engine.tokenizer.encode(question)
        ready = session.ready
        # the question's own rows (under a read policy) start after the scaffold's prefix either
        # way: the ready fork computed the prefix exactly, so a fork of the stream does too (it
        # read it under the policy: its answer then depended on whether the ready fork was open)
        if ready is not None and session.ready_version == data.data_version and self.engine.seq_ops.is_idle(ready):
            parent, n, suffix = ready, len(ready.tokens), q_ids + list(layout.suffix)
        else:
            parent, n, suffix = session.stream, data.snapshot_len(), layout.query_ids(self.engine.tokenizer, question)
        own_from = data.snapshot_len() + len(layout.prefix)
        if parent is None:
            raise RuntimeError(f"session {session.id} has no resident stream after restore")
        if parent.num_computed < n:  # before any preemption for it: the fork could not start anyway
            # (a flash batch preempted a running question every step for a fork that then failed
            # here, and the question, ranked above the stream, took the blocks back: review)
            raise KVCacheFullError(f"session {session.id}: its stream has computed {parent.num_computed} of the "
                                   f"{n} rows of version {data.data_version} (the rest wait for KV blocks); retry later")
        end = self._fork_end(n, len(suffix), params)
        if self.engine.pool.num_free < 1:  # the fork copies its partial block now: make room first,
            self.engine.seq_ops.reclaim(1)  # as a span query's fork does (idle streaming inputs),
            if self.engine.pool.num_free < 1:  # then from another idle session,
                self.offload._offload_one(exclude=session)
            if self.engine.pool.num_free < 1:  # then from running requests of a less urgent class, only
                # if they free all the gate asks for (a flash batch truncated a running question for
                # its copy block, the gate then refused the batch, and so every step: review)
                want = gate.start_blocks(sched.seqs.values(), n, end) if gate is not None else 1
                self.engine.seq_ops.reclaim(max(1, want), below=klass)
        if gate is not None and not gate.room_for(sched.seqs.values(), n, end):
            session.wanted_at = time.monotonic()  # kept resident meanwhile (offload.WANTED_S); AsyncEngine retries
            raise KVCacheFullError(_NO_ROOM)
        seq = self.engine.add_fork_request(request_id, parent, n, suffix, params, klass=klass, read=session.spec.kv_read,
                                           read_from=own_from)
        data.last_used, session.wanted_at = time.monotonic(), float("-inf")  # started: nobody waits now
        return {"data_version": data.data_version, "prompt_tokens": len(seq.tokens),
                "computed_prompt_tokens": len(seq.tokens) - seq.num_computed, "prompt_token_ids": list(seq.tokens)}

    def _fork_end(self, rows: int, added: int, params: SamplingParams) -> int:
        """The rows a question's fork of ``rows`` parent rows and ``added`` own prompt rows may reach."""
        return min(rows + added + params.max_tokens, self.engine.max_model_len)

    # ------------------------------------------------------------- step hooks
    def has_work(self) -> bool:
        """Records to ingest (an offloaded session's too: it comes back for them), a stale
        ``ready`` fork to rebuild while the free blocks hold it (else it waits for a step other
        work makes: an engine whose pool idle sessions filled stepped for it for good, fuzz seed
        12910) or a flash batch due, in some resident session."""
        return any((s.stream is None and s.data.queue) or s.stream is not None and (
            s.data.queue or s.stream.num_computed < len(s.stream.tokens)
            or (self.ready_forks.stale(s) and self.ready_forks.fits(s))
            or (s.ready is not None and s.ready.num_computed < len(s.ready.tokens))
            or (s.flash.questions and s.flash.batch_version is None
                and s.flash.evaluated_version < s.data.data_version) or s.flash.to_start)
            for s in self.sessions.values())

    def before_step(self) -> None:
        # the rows fed to resident streams and their ready forks and not yet computed, in blocks
        # still to take: a feed, a restore or a ready fork that came after another session's feed
        # in the same step took the blocks that feed's eviction had just freed for its rows, and
        # two streams mid-ingestion that each needed more than was left waited for each other for
        # good (neither idle, so neither could be offloaded: fuzz seed 2726)
        pending = sum(self._owed(s) for s in self.sessions.values())
        held_back: list[tuple[int, PriorityClass]] = []  # (blocks, class) of ingestion that waits
        for session in self.sessions.values():
            if session.stream is None and session.data.queue:
                self._bring_back(session, pending, held_back)
            if session.stream is not None:
                owed = self._owed(session)
                self._feed(session, pending, held_back)
                self.ready_forks.refresh(session, pending + self._owed(session) - owed)
                pending += self._owed(session) - owed
                self.flash.schedule(session)
        self.offload.relieve_pressure(held_back)

    def _owed(self, session: Session) -> int:
        """Blocks the session's stream and ready fork still take for their rows fed and not yet computed."""
        kv = self.engine.kv
        return sum(kv.growth_cost(s.seq_id, len(s.tokens)) for s in (session.stream, session.ready)
                   if s is not None and kv.has(s.seq_id))

    def after_step(self, outputs: list[Any]) -> list[Any]:
        """Advance versions, emit events, absorb finished flash evaluations (returns the
        outputs that belong to ordinary requests)."""
        for session in self.sessions.values():
            stream = session.stream
            if stream is None or stream.status is SeqStatus.FINISHED:
                continue
            self.ready_forks.take_probe(session)
            self.flash.schedule(session)  # the ready fork built before this step is computed now
            if session.data.advance(stream.num_computed):
                session.changed_at = time.monotonic()
                session.emit("data_updated", data_version=session.data.data_version,
                             tokens=session.data.snapshot_len(), records_in_window=len(session.data.spans),
                             queued_records=len(session.data.queue))
        return self.flash.collect(outputs)

    def _feed(self, session: Session, pending: int, held_back: list[tuple[int, PriorityClass]]) -> None:
        """Feed the next batch of queued records to an idle stream. While other streams' fed rows
        still need ``pending`` blocks, a batch starts only if the free blocks hold it beside them
        (else it stays queued, and its need goes to ``held_back``, for idle sessions to be
        offloaded): two sessions ingesting at once in a pool that held either window but not
        both took chunks in turn until neither could finish, and pinned streams wait for each
        other for good (helper-35)."""
        data, stream, streams = session.data, session.stream, self.engine.seq_ops
        if not data.queue or stream is None or not streams.is_idle(stream):
            return
        batch = data.take_batch(min(data.spec.ingest_batch_tokens, data.spec.record_window))
        incoming = sum(len(r.ids) for r in batch)
        n_rec, n_tok = data.eviction_for(incoming)
        need = self._feed_need(session, n_tok, incoming)
        if pending and need > self.engine.pool.num_free - pending:
            data.requeue(batch)
            held_back.append((need + pending, stream.klass))
            return
        if n_tok:
            # the ready fork is stale once this batch is in, and it shares the window: left open,
            # the eviction copies the window into fresh blocks and the old ones stay held until
            # the new version is computed (a window over about half the pool then never found its
            # blocks: helper-35). Closed, the rows move down in their own blocks: 11 against
            # 55-70 ms for a 6,000-token window (embedded model, Zen 4)
            self.ready_forks.close(session)
            try:
                memory = self._evict(session, n_tok)
            except OutOfBlocksError:
                data.requeue(batch)
                return
            removed = data.evicted(n_rec, n_tok, memory)
            session.emit("evicted", records=n_rec, tokens=removed, memory_tokens=data.memory,
                         total_evicted=data.counters.records_evicted)
        streams.append(stream, [t for r in batch for t in r.ids])
        for rec in batch:
            data.fed(rec)

    def _bring_back(self, session: Session, pending: int, held_back: list[tuple[int, PriorityClass]]) -> None:
        """Restore an offloaded session whose records wait (offloaded while another session
        ingested) once the pool holds it beside the rows other streams still have to compute
        and the request that blocks the queue (or each would offload the other in turn); until
        then its need goes to ``held_back``, for idle sessions to be offloaded."""
        need = self.engine.kv.blocks_for(len(session.offloaded_tokens or ())) + 1
        if need <= self.engine.pool.num_free - pending - self.engine.scheduler.blocked_need:
            try:
                self.offload.ensure_resident(session)
                return
            except QueueFullError:
                pass
        held_back.append((need + pending, PriorityClass.STREAM))

    def _feed_need(self, session: Session, evict: int, incoming: int) -> int:
        """Blocks the stream takes to hold ``incoming`` more tokens after evicting ``evict``
        (a snapkv session keeps up to its budget of them as memory)."""
        stream, policy, kv = session.stream, session.spec.kv_write, self.engine.kv
        assert stream is not None
        removed = evict
        if policy is not None and evict:  # the memory and the evicted tokens become the new memory
            removed += session.data.memory - min(policy.budget, session.data.memory + evict)
        return kv.growth_cost(stream.seq_id, len(stream.tokens) - removed + incoming)

    def _evict(self, session: Session, num_tokens: int) -> int | None:
        """Evict the oldest ``num_tokens`` record tokens of the stream; returns the snapkv memory
        size after it (None: ``oldest``, nothing kept)::

            oldest   [ frozen | r0 r1 | r2 r3 ]           -> [ frozen | r2 r3 ]
            snapkv   [ frozen | memory | r0 r1 | r2 r3 ]   -> [ frozen | memory' | r2 r3 ]
                     memory' = top budget of (memory, r0, r1) by SnapKV score, the queries of
                     the newest rows (r3's) observing; kept keys re-positioned, order kept
        """
        data, stream, streams = session.data, session.stream, self.engine.seq_ops
        policy = session.spec.kv_write
        if policy is None:
            streams.evict(stream, data.frozen_len, num_tokens)
            return None
        count = data.memory + num_tokens
        keep = min(policy.budget, count)
        picks = streams.rank(stream, data.frozen_len, count, keep, policy)
        if picks is None:  # no observed queries (a restore without its window): keep the newest
            picks = list(range(count - keep, count))
            data.counters.snapkv_fallbacks += 1
        streams.evict(stream, data.frozen_len, count, picks)
        return keep

    def maintain(self) -> None:
        """Periodic work while the engine idles: KV snapshots of idle sessions (session dir)."""
        self.offload.maintain()

    def close(self) -> None:
        """Persist every session (with a session dir) and stop the writer (shutdown)."""
        self.offload.save_all()
        self.offload.close()

    # ------------------------------------------------------------------- stats
    def stats(self, session_id: str) -> dict[str, Any]:
        session = self.get(session_id)
        stream = session.stream
        out = session.stats(self.engine.kv.block_size, self.offload.kv_bytes_per_token,
                            stream.num_computed if stream is not None else None)
        out["ready_version"] = session.ready_version
        out["flash"] = self.flash.stats(session)
        out["ready_exit"] = {"enabled": session.spec.ready_exit, "last": session.ready_probe}
        return out

    def layout(self, session_id: str) -> dict[str, Any]:
        return self.get(session_id).layout_info()
