"""Where a session's KV lives (pool -> host -> disk) and how it survives a restart.

Offloading an idle session (stream computed; records may still wait in its queue) exports
its stream's K/V to host tensors and frees its blocks; beyond ``host_offload_bytes`` the least
recently used host copies spill to ``--session-dir``. The next push or query restores it, and
so does the pool once it can hold it again while records wait (``SessionManager.before_step``). With a
session dir, every acknowledged push is logged (fsync) before it is acknowledged, and idle
sessions snapshot their KV; recovery loads the snapshot and re-queues newer pushes.
"""
from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterable

from streamkv.errors import KVCacheFullError, QueueFullError
from streamkv.kv.block_pool import OutOfBlocksError
from streamkv.sampling.grammar import GuidedSpec
from streamkv.sched.sequence import PriorityClass, SeqStatus
from streamkv.sessions.session import Session
from streamkv.sessions.spec import SessionLayout, SessionSpec
from streamkv.sessions.state import Counters, Record, SessionData, Span
from streamkv.sessions.store import SessionStore

if TYPE_CHECKING:
    from streamkv.sessions.manager import SessionManager

log = logging.getLogger(__name__)

#: A session a question waited for (its fork found no room) is not offloaded for less urgent
#: work (stateless requests, ingestion) until this long after the question's last try: a waiting
#: question is tried again after every step, and offloading its session for the requests its
#: restore had preempted made that try restore it again, preempting them again, step after step
#: (7 restores, 21 preemptions for one question on a 48-block pool,
#: ``tests/test_session_pool_pressure.py``). Work as urgent as the question (other sessions'
#: questions) may still have it offloaded.
WANTED_S = 1.0


