"""Span queries on the embedded model: order-free ``plus``, cache hits equal to misses bit for
bit (in float32 and the default dtype), operands reused at new positions, inner gens, batch
invariance, errors before any work, aborts and cache pressure without leaks."""
from __future__ import annotations

import pytest
import torch

from streamkv import LLM, SamplingParams
from streamkv.engine.dtype import resolve_dtype
from streamkv.errors import InvalidRequestError
from streamkv.spans import ir
from streamkv.spans.ir import fragment, gen, plus, seq, system, user
from streamkv.spans.lower import Piece

DEFAULT = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
DOCS = [fragment(f"Document {name}: {fact}\n") for name, fact in (
    ("A", "the river Loire flows through Orleans, Tours and Nantes."),
    ("B", "the chateau of Chambord was built for Francis I."),
    ("C", "owls hunt at night and sleep during the day."),
    ("D", "the Eiffel tower was finished in 1889."))]
SYS = system("Answer from the documents.")
T0 = {"max_tokens": 10, "temperature": 0, "logprobs": 2, "ignore_eos": True}


def rag(docs, question="Which document is about a king?"):
    return gen(seq(SYS, plus(*docs), user(question)), **T0)


def result(out):
    assert out.finish_reason != "error", out.error
    return out.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]


def run(llm, *queries):
    return [result(o) for o in llm.span_queries(list(queries))]


def cold(llm, query):
    llm.engine.spans.cache.clear()
    return run(llm, query)[0]


def no_leaks(llm):
    llm.engine.spans.cache.clear()
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.fixture(scope="module", params=sorted({DEFAULT, "float32"}))
def llm(request) -> LLM:
    # 64-token steps: operands, prefixes and tails are computed in chunks, batched together
    return LLM(dtype=request.param, max_num_batched_tokens=64, num_blocks=96)


def test_plus_is_order_free_and_a_hit_equals_a_miss(llm):
    miss = cold(llm, rag(DOCS[:3]))
    out = llm.span_queries(rag([DOCS[2], DOCS[0], DOCS[1]]))[0]  # permuted: every state is a hit
    assert result(out) == miss
    usage = out.metrics["spans"]["usage"]
    assert usage["reused_tokens"] == usage["prompt_tokens"] - len(llm.engine.spans.renderer.generation_prompt())
    assert cold(llm, rag([DOCS[1], DOCS[2], DOCS[0]])) == miss  # permuted and cold
    no_leaks(llm)


def test_operands_reused_at_new_positions_equal_a_cold_run(llm):
    llm.engine.spans.cache.clear()
    run(llm, rag(DOCS[:2]))
    warm = llm.span_queries(rag([DOCS[3], DOCS[1], DOCS[0]]))[0]
    usage = warm.metrics["spans"]["usage"]
    assert usage["reused_tokens"] > 0 and usage["repositioned_tokens"] > 0
    assert result(warm) == cold(llm, rag([DOCS[3], DOCS[1], DOCS[0]]))
    no_leaks(llm)


def test_a_plus_differs_from_the_plain_prompt(llm):
    """Operands do not attend to each other: the span output is not the plain prompt's."""
    _, plan = llm.engine.spans.plan(rag(DOCS[:3]))
    ids = [t for s in plan.segments for t in (s.ids if isinstance(s, Piece) else
                                             [u for o in s.operands for u in o.segments[0].ids])]
    ids += list(plan.gen.prompt)
    plain = llm.generate([ids], SamplingParams(**T0))[0]
    span = llm.span_queries(rag(DOCS[:3]))[0]
    assert [lp.logprob for lp in span.logprobs] != [lp.logprob for lp in plain.logprobs]
    no_leaks(llm)


def test_inner_gens_feed_the_judge_and_equal_plain_requests(llm):
    llm.engine.spans.cache.clear()
    inner = [gen(user(q), max_tokens=6, temperature=0) for q in ("Name a colour.", "Name a fruit.")]
    judge = gen(seq(SYS, plus(*inner), user("Repeat both answers.")), **T0)
    first = llm.span_queries(judge)[0]
    texts = {i["path"]: i["text"] for i in first.metrics["spans"]["inner"]}
    assert len(texts) == 2
    # each inner gen saw exactly the shared prefix and its own input: a plain request on those ids
    renderer, sys_ids = llm.engine.spans.renderer, llm.engine.spans.renderer.text(SYS)
    for q in inner:
        ids = list(renderer.bos) + list(sys_ids) + list(renderer.text(q.input)) + list(renderer.generation_prompt())
        plain = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
        assert plain.text in texts.values()
    again = llm.span_queries(judge)[0]  # greedy inner outputs are cached: the whole judge is a hit
    assert result(again) == result(first)
    assert again.metrics["spans"]["usage"]["computed_tokens"] < first.metrics["spans"]["usage"]["computed_tokens"]
    no_leaks(llm)


