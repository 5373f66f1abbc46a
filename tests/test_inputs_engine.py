"""Streaming-input requests on a fake runner whose KV lives in slots (tests/fakes.py).

The fake checks every row it reads back through the block table, so a lost copy-on-write, a
block freed too early or a stale row after an LCP invalidation fails; the greedy output must
equal a fresh request on the final prompt.
"""
from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings, strategies as st

from streamkv.errors import InputStreamClosedError, InputStreamNotFoundError, InvalidRequestError, QueueFullError
from streamkv.sampling.params import SamplingParams
from tests.fakes import slot_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _fresh(text: str, num_blocks: int = 256, **kw) -> list[int]:
    engine, _ = slot_engine(num_blocks=num_blocks, **kw)
    engine.add_request("ref", text, GREEDY)
    return engine.run_to_completion(["ref"])["ref"].token_ids


def _drain(engine, steps: int = 3) -> None:
    for _ in range(steps):
        engine.step()
        engine.check_integrity()


def _finish(engine, rid: str):
    engine.inputs.finish(rid)
    out = engine.run_to_completion([rid])[rid]
    engine.check_integrity()
    return out


def test_append_prefills_while_input_arrives_and_matches_fresh_request():
    engine, runner = slot_engine(budget=8)
    text = "thequickbrownfoxjumpsoverthelazydog"
    stream = engine.inputs.open("s", prompt=text[:10], params=GREEDY)
    _drain(engine, 4)
    assert stream.seq.num_computed == 9  # all but the held-back last token
    assert not engine.has_unfinished()  # idle until more input: the loop may sleep
    engine.inputs.append("s", text[10:])
    assert engine.has_unfinished()
    out = _finish(engine, "s")
    assert out.token_ids == _fresh(text)
    names = [e for e, _ in out.events]
    assert names[:3] == ["queued", "scheduled", "kv_resident"] and "input_appended" in names
    assert names[-1] == "finished" and out.metrics["tokens_invalidated"] == 0


def test_update_keeps_the_lcp_and_frees_the_rest():
    engine, runner = slot_engine(budget=64)
    stream = engine.inputs.open("s", prompt="abcdefghijklmnopqrst", params=GREEDY)
    _drain(engine)
    held = engine.kv.num_blocks_held(stream.seq.seq_id)
    _, lcp, dropped = engine.inputs.update("s", "abcdefgXYZ")
    assert (lcp, dropped) == (7, 19 - 7)
    assert stream.seq.num_computed == 7 and engine.kv.num_blocks_held(stream.seq.seq_id) < held
    engine.check_integrity()
    out = _finish(engine, "s")
    assert out.token_ids == _fresh("abcdefgXYZ")
    assert out.metrics["tokens_invalidated"] == 12


def test_truncate_into_a_prefix_cached_block_copies_it_and_keeps_the_cache_entry():
    engine, runner = slot_engine(block_size=4)
    engine.add_request("other", "abcdefghij", GREEDY)
    engine.run_to_completion(["other"])
    stream = engine.inputs.open("s", prompt="abcdefghijkl", params=GREEDY)
    _drain(engine)
    assert stream.seq.num_cached_tokens == 8  # two blocks from the prefix cache
    copies = runner.kv_ops.copies
    engine.inputs.update("s", "abcdeZZZ")  # cut inside the shared, cached second block
    assert runner.kv_ops.copies == copies + 1
    engine.check_integrity()
    assert _finish(engine, "s").token_ids == _fresh("abcdeZZZ")
    engine.add_request("again", "abcdefghij", GREEDY)  # the cached block still holds "efgh"
    assert engine.run_to_completion(["again"])["again"].token_ids == _fresh("abcdefghij")


