"""Live sessions on the engine: equivalence with stateless generation and with a dense
reference under eviction, snapshot isolation, bounded memory over long streams, overflow."""
from __future__ import annotations

import random

import pytest
import torch

from streamkv import LLM, SamplingParams
from streamkv.errors import InvalidRequestError, QueueFullError, SessionNotFoundError
from streamkv.sessions.spec import SessionSpec
from tests.session_reference import DenseSession, tiny_pair
from tests.tiny_checkpoints import make_tiny_hf_checkpoint

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def _ask(engine, sid: str, rid: str, question: str, params: SamplingParams = GREEDY):
    info = engine.sessions.query(sid, rid, question, params)
    return info, engine.run_to_completion([rid])[rid]


def _records(rng: random.Random, n: int, start: int) -> list[str]:
    return [f"item {start + i}: value {rng.randint(0, 999)} at level {rng.choice('abcdef')}" for i in range(n)]


def test_answers_equal_stateless_generation_on_the_exact_token_ids(smol_fp32):
    """Acceptance 1 without eviction, on the embedded model: answers and first-token logprobs."""
    engine = smol_fp32.engine
    rng = random.Random(0)
    sess = engine.sessions.create(SessionSpec(system="Answer from the data.", retention_tokens=1500))
    n = 0
    for round_ in range(4):
        for _ in range(rng.randint(1, 3)):
            engine.sessions.push(sess.id, _records(rng, rng.randint(1, 4), n))
            n += 4
        _drain(engine)
        question = rng.choice(["What is the last value?", "Which level appears most?", "How many items?"])
        info, ans = _ask(engine, sess.id, f"s{round_}", question)
        engine.add_request(f"r{round_}", info["prompt_token_ids"], GREEDY)
        ref = engine.run_to_completion([f"r{round_}"])[f"r{round_}"]
        assert ans.token_ids == ref.token_ids, (ans.text, ref.text)
        assert ans.logprobs[0].top[0][0] == ref.logprobs[0].top[0][0]
        for (t1, l1), (t2, l2) in zip(ans.logprobs[0].top, ref.logprobs[0].top):
            assert t1 == t2 and abs(l1 - l2) < 1e-3
        assert info["data_version"] == engine.sessions.get(sess.id).data.last_version
        assert info["computed_prompt_tokens"] < 40  # only the question, not the data
    engine.sessions.delete(sess.id)
    engine.check_integrity()
    assert engine.pool.num_used == 0 or all(b.ref_count == 0 for b in engine.pool.blocks if b.block_hash is None)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    return tiny_pair(request.param, tmp_path_factory)


def test_evicting_session_matches_a_dense_reference(tiny):
    """Acceptance 1 with eviction: the paged session (forks, chunked ingestion, in-place and
    copy-on-write re-positioning) equals a dense cache edited by hand."""
    hf, llm = tiny
    engine = llm.engine
    inv_freq = engine.bundle.runner.model.rope.inv_freq
    rng = random.Random(1)
    spec = SessionSpec(system="sys", chat=False, retention_tokens=120, evict_tokens=30, ingest_batch_tokens=1000)
    sess = engine.sessions.create(spec)
    ref = DenseSession(hf, inv_freq)
    ref.append(list(sess.layout.frozen))
    evictions = []
    sess.listeners.append(lambda ev: evictions.append(ev) if ev["event"] == "evicted" else None)
    stop = set(engine.tokenizer.eos_token_ids)
    held_fork = None
    for step in range(14):
        records = _records(rng, rng.randint(1, 3), step * 3)
        engine.sessions.push(sess.id, records)
        before = len(evictions)
        _drain(engine)
        for ev in evictions[before:]:
            ref.evict(len(sess.layout.frozen), ev["tokens"])
        ref.append([t for r in records for t in sess.layout.record_ids(spec, engine.tokenizer, r)])
        assert list(sess.stream.tokens) == _stream_ids(sess)
        if step == 5:  # keep a query in flight across later evictions: copy-on-write path
            engine.sessions.query(sess.id, "held", "keep?", SamplingParams(max_tokens=64, ignore_eos=True))
            held_fork = "held"
        if step % 3 == 2:
            q_ids = sess.layout.query_ids(engine.tokenizer, "value?")
            info, ans = _ask(engine, sess.id, f"q{step}", "value?")
            want, first = ref.answer(q_ids, 8, stop)
            assert ans.token_ids == want
            lp = torch.log_softmax(first, -1)
            for tok, logprob in ans.logprobs[0].top:
                assert abs(lp[tok].item() - logprob) < 1e-3
            engine.check_integrity()
    assert evictions, "the stream never reached its retention window"
    assert len(sess.stream.tokens) <= len(sess.layout.frozen) + spec.retention_tokens
    if held_fork:
        engine.abort(held_fork)
    engine.sessions.delete(sess.id)
    engine.step()
    engine.check_integrity()