def test_sampled_inner_gens_are_not_cached(llm):
    llm.engine.spans.cache.clear()
    q = gen(seq(SYS, plus(gen(user("Say a word."), max_tokens=4, temperature=0.8), DOCS[0]), user("Go.")), **T0)
    a = llm.span_queries(q)[0].metrics["spans"]["usage"]
    b = llm.span_queries(q)[0].metrics["spans"]["usage"]
    assert b["computed_tokens"] >= 8  # the sampled inner gen ran again (its span is not reused)
    assert a["prompt_tokens"] > 0
    no_leaks(llm)


def test_concurrent_span_queries_and_requests_are_batch_invariant(llm):
    queries = [rag(DOCS[:2]), rag(DOCS[1:4], "Which is about birds?"), rag([DOCS[0], DOCS[3]], "When?")]
    alone = [cold(llm, q) for q in queries]
    plain_alone = llm.generate(["The capital of France is"], SamplingParams(**T0))[0]
    llm.engine.spans.cache.clear()
    engine = llm.engine
    for i, q in enumerate(queries):
        engine.spans.submit(f"together-{i}", q)
    engine.add_request("plain", "The capital of France is", SamplingParams(**T0))
    done = engine.run_to_completion([f"together-{i}" for i in range(3)] + ["plain"])
    assert [result(done[f"together-{i}"]) for i in range(3)] == alone
    assert result(done["plain"]) == result(plain_alone)
    no_leaks(llm)


def test_bad_queries_fail_before_any_work(llm):
    spans, pool = llm.engine.spans, llm.engine.pool
    free = pool.num_free
    for bad, words in [
        (seq(user("x")), "root must be a gen or chat node, got seq"),  # named as sent: it said "user"
        (gen(seq(user("q"), ir.retrieve("nope", "1")), max_tokens=2), "unknown corpus 'nope'"),
        (gen(user("x " * 9000), max_tokens=2), "the context is"),
        (gen(seq(SYS, plus(fragment("word " * 500), fragment("other " * 500))), max_tokens=2), "KV cache holds"),
    ]:
        with pytest.raises(InvalidRequestError, match=words):
            spans.submit("bad", bad)
    with pytest.raises(InvalidRequestError, match="locality_k"):
        spans.submit("bad", rag(DOCS[:2]), locality_k=1)
    assert pool.num_free == free and not spans.has_work()
    for wrapped in (seq(gen(user("Hi"), max_tokens=2, temperature=0)), plus(gen(user("Hi"), max_tokens=2, temperature=0))):
        spans.plan(wrapped)  # a one-child seq or plus around a gen unwraps to it and runs (review)


def test_retrieve_equals_explicit_fragments(llm):
    llm.engine.spans.add_corpus("docs", {f"d{i}": d.text for i, d in enumerate(DOCS)})
    q = gen(seq(SYS, ir.retrieve("docs", "d2", "d0"), user("Which document is about a king?")), **T0)
    assert run(llm, q)[0] == cold(llm, rag([DOCS[0], DOCS[2]]))
    with pytest.raises(InvalidRequestError, match="no fragment"):
        llm.engine.spans.submit("bad", gen(ir.retrieve("docs", "zz")))
    no_leaks(llm)


def test_abort_while_spans_compute_frees_everything(llm):
    llm.engine.spans.cache.clear()
    engine = llm.engine
    engine.spans.submit("gone", rag(DOCS))
    engine.step()
    assert engine.abort("gone")
    outs = engine.step()
    assert any(o.request_id == "gone" and o.finish_reason == "abort" for o in outs)
    assert not engine.spans.has_work()
    no_leaks(llm)


