"""Read-time KV policies: validation, page plans, page bounds, the native scorer against the
torch one, and attention over the picked pages against a float64 reference, per backend."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from streamkv.attention.backend import KVCache, SeqSpan, make_backend
from streamkv.attention.torch_ref import span_slots
from streamkv.kv.bounds import PageBounds
from streamkv.native import page_bounds, page_select
from streamkv.policies import QuestPolicy, RecentPolicy, SpanSlots, make_read_policy
from streamkv.runner.kv_ops import KVOps

BS = 16


# ----------------------------------------------------------------------------- hyper-parameters
def test_policies_are_built_and_validated_from_json_objects():
    p = make_read_policy({"policy": "quest", "budget_tokens": 512, "sink_tokens": 16, "recent_tokens": 64})
    assert p == QuestPolicy(budget_tokens=512, sink_tokens=16, recent_tokens=64)
    assert make_read_policy(p.to_dict()) == p
    assert make_read_policy({"policy": "recent"}) == RecentPolicy()
    assert make_read_policy(None) is None
    bad = [{"policy": "nope"}, {"budget_tokens": 5}, {"policy": "quest", "budget_tokens": -1},
           {"policy": "quest", "budget_tokens": 100, "recent_tokens": 256}, {"policy": "quest", "window": 3},
           {"policy": "quest", "budget_tokens": "1024"}, {"policy": "recent", "rescore": 1}, "quest",
           {"policy": "quest", "budget_tokens": 10**30}, {"policy": "recent", "sink_tokens": 2**24 + 1}]
    for spec in bad:  # every message names the field (a session spec's 400 takes its param from it)
        with pytest.raises(ValueError, match="^kv_read"):
            make_read_policy(spec)


def test_a_session_spec_keeps_its_policy_through_persistence():
    from streamkv.sessions.spec import SessionSpec

    spec = SessionSpec(kv_read={"policy": "quest", "budget_tokens": 512})
    assert isinstance(spec.kv_read, QuestPolicy)
    assert SessionSpec(**spec.to_dict()) == spec
    assert SessionSpec().kv_read is None and SessionSpec(**SessionSpec().to_dict()).kv_read is None


def test_page_plan_keeps_sinks_and_the_tail_holding_the_new_rows():
    p = QuestPolicy(budget_tokens=256, sink_tokens=32, recent_tokens=64)
    plan = p.plan(start=990, ctx_len=1000, block_size=BS)
    # sinks: blocks 0-1; tail from the block of min(990, 1000 - 64) = 936 -> block 58; 63 blocks
    assert (plan.sink, plan.tail) == (2, 58)
    assert plan.keep == 256 // BS - 2 - (63 - 58)
    long_chunk = p.plan(start=500, ctx_len=1000, block_size=BS)  # a long chunk: its rows stay in the tail
    assert long_chunk.tail == 500 // BS
    assert p.plan(start=200, ctx_len=250, block_size=BS) is None  # everything fits the budget
    assert RecentPolicy(sink_tokens=16, recent_tokens=32).plan(990, 1000, BS).keep == 0


# ----------------------------------------------------------------------------- page bounds
@settings(max_examples=25, deadline=None)
@given(writes=st.lists(st.tuples(st.integers(0, 31), st.integers(1, 40)), min_size=1, max_size=6),
       seed=st.integers(0, 2 ** 16))
def test_page_bounds_bound_every_key_after_writes_and_copies(writes, seed):
    """Invariant: for every fresh block and any q, q . k <= [q+ | q-] . bounds (all layers)."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(2, 32, BS, 2, 8, torch.bfloat16)
    bounds = cache.page_bounds()
    ops = KVOps(cache, None)
    for start_block, n in writes:
        slots = torch.arange(start_block * BS, min(32 * BS, start_block * BS + n))
        cache.k[:, slots] = torch.randn(2, slots.numel(), 2, 8, generator=g).bfloat16()
        cache.written(slots)
        bounds.refresh(torch.arange(32))
        ops.copy(slots, (slots + 5 * BS) % (32 * BS))  # a move marks its destination stale
        assert not bounds.fresh[((slots + 5 * BS) % (32 * BS)) // BS].any()
    bounds.refresh(torch.arange(32))
    keys = cache.k.view(2, 32, BS, 2, 8).float()
    q = torch.randn(64, 8, generator=g)
    hi, lo = bounds.data.float().split(8, dim=-1)                         # [L, blocks, kvh, 8]
    upper = (q.clamp(min=0)[:, None, None, None] * hi + q.clamp(max=0)[:, None, None, None] * lo).sum(-1)
    dots = torch.einsum("qd,lbthd->qlbth", q, keys).amax(dim=3)          # best key per block
    assert (dots <= upper + 1e-4).all()


# ----------------------------------------------------------------------------- scoring
def _bounds(n_blocks: int, kvh: int, dim: int, g: torch.Generator) -> torch.Tensor:
    mid = torch.randn(n_blocks, kvh, dim, generator=g)
    rad = torch.rand(n_blocks, kvh, dim, generator=g)
    return torch.cat([mid + rad, mid - rad], dim=-1).bfloat16()


@pytest.mark.skipif(page_select() is None, reason="no C compiler: native page selection not built")
@pytest.mark.parametrize("rows, kv_heads, group, dim", [(1, 3, 3, 64), (5, 3, 3, 64), (29, 3, 3, 64), (1, 3, 1, 16),
                                                       (1, 3, 4, 48), (2, 3, 2, 32), (1, 3, 3, 128), (1, 6, 3, 64)])
def test_native_selection_equals_the_torch_definition(rows, kv_heads, group, dim):
    """With up to 4 rows per kv head (a decode row's group) and head_dim <= 64 the kernel puts
    pages in vector lanes (every head's rows in one softmax pass while they fit 16 lanes: not
    6 heads x 3), otherwise rows; either way it must pick what torch picks."""
    g = torch.Generator().manual_seed(rows * 1000 + kv_heads * 300 + group * 100 + dim)
    bounds = _bounds(300, kv_heads, dim, g)
    candidates = torch.randperm(300, generator=g)[:180].sort().values
    q = torch.randn(rows, kv_heads, group, dim, generator=g).bfloat16()
    policy = QuestPolicy()
    ref = super(QuestPolicy, policy).select(q, bounds, candidates, 40, 0.125)
    assert torch.equal(policy.select(q, bounds, candidates, 40, 0.125), ref)
    slots = SpanSlots(torch.arange(7 * BS + 180 * BS + 20) * 3, 7 * BS, 7 * BS + 180 * BS, BS)
    compact, picked = policy.compact(q, bounds, candidates, 40, 0.125, slots)
    assert torch.equal(picked, ref) and torch.equal(compact, slots.gather(ref))


@pytest.mark.skipif(page_select() is None, reason="no C compiler: native page selection not built")
def test_native_selection_breaks_ties_toward_the_earlier_page():
    """Pages whose bounds are equal score equal bits; the kernel keeps the earlier ones (a rule,
    so a pick never depends on how the scan met them)."""
    g = torch.Generator().manual_seed(5)
    one = _bounds(1, 3, 64, g)
    q = torch.randn(1, 3, 3, 64, generator=g).bfloat16()
    candidates = torch.arange(200)
    same = one.expand(200, -1, -1).contiguous()                          # every page alike
    assert torch.equal(QuestPolicy().select(q, same, candidates, 40, 0.125), torch.arange(40))
    high = torch.cat([one[:, :, :64] + 4, one[:, :, 64:] - 4], dim=-1)  # wider bounds: a higher score
    mixed = same.clone()
    best = torch.randperm(200, generator=g)[:70]
    mixed[best] = high
    picked = QuestPolicy().select(q, mixed, candidates, 40, 0.125)
    assert torch.equal(picked, best.sort().values[:40])


def _page_scorers(tmp_path, builds: dict[str, list[str]]) -> dict:
    """``page_select.c`` alone, built (in parallel) with the native flags plus each build's
    flags, as scorers like ``native.page_select()``."""
    import ctypes
    import functools
    import subprocess

    from streamkv.native import fast_ops, loader as native

    src, built = native._HERE / "page_select.c", native._library().streamkv_page_select
    procs = {name: subprocess.Popen([native._compiler(), *native._FLAGS, *flags, "-shared", str(src), "-o",
                                     str(tmp_path / f"{name}.so"), "-lm"]) for name, flags in builds.items()}
    out = {}
    for name, proc in procs.items():
        assert proc.wait(timeout=120) == 0, name
        fn = ctypes.CDLL(str(tmp_path / f"{name}.so")).streamkv_page_select
        fn.restype, fn.argtypes = built.restype, built.argtypes
        out[name] = functools.partial(fast_ops._select, fn)
    return out


@pytest.mark.skipif(page_select() is None, reason="no C compiler: native page selection not built")
def test_the_avx2_and_scalar_page_scorers_rank_every_page_alike(tmp_path):
    """Without AVX512-BF16 each (page, row) bound is one float32 fma chain over the channels in
    order, written for AVX2 (pages in lanes up to 4 rows, rows in lanes above) and in scalar C:
    both builds must rank every candidate page the same (each keep = 1 .. P picks alike)."""
    from streamkv.native.cpu import has_flag

    if not (has_flag("avx2") and has_flag("fma")):
        pytest.skip("needs an AVX2 + FMA CPU to build both the AVX2 and the scalar scorer")
    scorers = _page_scorers(tmp_path, {"avx2": ["-mno-avx512bf16"], "scalar": ["-mno-avx2", "-mno-fma"]})
    avx2, scalar = scorers["avx2"], scorers["scalar"]
    for rows, kv_heads, group, dim in [(1, 3, 3, 64), (1, 3, 1, 32), (6, 3, 3, 64), (1, 6, 3, 64)]:
        g = torch.Generator().manual_seed(rows * 100 + kv_heads * 10 + dim)
        bounds = _bounds(120, kv_heads, dim, g)
        candidates = torch.randperm(120, generator=g)[:70].sort().values
        q = torch.randn(rows, kv_heads, group, dim, generator=g)
        for keep in range(1, 71):
            want = scalar(q, bounds, candidates, keep, 0.125)[0]
            assert torch.equal(avx2(q, bounds, candidates, keep, 0.125)[0], want), (rows, kv_heads, group, dim, keep)


def test_quest_reads_the_page_that_holds_the_matching_keys():
    """A 'needle' page whose keys align with the query wins over 99 random pages."""
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(100, BS, 2, 32, generator=g) * 0.3
    q = torch.randn(1, 2, 2, 32, generator=g)
    keys[63, 5] = q[0, :, 0] * 2                                 # one token of block 63, both kv heads
    bounds = torch.cat([keys.amax(1), keys.amin(1)], dim=-1).bfloat16()
    picked = QuestPolicy().select(q.bfloat16(), bounds, torch.arange(100), 4, 32 ** -0.5)
    assert 63 in picked.tolist()


# ----------------------------------------------------------------------------- attention
def _reference(q: torch.Tensor, cache: KVCache, layer: int, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64 of q [n, H, D], the last n rows of context ``slots``."""
    k = cache.k[layer, slots].double().repeat_interleave(q.shape[1] // cache.k.shape[2], dim=1)
    v = cache.v[layer, slots].double().repeat_interleave(q.shape[1] // cache.k.shape[2], dim=1)
    n, length = q.shape[0], slots.numel()
    logits = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", logits.softmax(-1), v)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("policy", [QuestPolicy(budget_tokens=256, sink_tokens=16, recent_tokens=48),
                                    QuestPolicy(budget_tokens=256, sink_tokens=16, recent_tokens=48, rescore=True),
                                    RecentPolicy(sink_tokens=32, recent_tokens=40)])
def test_attention_reads_exactly_the_picked_pages(backend, policy):
    """A question chunk then answer rows: each row's output equals float64 attention over the
    slots the selector compacted it to (sinks + picked pages + tail): the question's rows each
    pick their own pages (as they would alone), and the answer's rows reuse the pages its rows
    chose together (each page's best share over them) unless the policy re-scores."""
    torch.manual_seed(0)
    layers, kvh, heads, dim = 2, 2, 4, 32
    cache = KVCache(layers, 128, BS, kvh, dim, torch.bfloat16)
    cache.k.normal_()
    cache.v.normal_()
    try:
        be = make_backend(backend, cache, dim ** -0.5)
    except RuntimeError:
        pytest.skip("native kernels unavailable")
    table = tuple(int(b) for b in torch.randperm(128)[:70])   # a scattered block table
    ctx = 1000
    picks_seen, question_q = {}, {}
    for step, (start, n) in enumerate([(ctx - 12, 12), (ctx, 1), (ctx + 1, 1)]):
        span = SeqSpan(0, n, start, table, policy, seq_id=5, num_prompt=ctx, policy_from=ctx - 12)
        meta = be.prepare([span], n)
        assert meta.selector is not None
        for layer in range(layers):
            q = torch.randn(n, heads, dim).bfloat16()
            kv = torch.randn(n, kvh, dim).bfloat16()
            question_q.setdefault(layer, q)
            spans, slots = meta.selector.for_layer(layer, q) if step == 0 or policy.rescore else (None, None)
            out = be.forward(layer, q, kv, kv, meta)
            if slots is None:                                  # a reused choice: ask the selector again
                spans, slots = meta.selector.for_layer(layer, q)
            assert len(spans) == n                             # one span per row
            for row, (sp, sl) in enumerate(zip(spans, slots)):
                assert sp.q_len == 1 and sp.start + 1 == sl.numel() <= 256 + 1
                torch.testing.assert_close(out[row:row + 1].double(), _reference(q[row:row + 1], cache, layer, sl,
                                                                                 dim ** -0.5), atol=2e-2, rtol=2e-2)
            picks_seen.setdefault(layer, []).append(slots[-1][:16 + 11 * BS].tolist())  # sinks + 11 pages
    reuse = isinstance(policy, QuestPolicy) and not policy.rescore
    assert (5 in be.picks) == reuse
    if reuse:  # the answer's rows read the pages the question's rows chose together, layer by layer
        plan = policy.plan(ctx - 12, ctx, BS)
        full = SpanSlots(span_slots(table, ctx + 1, BS, "cpu"), plan.sink * BS, plan.tail * BS, BS)
        pages = torch.tensor(table[plan.sink:plan.tail])
        for layer, seen in picks_seen.items():
            assert seen[1] == seen[2]
            bounds = cache.bounds.data[layer].index_select(0, pages)
            share = torch.stack([policy.score_pages(row.view(1, kvh, -1, dim), bounds, dim ** -0.5)
                                 for row in question_q[layer]]).amax(0)
            chosen = share.topk(plan.keep).indices.sort().values
            assert seen[1] == full.gather(chosen)[:16 + 11 * BS].tolist()
    be.release([5])
    assert 5 not in be.picks


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_budget_covering_the_context_changes_nothing(backend):
    torch.manual_seed(1)
    cache = KVCache(1, 64, BS, 2, 32, torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    be = make_backend(backend, cache, 32 ** -0.5)
    table = tuple(range(3, 40))
    q, kv = torch.randn(7, 4, 32), torch.randn(7, 2, 32)
    plain = be.forward(0, q, kv, kv, be.prepare([SeqSpan(0, 7, 300, table)], 7))
    meta = be.prepare([SeqSpan(0, 7, 300, table, QuestPolicy(budget_tokens=512, sink_tokens=0, recent_tokens=0))], 7)
    assert meta.selector is None
    assert torch.equal(be.forward(0, q, kv, kv, meta), plain)


# ----------------------------------------------------------------------------- sessions
def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_session_questions_under_a_read_policy(smol_fp32):
    """On the embedded model: a budget covering the context answers exactly like the exact
    session; a small budget really drops pages, its flash answers equal its own queries,
    nothing it computed enters the prefix cache and its per-question state is released."""
    from streamkv.sessions.spec import SessionSpec
    from streamkv import SamplingParams

    engine = smol_fp32.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
    records = [f"sensor {i % 7} reading {(i * 37) % 1000} at t={i}" for i in range(80)]
    narrow_policy = {"policy": "quest", "budget_tokens": 256, "sink_tokens": 32, "recent_tokens": 64}
    specs = {"exact": None, "wide": {"policy": "quest", "budget_tokens": 8192}, "narrow": narrow_policy}
    sessions = {k: engine.sessions.create(SessionSpec(system="Answer from the data.", retention_tokens=4000,
                                                      kv_read=v)) for k, v in specs.items()}
    question = "What was the reading of sensor 3 at t=38?"
    fq = engine.sessions.flash.register(sessions["narrow"], question, max_tokens=8)
    for s in sessions.values():
        engine.sessions.push(s.id, records)
    _drain(engine)
    assert sessions["narrow"].data.snapshot_len() > 1000  # about 4x the narrow budget
    answers = {}
    for name, s in sessions.items():
        engine.sessions.query(s.id, f"q-{name}", question, params)
        answers[name] = engine.run_to_completion([f"q-{name}"])[f"q-{name}"]
    assert answers["wide"].token_ids == answers["exact"].token_ids
    for a, b in zip(answers["wide"].logprobs, answers["exact"].logprobs):
        assert abs(a.logprob - b.logprob) < 1e-4
    narrow = sessions["narrow"]
    assert len(answers["narrow"].token_ids) >= 1
    bounds = engine.bundle.runner.backend.cache.bounds
    assert bounds is not None and bool(bounds.fresh.any())       # pages were scored
    engine.step()                                                # hands the finished ids to the runner
    assert engine.bundle.runner.backend.picks == {}              # released with the finished forks
    flash = narrow.flash.cached(fq.id, narrow.data.data_version)
    assert flash.token_ids == answers["narrow"].token_ids        # flash = query, under the same policy
    assert engine.sessions.stats(narrow.id)["spec"]["kv_read"] == {**narrow_policy, "rescore": False}
    assert engine.sessions.layout(narrow.id)["kv_read"]["policy"] == "quest"
    for s in sessions.values():
        engine.sessions.delete(s.id)
    engine.check_integrity()


def test_reused_picks_follow_blocks_that_moved():
    """A decode step after the sequence's blocks moved (a swap): the reused picks resolve to
    the new slots, and attention reads the moved KV, not whatever the old blocks now hold."""
    from streamkv.attention.torch_ref import span_slots

    torch.manual_seed(3)
    cache = KVCache(1, 160, BS, 2, 32, torch.bfloat16)
    cache.k.normal_()
    cache.v.normal_()
    be = make_backend("torch", cache, 32 ** -0.5)
    policy = QuestPolicy(budget_tokens=256, sink_tokens=16, recent_tokens=48)
    table, ctx = tuple(range(70)), 1000
    meta = be.prepare([SeqSpan(0, 12, ctx - 12, table, policy, seq_id=9, num_prompt=ctx)], 12)
    be.forward(0, torch.randn(12, 4, 32).bfloat16(), *(2 * [torch.randn(12, 2, 32).bfloat16()]), meta)
    picked = be.picks[9].layers[0]
    moved = tuple(range(80, 150))                       # the swap-in put the blocks elsewhere
    old, new = span_slots(table, ctx, BS, "cpu"), span_slots(moved, ctx, BS, "cpu")
    KVOps(cache, None).copy(old, new)
    cache.k[:, old] = 0                                 # the old blocks now belong to someone else
    span = SeqSpan(0, 1, ctx, moved, policy, seq_id=9, num_prompt=ctx)
    meta = be.prepare([span], 1)
    q = torch.randn(1, 4, 32).bfloat16()
    out = be.forward(0, q, *(2 * [torch.randn(1, 2, 32).bfloat16()]), meta)
    full = span_slots(moved, ctx + 1, BS, "cpu")
    expect = SpanSlots(full, BS, policy.plan(ctx - 1, ctx, BS).tail * BS, BS).gather(picked)  # the last row's
    _, slots = meta.selector.for_layer(0, q)
    assert torch.equal(slots[0], expect)
    assert be.picks[9].table == moved[:len(be.picks[9].table)]  # resolved once, then reused
    torch.testing.assert_close(out.double(), _reference(q, cache, 0, expect, 32 ** -0.5), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rescore", [True, False])
def test_the_fused_selecting_step_equals_the_per_layer_path(monkeypatch, rescore):
    """A request's Quest decode rows re-score every layer inside one native call
    (``streamkv_fwd_sel``), or (rescore false) read there the pages their first answer row
    picked per layer; the same rows through the per-layer Python path give the same bits,
    and the same report: the steps that sample the attention recall stay fused (the native loop
    hands back the sampled layer's queries) and measure what the per-layer path measures."""
    from streamkv import LLM, SamplingParams
    from streamkv.attention.selection import LayerSelector

    llm = LLM(max_num_batched_tokens=512)
    prompt = " ".join(f"note {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} coins." for i in range(80))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    quest = {"policy": "quest", "budget_tokens": 256, "sink_tokens": 16, "recent_tokens": 64, "rescore": rescore}
    fused = LayerSelector.fused
    calls = []

    def spy(self):
        out = fused(self)
        calls.append(out)
        return out

    monkeypatch.setattr(LayerSelector, "fused", spy)
    a = llm.generate([prompt, "Say hi."], params, kv_read=quest)
    steps = [c for c in calls if c is not None]
    assert len(steps) >= 30 and sum(bool(c.recall_layers) for c in steps) >= 2  # recall samples fused too
    reused = [c for c in steps if any(e.picked is not None for e in c.entries)]
    assert len(reused) == (0 if rescore else len(steps))  # (the row that picks runs the per-layer path)
    assert a[0].kv["attention_recall"] is not None
    monkeypatch.setattr(LayerSelector, "fused", lambda self: None)
    b = llm.generate([prompt, "Say hi."], params, kv_read=quest)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]
    assert a[0].kv == b[0].kv
    if not rescore:
        return
    assert a[0].kv["pages_picked"] < a[0].kv["pages_scored"]
    # pages scored are pages ranked: none for `recent` (it picks no page; 2,250 were reported),
    # and for quest without rescoring only the first answer row's, which later rows reuse
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    recent = llm.generate([prompt], short, kv_read={"policy": "recent", "sink_tokens": 0, "recent_tokens": 0})[0].kv
    assert recent["pages_scored"] == recent["pages_picked"] == 0
    once = llm.generate([prompt], short, kv_read={**quest, "rescore": False})[0].kv
    every = llm.generate([prompt], short, kv_read=quest)[0].kv
    assert 0 < once["pages_scored"] < every["pages_scored"]


def test_a_server_default_quest_acts_like_the_same_object_in_a_request():
    """``--kv-read`` with a quest object and a request sending that object get one policy: both
    re-score every decode step (the default used to keep the dataclass's ``rescore: false``)."""
    from streamkv.config import KVPolicyConfig
    from streamkv.engine.kv_policies import KVPolicies

    spec = {"policy": "quest", "budget_tokens": 96, "sink_tokens": 16, "recent_tokens": 32}
    default = KVPolicies.from_config(KVPolicyConfig(kv_read=json.dumps(spec)))
    assert default.read is not None and default.read.rescore
    assert default.resolve(None, None)[1] == KVPolicies().resolve(None, spec)[1] == default.read
    pinned = KVPolicies.from_config(KVPolicyConfig(kv_read=json.dumps({**spec, "rescore": False})))
    assert pinned.read is not None and not pinned.read.rescore


def _quest_session(engine, rescore: bool) -> str:
    """A session under quest over 80 sensor records, ingested (the engine drained): its id."""
    from streamkv.sessions.spec import SessionSpec

    policy = {"policy": "quest", "budget_tokens": 256, "sink_tokens": 32, "recent_tokens": 64, "rescore": rescore}
    session = engine.sessions.create(SessionSpec(system="Answer from the data.", retention_tokens=4000,
                                                 kv_read=policy))
    engine.sessions.push(session.id, [f"sensor {i % 7} reading {(i * 37) % 1000} at t={i}" for i in range(80)])
    _drain(engine)
    return session.id


def _ask(engine, sid: str, max_tokens: int) -> None:
    from streamkv import SamplingParams

    question = ("Across every sensor listed above, what was the reading of sensor 3 at t=38, and which sensor "
                "reported the largest reading near the end of the data?")
    engine.sessions.query(sid, "q", question, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3))


def _answer(out) -> tuple:
    return out.token_ids, [lp.logprob for lp in out.logprobs], out.kv


def _session_answer(engine, rescore: bool, max_tokens: int) -> tuple:
    """(token ids, logprobs, read report) of one quest session question over 80 sensor records."""
    _ask(engine, _quest_session(engine, rescore), max_tokens)
    return _answer(engine.run_to_completion(["q"])["q"])


@pytest.mark.parametrize("rescore", [False, True])
def test_a_session_question_under_quest_is_the_same_chunked(rescore):
    """Determinism under chunking for session questions under ``quest``: each question row
    picks its own pages (as it would alone) and, without ``rescore`` (the sessions' default),
    the answer reuses what the question's last 32 rows chose together; so the bits (and the
    read report) are the same whether the question
    goes in one chunk or in chunks of 5. (Before, a chunk's rows picked one page set
    together and the logprobs depended on the chunking.)"""
    from streamkv import LLM

    answers = [_session_answer(LLM(dtype="float32", max_chunk_tokens=chunk).engine, rescore, 4) for chunk in (None, 5)]
    assert answers[0] == answers[1]
    assert answers[0][2]["pages_picked"] > 0 and answers[0][2]["attention_recall"] is not None


@pytest.mark.parametrize("rescore", [False, True])
def test_a_fused_session_question_equals_the_per_layer_path(monkeypatch, rescore):
    """A session question's rows under ``quest`` run inside the one native layer call, each
    ranking the pages with its own query; the loop hands back the window rows' shares (the
    answer's picks) and the queries of every layer a row samples its recall in (two rows, two
    layers here). Through the per-layer Python path: the same bits and the same read report."""
    from streamkv import LLM
    from streamkv.attention.selection import LayerSelector

    fused, calls = LayerSelector.fused, []

    def spy(self):
        calls.append(fused(self))
        return calls[-1]

    answers = []
    for path in (spy, lambda self: None):
        monkeypatch.setattr(LayerSelector, "fused", path)
        answers.append(_session_answer(LLM().engine, rescore, 6))
    questions = [c for c in calls if c is not None and any(e.rows for e in c.entries)]
    assert questions and any(len(c.recall_layers) > 1 for c in questions)
    assert answers[0] == answers[1]
    assert answers[0][2]["pages_picked"] > 0 and answers[0][2]["attention_recall"] is not None


def test_a_fused_step_of_question_chunks_beside_a_requests_decode_equals_the_per_layer_path(monkeypatch):
    """A session question in chunks of 8 (its answer window split across steps) while a quest
    request decodes beside it: the fused steps hold both kinds of entry (and the request's row
    samples its recall in one of them), and everything comes out as through the per-layer
    Python path (tokens, logprobs, read reports)."""
    from streamkv import LLM, SamplingParams
    from streamkv.attention.selection import LayerSelector

    fused, calls = LayerSelector.fused, []

    def spy(self):
        calls.append(fused(self))
        return calls[-1]

    prompt = " ".join(f"note {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} coins." for i in range(60))
    quest = {"policy": "quest", "budget_tokens": 256, "sink_tokens": 16, "recent_tokens": 64, "rescore": True}
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    results = []
    for path in (spy, lambda self: None):
        monkeypatch.setattr(LayerSelector, "fused", path)
        engine = LLM(max_chunk_tokens=8).engine
        sid = _quest_session(engine, rescore=False)
        engine.add_request("r", prompt, params, kv_read=quest)
        while not any(o.request_id == "r" and o.token_ids                    # r's next row at position
                      and (len(o.prompt_token_ids) + len(o.token_ids) - 1) % 16 == 12 for o in engine.step()):
            pass                                                             # 12: it samples its recall at
        _ask(engine, sid, 4)
        outs = engine.run_to_completion(["q", "r"])
        results += [_answer(outs["q"]), _answer(outs["r"])]
    mixed = [c for c in calls if c is not None and any(e.rows for e in c.entries)
             and any(not e.rows for e in c.entries)]
    assert mixed, "no fused step held question rows beside a decode row"
    decoders = [{id(e.choice) for e in c.entries if not e.rows} for c in mixed]   # 16 during the question
    assert any(id(choice) in d for c, d in zip(mixed, decoders) for _, choice, _ in c.sampled)
    assert results[:2] == results[2:]


def test_a_session_question_under_quest_is_the_same_with_or_without_the_ready_fork(smol_fp32):
    """A question forks the session's ready fork (snapshot + the scaffold's prefix, computed
    exactly) when it is open, else the stream at the snapshot (right after a version finishes,
    after a restore, or when pool pressure closed it). The stream fork read the prefix under
    quest, so the answer, its logprobs and read report depended on which (review: tokens
    differ from the 1st); it now computes the prefix exactly too. Flash answers fork the ready
    fork: they equal both. Both answer in the step the question is asked: the stream fork's
    exact prefix rows and its own rows under quest share one step (the runner splits them into
    two spans); it took a step more."""
    from streamkv import SamplingParams
    from streamkv.sessions.spec import SessionSpec

    engine = smol_fp32.engine
    policy = {"policy": "quest", "budget_tokens": 128, "sink_tokens": 16, "recent_tokens": 32}
    records = [f"sensor {i % 7} reading {(i * 37) % 1000} at t={i}" for i in range(80)]
    question = "What was the reading of sensor 3 at t=38?"
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    session = engine.sessions.create(SessionSpec(system="Answer from the data.", retention_tokens=4000, kv_read=policy))
    fq = engine.sessions.flash.register(session, question, max_tokens=8)
    engine.sessions.push(session.id, records)
    _drain(engine)
    outs = {}
    for tag in ("ready", "stream"):
        if tag == "stream":
            engine.sessions.ready_forks.close(session)
        assert (session.ready is not None) == (tag == "ready")
        engine.sessions.query(session.id, tag, question, params)
        first = [o for o in engine.step() if o.request_id == tag]
        assert first and len(first[0].token_ids) == 1, tag  # the first token, in one step
        out = engine.run_to_completion([tag])[tag]
        outs[tag] = (out.token_ids, [lp.logprob for lp in out.logprobs], out.kv)
    assert outs["ready"] == outs["stream"]
    assert session.flash.cached(fq.id, session.data.data_version).token_ids == outs["ready"][0]
    engine.sessions.delete(session.id)
    engine.step()
    engine.check_integrity()


def test_a_recomputed_answer_under_quest_never_takes_exact_rows_from_the_prefix_cache():
    """Preempted (recompute) while a follow-up turn, whose prompt is this prompt + this answer,
    had put exact blocks for those ids in the prefix cache, a quest request's lookup took them
    for its answer rows, and its later logprobs changed (review: 5 of 48 from token 40). A
    lookup now stops at the exact rows (``read_from``)."""
    from streamkv import LLM, SamplingParams

    text = "Record 1. " + " ".join(f"item{(7 + j) % 97} weighs {j % 13} kg;" for j in range(50)) + "\nWhich?"
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=1)
    quest = {"policy": "quest", "budget_tokens": 96, "sink_tokens": 16, "recent_tokens": 32}
    llm = LLM(dtype="float32", max_num_batched_tokens=512, num_blocks=48, preemption="recompute")
    engine = llm.engine
    ref = llm.generate([text], params, kv_read=quest)[0]  # alone, never preempted
    engine.pool.reset_prefix_cache()
    follow = list(ref.prompt_token_ids) + list(ref.token_ids)
    engine.add_request("follow", follow, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
                       priority=-1)
    engine.step()  # its exact rows for the quest request's prompt and answer ids are cached
    engine.add_request("q", text, params, kv_read=quest)
    seq = engine._requests["q"].seq
    done, filler = {}, False
    while engine.has_unfinished():
        if not filler and seq.num_output >= 40:  # a pressing request: q is preempted
            engine.add_request("filler", " ".join(f"w{j}" for j in range(100)),
                               SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), priority=-1)
            filler = True
        done.update({o.request_id: o for o in engine.step() if o.finished})
    got = done["q"]
    assert got.metrics["num_preemptions"] > 0
    assert got.token_ids == ref.token_ids
    assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in ref.logprobs]
    engine.check_integrity()