def _stream_ids(sess) -> list[int]:
    return list(sess.stream.tokens)


def test_query_during_a_large_backlog_sees_the_last_complete_version(smol_fp32):
    """Acceptance 2: 4,000 queued tokens do not delay a query; it answers version 1."""
    engine = smol_fp32.engine
    sess = engine.sessions.create(SessionSpec(system="Data follows.", retention_tokens=6000, ingest_batch_tokens=256))
    engine.sessions.push(sess.id, ["the answer is 42"])
    _drain(engine)
    backlog = [f"filler record {i} with some words in it" for i in range(400)]
    engine.sessions.push(sess.id, backlog)
    assert sess.data.queued_tokens + len(sess.stream.tokens) - sess.stream.num_computed >= 4000
    engine.step()  # ingestion starts
    info = engine.sessions.query(sess.id, "q", "What is the answer?", SamplingParams(max_tokens=6))
    steps = 0
    while True:
        outs = engine.step()
        steps += 1
        if any(o.request_id == "q" and o.finished for o in outs):
            break
    assert info["data_version"] == 1
    assert sess.data.data_version == 1 and sess.data.queue, "ingestion should still be running"
    assert steps <= 8
    engine.sessions.delete(sess.id)


def test_long_stream_keeps_memory_and_positions_bounded(tiny):
    """Acceptance 3 (engine level): 10x the retention window streamed through."""
    _, llm = tiny
    engine = llm.engine
    spec = SessionSpec(system="s", chat=False, retention_tokens=100, evict_tokens=25)
    sess = engine.sessions.create(spec)
    total = 0
    peak_blocks = 0
    for i in range(140):
        engine.sessions.push(sess.id, [f"row {i} {i * 7 % 13}"])
        _drain(engine)
        total += len(sess.layout.record_ids(spec, engine.tokenizer, f"row {i} {i * 7 % 13}"))
        peak_blocks = max(peak_blocks, engine.pool.num_used)
        assert len(sess.stream.tokens) <= len(sess.layout.frozen) + spec.retention_tokens
    assert total >= 10 * spec.retention_tokens
    assert peak_blocks <= engine.kv.blocks_for(len(sess.layout.frozen) + spec.retention_tokens) + 4
    stats = engine.sessions.stats(sess.id)
    assert stats["records"]["evicted"] + stats["records"]["in_window"] == 140
    engine.sessions.delete(sess.id)


@pytest.mark.parametrize("policy", ["drop_oldest", "reject"])
def test_overflow_policies_count_every_record(tiny, policy):
    """Acceptance 4 (engine level): pushes outrun ingestion; dropped count is exact."""
    _, llm = tiny
    engine = llm.engine
    spec = SessionSpec(system="s", chat=False, retention_tokens=200, max_queue_tokens=60, overflow=policy)
    sess = engine.sessions.create(spec)
    rejected, dropped_reported = 0, 0
    events = []
    sess.listeners.append(events.append)
    for i in range(40):
        rec = f"record number {i}"
        try:
            res = engine.sessions.push(sess.id, [rec])
            dropped_reported += res["dropped"]
        except QueueFullError:
            rejected += 1
        if i % 10 == 9:
            engine.step()
    _drain(engine)
    c = sess.data.counters
    if policy == "reject":
        assert rejected > 0 and c.records_dropped == 0
        assert c.records_pushed == 40 - rejected == c.records_ingested
    else:
        assert rejected == 0 and c.records_dropped > 0
        assert c.records_dropped == dropped_reported == sum(e["records"] for e in events if e["event"] == "dropped")
        assert c.records_ingested + c.records_dropped == 40
    engine.sessions.delete(sess.id)


def test_bad_session_input_is_rejected(tiny):
    _, llm = tiny
    engine = llm.engine
    with pytest.raises(ValueError):
        SessionSpec(retention_tokens=0)
    with pytest.raises(ValueError):
        SessionSpec(overflow="explode")
    with pytest.raises(InvalidRequestError):
        engine.sessions.create(SessionSpec(system="s", chat=False, retention_tokens=100000))
    sess = engine.sessions.create(SessionSpec(system="s", chat=False, retention_tokens=100))
    for bad in ([], "text", [""], [3], ["x" * 70000]):
        with pytest.raises(InvalidRequestError):
            engine.sessions.push(sess.id, bad)
    with pytest.raises(InvalidRequestError):
        engine.sessions.query(sess.id, "q", "  ", GREEDY)
    with pytest.raises(SessionNotFoundError):
        engine.sessions.push("sess_nope", ["x"])
    assert sess.data.last_version == 0
    engine.sessions.delete(sess.id)
    with pytest.raises(SessionNotFoundError):
        engine.sessions.get(sess.id)