def test_errors_leave_the_stream_unchanged():
    engine, _ = slot_engine(max_model_len=40, max_input_streams=2)
    engine.inputs.open("s", prompt="abc", params=GREEDY)
    with pytest.raises(InvalidRequestError, match="context"):
        engine.inputs.append("s", "x" * 40)
    assert engine.inputs.get("s").text == "abc"
    with pytest.raises(InvalidRequestError, match="string"):
        engine.inputs.append("s", 3)
    with pytest.raises(InputStreamNotFoundError):
        engine.inputs.append("nope", "x")
    engine.inputs.open("t", prompt="", params=GREEDY)
    with pytest.raises(QueueFullError):
        engine.inputs.open("u", prompt="x", params=GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.inputs.finish("t")
    engine.inputs.append("t", "hello")
    out = _finish(engine, "s")
    assert out.token_ids == _fresh("abc")
    with pytest.raises(InputStreamClosedError):
        engine.inputs.append("s", "more")
    with pytest.raises(InvalidRequestError, match="one of"):
        engine.inputs.open("v", params=GREEDY)
    assert _finish(engine, "t").token_ids == _fresh("hello")


def test_ttl_expiry_aborts_and_frees():
    engine, _ = slot_engine(input_stream_ttl_s=5.0)
    s = engine.inputs.open("s", prompt="abcdefgh", params=GREEDY)
    _drain(engine)
    assert engine.kv.has(s.seq.seq_id)
    assert engine.inputs.maintain(now=s.last_activity + 1.0) == []
    opened = s.last_activity
    time.sleep(0.05)
    with pytest.raises(InvalidRequestError, match="context"):  # a refused call is the client too
        engine.inputs.append("s", " word" * 5000)
    assert s.last_activity > opened and engine.inputs.maintain(now=opened + 5.02) == []
    assert engine.inputs.maintain(now=s.last_activity + 6.0) == ["s"]
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert engine.pool.num_used == 0 and not engine.has_unfinished()
    with pytest.raises(InputStreamClosedError, match="expired"):
        engine.inputs.append("s", "x")


def test_an_aborted_input_not_yet_reaped_hides_no_other_requests_work():
    """An aborted input stays among the open ones until the next reap, and was counted as
    idle: with its request gone, ``has_unfinished`` said False while a finished input still
    had to generate, and a ``while has_unfinished(): step()`` loop never answered it (review)."""
    engine, _ = slot_engine()
    engine.inputs.open("a", prompt="abcdefgh", params=GREEDY)
    engine.inputs.open("b", prompt="bcdefghi", params=GREEDY)
    _drain(engine)
    engine.abort("a")
    engine.inputs.finish("b")
    assert engine.has_unfinished()
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs if o.finished) == [("a", "abort"), ("b", "length")]
    assert engine.pool.num_used == 0


def test_a_finish_with_a_last_piece_it_cannot_take_keeps_neither():
    """``finish`` with a last piece appended the piece, then finished: refused (here the write
    policy cannot hold the longer prompt), the piece stayed, and a client retrying the same
    call got it twice (review). Both happen together now, or neither."""
    engine, _ = slot_engine(num_blocks=16, block_size=4)
    kv_write = {"policy": "streaming_llm", "sink_tokens": 4, "window_tokens": 8}
    engine.inputs.open("s", prompt="a" * 40, params=GREEDY, kv_write=kv_write)
    _drain(engine)
    before = list(engine.inputs.get("s").seq.tokens)
    with pytest.raises(InvalidRequestError, match="kv_write"):
        engine.inputs.finish("s", "b" * 15)
    stream = engine.inputs.get("s")  # still open, as it was
    assert stream.text == "a" * 40 and stream.appends == 0 and stream.seq.tokens == before
    engine.inputs.finish("s", "b" * 3)
    out = engine.run_to_completion(["s"])["s"]
    ref, _ = slot_engine(num_blocks=16, block_size=4)
    ref.add_request("ref", "a" * 40 + "b" * 3, GREEDY, kv_write=kv_write)
    assert out.token_ids == ref.run_to_completion(["ref"])["ref"].token_ids and stream.appends == 1
    engine.check_integrity()