def test_a_stream_forks_question_scores_no_page_its_own_step_writes(smol_fp32):
    """With a short ``recent_tokens`` the question's scored pages reach the blocks its scaffold's
    exact rows fill: computed in one step with them (df46c6c), those pages were scored by the
    bounds of what their slots held before, so the same question on the same version answered
    with other logprobs and recall each time (review). Such a question takes the prefix a step
    ahead, as before; every answer equals the ready fork's."""
    from streamkv import SamplingParams
    from streamkv.sessions.spec import SessionSpec

    engine = smol_fp32.engine
    policy = {"policy": "quest", "budget_tokens": 128, "sink_tokens": 16, "recent_tokens": 16}
    records = [f"sensor {i % 7} reading {(i * 37) % 1000} at t={i}" for i in range(40)]
    prefix = ("Below is a question about the sensor log above. Read the log carefully, then answer it with a "
              "single number and nothing else. Question: ")
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)
    session = engine.sessions.create(SessionSpec(system="Answer from the data.", chat=False, retention_tokens=4000,
                                                 kv_read=policy, query_prefix=prefix, query_suffix=" Answer:"))
    engine.sessions.push(session.id, records)
    for _ in range(200):
        engine.step()
        if session.ready is not None and engine.seq_ops.is_idle(session.ready) and not session.data.queue:
            break
    outs = []
    for tag in ("ready", "stream1", "stream2"):
        if tag != "ready":
            engine.sessions.ready_forks.close(session)
        engine.sessions.query(session.id, tag, "What was the reading of sensor 3 at t=38?", params)
        out = engine.run_to_completion([tag])[tag]
        outs.append((out.token_ids, [lp.logprob for lp in out.logprobs], out.kv["attention_recall"]))
    assert outs[0] == outs[1] == outs[2]
    engine.sessions.delete(session.id)
    engine.step()
    engine.check_integrity()