def test_locality_k_runs_a_tree_of_judges(llm):
    inner = [gen(user(f"Say the name number {i}."), max_tokens=3, temperature=0) for i in range(4)]
    q = gen(seq(SYS, plus(*inner), user("List the names.")), max_tokens=6, temperature=0)
    info = llm.engine.spans.explain(q, locality_k=2)
    assert sum(1 for r in info["layout"] if r["kind"] == "gen") == 6  # 2 judges over 2 gens each
    out = llm.span_queries(q, locality_k=2)[0]
    assert out.finish_reason != "error" and len(out.metrics["spans"]["inner"]) == 6
    no_leaks(llm)


def test_cache_pressure_moves_spans_to_the_host_then_drops_them_and_every_query_finishes():
    # 1,280 tokens: one query (50 blocks) and a few cached notes; a host tier of ~3 note states
    llm = LLM(dtype="float32", num_blocks=80, span_host_bytes=12 << 20)
    docs = [fragment(f"Note {i}: " + " ".join(f"item{i}-{j}" for j in range(30)) + "\n") for i in range(10)]
    outs = llm.span_queries([gen(seq(SYS, plus(docs[i], docs[(i + 1) % 10]), user("Sum up.")), max_tokens=4,
                                 temperature=0) for i in range(10)])
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    cache = llm.engine.spans.cache
    assert cache.stats.offloads > 0 and cache.stats.evictions > 0 and cache.host_used <= 12 << 20
    no_leaks(llm)
    assert cache.host_used == 0 and cache.host_entries() == 0


def test_a_hit_restored_from_the_host_equals_a_hit_in_the_pool(llm):
    spans = llm.engine.spans
    warm = run(llm, rag(DOCS[:3]))  # computed and cached, in the pool
    cached = len(spans.cache)
    assert sum(1 for s in spans.cache._entries.values() if s.assembled) == 1  # the plus: dropped, not copied
    assert spans.cache.trim(llm.engine.pool.num_blocks + 1) == cached  # every state leaves the pool
    assert spans.cache.held_blocks() == 0 and spans.cache.host_entries() == cached - 1
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
    restores = spans.cache.stats.restores
    out = llm.span_queries(rag(DOCS[:3]))[0]
    assert result(out) == warm[0] and spans.cache.stats.restores > restores
    usage = out.metrics["spans"]["usage"]  # the plus re-assembled, the question restored onto it
    r = spans.renderer
    assert usage["reused_tokens"] >= sum(len(r.text(d)) for d in DOCS[:3] + [user("Which document is about a king?")])
    assert usage["computed_tokens"] == max(len(r.generation_prompt()), 1)
    spans.cache.trim(llm.engine.pool.num_blocks + 1)
    # operands restored and placed at new positions equal a cold run
    assert run(llm, rag(DOCS[1:4])) == [cold(llm, rag(DOCS[1:4]))]
    no_leaks(llm)


def test_a_prepared_corpus_is_a_hit_for_queries_after_its_prefix(llm):
    llm.engine.spans.cache.clear()
    spans = llm.engine.spans
    spans.add_corpus("prep", {f"d{i}": d.text for i, d in enumerate(DOCS)})
    spans.prepare("prep-1", "prep", SYS)
    out = llm.engine.run_to_completion(["prep-1"])["prep-1"]
    assert out.finish_reason == "stop" and out.metrics["spans"]["usage"]["computed_tokens"] > 0
    q = gen(seq(SYS, ir.retrieve("prep", "d3", "d1")), **T0)
    usage = llm.span_queries(q)[0].metrics["spans"]["usage"]
    doc_tokens = sum(len(spans.renderer.text(DOCS[i])) for i in (1, 3))
    assert usage["reused_tokens"] >= doc_tokens  # both fragments (and the prefix) were ready
    with pytest.raises(InvalidRequestError, match="unknown corpus"):
        spans.prepare("prep-2", "nope")
    no_leaks(llm)


def test_a_corpus_with_a_bad_fragment_is_not_changed(llm):
    spans = llm.engine.spans
    spans.add_corpus("keep", {"a": "short text"})
    with pytest.raises(InvalidRequestError, match="'big' has"):
        spans.add_corpus("keep", {"b": "fine", "big": "word " * 9000})
    with pytest.raises(InvalidRequestError):
        spans.add_corpus("fresh", {"big": "word " * 9000})
    assert spans.corpora["keep"] == {"a": "short text"} and "fresh" not in spans.corpora
    with pytest.raises(InvalidRequestError, match="'e' is empty"):  # found by the API fuzzer: its prepare hung
        spans.add_corpus("keep", {"e": ""})
    assert spans.corpora["keep"] == {"a": "short text"}