def test_complete_inputs_rank_above_partial_ones():
    engine, runner = slot_engine(budget=4, chunk=4)
    engine.inputs.open("partial", prompt="abcdefghijklmnop", params=GREEDY)
    engine.add_request("full", "qrstuvwxyzabcdef", GREEDY)
    engine.step()
    assert [s.seq_id for s in runner.plans[-1].seqs] == [1]  # the complete request first
    engine, runner = slot_engine(budget=4, chunk=4, queue_policy="fifo")
    engine.inputs.open("partial", prompt="abcdefghijklmnop", params=GREEDY)
    engine.add_request("full", "qrstuvwxyzabcdef", GREEDY)
    engine.step()
    assert [s.seq_id for s in runner.plans[-1].seqs] == [0]  # fifo: one tier, arrival order


def test_partial_prefill_never_shares_a_step_with_a_complete_prefill():
    engine, runner = slot_engine(budget=16)
    p = engine.inputs.open("partial", prompt=LETTERS, params=GREEDY)  # 25 computable tokens
    rows = lambda: [(s.seq_id, s.num_tokens) for s in runner.plans[-1].seqs]
    engine.step()
    assert rows() == [(p.seq.seq_id, 16)]
    engine.add_request("full", "qrstuvwxyz", GREEDY)  # 10 tokens, 6 of the budget left over
    engine.step()
    assert rows() == [(1, 10)]  # the complete request's prefill runs alone
    engine.step()
    assert rows() == [(1, 1), (p.seq.seq_id, 9)]  # next to its decode, background prefill resumes
    engine, runner = slot_engine(budget=16, queue_policy="fifo")
    engine.inputs.open("partial", prompt=LETTERS, params=GREEDY)
    engine.add_request("full", "qrstuvwxyz", GREEDY)
    engine.step()
    assert rows() == [(0, 16)]  # fifo: one tier, nothing is background


@pytest.mark.parametrize("policy", ["fcfs", "fifo", "mcps", "lcas"])
def test_idle_inputs_that_cannot_fit_together_do_not_preempt_each_other_in_turn(policy):
    """Two idle streaming inputs that the pool cannot hold together preempted each other step
    after step (a server burned a core re-prefilling them until they were deleted): a victim
    now always ranks below the sequence that needs its blocks."""
    engine, runner = slot_engine(num_blocks=10, block_size=4, queue_policy=policy)
    a = engine.inputs.open("a", prompt=LETTERS[:24], params=GREEDY)  # 23 computable rows: 6 blocks
    _drain(engine)
    b = engine.inputs.open("b", prompt=LETTERS[2:26], params=GREEDY)
    for i in range(30):
        if i == 10:
            settled = len(runner.plans)
        engine.step()
        engine.check_integrity()
    assert engine.scheduler.num_preemptions <= 1, engine.scheduler.num_preemptions
    assert sum(it.num_tokens for plan in runner.plans[settled:] for it in plan.seqs) == 0  # nobody recomputes
    assert _finish(engine, "b").token_ids == _fresh(LETTERS[2:26])
    assert _finish(engine, "a").token_ids == _fresh(LETTERS[:24])
    assert a.seq.num_preemptions + b.seq.num_preemptions <= 2