class Offloader:
    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager
        self.engine = manager.engine
        cfg = manager.config
        self.store = SessionStore(cfg.session_dir) if cfg.session_dir else None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamkv-session-io")
        self._writes: list[Future] = []
        ops = self.engine.kv_ops
        self.kv_bytes_per_token = (ops.cache.nbytes // (ops.cache.num_blocks * ops.cache.block_size)) if ops else 0

    # ----------------------------------------------------------- durability hooks
    def created(self, session: Session) -> None:
        if self.store is not None:
            self.store.create(session.id, session.spec.to_dict(), session.created)

    def deleted(self, session: Session) -> None:
        if self.store is not None:
            self.store.delete(session.id)

    def flash_changed(self, session: Session) -> None:
        if self.store is not None:
            self.store.save_flash(session.id, [q.to_dict() for q in session.flash.questions.values()])

    def logged(self, session: Session, version: int, records: list[str], dropped: list[Record]) -> None:
        if self.store is None:
            return
        own_dropped = sum(1 for r in dropped if r.version == version)
        drops = _drop_counts([r for r in dropped if r.version != version])
        if own_dropped:  # (not replayed as drops: the line holds only its survivors; counted on recovery)
            drops[version] = own_dropped
        self.store.log_push(session.id, version, records[own_dropped:], drops)

    # ------------------------------------------------------------------ offload
    def quiescent(self, session: Session) -> bool:
        """Idle with nothing queued (checkpoints)."""
        return self.idle(session) and not session.data.queue

    def idle(self, session: Session) -> bool:
        """Resident with every fed row computed: it may be offloaded (queued records come back
        with it; a session held back while another ingests is offloaded for it)."""
        stream = session.stream
        return stream is not None and self.engine.seq_ops.is_idle(stream)

    def freeable(self, session: Session) -> int:
        """Pool blocks that offloading ``session`` would give back: those its stream and ready
        fork hold alone. A running question's fork shares nearly all of them, so offloading a
        session while it answers frees next to nothing and only costs a restore later."""
        seqs = [s.seq_id for s in (session.stream, session.ready) if s is not None]
        return self.engine.kv.num_unshared(*seqs)

    def offload(self, session: Session) -> int:
        """Move an idle session's KV to host memory; returns the pool blocks this freed."""
        stream = session.stream
        if stream is None or not self.idle(session):
            return 0
        if session.flash.to_start:  # a batch still starting would wait for its return: end it
            self.manager.flash.abort_all(session)
        free = self.engine.pool.num_free
        session.host_kv = self.engine.seq_ops.export(stream, len(stream.tokens))
        session.host_q = self.engine.seq_ops.queries(stream)
        session.offloaded_tokens = list(stream.tokens)
        self.manager.drop_kv(session)
        session.emit("offloaded", where="host", tokens=len(session.offloaded_tokens))
        self._spill_host()
        return self.engine.pool.num_free - free

    def _spill_host(self) -> None:
        hosted = sorted((s for s in self.manager.sessions.values() if s.host_kv is not None),
                        key=lambda s: s.data.last_used)
        total = sum(s.host_kv[0].nbytes * 2 for s in hosted)  # type: ignore[index]
        for session in hosted:
            if total <= self.manager.config.host_offload_bytes or self.store is None:
                break
            total -= session.host_kv[0].nbytes * 2  # type: ignore[index]
            self._save_host_copy(session)
            session.host_kv = session.host_q = None
            session.emit("offloaded", where="disk", tokens=len(session.offloaded_tokens or []))

    def ensure_resident(self, session: Session, below: PriorityClass | None = None) -> None:
        """Restore an offloaded session's KV into the pool, offloading other idle sessions for
        room; with ``below`` (a question's class) then preempting running requests of a less
        urgent class, and failing as ``KVCacheFullError`` (503) rather than ``QueueFullError``."""
        if session.where == "pool":
            return
        tokens = session.offloaded_tokens or []
        if session.host_kv is not None:
            (k, v), q = session.host_kv, session.host_q
        elif self.store is not None:
            self.flush()
            k, v, q = self.store.load_kv(session.id)
        else:
            raise RuntimeError(f"session {session.id} has no KV anywhere")
        policy = session.spec.kv_write
        while True:
            try:
                session.stream = self.engine.seq_ops.restore(tokens, k, v, observe=policy.observation if policy else 0,
                                                             queries=q)
                break
            except OutOfBlocksError:
                if self._offload_one(exclude=session):
                    continue
                free = self.engine.pool.num_free
                if below is not None:  # as the question's fork does (SessionManager.start_query)
                    self.engine.seq_ops.reclaim(self.engine.kv.blocks_for(len(tokens)) + 1, below=below)
                    if self.engine.pool.num_free > free:
                        continue
                    raise KVCacheFullError("the KV cache is full; retry later") from None
                raise QueueFullError("the KV cache is full; retry later", retry_after=1.0) from None
        session.host_kv, session.host_q, session.offloaded_tokens = None, None, None
        session.emit("restored", tokens=len(tokens))

    def spare_blocks(self, session: Session, klass: PriorityClass) -> int:
        """At most the blocks a restore of ``session`` for a question of ``klass`` could free:
        other idle sessions' own blocks and those of running requests of a less urgent class
        (and of inputs still streaming: ``Scheduler.reclaimable``); an upper bound, as
        ``ensure_resident`` takes them."""
        sessions = sum(self.freeable(s) for s in self.manager.sessions.values()
                       if s is not session and s.where == "pool" and self.idle(s))
        return sessions + self.engine.scheduler.reclaimable(klass)

    def _offload_one(self, exclude: Session | None = None, spare_wanted: bool = False) -> int:
        """Offload the least recently used quiescent session that frees at least half the blocks
        it holds; failing that, any that frees some (one answering a question shares most of its
        blocks with the question's fork). ``spare_wanted``: for less urgent work than a question,
        so not a session a question waits for (``WANTED_S``). Returns the blocks freed (0: none
        could be)."""
        now = time.monotonic()
        found = [(s, self.freeable(s), self.engine.kv.num_blocks_held(s.stream.seq_id))  # type: ignore[union-attr]
                 for s in sorted(self.manager.sessions.values(), key=lambda s: s.data.last_used)
                 if s is not exclude and s.where == "pool" and self.idle(s)
                 and not (spare_wanted and now - s.wanted_at < WANTED_S)]
        for enough in (lambda free, held: 2 * free >= held, lambda free, held: free > 0):
            for session, free, held in found:
                if enough(free, held):
                    return self.offload(session)
        return 0

    def relieve_pressure(self, held_back: Iterable[tuple[int, PriorityClass]] = ()) -> None:
        """Offload idle sessions while a waiting sequence, or a pinned stream with rows to
        compute (a session ingesting, a span query's: pinned streams preempt nobody and wait,
        so a span query behind idle sessions waited for good), or ingestion ``held_back`` this
        step (``(blocks, class)``), cannot get its blocks; when that is not enough and the
        latest step stalled, close ``ready`` forks too."""
        kv, seqs = self.engine.kv, self.engine.scheduler.seqs.values()
        needing = [(kv.blocks_for(len(s.tokens) + 1), s.klass) for s in seqs if s.status is SeqStatus.WAITING]
        needing += [(kv.growth_cost(s.seq_id, len(s.tokens)), s.klass) for s in seqs  # forks wait too (never dropped)
                    if s.status is SeqStatus.RUNNING and (s.pinned or s.forked_rows) and s.has_work and kv.has(s.seq_id)]
        needing = [(n, k) for n, k in [*needing, *held_back] if n > 0]
        if not needing:
            return
        spare = all(k > PriorityClass.SESSION for _, k in needing)  # none as urgent as a question
        # at least the smallest need; the request that blocks the queue may need more (nothing
        # unpinned passes it, so room for a smaller one behind it served nobody)
        need = max(min(n for n, _ in needing), self.engine.scheduler.blocked_need) - self.engine.pool.num_free
        while need > 0:
            freed = self._offload_one(spare_wanted=spare)
            if not freed:
                break
            need -= freed
        if need > 0 and self.engine.scheduler.stalled:
            self._close_ready_forks(self.engine.pool.num_free + need)

    def _close_ready_forks(self, free: int) -> None:
        """The last resort when the latest step computed nothing, pinned work starved and no
        session could be offloaded: close resident sessions' ``ready`` forks (a query forks the
        stream instead; the next version makes a new one) until ``free`` blocks are. Each
        holds its own copy of the window's last block and the query prefix's rows: two sessions
        ingesting at once, each stream a block or two short, waited for good beside their idle
        ready forks (fuzz seeds 10076, 12833, 13874, 15073)."""
        for session in self.manager.sessions.values():
            if self.engine.pool.num_free >= free:
                return
            self.manager.ready_forks.close(session)

    # ------------------------------------------------------------- persistence
    def maintain(self) -> None:
        """Snapshot sessions that have been idle for ``checkpoint_idle_s`` (engine thread)."""
        if self.store is None:
            return
        now = time.monotonic()
        for session in self.manager.sessions.values():
            if (session.where == "pool" and session.saved_version < session.data.data_version
                    and self.quiescent(session) and now - session.changed_at >= self.manager.config.checkpoint_idle_s):
                self.checkpoint(session)

    def checkpoint(self, session: Session) -> None:
        stream = session.stream
        if self.store is None or stream is None:
            return
        n = session.data.snapshot_len()
        if stream.num_computed < n:  # (a shutdown right after create: version 0's rows not computed yet;
            return  # export raised and the rest of save_all never ran: review) the log replays it
        k, v = self.engine.seq_ops.export(stream, n)
        q = self.engine.seq_ops.queries(stream) if n == len(stream.tokens) else None  # the window ends at n
        session.saved_version = session.data.data_version
        self._writes.append(self._writer.submit(self.store.save_kv, session.id, k, v,
                                                self._meta(session, list(stream.tokens[:n])), q))

    def save_all(self) -> None:
        """Snapshot every resident session at its newest complete version (shutdown)."""
        for session in list(self.manager.sessions.values()):
            if session.where == "pool" and session.saved_version < session.data.data_version:
                self.checkpoint(session)
            elif session.host_kv is not None:
                self._save_host_copy(session)
        self.flush()

    def _save_host_copy(self, session: Session) -> None:
        """Write an offloaded session's host KV to the session dir (no-op without one)."""
        if self.store is None or session.host_kv is None:
            return
        k, v = session.host_kv
        self.store.save_kv(session.id, k, v, self._meta(session, session.offloaded_tokens or []), session.host_q)
        session.saved_version = session.data.data_version

    def flush(self) -> None:
        for fut in self._writes:
            fut.result()
        self._writes.clear()

    def _meta(self, session: Session, tokens: list[int]) -> dict[str, Any]:
        d = session.data
        spans = [[s.start, s.end, s.version] for s in d.spans if s.end <= len(tokens)]
        return {"tokens": tokens, "spans": spans, "data_version": d.data_version, "memory": d.memory,
                "counters": vars(d.counters).copy(), "last_version": d.last_version}  # (the pushes counted)

    def recover(self) -> None:
        if self.store is None:
            return
        for stored in self.store.load_all():
            try:
                self._recover_one(stored)
            except Exception:
                log.exception("could not recover session %s; leaving its files in place", stored.session_id)

    # --------------------------------------------------------------- migration
    def adopt(self, session_id: str) -> Session | None:
        """Load one session from the (shared) session dir into this engine, KV resident: the
        target half of a migration, or a failed replica's session recovering elsewhere."""
        if self.store is None:
            return None
        stored = self.store.load_one(session_id)
        if stored is None:
            return None
        session = self._recover_one(stored)
        try:
            self.ensure_resident(session)
        except Exception:  # e.g. the pool is full (429): leave no half-adopted copy behind
            self.forget(session)
            raise
        return session

    def forget(self, session: Session) -> None:
        """Drop this engine's copy of a session; its files stay."""
        self.manager.flash.abort_all(session)
        self.manager.drop_kv(session)
        self.manager.sessions.pop(session.id, None)
        session.host_kv = session.host_q = None
        if self.store is not None:
            self.store.forget(session.id)

    def stale(self, session: Session) -> bool:
        """The dir's log holds a push this copy never saw (another replica owned it since)."""
        return self.store is not None and self.store.last_logged_version(session.id) > session.data.last_version

    def release(self, session: Session) -> None:
        """Make the session dir hold everything this engine knows of the session (the KV at its
        newest complete version; newer pushes are already in the log), then close the log.
        The source half of a migration: the caller forgets the session, the files stay."""
        assert self.store is not None
        stream = session.stream
        if (stream is not None and session.saved_version < session.data.data_version
                and stream.num_computed >= session.data.snapshot_len()):
            self.checkpoint(session)
        elif session.host_kv is not None and session.saved_version < session.data.data_version:
            self._save_host_copy(session)
        self.flash_changed(session)
        self.flush()
        self.store.forget(session.id)

    def _recover_one(self, stored: Any) -> Session:
        spec = SessionSpec(**stored.spec)
        snap = stored.snapshot
        if snap is None:
            session = self.manager.create(spec, stored.session_id, stored.created)
        else:
            layout = SessionLayout.build(spec, self.engine.tokenizer)
            data = SessionData(spec, layout, spans=_spans(snap["spans"]), data_version=snap["data_version"],
                               last_version=snap["data_version"], counters=Counters(**snap["counters"]),
                               memory=snap.get("memory", 0))
            session = Session(stored.session_id, data, created=stored.created,
                              offloaded_tokens=list(snap["tokens"]), saved_version=snap["data_version"])
            self.manager.sessions[session.id] = session
        for q in stored.flash:
            guided = GuidedSpec(**q["guided"]) if q.get("guided") else None
            self.manager.flash.register(session, q["question"], q["max_tokens"], q["temperature"], q["id"], guided)
        data = session.data
        tokenizer = self.engine.tokenizer
        # pushes after the snapshot's counters (a push queued while the session stayed offloaded
        # on disk came back uncounted: review); without a snapshot every logged push counts
        # (a snapshot of the older code, without last_version, counted what it counted: no more)
        counted = -1 if snap is None else snap.get("last_version", math.inf)
        for version, records, drops in stored.pushes:
            data.last_version = max(data.last_version, version)
            if version > data.data_version:
                data.accept([Record(version, session.layout.record_ids(spec, tokenizer, r), r) for r in records],
                            unbounded=True)
            own = drops.pop(version, 0)  # its own records dropped at once (logged without them)
            _apply_drops(data, drops)
            if version > counted:
                data.counters.records_pushed += len(records) + own
                data.counters.records_dropped += own + sum(drops.values())
        if data.queue:
            self.ensure_resident(session)
        log.info("recovered session %s at data version %d (%d records to re-ingest)",
                 session.id, data.data_version, len(data.queue))
        return session

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)
        if self.store is not None:
            self.store.close()


def _spans(raw: list[list[int]]) -> Any:
    from collections import deque

    return deque(Span(a, b, v) for a, b, v in raw)


def _drop_counts(dropped: list[Record]) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in dropped:
        out[r.version] = out.get(r.version, 0) + 1
    return out


def _apply_drops(data: SessionData, drops: dict[int, int]) -> None:
    """Replay drop_oldest decisions logged after a push: the oldest queued records of a version."""
    for version, count in drops.items():
        for _ in range(count):
            idx = next((i for i, r in enumerate(data.queue) if r.version == int(version)), None)
            if idx is None:
                break
            rec = data.queue[idx]
            del data.queue[idx]
            data.queued_tokens -= len(rec.ids)