@pytest.mark.skipif(page_bounds() is None, reason="no C compiler: the native kernels are not built")
def test_native_bounds_of_a_float32_cache_are_the_torch_paths_bits():
    """A float32 cache's bounds in C (max / min rounded outward to bf16) equal the torch path's
    (kv/bounds.py: _round) bit for bit: values exact in bf16, just above and below them, negatives,
    zeros of both signs, subnormals and the largest finite floats."""
    g = torch.Generator().manual_seed(7)
    layers, blocks, heads, dim = 3, 24, 2, 16
    k = torch.randn(layers, blocks * BS, heads, dim, generator=g) * 4
    exact = k.bfloat16().float()
    k[:, : 4 * BS] = exact[:, : 4 * BS]                                    # exactly bf16 values
    k[:, 4 * BS: 8 * BS] = torch.nextafter(exact[:, 4 * BS: 8 * BS], torch.tensor(float("inf")))
    k[:, 8 * BS: 12 * BS] = torch.nextafter(exact[:, 8 * BS: 12 * BS], torch.tensor(float("-inf")))
    edges = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, 1.0, -1.0])
    k[:, 12 * BS: 13 * BS] = edges.repeat(2)[:, None, None]
    k[:, 13 * BS: 14 * BS] = -k[:, 13 * BS: 14 * BS].abs()                # every key of a block negative
    native, ref = PageBounds(k, BS), PageBounds(k, BS)
    assert native._native is not None
    ref._native = None
    which = torch.arange(blocks)
    native.refresh(which)
    ref.refresh(which)
    assert torch.equal(native.data.view(torch.int16), ref.data.view(torch.int16))
    hi, lo = native.data.float().split(dim, dim=-1)
    keys = k.view(layers, blocks, BS, heads, dim)
    assert (keys <= hi[:, :, None]).all() and (keys >= lo[:, :, None]).all()
