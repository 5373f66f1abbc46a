"""Flash queries (registered questions answered after every update), ready-position early
exit and the response cache, on the embedded model in float32."""
from __future__ import annotations

import pytest

from streamkv import LLM, SamplingParams
from streamkv.errors import InvalidRequestError

QUESTIONS = ["What is the latest value?", "Is the value rising?"]


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


@pytest.fixture()
def session(smol_fp32):
    s = smol_fp32.session("You watch a counter.", retention_tokens=1500)
    yield s
    s.close()


def test_flash_answer_equals_an_ordinary_query_at_the_same_version(smol_fp32, session):
    engine = smol_fp32.engine
    ids = [session.register_flash(q, max_tokens=12) for q in QUESTIONS]
    session.push(["counter=3", "counter=5"])
    _drain(engine)
    answers = session.flash_answers()
    assert set(answers) == set(ids)
    for qid, q in zip(ids, QUESTIONS):
        flash = answers[qid]
        assert flash.data_version == 1
        engine.sessions.query(session.id, f"plain-{qid}", q, SamplingParams(max_tokens=12, temperature=0))
        plain = engine.run_to_completion([f"plain-{qid}"])[f"plain-{qid}"]
        assert flash.token_ids == plain.token_ids and flash.answer == plain.text
        assert flash.confidence["first"] is not None and flash.confidence["min"] <= flash.confidence["first"]
    served = session.query(QUESTIONS[0], max_tokens=12)
    assert served.source == "flash" and served.answer == answers[ids[0]].answer
    assert served.usage["computed_prompt_tokens"] == 0
    other = session.query("Something else?", max_tokens=4)
    assert other.source == "session"


def test_events_arrive_in_version_order_and_pending_work_stays_bounded(smol_fp32, session):
    """Acceptance 2 + 3 (engine level): pushes faster than evaluation; versions skipped,
    never delivered out of order, at most one pending evaluation per question."""
    engine = smol_fp32.engine
    for q in QUESTIONS:
        session.register_flash(q, max_tokens=8)
    events = []
    engine.sessions.get(session.id).listeners.append(events.append)
    flash = engine.sessions.get(session.id).flash
    for i in range(12):
        session.push([f"counter={i}"])
        engine.step()
        assert len(flash.inflight) <= len(QUESTIONS)
    _drain(engine)
    ready = [e for e in events if e["event"] == "flash_ready"]
    for q in QUESTIONS:
        versions = [e["data_version"] for e in ready if e["question"] == q]
        assert versions == sorted(set(versions)), versions
        assert versions[-1] == 12
    assert flash.counters["versions_skipped"] > 0
    seen_updates: set[int] = set()
    for e in events:
        if e["event"] == "data_updated":
            seen_updates.add(e["data_version"])
        elif e["event"] == "flash_ready":
            assert e["data_version"] in seen_updates or e["data_version"] == 0  # version 0: no data yet
    batches = [e["data_version"] for e in ready]
    assert batches == sorted(batches)


def test_a_query_waits_for_the_in_flight_evaluation_instead_of_duplicating_it(smol_fp32, session):
    engine = smol_fp32.engine
    session.register_flash(QUESTIONS[0], max_tokens=8)
    session.push(["counter=9"])
    while engine.sessions.get(session.id).flash.batch_version != 1:
        engine.step()
    before = engine.stats.prompt_tokens
    ans = session.query(QUESTIONS[0])
    assert ans.source == "flash" and ans.data_version == 1
    assert engine.stats.prompt_tokens == before  # no new request was added