def test_lcas_serves_the_latest_chunk_and_aging_bounds_the_wait():
    from streamkv.sched.policies import make_queue_policy

    engine, runner = slot_engine(budget=4, chunk=4, queue_policy="lcas")
    a = engine.inputs.open("a", prompt="abcdefghijklmnop", params=GREEDY)
    b = engine.inputs.open("b", prompt="qrstuvwxyzabcdef", params=GREEDY)
    engine.inputs.append("a", "q")  # a's chunk is the newest
    engine.step()
    assert [s.seq_id for s in runner.plans[-1].seqs] == [a.seq.seq_id]
    lcas, aged = make_queue_policy("lcas"), make_queue_policy("lcas", max_wait_s=5.0)
    engine.inputs.finish("b")
    engine.inputs.finish("a")  # both complete now; a's input is the newest
    now = a.seq.last_input + 3.0
    assert b.seq.has_work and a.seq.has_work
    assert lcas.rank([b.seq, a.seq], now + 10.0)[0] is a.seq  # b starves without aging
    assert aged.rank([b.seq, a.seq], now)[0] is a.seq  # nobody waited 5 s yet: plain lcas
    assert now - b.seq.last_input < 5.0 < now + 10.0 - b.seq.last_input
    assert aged.rank([a.seq, b.seq], now + 10.0)[0] is b.seq  # b's input is > 5 s old: first
    # An input still streaming never ages: it is background work, and one preempted while
    # its client is quiet must not be recomputed ahead of everything (it thrashed under
    # memory pressure); once finished it is complete and ages like any request.
    c = engine.inputs.open("c", prompt="zyxwvutsrqponm", params=GREEDY)
    d = engine.inputs.open("d", prompt="mnopqrstuvwxyz", params=GREEDY)
    assert c.seq.has_work and d.seq.has_work and d.seq.last_input >= c.seq.last_input
    assert aged.rank([c.seq, d.seq], d.seq.last_input + 60.0)[0] is d.seq  # plain lcas
    with pytest.raises(ValueError, match="max_wait_s"):
        make_queue_policy("lcas", max_wait_s=0)
    with pytest.raises(ValueError, match="unknown queue policy"):
        make_queue_policy("nope")


@st.composite
def _scripts(draw):
    ops = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["append", "update", "step", "step", "other", "other"]))
        text = "".join(draw(st.lists(st.sampled_from(LETTERS[:6]), min_size=0, max_size=14)))
        ops.append((kind, text))
    return ops


@settings(max_examples=150, deadline=None)
@given(script=_scripts(), seed=st.integers(0, 10_000), policy=st.sampled_from(["fifo", "fcfs", "mcps", "lcas"]),
       preemption=st.sampled_from(["recompute", "swap"]), swap_blocks=st.integers(0, 24))
def test_random_changes_preemption_and_pressure_keep_output_and_pool_invariants(script, seed, policy, preemption,
                                                                                 swap_blocks):
    """Any mix of appends, updates, steps and competing requests (forcing preemption, by
    recompute or swap, in a small pool) ends with the fresh request's output and clean
    device and host pools."""
    rng = random.Random(seed)
    pool = {"num_blocks": 14, "block_size": 4}
    engine, _ = slot_engine(**pool, budget=rng.choice([3, 8, 64]), queue_policy=policy,
                            preemption=preemption, swap_blocks=swap_blocks)
    text, done = "ab", {}
    engine.inputs.open("s", prompt=text, params=GREEDY)
    others = 0
    for kind, piece in script:
        if kind == "append":
            if len(text + piece) >= 56:  # the pool's 14 x 4 rows: refused, the stream unchanged
                with pytest.raises(InvalidRequestError, match="KV cache holds only"):
                    engine.inputs.append("s", piece)
                continue
            text += piece
            engine.inputs.append("s", piece)
        elif kind == "update":
            text = (text[:rng.randrange(len(text) + 1)] + piece)[:55]
            engine.inputs.update("s", text)
        elif kind == "other":
            engine.add_request(f"o{others}", "".join(rng.choice(LETTERS) for _ in range(rng.randrange(12, 30))),
                               GREEDY)
            others += 1
        else:
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.check_integrity()
    if not text:
        text = "z"
        engine.inputs.append("s", text)
    engine.inputs.finish("s")
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(done) == {"s", *(f"o{i}" for i in range(others))}
    # the same pool: a prompt over 49 tokens leaves room for fewer than 8 outputs, and a fresh
    # request there stops at the same token (finished, "needs more KV than the whole pool")
    assert done["s"].token_ids == _fresh(text, **pool)
    engine.check_integrity()
    assert engine.pool.num_used == 0 and engine.inputs.get_state("s") == "finished"
    assert engine.kv.host.num_used == 0


