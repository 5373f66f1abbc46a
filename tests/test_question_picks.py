"""A question's rows under a read policy read alike in any chunking (``streamkv.attention.picks``):
each row ranks the question's candidate pages with its own query, the answer reuses what the
question's last rows chose together (``rescore`` false), and a replay (a recompute after a
preemption) chooses again the same; checked bit for bit on the invariant backend."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from streamkv.attention.backend import KVCache, SeqSpan, make_backend
from streamkv.attention.picks import WINDOW
from streamkv.policies import QuestPolicy

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
        share = policy.row_scores(q, be.cache.bounds.data[layer].index_select(0, pages), DIM ** -0.5)
        assert picks[layer] == share.amax(0).topk(plan.keep).indices.sort().values.tolist()
        assert picks[layer] != share[-1].topk(plan.keep).indices.sort().values.tolist()
