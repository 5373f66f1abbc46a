"""Live sessions on the engine: equivalence with stateless generation and with a dense
reference under eviction, snapshot isolation, bounded memory over long streams, overflow
(pool pressure: tests/test_session_pool_pressure.py)."""
from __future__ import annotations

import random

import pytest
import torch

from streamkv import SamplingParams
from streamkv.errors import InvalidRequestError, QueueFullError, SessionNotFoundError
from streamkv.sessions.spec import SessionSpec
from tests.session_reference import DenseSession, tiny_pair

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