def test_swapped_input_updated_while_out_resumes_from_the_lcp():
    """Preempted by swap, then updated while on the host: host blocks past the LCP go back,
    the rest swaps in and only the new tail is computed."""
    engine, runner = slot_engine(num_blocks=10, block_size=4, budget=64, preemption="swap", swap_blocks=8)
    s = engine.inputs.open("s", prompt="abcdefghijklmnopqrstuv", params=GREEDY)  # 22 tokens, 6 blocks
    _drain(engine, 2)
    engine.add_request("big", "zyxwvutsrqponmlkjihgfedcbazyxwvu", GREEDY)  # 32 + 8 tokens: s must go
    engine.step()
    engine.check_integrity()
    assert s.seq.swapped and engine.kv.host.num_used == 6
    assert engine.scheduler.preemptions_by_kind == {"recompute": 0, "swap": 1}
    _, lcp, dropped = engine.inputs.update("s", "abcdefghijXY")
    assert (lcp, dropped) == (10, 11) and engine.kv.host.num_used == 3
    engine.check_integrity()
    done = engine.run_to_completion(["big"])
    out = _finish(engine, "s")
    assert out.token_ids == _fresh("abcdefghijXY") and done["big"].token_ids == _fresh("zyxwvutsrqponmlkjihgfedcbazyxwvu")
    names = [e for e, _ in out.events]
    assert names.index("preempted_swap") < names.index("input_updated") < names.index("swapped_in")
    assert engine.kv.host.num_used == 0 and engine.pool.num_used == 0
    assert runner.kv_ops.swap_bytes == (6 + 3) * 64 * 4


def test_cost_policy_follows_the_profile():
    from streamkv.sched.preemption import CostProfile, make_preemption

    cheap_swap = CostProfile(((16, 0.01), (1024, 0.6)), ((1, 1e-5), (64, 6e-4)), ((1, 1e-5), (64, 6e-4)))
    dear_swap = CostProfile(((16, 1e-4), (1024, 6e-3)), ((1, 0.01), (64, 0.6)), ((1, 0.01), (64, 0.6)))
    assert make_preemption("cost", cheap_swap).swap(num_computed=256, blocks=16)
    assert not make_preemption("cost", dear_swap).swap(num_computed=256, blocks=16)
    assert not make_preemption("cost").swap(256, 16)  # no profile: recompute
    assert cheap_swap.prefill_s(2048) > cheap_swap.prefill_s(1024)  # extends past the last point
    with pytest.raises(ValueError, match="ascending"):
        CostProfile(((16, 0.1),), ((1, 0.1), (2, 0.2)), ((1, 0.1), (2, 0.2)))
    for bad in (((16, 0.1), (64, float("inf"))), ((16, 0.1), (64, float("nan"))), ((16, 0.1), (64, -1.0)),
                ((-16, 0.1), (64, 0.2))):
        with pytest.raises(ValueError, match="finite times"):
            CostProfile(bad, ((1, 0.1), (2, 0.2)), ((1, 0.1), (2, 0.2)))
    with pytest.raises(ValueError, match="unknown preemption"):
        make_preemption("nope")


def test_profile_sizes_fit_the_room_with_two_points_at_least():
    from streamkv.engine.profile import fitting

    assert fitting((16, 256), 640) == [16, 256]
    assert fitting((16, 256), 128) == [16, 128]        # one fits: the room joins it
    assert fitting((16, 256), 16) == [8, 16]           # the one that fits is the room: half of it too
    assert fitting((16, 256), 8) == [4, 8]
    assert fitting((1, 16), 1) == [1]                  # no line fits in one block (measure() refuses it)


