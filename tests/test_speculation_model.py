"""Prompt-lookup speculation on the embedded model: with the default (invariant) numerics
the output is exactly plain decoding's, greedy and seeded, batched or alone, and drafts
are really accepted on repetitive prompts."""
from __future__ import annotations

import pytest

from streamkv import LLM
from streamkv.sampling.params import SamplingParams

RECORDS = "\n".join(f'{{"id": {i}, "sensor": "s{i % 3}", "temp": {20 + i * 0.5}}}' for i in range(8))
PROMPTS = [
    f"Records:\n{RECORDS}\nRepeat the last 4 records exactly as JSON lines.",
    "def add(a, b):\n    return a + b\n\nRewrite this function with type hints and keep the body.",
    "List the numbers from 1 to 30 separated by commas.",
    "Copy this sentence three times: the quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain what a hash table is in two sentences.",
    "Name three primary colors.",
]


@pytest.fixture(scope="module")
def pair():
    return LLM(speculation="none"), LLM(speculation="pld")


def _chat(llm, params, prompts=PROMPTS):
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], params)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=64, temperature=0.0),
    SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=7),
    SamplingParams(max_tokens=40, temperature=0.0, stop=["\n\n", "6,"]),
], ids=["greedy", "seeded", "stop-strings"])
def test_speculative_output_is_plain_decoding(pair, params):
    plain, spec = pair
    before = spec.engine.scheduler.spec_stats.accepted
    want = _chat(plain, params)
    got = _chat(spec, params)
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert spec.engine.scheduler.spec_stats.accepted > before  # drafts were accepted, not only proposed
    alone = _chat(spec, params, PROMPTS[:1])[0]  # batch of one: the load cap lets it draft fully
    assert alone.token_ids == want[0].token_ids


def test_a_repetitive_prompt_takes_fewer_steps(pair):
    plain, spec = pair
    params = SamplingParams(max_tokens=64, temperature=0.0)
    steps = []
    for llm in pair:
        s0 = llm.engine.stats.steps
        out = _chat(llm, params, PROMPTS[:1])[0]
        steps.append(llm.engine.stats.steps - s0)
    assert len(out.token_ids) == 64
    assert steps[1] < 0.7 * steps[0], steps


def test_session_queries_and_flash_answers_are_unchanged(pair):
    """A session question is a fork of the session's stream: it may draft from the records it
    reads (they are in its tokens), and its answer is still plain decoding's."""
    records = [f'{{"t": "10:{i:02d}", "sensor": "s{i % 3}", "temp": {20 + i * 0.5}}}' for i in range(12)]
    answers = []
    for llm in pair:
        s = llm.session("You read sensor records.", retention_tokens=2000)
        s.register_flash("List the sensors of the last two records.", max_tokens=32)
        s.push(records)
        s.ingest()
        for _ in range(500):  # the flash evaluation of the new version runs in the next steps
            if s.flash_answers():
                break
            llm.engine.step()
        got = [s.query(q, max_tokens=48) for q in ("Repeat the last three records exactly.",
                                                    "List the sensors of the last two records.")]
        assert got[1].source == "flash"
        answers.append([a.answer for a in got])
    assert answers[0] == answers[1]


def test_structured_outputs_are_drafted_and_unchanged(pair):
    """A guided row drafts too: each verified row goes through the row's own matcher, so the
    output equals plain guided decoding and stays valid."""
    import json

    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar")
    from streamkv.sampling.grammar import GuidedSpec

    schema = {"type": "array", "minItems": 4, "maxItems": 4, "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "color": {"enum": ["red", "green", "blue"]}}, "required": ["id", "color"]}}
    spec = GuidedSpec.json_schema(schema)
    prompts = ["List four objects with an id and a color as JSON.", "Give four colored items as JSON."]
    outs = []
    for llm in pair:
        before = llm.engine.scheduler.spec_stats.accepted
        outs.append(_chat(llm, [SamplingParams(max_tokens=120, temperature=t, seed=3, guided=spec)
                                for t in (0.0, 1.0)], prompts))
        gained = llm.engine.scheduler.spec_stats.accepted - before
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert gained > 0  # the speculating engine accepted drafts inside the JSON
    for o in outs[1]:
        assert o.finish_reason == "stop" and len(json.loads(o.text)) == 4