def test_concurrent_queries_on_one_session_during_ingestion_equal_their_solo_answers(tiny):
    _, llm = tiny
    engine = llm.engine
    sess = engine.sessions.create(SessionSpec(system="s", chat=False, retention_tokens=300, ingest_batch_tokens=16))
    engine.sessions.push(sess.id, [f"row {i} value {i * 3}" for i in range(6)])
    _drain(engine)
    questions = ["first?", "last value?", "how many rows?", "sum?"]
    solo = {}
    for i, q in enumerate(questions):
        solo[q] = _ask(engine, sess.id, f"solo{i}", q)[1].token_ids
    engine.sessions.push(sess.id, [f"late row {i}" for i in range(20)])  # ingestion runs meanwhile
    engine.step()
    infos = {q: engine.sessions.query(sess.id, f"c{i}", q, GREEDY) for i, q in enumerate(questions)}
    outs = engine.run_to_completion([f"c{i}" for i in range(len(questions))])
    for i, q in enumerate(questions):
        assert infos[q]["data_version"] == 1
        assert outs[f"c{i}"].token_ids == solo[q]
    _drain(engine)
    assert sess.data.data_version == 2
    engine.sessions.delete(sess.id)
    engine.check_integrity()


def _idle_sessions(tmp_path):
    """A tiny model whose 40-block pool two ingested, idle sessions hold most of."""
    path = make_tiny_hf_checkpoint(tmp_path / "m", "llama", max_position_embeddings=512)
    llm = LLM(model=str(path), dtype="float32", num_blocks=40, block_size=4)
    sessions = [llm.session("s", chat=False, retention_tokens=60) for _ in range(2)]
    for s in sessions:
        s.push([f"record {i} of some data" for i in range(6)])
        s.ingest()
    return llm, sessions