def test_profile_key_follows_the_sizes_the_pool_and_context_let_it_measure():
    """A narrow measurement (small max_model_len or pool) must not share a cached profile with
    the default one; identical configs must (fake runner: no model needed)."""
    from streamkv.engine.profile import profile_key

    def key(**kw) -> str:
        return profile_key(slot_engine(**{"num_blocks": 512, "block_size": 4, "max_model_len": 2048, **kw})[0])

    ref = key()
    assert key() == ref and key(num_blocks=1024, max_model_len=4096) == ref   # every size fits in both
    assert key(max_model_len=3) != ref and key(num_blocks=2) != ref and key(max_model_len=513) != ref


def test_advance_gives_up_on_an_input_that_can_get_no_block():
    # two open inputs hold the pool (background work preempts nobody above it): advance() ran
    # empty steps for ever (max_steps 1 << 30); now a typed error, and the input stays open
    from streamkv.engine.llm import LLM
    from streamkv.errors import KVCacheFullError
    from streamkv.inputs.local import STALL_STEPS, InputHandle

    engine, _ = slot_engine(num_blocks=10, block_size=4)
    for rid in ("a", "b"):
        engine.inputs.open(rid, prompt="x" * 19, params=GREEDY)
    _drain(engine, 6)
    engine.inputs.open("c", prompt="y" * 19, params=GREEDY)
    handle = InputHandle(engine, "c")
    with pytest.raises(KVCacheFullError, match="no KV block"):
        handle.advance()
    assert engine.stats.steps < STALL_STEPS + 10 and engine.inputs.get_state("c") == "open"
    with pytest.raises(InvalidRequestError, match="max_steps"):
        handle.advance("3")
    llm = LLM.__new__(LLM)  # the Python API's own checks, on this engine
    llm.engine, llm._ids = engine, iter(range(100))
    for bad in (float("nan"), 0, "2", True):  # NaN hung: nothing was ever submitted
        with pytest.raises(InvalidRequestError, match="concurrency"):
            llm.span_bulk([], concurrency=bad)
    with pytest.raises(InvalidRequestError, match="queries must be a list"):
        llm.span_bulk(None)
    with pytest.raises(InvalidRequestError, match="open_input takes"):
        llm.open_input(None)
    with pytest.raises(InvalidRequestError, match="request id"):  # was accepted, then unreachable
        engine.inputs.open(None, prompt="x", params=GREEDY)
    import asyncio

    from streamkv.engine.async_engine import AsyncEngine

    with pytest.raises(InvalidRequestError, match="kv must be"):  # a TypeError before
        asyncio.run(AsyncEngine(engine).open_input("z", prompt="x", kv={"kv_wrte": {}}))


def test_an_idle_streaming_input_does_not_hold_a_request_over_the_ceiling_back():
    """A request projecting more than the cell-budget ceiling runs only alone; an admitted
    streaming input whose client had gone quiet counted as "not alone", so the request waited
    as long as the client did (300 steps, 300 deferrals). An idle input no longer counts; once
    it gets text again it computes beside the request, and both outputs are unchanged."""
    from tests.fakes import fake_engine

    params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    engine, _ = fake_engine(num_blocks=64, budget=64, admission="cell-budget")  # ceiling: 128 tokens
    stream = engine.inputs.open("partial", prompt=LETTERS[:20], params=params(10))
    _drain(engine, 5)
    assert not stream.seq.has_work and stream.seq.num_computed == 19  # idle: waits for its client
    engine.add_request("big", [7] * 20, params(120))  # 140 projected tokens, over the ceiling
    done = {}
    for _ in range(40):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.admission.stats.deferred_requests == 0
    engine.inputs.append("partial", LETTERS[20:])  # text again while "big" decodes
    engine.inputs.finish("partial")
    done.update(engine.run_to_completion(["big", "partial"]))
    engine.check_integrity()
    solo, _ = fake_engine(num_blocks=64, budget=64)
    solo.add_request("big", [7] * 20, params(120))
    solo.add_request("partial", LETTERS, params(10))
    want = solo.run_to_completion(["big", "partial"])
    assert {r: o.token_ids for r, o in done.items()} == {r: o.token_ids for r, o in want.items()}
    # a streaming input still computing arrived rows is prompt work: the request waits for it
    engine, _ = fake_engine(num_blocks=64, budget=8, admission="cell-budget")
    engine.inputs.open("partial", prompt=LETTERS, params=params(10))
    engine.step()
    engine.add_request("big", [7] * 20, params(120))
    engine.step()
    assert engine.scheduler.admission.stats.deferred_requests == 1


