"""A session moves between two engines sharing one --session-dir (the replica half of
cluster migration): release on the source, adopt on the target, same version and answer."""
from __future__ import annotations

import pytest

from streamkv import LLM, SamplingParams
from streamkv.errors import InvalidRequestError, SessionExistsError, SessionMovedError, SessionNotFoundError
from streamkv.sessions.spec import SessionSpec

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
QUESTION = "What is the latest reading?"


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def _ask(engine, sid: str, rid: str) -> list[int]:
    engine.sessions.query(sid, rid, QUESTION, GREEDY)
    return engine.run_to_completion([rid])[rid].token_ids


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("shared"))
    opts = dict(session_dir=d, adopt_sessions=True, kv_cache_memory=96 << 20, checkpoint_idle_s=3600.0)
    return LLM(**opts).engine, LLM(**opts).engine


def test_release_then_adopt_keeps_version_layout_and_answer(pair):
    a, b = pair
    sess = a.sessions.create(SessionSpec(system="You track readings.", retention_tokens=120, evict_tokens=40),
                             "migrate-me-1")
    for i in range(10):
        a.sessions.push(sess.id, [f"reading {i}: {10 + 3 * i} units", f"note {i}: stable"])
    _drain(a)
    before = _ask(a, sess.id, "q-a")
    stats = a.sessions.stats(sess.id)
    ids = a.sessions.layout(sess.id)["stream_ids"]
    assert stats["evictions"] > 0
    # two pushes acknowledged but never ingested: the log carries them to the next owner
    a.sessions.push(sess.id, ["reading 10: 40 units"])
    a.sessions.push(sess.id, ["reading 11: 43 units"])
    out = a.sessions.release(sess.id)
    assert out["data_version"] == stats["data_version"] == 10
    assert sess.id not in a.sessions.sessions
    assert a.sessions.exists(sess.id)  # stored: adoptable, so its id cannot be taken
    # the target adopts on first use: the snapshot at version 10, then the two logged pushes
    adopted = b.sessions.get(sess.id)
    assert adopted.data.data_version == 10 and len(adopted.data.queue) == 2
    assert adopted.where == "pool"
    assert b.sessions.layout(sess.id)["stream_ids"] == ids
    _drain(b)
    assert b.sessions.stats(sess.id)["data_version"] == 12
    # and back: the answer at version 12 is the same on either engine
    at_b = _ask(b, sess.id, "q-b")
    b.sessions.release(sess.id)
    with pytest.raises(SessionMovedError):  # released here moments ago: a late request is refused,
        a.sessions.get(sess.id)  # never a second copy of a session someone else may hold
    a.sessions.adopt(sess.id)  # the owner the ingress chose takes it explicitly
    assert _ask(a, sess.id, "q-a2") == at_b
    assert before  # an answer was generated at version 10 too
    a.sessions.delete(sess.id)
    assert not a.sessions.exists(sess.id)
    with pytest.raises(SessionNotFoundError):
        b.sessions.get(sess.id)


def test_a_released_session_emits_migrated_and_ids_are_checked(pair):
    a, b = pair
    sess = a.sessions.create(SessionSpec(system="Log.", retention_tokens=200), "migrate-me-2")
    events: list[dict] = []
    sess.listeners.append(events.append)
    a.sessions.release(sess.id)
    assert events[-1]["event"] == "migrated" and events[-1]["data_version"] == 0
    assert b.sessions.exists("migrate-me-2") and "migrate-me-2" not in b.sessions.sessions
    b.sessions.get("migrate-me-2")  # adopted on first use (b never released it)
    with pytest.raises(SessionExistsError):
        b.sessions.create(SessionSpec(system="Log."), "migrate-me-2")
    with pytest.raises(SessionNotFoundError):
        b.sessions.get("../../etc")  # never a path: ids are 8-64 of [A-Za-z0-9_-]
    b.sessions.delete("migrate-me-2")


def test_release_needs_a_session_dir(smol_fp32):
    engine = smol_fp32.engine
    sess = engine.sessions.create(SessionSpec(system="x", retention_tokens=100))
    with pytest.raises(InvalidRequestError, match="session-dir"):
        engine.sessions.release(sess.id)
    engine.sessions.delete(sess.id)
