"""A question's rows under a read policy read alike in any chunking (``streamkv.attention.picks``):
each row ranks the question's candidate pages with its own query, the answer reuses what the
question's last rows chose together (``rescore`` false), and a replay (a recompute after a
preemption) chooses again the same; checked bit for bit on the invariant backend."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from streamkv.attention.backend import KVCache, SeqSpan, make_backend
from streamkv.attention.picks import WINDOW, question_rows
from streamkv.native import page_shares
from streamkv.policies import QuestPolicy, SpanSlots

BS, LAYERS, KVH, HEADS, DIM = 16, 2, 2, 4, 32
START, QUESTION, ANSWER = 600, 40, 3  # question rows [600, 640) (longer than the recent window, and
#                                     than WINDOW), then 3 answer rows
END = START + QUESTION


def _inputs() -> dict:
    g = torch.Generator().manual_seed(11)
    n = END + ANSWER - START
    return {"k0": torch.randn(LAYERS, 70 * BS, KVH, DIM, generator=g).bfloat16(),
            "q": torch.randn(LAYERS, n, HEADS, DIM, generator=g).bfloat16(),
            "kv": torch.randn(LAYERS, n, KVH, DIM, generator=g).bfloat16(),
            "table": tuple(int(b) for b in torch.randperm(70, generator=g))}


def _run(be, x: dict, policy: QuestPolicy, cuts: list[int]) -> tuple[torch.Tensor, dict]:
    """The question in chunks cut at ``cuts``, then the answer row by row: every row's output
    per layer [LAYERS, rows, H, D], and the picks the answer reused."""
    bounds = sorted({START, END, *cuts})
    steps = list(zip(bounds, bounds[1:])) + [(p, p + 1) for p in range(END, END + ANSWER)]
    out = torch.empty(LAYERS, END + ANSWER - START, HEADS, DIM)
    for a, b in steps:
        span = SeqSpan(0, b - a, a, x["table"], policy, seq_id=5, num_prompt=END, policy_from=START)
        meta = be.prepare([span], b - a)
        for layer in range(LAYERS):
            rows = slice(a - START, b - START)
            out[layer, rows] = be.forward(layer, x["q"][layer, rows], x["kv"][layer, rows], x["kv"][layer, rows],
                                          meta).float()
    picks = be.picks.get(5)
    return out, ({k: v.tolist() for k, v in picks.layers.items()} if picks is not None else {})


def _backend(x: dict):
    cache = KVCache(LAYERS, 70, BS, KVH, DIM, torch.bfloat16)
    cache.k.copy_(x["k0"].view_as(cache.k))
    cache.v.copy_(x["k0"].view_as(cache.v).flip(1))
    try:
        return make_backend("cpu", cache, DIM ** -0.5)
    except RuntimeError:
        pytest.skip("native kernels unavailable")


X = _inputs()


@pytest.mark.parametrize("rescore", [False, True])
@settings(max_examples=12, deadline=None)
@given(cuts=st.lists(st.integers(START + 1, END - 1), max_size=6), replay=st.lists(st.integers(START + 1, END - 1),
                                                                                   max_size=4))
def test_a_question_reads_alike_in_any_chunking_and_replays_alike(rescore, cuts, replay):
    policy = QuestPolicy(budget_tokens=256, sink_tokens=16, recent_tokens=16, rescore=rescore)
    whole, whole_picks = _run(_backend(X), X, policy, [])
    be = _backend(X)
    chunked, chunked_picks = _run(be, X, policy, cuts)
    assert torch.equal(chunked, whole)
    assert chunked_picks == whole_picks and bool(whole_picks) == (not rescore)
    again, again_picks = _run(be, X, policy, replay)  # a recompute: the remembered picks are taken again
    assert torch.equal(again, whole) and again_picks == whole_picks


def test_the_answer_reads_the_pages_the_window_chose_not_the_last_rows():
    """The answer's picks are each page's best share over the window's rows (here: the
    question's last WINDOW rows), so they differ from the picks of its last row alone."""
    policy = QuestPolicy(budget_tokens=256, sink_tokens=16, recent_tokens=16)
    be = _backend(X)
    _, picks = _run(be, X, policy, [END - 1])
    plan = policy.plan(START, END, BS)
    pages = torch.tensor(X["table"][plan.sink:plan.tail])
    for layer in range(LAYERS):
        q = X["q"][layer, QUESTION - WINDOW:QUESTION].view(WINDOW, KVH, -1, DIM)
        share = policy.row_scores(q, be.cache.bounds.data[layer], pages, DIM ** -0.5)
        assert picks[layer] == share.amax(0).topk(plan.keep).indices.sort().values.tolist()
        assert picks[layer] != share[-1].topk(plan.keep).indices.sort().values.tolist()