def test_an_update_that_cuts_into_a_prefix_hit_lowers_the_cached_count():
    """``num_cached_tokens`` (the prompt rows a prefix hit gave) kept the admission's 16 after
    an update cut the prompt to 6 tokens, 3 of them kept (review)."""
    engine, _ = slot_engine(block_size=4)
    engine.add_request("other", LETTERS[:16], GREEDY)
    engine.run_to_completion(["other"])
    stream = engine.inputs.open("s", prompt=LETTERS[:17], params=GREEDY)
    _drain(engine)
    assert stream.seq.num_cached_tokens == 16
    engine.inputs.update("s", "abcxyz")  # LCP 3: the hit's rows past it are gone
    out = _finish(engine, "s")
    assert out.num_cached_tokens == 3 and out.token_ids == _fresh("abcxyz")


def test_the_cost_policy_weighs_the_tokens_a_compressed_victim_would_recompute():
    """A compressed sequence holds 9 rows (3 blocks) for 82 computed tokens; recompute re-runs
    all 82. The scheduler passed the rows as ``num_computed``: T(9) = 9 ms against C(3) = 60 ms,
    so it recomputed what T(82) = 82 ms says to swap (review)."""
    from dataclasses import dataclass

    from streamkv.policies import StreamingLLMPolicy
    from streamkv.sched.preemption import Cost, CostProfile

    policy = StreamingLLMPolicy(sink_tokens=3, window_tokens=6)
    asked = []

    @dataclass(frozen=True)
    class Recorded(Cost):
        def swap(self, num_computed: int, blocks: int) -> bool:
            asked.append((num_computed, blocks))
            return super().swap(num_computed, blocks)

    # prefill 1 ms a token, a block 10 ms each way
    profile = CostProfile(((0, 0.0), (1000, 1.0)), ((0, 0.0), (100, 1.0)), ((0, 0.0), (100, 1.0)))
    engine, runner = slot_engine(num_blocks=24, max_model_len=256, swap_blocks=32)
    runner.write = policy
    engine.scheduler.preemption = Recorded(profile)
    engine.add_request("c", "ab" * 40, SamplingParams(max_tokens=30, ignore_eos=True), kv_write=policy.to_dict())
    seq = engine._requests["c"].seq
    while seq.layout is None or seq.num_output < 3:
        engine.step()
    computed = seq.num_computed
    engine.add_request("big", "z" * 90, SamplingParams(max_tokens=2, ignore_eos=True), priority=-1)
    while not asked:
        engine.step()
    assert asked[0] == (computed, 3) and computed > 80
    assert engine.scheduler.preemptions_by_kind["swap"] == 1
    engine.run_to_completion(["c", "big"])
    engine.check_integrity()


def test_a_swapped_input_updated_past_all_its_rows_comes_back_as_a_new_request():
    """Swapped out, then updated to a text sharing nothing with the old one: its host blocks
    went back but it stayed "swapped", came back through a swap-in of nothing (a spurious
    ``swapped_in``) and skipped the prefix lookup its new text hits (review)."""
    engine, _ = slot_engine(num_blocks=10, budget=64, preemption="swap", swap_blocks=16)
    engine.add_request("warm", "QRSTUVWXYZ" * 2, GREEDY)
    engine.run_to_completion(["warm"])
    stream = engine.inputs.open("s", prompt=LETTERS[:22], params=GREEDY)
    _drain(engine)
    engine.add_request("big", "zyxwvutsrqponmlkjihgfedcbazyxwvu", GREEDY)
    engine.step()
    assert stream.seq.swapped and engine.kv.host.num_used > 0
    engine.inputs.update("s", "QRSTUVWXYZ" * 2 + "ab")  # LCP 0; a prefix hit on "warm"
    assert not stream.seq.swapped and engine.kv.host.num_used == 0
    engine.check_integrity()
    engine.run_to_completion(["big"])
    out = _finish(engine, "s")
    assert "swapped_in" not in [name for name, _ in out.events]
    assert out.token_ids == _fresh("QRSTUVWXYZ" * 2 + "ab", num_blocks=10)