def test_idle_sessions_are_offloaded_when_requests_need_blocks(tmp_path):
    llm, sessions = _idle_sessions(tmp_path)
    engine = llm.engine
    before = [s.query("what?", max_tokens=4).token_ids for s in sessions]
    out = llm.generate([list(range(3, 110))], SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.finish_reason == "length"  # needed more blocks than were free
    where = [s.stats()["kv"]["where"] for s in sessions]
    assert "host" in where
    assert any(e["event"] == "offloaded" for s in sessions for e in s.events())
    after = [s.query("what?", max_tokens=4).token_ids for s in sessions]
    assert after == before
    engine.check_integrity()


def test_idle_sessions_are_offloaded_when_a_span_query_needs_blocks(tmp_path):
    # span streams are pinned: offloading looked only at unpinned waiting requests, so a span
    # query waited for good behind idle sessions, and the requests ranked after it too
    from streamkv.spans.ir import fragment, gen, plus, seq, user

    llm, sessions = _idle_sessions(tmp_path)
    engine = llm.engine
    free = engine.pool.num_free
    words = " ".join(f"w{i}" for i in range(4 * free))
    engine.spans.submit("q", gen(seq(fragment("sys"), plus(fragment(words)), user("q")), max_tokens=3, temperature=0))
    engine.add_request("p", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    done = {}
    for _ in range(500):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if len(done) == 2:
            break
    assert sorted(done) == ["p", "q"] and done["q"].finish_reason == "length", done.get("q")
    assert "host" in [s.stats()["kv"]["where"] for s in sessions]
    engine.spans.cache.clear()
    engine.check_integrity()


def test_idle_sessions_make_room_for_the_request_that_blocks_the_queue(tmp_path):
    # a long request L (more than is free) and a short one S (fits) wait together: offloading
    # freed only the smallest need (S's: nothing), but nothing unpinned passes L, so neither
    # ever ran (helper-23: a server frozen for 140 s until clients gave up)
    llm, sessions = _idle_sessions(tmp_path)
    engine = llm.engine
    free = engine.pool.num_free
    params = SamplingParams(max_tokens=4, temperature=0)
    engine.add_request("L", list(range(3, 3 + 4 * (free + 3))), params)
    engine.add_request("S", [5, 6, 7], params)
    done = {}
    for _ in range(300):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if len(done) == 2:
            break
    assert sorted(done) == ["L", "S"], (engine.scheduler.blocked_need, engine.pool.num_free)
    assert "host" in [s.stats()["kv"]["where"] for s in sessions]
    engine.check_integrity()


def test_a_session_question_takes_its_block_from_an_idle_streaming_input(tmp_path):
    # an input waiting for more text held the last free block: the question's fork (it copies
    # its partial block at once) failed with "the KV cache is full" (a 503), although a span
    # query's fork would have preempted that input (background work)
    llm, sessions = _idle_sessions(tmp_path)
    engine = llm.engine
    before = sessions[0].query("what?", max_tokens=4).token_ids
    handle = llm.open_input("w", SamplingParams(max_tokens=3, temperature=0))
    for i in range(400):  # one short word at a time until the input holds every free block
        if engine.pool.num_free == 0:
            break
        handle.append(f" w{i % 10}")
        handle.advance()
    assert engine.pool.num_free == 0 and "host" not in [s.stats()["kv"]["where"] for s in sessions]
    assert sessions[0].query("what?", max_tokens=4).token_ids == before
    assert engine.scheduler.num_preemptions > 0
    handle.result()
    engine.check_integrity()


REQUESTS = [list(range(3 + i, 30 + i)) for i in range(2)]
LONG = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)


def _session_beside_requests(tmp_path, offload: bool):
    """One ingested session (its answer to "what?" recorded; ``offload``: then moved to host) and
    two stateless requests (``r0``, ``r1``) stepped until they hold every free block of a 40-block
    pool. Returns (llm, session, answer before)."""
    path = make_tiny_hf_checkpoint(tmp_path / "m", "llama", max_position_embeddings=512)
    llm = LLM(model=str(path), dtype="float32", num_blocks=40, block_size=4)
    engine = llm.engine
    session = llm.session("s", chat=False, retention_tokens=60)
    session.push([f"record {i} of some data" for i in range(6)])
    session.ingest()
    before = session.query("what?", max_tokens=4).token_ids
    if offload:
        assert engine.sessions.offload.offload(engine.sessions.get(session.id)) > 0
    for i, p in enumerate(REQUESTS):
        engine.add_request(f"r{i}", p, LONG)
    for _ in range(200):  # until the requests hold every free block
        if engine.pool.num_free == 0:
            break
        engine.step()
    assert engine.pool.num_free == 0 and engine.has_unfinished()
    assert session.stats()["kv"]["where"] == ("host" if offload else "pool")
    return llm, session, before


def _requests_as_alone(llm) -> None:
    """r0 and r1 finish with the tokens they give alone (preempted, recomputed: the same)."""
    done = llm.engine.run_to_completion([f"r{i}" for i in range(len(REQUESTS))])
    alone = [o.token_ids for o in llm.generate(REQUESTS, LONG)]
    assert [done[f"r{i}"].token_ids for i in range(len(REQUESTS))] == alone


def test_a_session_question_preempts_a_running_request_for_its_block(tmp_path):
    # running stateless requests held every block: the question's fork (it copies its partial
    # block at once) failed with "the KV cache is full" (a 503) although they are a less urgent
    # class (POOL after SESSION) that the scheduler preempts for each other anyway
    llm, session, before = _session_beside_requests(tmp_path, offload=False)
    assert session.query("what?", max_tokens=4).token_ids == before
    assert llm.engine.scheduler.num_preemptions > 0
    _requests_as_alone(llm)
    llm.engine.check_integrity()


def test_an_offloaded_sessions_question_preempts_running_requests_to_come_back(tmp_path):
    # the session had been offloaded to host while requests filled the pool: restoring it for the
    # question failed with a 429 "the KV cache is full" (helper-27: 23 of 24 questions in a burst
    # beside completions on an 80-block pool); it now preempts them as the fork does
    llm, session, before = _session_beside_requests(tmp_path, offload=True)
    assert session.query("what?", max_tokens=4).token_ids == before
    assert llm.engine.scheduler.num_preemptions > 0
    _requests_as_alone(llm)
    llm.engine.check_integrity()


def test_a_push_refused_for_want_of_blocks_is_not_applied(tmp_path):
    # a push to an offloaded session that found no room to restore it answered 429 after its
    # records were already accepted as a new version (helper-29: versions = pushes + 429s + 1), so
    # a client retrying the 429 pushed them twice
    llm, session, _ = _session_beside_requests(tmp_path, offload=True)
    engine = llm.engine
    s = engine.sessions.get(session.id)
    version, pushed = s.data.data_version, s.data.counters.records_pushed
    with pytest.raises(QueueFullError):
        engine.sessions.push(session.id, ["one more record"])
    assert (s.data.data_version, s.data.counters.records_pushed, len(s.data.queue)) == (version, pushed, 0)
    engine.run_to_completion(["r0", "r1"])
    assert engine.sessions.push(session.id, ["one more record"])["data_version"] == version + 1
    engine.check_integrity()