@pytest.mark.skipif(page_shares() is None, reason="no C compiler: native page scoring not built")
@pytest.mark.parametrize("rows, kv_heads, group, dim", [(1, 3, 3, 64), (31, 3, 3, 64), (6, 3, 1, 32), (9, 2, 4, 48),
                                                       (2, 6, 3, 128)])
def test_native_row_shares_are_each_rows_own_and_pick_what_torch_picks(rows, kv_heads, group, dim):
    """``page_shares`` (C): a row's shares are the same bits alone, in a batch or split, and
    each row's best pages are those the torch definition (``score_pages`` of that row) ranks best."""
    g = torch.Generator().manual_seed(rows * 1000 + kv_heads * 100 + dim)
    mid, rad = torch.randn(300, kv_heads, dim, generator=g), torch.rand(300, kv_heads, dim, generator=g)
    bounds = torch.cat([mid + rad, mid - rad], dim=-1).bfloat16()
    candidates = torch.randperm(300, generator=g)[:180]
    q = torch.randn(rows, kv_heads, group, dim, generator=g).bfloat16()
    shares = page_shares()
    full = shares(q, bounds, candidates, 0.125)[0]
    assert torch.equal(full, torch.cat([shares(q[i:i + 1], bounds, candidates, 0.125)[0] for i in range(rows)]))
    cut = rows // 2
    assert torch.equal(full, torch.cat([shares(q[:cut], bounds, candidates, 0.125)[0],
                                        shares(q[cut:], bounds, candidates, 0.125)[0]]))
    policy = QuestPolicy()
    ref = torch.stack([policy.score_pages(q[i:i + 1], bounds.index_select(0, candidates), 0.125) for i in range(rows)])
    want = ref.topk(40, dim=-1).indices.sort(dim=-1).values
    # with keep: the kernel's picks, and each row's compacted slots (sinks, its pages, the tail up to its row)
    slots = SpanSlots(torch.arange(2 * BS + 180 * BS + 30 + rows) * 3, 2 * BS, 2 * BS + 180 * BS, BS)
    span = SeqSpan(0, rows, slots.full.numel() - rows, ())
    share, picked, flat = policy.rows_compact(q, bounds, candidates, 40, 0.125, slots, 31)
    assert torch.equal(share, full) and torch.equal(picked, want)
    assert [s.tolist() for s in question_rows(span, slots, picked, flat)[1]] == \
        [s.tolist() for s in question_rows(span, slots, want)[1]]


@pytest.mark.parametrize("rescore", [False, True])
def test_a_question_preempted_mid_way_answers_and_reports_as_alone(smol_fp32, rescore):
    """On the embedded model, a session question under quest asked in chunks of 5, preempted by
    recompute 15 rows in and replayed in chunks of 16 (as adaptive chunks may): the same bits
    and the same read report as alone (the replayed rows' reads are not counted again)."""
    from dataclasses import replace

    from streamkv import SamplingParams
    from streamkv.sessions.spec import SessionSpec

    engine = smol_fp32.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    policy = {"policy": "quest", "budget_tokens": 256, "sink_tokens": 32, "recent_tokens": 64, "rescore": rescore}
    session = engine.sessions.create(SessionSpec(system="Answer from the data.", retention_tokens=4000, kv_read=policy))
    engine.sessions.push(session.id, [f"sensor {i % 7} reading {(i * 37) % 1000} at t={i}" for i in range(80)])
    while engine.has_unfinished():
        engine.step()
    question = ("Across every sensor listed above, what was the reading of sensor 3 at t=38, and which sensor "
                "reported the largest reading near the end of the data?")
    config = engine.scheduler.config

    def ask(rid: str, preempt_at: int | None):
        engine.scheduler.config = replace(config, max_chunk_tokens=5)
        engine.sessions.query(session.id, rid, question, params)
        seq = engine._requests[rid].seq
        if preempt_at is not None:
            while seq.num_computed - seq.read_from < preempt_at:
                engine.step()
            assert seq.num_computed < seq.num_prompt_tokens  # mid-question
            engine.scheduler._preempt(seq)
            engine.scheduler.config = replace(config, max_chunk_tokens=16)
        out = engine.run_to_completion([rid])[rid]
        return out.token_ids, [lp.logprob for lp in out.logprobs], out.kv, out.metrics["num_preemptions"]

    try:
        alone, again = ask("alone", None), ask("again", 15)
    finally:
        engine.scheduler.config = config
        engine.sessions.delete(session.id)
    assert again[3] == 1 and alone[3] == 0
    assert again[:3] == alone[:3]
    engine.check_integrity()