def test_a_fork_request_reports_queued_and_scheduled_like_any_request():
    # a session question enters running with its KV: its events began at kv_resident (review)
    engine, _ = slot_engine(num_blocks=40)
    stream = engine.seq_ops.open([1 + i % 60 for i in range(30)])
    while not engine.seq_ops.is_idle(stream):
        engine.step()
    engine.add_fork_request("q", stream, 30, [5, 6, 7], GREEDY)
    names = [name for name, _ in engine.run_to_completion(["q"])["q"].events]
    assert names[:3] == ["queued", "scheduled", "kv_resident"] and names[-1] == "finished"


def test_swap_preemption_without_swap_space_says_it_recomputes(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="streamkv.engine.engine"):
        slot_engine(preemption="swap")
        assert "every victim is recomputed" in caplog.text
        caplog.clear()
        slot_engine(preemption="swap", swap_blocks=8)
        slot_engine(preemption="cost")  # the default: recompute without swap space, quietly
        assert "every victim is recomputed" not in caplog.text


def test_a_finish_carrying_text_records_the_append():
    # it counted an append but recorded only input_finished (review)
    engine, _ = slot_engine()
    engine.inputs.open("s", prompt=LETTERS[:10], params=GREEDY)
    _drain(engine)
    engine.inputs.finish("s", LETTERS[10:])
    names = [name for name, _ in engine.run_to_completion(["s"])["s"].events]
    assert names.index("input_appended") == names.index("input_finished") - 1
    assert engine.inputs.stats.appends == 1
    engine.inputs.open("t", prompt=LETTERS, params=GREEDY)
    engine.inputs.finish("t")
    assert "input_appended" not in [name for name, _ in engine.run_to_completion(["t"])["t"].events]


def test_an_in_process_handle_can_be_aborted_or_dropped_and_never_expires_while_stepped():
    # helper-60: LLM.open_input's handle had no abort, and a dropped handle kept its KV, its
    # place among max_input_streams (every later open was a QueueFullError for good) and,
    # finished, its output in Engine._kept. The TTL is the server loop's: in-process, the owner
    # may be inside another engine call for longer (helper-63), so steps never expire input.
    import gc

    from streamkv import LLM
    from streamkv.errors import QueueFullError

    engine, _ = slot_engine(max_input_streams=2, input_stream_ttl_s=0.2)
    llm = LLM.__new__(LLM)
    llm.engine, llm._ids = engine, iter(range(100))
    a, b = llm.open_input("abcdefgh", GREEDY), llm.open_input("ijklmnop", GREEDY)
    a.advance()
    b.advance()
    with pytest.raises(QueueFullError):
        llm.open_input("q", GREEDY)
    a.abort()
    del b
    gc.collect()
    assert [o.finish_reason for o in engine.step()] == ["abort", "abort"]
    assert engine.pool.num_used == 0 and not engine._kept
    with pytest.raises(InvalidRequestError, match="aborted"):
        a.result()
    c = llm.open_input("qrstuvwx", GREEDY)  # room again
    c.advance()
    time.sleep(0.3)  # past the TTL: stepping does not expire it
    engine.step()
    c.append("yz")
    assert c.result().finish_reason == "length"
    d = llm.open_input("yzabcdef", GREEDY)
    d.finish()
    _drain(engine)  # answered, but its result never read: dropping the handle forgets it
    assert list(engine._kept) == [d.request_id]
    del d
    engine.step()
    assert not engine._kept
