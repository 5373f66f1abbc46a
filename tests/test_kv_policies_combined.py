"""KV policies together and on streaming inputs (embedded model, bf16 by default):

* ``kv_write`` + ``kv_read`` on one request: the read policy picks pages among the rows the
  write policy kept, its ring always read; outputs bit-identical batched, chunked and after
  preemption by recompute or swap;
* a read policy's answer rows never reach the prefix cache (they attended to some pages only);
* a streaming input's policies apply at finish: the answer and the report equal a fresh
  request's with the same policies on the final prompt, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from streamkv import LLM, SamplingParams
from streamkv.attention.backend import KVCache, SeqSpan
from streamkv.attention.selection import LayerSelector
from streamkv.policies.read import QuestPolicy
from tests.test_kv_write import _doc  # the same long records prompt

SNAP = {"policy": "snapstream", "budget_tokens": 128, "sink_tokens": 16, "window_tokens": 64,
        "observation_tokens": 16}
QUEST = {"policy": "quest", "budget_tokens": 160, "sink_tokens": 16, "recent_tokens": 32}
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


def _result(out) -> tuple:
    return out.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]


def _report(out) -> dict:
    return {k: v for k, v in out.kv.items() if k != "compress_ms"}


def _quest(rescore: bool) -> dict:
    return {**QUEST, "rescore": rescore}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_batched_tokens=256, num_blocks=160, block_size=16)


@pytest.fixture(scope="module")
def solo(llm) -> dict[bool, list[tuple]]:
    """Each document alone with both policies, per ``rescore``."""
    llm.engine.pool.reset_prefix_cache()
    return {r: [_result(llm.generate([_doc(i)], PARAMS, kv_write=SNAP, kv_read=_quest(r))[0]) for i in range(3)]
            for r in (True, False)}


# ----------------------------------------------------------------------------- both on one request
def test_a_compressed_span_reads_its_whole_ring_and_picks_among_the_kept_rows():
    """Rows [S | K | ring]: whatever the queries, every ring row (the new one included, written
    in the middle of the ring) is read; the pages compete among the kept rows before it."""
    bs, sink, kept, window = 4, 4, 32, 24  # ring rows 36..59, the new row at 41
    cache = KVCache(1, 32, bs, 1, 8, torch.bfloat16)
    cache.k.normal_()
    policy = QuestPolicy(budget_tokens=48, sink_tokens=4, recent_tokens=8, rescore=True)
    table = tuple(range(3, 3 + 15))
    rows = sink + kept + window
    span = SeqSpan(0, 1, 5000, table, policy, seq_id=1, rows=rows, write_row=41, ring_from=sink + kept)
    slots = torch.tensor([table[r // bs] * bs + r % bs for r in range(rows)])
    selector = LayerSelector.build([span], [slots], cache, 0.35, {})
    assert selector is not None
    for seed in range(5):
        q = torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(seed))
        (out,), (compact,) = selector.for_layer(0, q)
        read = set(compact.tolist())
        assert set(slots[sink + kept:].tolist()) <= read and int(slots[41]) in read  # the ring, the new row
        assert set(slots[:sink].tolist()) <= read and len(read) == compact.numel() == 48
        assert out.ctx_len == 48


def test_picks_kept_from_before_the_ring_are_dropped_when_it_starts():
    """A policy that does not re-score remembers the pages it picked; a prompt shorter than the
    write policy's capacity starts its ring during decode, with a new plan: pick again."""
    bs, rows, ring_from = 4, 60, 36
    cache = KVCache(1, 32, bs, 1, 8, torch.bfloat16)
    cache.k.normal_()
    policy = QuestPolicy(budget_tokens=48, sink_tokens=4, recent_tokens=8, rescore=False)
    table = tuple(range(3, 3 + 15))
    slots = torch.tensor([table[r // bs] * bs + r % bs for r in range(rows)])
    memory: dict = {}
    before = SeqSpan(0, 1, 58, table, policy, seq_id=1)  # 59 rows, no ring yet: tail from row 50
    LayerSelector.build([before], [slots[:59]], cache, 0.35, memory).for_layer(0, torch.randn(1, 1, 8))
    assert memory[1].plan.tail == 12
    ring = SeqSpan(0, 1, 70, table, policy, seq_id=1, rows=rows, write_row=40, ring_from=ring_from)
    selector = LayerSelector.build([ring], [slots], cache, 0.35, memory)
    (_,), (compact,) = selector.for_layer(0, torch.randn(1, 1, 8))
    assert memory[1].plan.tail == ring_from // bs and set(slots[ring_from:].tolist()) <= set(compact.tolist())


def test_both_policies_report_and_repeat_batched_and_chunked(llm, solo):
    chunked = LLM(max_num_batched_tokens=256, max_chunk_tokens=40, num_blocks=160, enable_prefix_caching=False)
    for rescore in (True, False):
        outs = llm.generate([_doc(i) for i in range(3)], PARAMS, kv_write=SNAP, kv_read=_quest(rescore))
        assert [_result(o) for o in outs] == solo[rescore]
        kv = outs[0].kv
        assert kv["compressed"] and kv["tokens_kept"] == 16 + 128 + 64 < kv["tokens_seen"]
        assert kv["read"]["policy"] == "quest" and kv["tokens_read_per_step"] == 160 < kv["tokens_kept"]
        if rescore:  # every row ranks its candidates and picks a few
            assert kv["pages_scored"] > kv["pages_picked"] > 0
        else:  # the first answer row ranks them; the rest reuse its picks
            assert 0 < kv["pages_scored"] < kv["pages_picked"]
        again = chunked.generate([_doc(i) for i in range(3)], PARAMS, kv_write=SNAP, kv_read=_quest(rescore))
        assert [_result(o) for o in again] == solo[rescore]


def _preempted_mid_answer(engine, kv: dict, n: int, after: int, filler_words: int, filler_tokens: int) -> list:
    """Run ``n`` documents with ``kv`` until each has ``after`` tokens, then add as many
    higher-priority fillers, which take the pool from them mid-answer; their final outputs
    (at least one of them was preempted)."""
    for i in range(n):
        engine.add_request(f"c{i}", _doc(i), PARAMS, **kv)
    seqs = [engine._requests[f"c{i}"].seq for i in range(n)]
    done = {}
    while any(s.num_output < after and not s.finished for s in seqs):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    filler = SamplingParams(max_tokens=filler_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"f{i}", " ".join(f"w{i}x{j}" for j in range(filler_words)), filler, priority=-1)
    while len(done) < 2 * n:
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    outs = [done[f"c{i}"] for i in range(n)]
    assert sum(o.metrics["num_preemptions"] for o in outs) >= 1
    return outs


@pytest.mark.parametrize("mode,rescore", [("recompute", True), ("swap", False)])
def test_both_policies_survive_preemption(solo, mode, rescore):
    """Higher-priority requests take the pool from the compressed, page-reading ones mid-answer:
    they recompute (prefill, compression, answer rows with their page picks) or swap; same bits."""
    tight = LLM(max_num_batched_tokens=256, num_blocks=72, block_size=16, preemption=mode,
                swap_space=(64 << 20) if mode == "swap" else 0)
    kv = dict(kv_write=SNAP, kv_read=_quest(rescore))
    outs = _preempted_mid_answer(tight.engine, kv, 3, after=4, filler_words=90, filler_tokens=60)
    assert [_result(o) for o in outs] == solo[rescore]
    assert tight.engine.kv.host.num_used == 0
    tight.engine.check_integrity()


FITS = {"policy": "snapstream", "budget_tokens": 1024, "sink_tokens": 16, "window_tokens": 64,
        "observation_tokens": 16}  # capacity 1,104 rows: these prompts fit, nothing is dropped


@pytest.mark.parametrize("kv", [dict(kv_read=_quest(False)), dict(kv_write=FITS, kv_read=_quest(True))],
                         ids=["quest-picks", "fits+quest"])  # (re-scored quest alone takes the same branch)
def test_answers_under_a_read_policy_are_recomputed_row_by_row(llm, kv):
    """Preempted by recompute mid-answer, a request whose answer rows read some pages gets its
    prompt back from the prefix cache (never its answer: those rows are not exact) and then
    recomputes each answer row alone, reading the pages it read before: the same bits, and the
    same report (the recomputed rows' reads were counted again: pages scored grew)."""
    llm.engine.pool.reset_prefix_cache()
    alone = [llm.generate([_doc(i)], PARAMS, **kv)[0] for i in range(2)]
    tight = LLM(max_num_batched_tokens=256, num_blocks=72, block_size=16, preemption="recompute")
    outs = _preempted_mid_answer(tight.engine, kv, 2, after=6, filler_words=120, filler_tokens=40)
    assert [_result(o) for o in outs] == [_result(o) for o in alone]
    assert [_report(o) for o in outs] == [_report(o) for o in alone]
    tight.engine.check_integrity()


SMALL_SNAP = {"policy": "snapstream", "budget_tokens": 32, "sink_tokens": 16, "window_tokens": 32,
              "observation_tokens": 16}  # capacity 80 rows: the ring starts during the answer


@pytest.mark.parametrize("kv_write", [None, SMALL_SNAP], ids=["read", "write+read"])
def test_picks_taken_late_in_the_answer_are_not_reused_by_its_recomputed_early_rows(kv_write):
    """A short prompt: the first answer rows read every page and remember nothing; the picks are
    taken at a later row (or when the ring starts). Preempted by recompute, the replayed early
    answer rows reused those picks, whose regions reach past their context: the step failed
    every request in it, or read other pages (review). Picks now name the row that took them."""
    quest = {"policy": "quest", "budget_tokens": 64, "sink_tokens": 16, "recent_tokens": 16, "rescore": False}
    params = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = "Record 1. item3 weighs 4 kg; item9 weighs 2 kg; which?"
    small = LLM(max_num_batched_tokens=256, num_blocks=64, block_size=16, preemption="recompute",
                enable_prefix_caching=False)
    solo = small.generate([prompt], params, kv_write=kv_write, kv_read=quest)[0]
    engine = small.engine
    engine.add_request("x", prompt, params, kv_write=kv_write, kv_read=quest)
    seq = engine._requests["x"].seq
    while seq.num_output < 60:
        engine.step()
    assert engine.bundle.runner.backend.picks  # remembered, taken after the first answer row
    engine.scheduler._preempt(seq)  # what pool pressure does to it
    out = engine.run_to_completion(["x"])["x"]
    assert out.finish_reason == "length" and _result(out) == _result(solo)
    engine.check_integrity()


def test_a_read_policy_answer_never_enters_the_prefix_cache(llm):
    """The answer rows attended to some pages only: a later exact request whose prompt is that
    prompt + answer hits the prompt's blocks, never the answer's, and is exact."""
    engine = llm.engine
    engine.pool.reset_prefix_cache()
    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    first = llm.generate([_doc(5)], long, kv_read=_quest(True))[0]
    ids = list(first.prompt_token_ids) + list(first.token_ids)
    hit = llm.generate([ids], PARAMS)[0]
    assert 0 < hit.num_cached_tokens <= len(first.prompt_token_ids)
    engine.pool.reset_prefix_cache()
    assert _result(hit) == _result(llm.generate([ids], PARAMS)[0])
    engine.check_integrity()


# ----------------------------------------------------------------------------- streaming inputs
@pytest.mark.parametrize("kv", [dict(kv_write=SNAP), dict(kv_read=_quest(True)),
                                dict(kv_write=SNAP, kv_read=_quest(False))],
                         ids=["write", "read", "both"])
def test_a_streaming_input_applies_its_policies_at_finish(llm, kv):
    """Appends (prefilled as they arrive, past the observed rows) and an update, then finish:
    the same answer and report as a fresh request with the same policies on the final prompt."""
    engine = llm.engine
    text = _doc(7, words=300)
    cuts = [0, 300, 800, 1400, len(text)]
    h = llm.open_input(text[:cuts[1]], PARAMS, **kv)
    h.advance()
    for a, b in zip(cuts[1:], cuts[2:]):
        h.append(text[a:b])
        h.advance()
    seq = engine.inputs.get(h.request_id).seq
    assert seq.num_computed == len(seq.tokens) - 1 and seq.write is None and seq.read is None  # exact so far
    final = text + " Answer briefly."
    h.update(final)
    out = h.result()
    engine.pool.reset_prefix_cache()
    fresh = llm.generate([final], PARAMS, **kv)[0]
    assert _result(out) == _result(fresh)
    assert _report(out) == _report(fresh)
    if "kv_write" in kv:
        assert out.kv["compressed"] and out.kv["tokens_kept"] == 16 + 128 + 64
    plain = llm.open_input(text[:cuts[1]], PARAMS)  # same changes without policies: same invalidation count
    plain.advance()
    for a, b in zip(cuts[1:], cuts[2:]):
        plain.append(text[a:b])
        plain.advance()
    plain.update(final)
    assert plain.result().metrics["tokens_invalidated"] == out.metrics["tokens_invalidated"]
    engine.check_integrity()


def test_a_streaming_input_refuses_a_bad_policy_at_open(llm):
    from streamkv.errors import InvalidRequestError

    open_before = llm.engine.inputs.num_open
    with pytest.raises(InvalidRequestError, match="kv_write"):
        llm.open_input("some text", PARAMS, kv_write={"policy": "snapstream", "budget_tokens": -1})
    with pytest.raises(InvalidRequestError, match="kv_read"):
        llm.open_input("some text", PARAMS, kv_read={"policy": "quest", "budget_tokens": 8})
    assert llm.engine.inputs.num_open == open_before and not llm.engine.has_unfinished()