def test_ready_position_exit_is_exactly_as_specified(smol_fp32):
    engine = smol_fp32.engine
    layout = dict(chat=False, data_header="Sensors:\n", query_prefix="Status: the door is")
    probe = smol_fp32.session("Door sensor log.", retention_tokens=500, **layout)
    probe.push(["door=open"])
    _drain(engine)
    sess = engine.sessions.get(probe.id)
    ready_ids = list(sess.ready.tokens)
    ref = smol_fp32.generate([ready_ids], SamplingParams(max_tokens=1, temperature=0, logprobs=2))[0]
    top = ref.logprobs[0].top
    token_text = smol_fp32.tokenizer.decode([top[0][0]]).strip()
    gap = top[0][1] - top[1][1]
    assert token_text, "the scaffold should end where a word is predicted"
    probe.close()
    for vocab, min_gap, expect_ready in [((token_text,), max(0.0, gap - 0.01), True),
                                         ((token_text,), gap + 0.5, False),
                                         (("zzz-not-a-token",), 0.0, False)]:
        s = smol_fp32.session("Door sensor log.", retention_tokens=500, ready_exit_vocab=vocab,
                              ready_exit_min_gap=min_gap, **layout)
        s.push(["door=open"])
        _drain(engine)
        ans = s.query("Is the door open?", max_tokens=4)
        assert (ans.source == "ready") == expect_ready, (vocab, min_gap, gap, ans)
        if expect_ready:
            assert ans.answer == token_text and abs(ans.confidence["first"] - gap) < 1e-3
        s.close()
    off = smol_fp32.session("Door sensor log.", retention_tokens=500, **layout)
    off.push(["door=open"])
    _drain(engine)
    assert off.query("Is the door open?", max_tokens=4).source == "session"  # off by default
    off.close()


def test_bad_flash_registrations(smol_fp32, session):
    with pytest.raises(InvalidRequestError):
        session.register_flash("  ")
    with pytest.raises(InvalidRequestError):
        session.register_flash("ok?", max_tokens=0)
    session.register_flash("ok?")
    with pytest.raises(InvalidRequestError):
        session.register_flash("OK? ")  # same question after normalization
    with pytest.raises(InvalidRequestError):
        session.unregister_flash("fq_missing")
    with pytest.raises(ValueError):
        smol_fp32.session("x", ready_exit_vocab=[""])


def test_response_cache_serves_deterministic_requests_only(smol_path):
    llm = LLM(dtype="float32", response_cache_entries=4)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    first, again = llm.generate(["The sky is"], greedy)[0], llm.generate(["The sky is"], greedy)[0]
    assert not first.cached and again.cached and again.token_ids == first.token_ids and again.text == first.text
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=3)
    a, b = llm.generate(["Once"], seeded)[0], llm.generate(["Once"], seeded)[0]
    assert b.cached and a.token_ids == b.token_ids
    random_ = SamplingParams(max_tokens=8, temperature=0.9)
    assert not llm.generate(["Once"], random_)[0].cached and not llm.generate(["Once"], random_)[0].cached
    other = llm.generate(["The sky is"], SamplingParams(max_tokens=9, temperature=0))[0]
    assert not other.cached
    assert llm.engine.responses.hits == 2


def test_only_a_registered_question_asks_the_engine_thread_whether_it_is_in_flight(smol_fp32, session):
    """The server's check for an in-flight flash evaluation went through the engine thread for
    every session question; the engine thread takes commands only between steps, so a plain
    question waited for one more step boundary before its fork was even created."""
    import asyncio
    from types import SimpleNamespace

    from streamkv.server.flash_api import wait_for_flash

    calls: list[object] = []

    async def call(fn):
        calls.append(fn)
        return fn(smol_fp32.engine)

    fake = SimpleNamespace(engine=smol_fp32.engine, call=call)
    session.register_flash(QUESTIONS[0], max_tokens=4)
    assert asyncio.run(wait_for_flash(fake, session.id, "How many readings?", 0.0)) is None
    assert calls == []  # not registered: nothing can be in flight, no round trip
    assert asyncio.run(wait_for_flash(fake, session.id, QUESTIONS[0], 0.0)) is None  # registered, not in flight
    assert len(calls) == 1
