"""Sessions' ``ready`` forks (DESIGN.md section 3, "Sessions").

A ready fork is the stream at its newest complete version with the query prefix appended, so a
question forks it and computes only its own tokens::

    stream  [ frozen | window ............ | fed, not a version yet ]
    ready   [ frozen | window ............ | prefix ]
            '--- full blocks: shared ---'^ snapshot_len
                                          its own: a copy of the partial last block + the prefix rows

It is an optimisation, never something another sequence waits for: it opens only beside the
blocks fed rows still take, and is closed first when blocks run short (before an eviction, in a
stalled step). Without one, a question forks the stream at its snapshot and computes the prefix too.
With ``ready_exit`` on, its end's next-token logprobs are probed (the ready-position answer).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamkv.errors import InvalidRequestError
from streamkv.sampling.params import SamplingParams
from streamkv.sessions.session import Session

if TYPE_CHECKING:
    from streamkv.ops.core import EngineCore as Engine


class ReadyForks:
    """Opens, closes and probes the sessions' ``ready`` forks (engine thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def close(self, session: Session) -> None:
        """Close the session's ``ready`` fork, if open (queries fork the stream meanwhile)."""
        if session.ready is not None:
            self.engine.seq_ops.close(session.ready)
            session.ready = None

    def stale(self, session: Session) -> bool:
        """The session has a query prefix and no ready fork at its newest version."""
        return bool(session.layout.prefix) and session.ready_version != session.data.data_version

    def blocks(self, session: Session) -> int:
        """Blocks a new ready fork takes of its own: a copy of the window's partial last block and
        the query prefix's rows (the full blocks before them are shared)."""
        kv, snap = self.engine.kv, session.data.snapshot_len()
        return kv.blocks_for(snap + len(session.layout.prefix)) - snap // kv.block_size

    def fits(self, session: Session, pending: int = 0) -> bool:
        """A new ready fork's own blocks are free beside ``pending`` blocks owed to fed rows."""
        return self.blocks(session) <= self.engine.pool.num_free - pending

    def refresh(self, session: Session, pending: int) -> None:
        """Open a ready fork at the newest complete version if it is stale and fits beside the
        ``pending`` blocks fed rows still take. It ranks as a question, above the streams: a
        session brought back from host forked one with the block another stream, a few rows from
        idle, needed; that stream got no row, a request it kept out of the pool prefilled until it
        gave its blocks back, and the session went back to host, over and over (fuzz seed 23061)."""
        stream = session.stream
        if stream is None or not self.stale(session):
            return
        self.close(session)
        if not self.fits(session, pending):
            return
        peek = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2) if session.spec.ready_exit else None
        try:
            session.ready = self.engine.seq_ops.fork(stream, session.data.snapshot_len(), session.layout.prefix,
                                                     peek=peek)
        except InvalidRequestError:  # no block for the copy right now: queries fork the stream instead
            return
        session.ready_version = session.data.data_version

    def take_probe(self, session: Session) -> None:
        """Record the ready position's top token once computed (``ready_exit`` sessions), whether
        it qualifies or not: shown in stats, so the vocabulary and min gap can be tuned."""
        ready = session.ready
        if ready is None or ready.peeked is None or not session.spec.ready_exit:
            return
        lp, ready.peeked = ready.peeked, None
        top = getattr(lp, "top", ())
        if len(top) < 2:
            return
        token, gap = top[0][0], top[0][1] - top[1][1]
        text = self.engine.tokenizer.decode([token]).strip()
        ok = text in session.spec.ready_exit_vocab and gap >= session.spec.ready_exit_min_gap
        session.ready_probe = {"answer": text, "token_id": token, "gap": gap,
                               "data_version": session.ready_version, "qualifies": ok}

    @staticmethod
    def exit_answer(session: Session) -> dict[str, Any] | None:
        """The ready-position answer for the current version, if the session enables it and the
        top token qualifies (no forward pass); else None."""
        probe = session.ready_probe
        if (probe is None or not probe["qualifies"] or not session.spec.ready_exit
                or probe["data_version"] != session.data.data_version):
            return None
        return probe
