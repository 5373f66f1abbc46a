"""Sessions with ``"evict": "snapkv"``: the evicted span keeps its top tokens by SnapKV score.

* the ranking (``SnapStreamPolicy.rank_span``) is SnapKV's score averaged over layers and kv heads;
* the window book-keeping never exceeds the retention (hypothesis);
* on tiny llama / qwen3 checkpoints the paged session equals a dense transformers cache edited
  by hand, and every kept set is a top-k of the SnapKV scores computed from transformers' own
  queries and keys;
* on the embedded model the choices are bit-identical under batching and offload.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkv import LLM, SamplingParams
from streamkv.policies.write import SnapStreamPolicy
from streamkv.sessions.spec import SessionLayout, SessionSpec
from streamkv.sessions.state import Record, SessionData
from tests.session_reference import DenseSession, tiny_pair

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def _records(rng: random.Random, n: int, start: int) -> list[str]:
    return [f"item {start + i}: value {rng.randint(0, 999)} at level {rng.choice('abcdef')}" for i in range(n)]


# ------------------------------------------------------------------ the ranking
def test_rank_span_is_snapkv_averaged_over_layers_and_heads():
    g = torch.Generator().manual_seed(0)
    layers, length, kvh, heads, dim, obs = 3, 40, 2, 4, 16, 5
    keys = torch.randn(layers, length, kvh, dim, generator=g)
    q = torch.randn(layers, obs, heads, dim, generator=g)
    policy = SnapStreamPolicy(sink_tokens=0, window_tokens=obs, budget_tokens=8, observation_tokens=obs)
    scale = dim ** -0.5
    want = torch.stack([policy.scores(q[i], keys[i], scale).mean(0) for i in range(layers)]).mean(0)
    picks = policy.rank_span(q, keys, 4, 20, 6, scale)
    assert picks.tolist() == sorted(want[4:24].topk(6).indices.tolist())
    # a span reaching the observed rows keeps them first (they are the newest)
    tail = policy.rank_span(q, keys, 30, 10, 7, scale).tolist()
    assert set(range(5, 10)) <= set(tail) and len(tail) == 7
    assert policy.rank_span(q, keys, 4, 6, 6, scale).tolist() == list(range(6))


def test_rank_span_keeps_what_the_queries_attend_to():
    """Keys aligned with every observed query win; orthogonal noise loses."""
    g = torch.Generator().manual_seed(1)
    layers, length, dim, obs = 2, 64, 32, 4
    direction = torch.randn(dim, generator=g)
    keys = 0.1 * torch.randn(layers, length, 1, dim, generator=g)
    hot = [7, 19, 33]
    keys[:, hot, 0] = 3 * direction
    q = direction.expand(layers, obs, 2, dim).clone()
    policy = SnapStreamPolicy(sink_tokens=0, window_tokens=obs, budget_tokens=4, observation_tokens=obs, pool_kernel=1)
    picks = policy.rank_span(q, keys, 0, 50, 3, dim ** -0.5).tolist()
    assert picks == hot


# --------------------------------------------------------------- the window
class _Tok:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1] * len(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=60), st.integers(8, 60), st.integers(1, 50))
def test_window_never_exceeds_the_retention_and_memory_stays_in_budget(sizes, budget, chunk):
    spec = SessionSpec(chat=False, system="s", data_header="", retention_tokens=120, evict_tokens=min(chunk, 120),
                       evict="snapkv", kv_write={"budget_tokens": budget, "observation_tokens": 8},
                       ingest_batch_tokens=50)
    data = SessionData(spec, SessionLayout.build(spec, _Tok()))
    for i, n in enumerate(sizes):
        n = min(n, spec.record_window)
        incoming = n
        n_rec, n_tok = data.eviction_for(incoming)
        if n_tok:
            before = data.sliding_tokens
            removed = data.evicted(n_rec, n_tok, min(budget, data.memory + n_tok))
            assert data.sliding_tokens == before - removed
        assert data.sliding_tokens + incoming <= spec.retention_tokens
        assert data.memory <= budget
        data.fed(Record(i + 1, [0] * n, "x"))
        spans = list(data.spans)
        assert spans[0].start == data.base_len
        assert all(a.end == b.start for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("bad, match", [
    ({"evict": "lru"}, "evict must be one of"),
    ({"kv_write": {"policy": "snapstream"}}, 'also send "evict": "snapkv"'),
    ({"evict": "snapkv", "kv_write": {"policy": "streaming_llm"}}, "needs a policy that scores tokens"),
    ({"evict": "snapkv", "kv_write": {"sink_tokens": 4}}, "sink_tokens does not apply"),
    ({"evict": "snapkv", "kv_write": {"window_tokens": 100}}, "window_tokens does not apply"),
    ({"evict": "snapkv", "kv_write": {"budget_tokens": 2048}}, "less than retention_tokens"),
    ({"evict": "snapkv", "kv_write": {"budget_tokens": 8}}, "at least observation_tokens"),
    ({"evict": "snapkv", "kv_write": {"pool_kernel": 4}}, "pool_kernel must be odd"),
    # observation_tokens becomes the session's window: its errors named window_tokens, which
    # a session never takes; an unknown policy was "needs a policy that scores tokens"
    ({"evict": "snapkv", "kv_write": {"observation_tokens": False}}, "observation_tokens must be an integer >= 1"),
    ({"evict": "snapkv", "kv_write": {"observation_tokens": 0}}, "observation_tokens must be an integer >= 1"),
    ({"evict": "snapkv", "kv_write": {"policy": "bogus"}}, "kv_write.policy must be one of"),
])
def test_bad_eviction_specs_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        SessionSpec(**bad)


def test_spec_round_trips_and_defaults():
    spec = SessionSpec(evict="snapkv", retention_tokens=1000)
    assert spec.kv_write.budget_tokens == 250 and spec.record_window == 750
    assert SessionSpec(**spec.to_dict()) == spec


# ------------------------------------------------- paged vs dense (transformers)
@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    return tiny_pair(request.param, tmp_path_factory)


def _spy_evictions(engine) -> list[tuple[int, int, list[int]]]:
    calls: list[tuple[int, int, list[int]]] = []
    original = engine.seq_ops.evict

    def spy(seq, start, count, keep=()):
        calls.append((start, count, list(keep)))
        return original(seq, start, count, keep)

    engine.seq_ops.evict = spy
    return calls


def _reference_scores(ref: DenseSession, policy: SnapStreamPolicy, scale: float) -> torch.Tensor:
    """SnapKV scores [L] of the dense cache's tokens, from transformers' queries and keys."""
    keys, q = ref.keys(), ref.queries
    total = torch.stack([policy.scores(q[i], keys[i], scale).mean(0) for i in range(len(keys))]).mean(0)
    return torch.cat([total, torch.full((q.shape[1],), float("inf"))])


def test_snapkv_session_matches_a_dense_reference(tiny):
    hf, llm = tiny
    engine = llm.engine
    inv_freq = engine.bundle.runner.model.rope.inv_freq
    rng = random.Random(2)
    spec = SessionSpec(system="sys", chat=False, retention_tokens=120, evict_tokens=30, ingest_batch_tokens=1000,
                       evict="snapkv", kv_write={"budget_tokens": 40, "observation_tokens": 32})
    policy = spec.kv_write
    sess = engine.sessions.create(spec)
    frozen = len(sess.layout.frozen)
    calls = _spy_evictions(engine)
    ref = DenseSession(hf, inv_freq, observe=policy.observation)
    ref.append(list(sess.layout.frozen))
    stop = set(engine.tokenizer.eos_token_ids)
    scale = hf.config.head_dim ** -0.5 if getattr(hf.config, "head_dim", None) else \
        (hf.config.hidden_size // hf.config.num_attention_heads) ** -0.5
    checked = 0
    for step in range(14):
        records = _records(rng, rng.randint(1, 3), step * 3)
        engine.sessions.push(sess.id, records)
        before = len(calls)
        _drain(engine)
        for start, count, keep in calls[before:]:
            assert start == frozen and len(keep) == min(policy.budget, count)
            scores = _reference_scores(ref, policy, scale)[start:start + count]
            kept = torch.zeros(count, dtype=torch.bool)
            kept[keep] = True
            if kept.all():
                continue
            # a top-k of the reference scores (up to float32 rounding between the two paths)
            assert scores[kept].min() >= scores[~kept].max() - 1e-5, (scores[kept].min(), scores[~kept].max())
            ref.evict(start, count, keep)
            checked += 1
        ref.append([t for r in records for t in sess.layout.record_ids(spec, engine.tokenizer, r)])
        assert ref.length == len(sess.stream.tokens)
        assert len(sess.stream.tokens) <= frozen + spec.retention_tokens
        if step % 3 == 2:
            q_ids = sess.layout.query_ids(engine.tokenizer, "value?")
            info = engine.sessions.query(sess.id, f"q{step}", "value?", GREEDY)
            ans = engine.run_to_completion([f"q{step}"])[f"q{step}"]
            want, first = ref.answer(q_ids, 8, stop)
            assert ans.token_ids == want
            lp = torch.log_softmax(first, -1)
            for tok, logprob in ans.logprobs[0].top:
                assert abs(lp[tok].item() - logprob) < 1e-3
            assert info["prompt_token_ids"][:frozen] == list(sess.layout.frozen)
            engine.check_integrity()
    assert checked >= 2, "the session never evicted with a choice to make"
    assert sess.data.memory == policy.budget and sess.data.counters.snapkv_fallbacks == 0
    engine.seq_ops.evict = type(engine.seq_ops).evict.__get__(engine.seq_ops)
    engine.sessions.delete(sess.id)
    engine.step()
    engine.check_integrity()


# ----------------------------------------------------- embedded model, bitwise
def _feed_all(engine, sid: str, batches: list[list[str]], load: bool = False) -> None:
    for i, batch in enumerate(batches):
        engine.sessions.push(sid, batch)
        if load:  # stateless traffic batched with the ingestion
            engine.add_request(f"load{sid}{i}", engine.tokenizer.encode("Tell me a story about a cat. " * 3),
                               SamplingParams(max_tokens=6, ignore_eos=True))
        _drain(engine)


def test_snapkv_choices_are_bit_identical_under_batching_and_offload(smol_fp32):
    engine = smol_fp32.engine
    rng = random.Random(3)
    batches = [_records(rng, rng.randint(2, 6), i * 6) for i in range(12)]
    batches[1] = ["the passkey is 7319; remember it"] + batches[1]
    spec = SessionSpec(system="Answer from the data.", retention_tokens=256, evict_tokens=64,
                       evict="snapkv", kv_write={"budget_tokens": 64, "observation_tokens": 16})
    a = engine.sessions.create(spec)
    _feed_all(engine, a.id, batches)
    b = engine.sessions.create(spec)
    for i, batch in enumerate(batches):
        _feed_all(engine, b.id, [batch], load=True)
        if i in (4, 8):  # through host memory and back: the query window travels with the KV
            assert engine.sessions.offload.offload(b) > 0 and b.where == "host"
    engine.sessions.offload.ensure_resident(b)
    assert a.data.counters.evictions >= 3 and b.data.counters.snapkv_fallbacks == 0
    assert a.data.memory == 64
    assert list(a.stream.tokens) == list(b.stream.tokens)
    ka, va = engine.seq_ops.export(a.stream, len(a.stream.tokens))
    kb, vb = engine.seq_ops.export(b.stream, len(b.stream.tokens))
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    answers = []
    for sess in (a, b):
        engine.sessions.query(sess.id, f"ask{sess.id}", "What is the passkey?", GREEDY)
        answers.append(engine.run_to_completion([f"ask{sess.id}"])[f"ask{sess.id}"].token_ids)
    assert answers[0] == answers[1]
    # the memory holds tokens of evicted records: not only the newest ones
    frozen = len(a.layout.frozen)
    memory = a.stream.tokens[frozen:frozen + a.data.memory]
    first_window = [t for r in batches[-1] for t in a.layout.record_ids(spec, engine.tokenizer, r)]
    assert memory != first_window[:len(memory)]
    stats = engine.sessions.stats(a.id)
    assert stats["memory_tokens"] == 64 and stats["spec"]["evict"] == "snapkv"
    for sess in (a, b):
        engine.sessions.delete(sess.id)
    engine.check_integrity()


def test_oldest_eviction_keeps_no_memory(smol_fp32):
    engine = smol_fp32.engine
    rng = random.Random(4)
    sess = engine.sessions.create(SessionSpec(system="Data.", retention_tokens=200, evict_tokens=50))
    _feed_all(engine, sess.id, [_records(rng, 4, i * 4) for i in range(10)])
    assert sess.data.counters.evictions and sess.data.memory == 0
    assert sess.data.spans[0].start == len(sess.layout.frozen)
    engine.sessions.delete(sess.id)


def test_query_window_survives_disk_offload_and_the_snapshot_records_the_memory(tmp_path):
    """Offload beyond the host budget spills to the session dir; the restored stream scores its
    next eviction with the saved window (no fallback) and matches a twin that stayed resident."""
    import json

    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, session_dir=str(tmp_path), host_offload_bytes=0)
    engine = llm.engine
    rng = random.Random(5)
    batches = [_records(rng, rng.randint(1, 2), i * 2) for i in range(14)]
    spec = SessionSpec(system="Data.", retention_tokens=160, evict_tokens=32,
                       evict="snapkv", kv_write={"budget_tokens": 48, "observation_tokens": 40})
    twin, moved = engine.sessions.create(spec), engine.sessions.create(spec)
    for i, batch in enumerate(batches):
        _feed_all(engine, twin.id, [batch])
        _feed_all(engine, moved.id, [batch])
        if i in (5, 9):
            engine.sessions.offload.offload(moved)
            assert moved.where == "disk"
            kv = json.loads((tmp_path / moved.id / "kv.json").read_text())
            assert kv["memory"] == moved.data.memory
    assert moved.data.counters.evictions >= 3 and moved.data.counters.snapkv_fallbacks == 0
    assert list(twin.stream.tokens) == list(moved.stream.tokens)
    k1, v1 = engine.seq_ops.export(twin.stream, len(twin.stream.tokens))
    k2, v2 = engine.seq_ops.export(moved.stream, len(moved.stream.tokens))
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    engine.sessions.close()
