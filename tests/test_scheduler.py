"""Scheduler and engine logic with a fake runner: no model, no tensors."""
from __future__ import annotations

import random

import pytest

from streamkv.errors import InvalidRequestError
from streamkv.sampling.params import SamplingParams
from tests.fakes import fake_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _run(engine, prompts, params=GREEDY, priorities=None):
    ids = []
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        engine.add_request(rid, p, params, priority=(priorities or [0] * len(prompts))[i])
        ids.append(rid)
    done = engine.run_to_completion(ids)
    engine.check_integrity()
    return [done[r].token_ids for r in ids], done


def _prompts(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(1, 64) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_token_budget_and_seq_cap_respected():
    engine, runner = fake_engine(budget=16, max_num_seqs=3)
    _run(engine, _prompts(8))
    assert runner.plans
    for plan in runner.plans:
        assert plan.num_tokens <= 16
        assert len(plan.seqs) <= 3


def test_outputs_independent_of_batching_chunking_and_preemption():
    prompts = _prompts(12, seed=1)
    solo = []
    for p in prompts:
        engine, _ = fake_engine(num_blocks=256, budget=512, prefix=False)
        solo.append(_run(engine, [p])[0][0])
    for kwargs in (dict(budget=512), dict(budget=7), dict(budget=16, chunk=5),
                   dict(num_blocks=24, budget=64), dict(num_blocks=16, budget=8, block_size=4)):
        engine, _ = fake_engine(**kwargs)
        got, _ = _run(engine, prompts)
        assert got == solo, kwargs


def test_memory_pressure_preempts_lowest_ranked_first():
    engine, runner = fake_engine(num_blocks=14, block_size=4, budget=64)
    prompts = _prompts(6, seed=2, lo=10, hi=14)
    _, done = _run(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    first_victims = [p.preempted for p in runner.plans if p.preempted][0]
    # the earliest-arrived request is ranked highest under FCFS and is never the first victim
    seq_ids = {rid: i for i, rid in enumerate(sorted(done))}
    assert seq_ids["r0"] not in first_victims
    # a readmitted request's own earlier blocks are not "cached prompt tokens" (usage.cached_tokens)
    assert all(o.num_cached_tokens == 0 for o in done.values()), {k: o.num_cached_tokens for k, o in done.items()}


def test_priority_runs_first():
    engine, runner = fake_engine(budget=8, max_num_seqs=1)
    engine.add_request("low", [5] * 6, GREEDY, priority=5)
    engine.add_request("high", [6] * 6, GREEDY, priority=-1)
    engine.step()
    first = runner.plans[0].seqs[0]
    assert list(first.token_ids[:1]) == [6]


def test_prefix_cache_hit_reuses_blocks_and_keeps_output():
    engine, runner = fake_engine(block_size=4, budget=512)
    prompt = list(range(1, 30))
    a, done_a = _run(engine, [prompt])
    engine.add_request("again", prompt, GREEDY)
    b = engine.run_to_completion(["again"])["again"]
    assert b.num_cached_tokens == 28  # 7 full blocks; the last token is always recomputed
    assert b.token_ids == a[0]
    assert engine.pool.prefix_hits >= 7


def test_stop_token_and_max_tokens():
    engine, _ = fake_engine(eos_after=3)
    _, done = _run(engine, [[1, 2, 3]], SamplingParams(max_tokens=10, temperature=0))
    out = done["r0"]
    assert out.finish_reason == "stop" and len(out.token_ids) == 4 and out.token_ids[-1] == 0
    engine, _ = fake_engine(eos_after=3)
    _, done = _run(engine, [[1, 2, 3]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert done["r0"].finish_reason == "length" and len(done["r0"].token_ids) == 10


def test_context_limit_finishes_with_length():
    engine, _ = fake_engine(max_model_len=20)
    _, done = _run(engine, [[1] * 15], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert done["r0"].finish_reason == "length"
    assert len(done["r0"].prompt_token_ids) + len(done["r0"].token_ids) == 20


def test_a_request_outgrowing_the_whole_pool_finishes_and_is_reported():
    """The scheduler ends a sequence that needs more KV than the pool holds; its request
    gets its final output and the engine goes idle (it used to stay unfinished forever)."""
    engine, _ = fake_engine(num_blocks=4, block_size=4, budget=64)  # 16 rows
    engine.add_request("big", list(range(1, 13)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    done = {}
    for _ in range(50):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        if not engine.has_unfinished():
            break
    assert done["big"].finish_reason == "length" and not engine.has_unfinished()
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_request_preempted_when_it_holds_the_whole_pool_finishes_instead_of_waiting_forever(preemption):
    """A request holding every block, whose next row needs one more, was preempted (by a more
    urgent request, or by itself for want of a block while others ran) and could never come
    back: waiting, it also held up everything ranked after it, and the engine spun (review).
    It now finishes "length" as it would alone, and the others run."""
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=10, block_size=2, preemption=preemption, swap_blocks=30)  # 20 rows
    engine.add_request("a", "abcdefghijklmno", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                       priority=5)
    seq = engine._requests["a"].seq
    while len(seq.tokens) < 21:  # 20 rows computed: all 10 blocks; the next row needs an 11th
        engine.step()
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("c", "pqrst", short, priority=0)
    engine.add_request("d", "uvw", short, priority=9)
    done = {}
    for _ in range(300):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        if not engine.has_unfinished():
            break
    assert sorted(done) == ["a", "c", "d"] and not engine.has_unfinished()
    assert done["a"].finish_reason == "length" and len(done["a"].token_ids) == 6  # 15 + 6 = 21 tokens
    assert [len(done[r].token_ids) for r in "cd"] == [3, 3]
    assert engine.pool.num_used == 0 and engine.kv.host.num_used == 0
    engine.check_integrity()


def test_abort_frees_blocks():
    engine, _ = fake_engine()
    engine.add_request("a", [1] * 30, GREEDY)
    engine.add_request("b", [2] * 30, GREEDY)
    engine.step()
    assert engine.pool.num_used > 0
    assert engine.abort("a")
    outs = engine.step()
    assert any(o.request_id == "a" and o.finish_reason == "abort" for o in outs)
    engine.run_to_completion(["b"])
    engine.check_integrity()
    assert all(b.ref_count == 0 for b in engine.pool.blocks)


@pytest.mark.parametrize("prompt,match", [
    ([], "empty"), ("", "empty"), ([1] * 600, "context"), ([999], "vocabulary"), ([-1], "vocabulary"),
])
def test_bad_prompts_rejected_without_side_effects(prompt, match):
    engine, _ = fake_engine()
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("x", prompt, GREEDY)
    assert not engine.has_unfinished()
    got, _ = _run(engine, [[1, 2, 3]])
    assert len(got[0]) == 12


def test_prompt_larger_than_pool_rejected():
    engine, _ = fake_engine(num_blocks=4, block_size=4)
    with pytest.raises(InvalidRequestError, match="KV cache"):
        engine.add_request("x", [1] * 20, GREEDY)


def test_duplicate_request_id_rejected():
    engine, _ = fake_engine()
    engine.add_request("x", [1, 2], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("x", [1, 2], GREEDY)


def test_failing_step_fails_only_its_requests():
    engine, runner = fake_engine()
    real = runner.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(plan)

    runner.execute = flaky  # type: ignore[method-assign]
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.step()
    outs = engine.step()
    assert outs and outs[0].finish_reason == "error" and "boom" in outs[0].error
    got, _ = _run(engine, [[4, 5, 6]])
    assert len(got[0]) == 12


def test_a_step_that_fails_before_its_swap_out_copies_leaves_the_victim_whole():
    """A swapped-out victim is not one of the failed step's requests, so it lived on, marked
    swapped, with host blocks the copies never wrote: its swap-in then read rows that were
    never written (the slot runner asserts on them) and it failed too. It recomputes now."""
    from tests.fakes import slot_engine

    def run(fail: bool):
        engine, runner = slot_engine(num_blocks=10, block_size=4, budget=64, preemption="swap", swap_blocks=8)
        real, armed = runner.kv_ops.swap, [fail]

        def swap(out, into):  # the first step that swaps out fails before copying
            if out and armed[0]:
                armed[0] = False
                raise RuntimeError("boom before the copies")
            return real(out, into)

        runner.kv_ops.swap = swap
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        engine.add_request("s", "abcdefghijklmnopqrstuv", params)  # 22 tokens, 6 blocks
        for _ in range(2):
            engine.step()
        engine.add_request("big", "zyxwvutsrqponmlkjihgfedcbazyxwvu", params, priority=-1)  # s makes room
        done = engine.run_to_completion(["s", "big"])
        engine.check_integrity()
        assert engine.pool.num_used == 0 and engine.kv.host.num_used == 0
        return done, engine

    ref, _ = run(fail=False)
    got, engine = run(fail=True)
    assert got["big"].finish_reason == "error" and "boom" in got["big"].error
    assert got["s"].finish_reason == ref["s"].finish_reason and got["s"].token_ids == ref["s"].token_ids
    assert engine.scheduler.preemptions_by_kind["swap"] == 1


def test_a_read_policy_covers_only_the_fork_own_rows_even_after_preemption():
    """The plan carries a fork's read policy for rows at or after the fork point only; a
    recompute preemption drops only the fork's own rows (its parent's stay: a session's
    re-positioned window is nothing a prefill of the ids gives back), so it resumes there."""
    from streamkv.policies import QuestPolicy

    engine, runner = fake_engine(num_blocks=64, block_size=4, budget=16)
    stream = engine.seq_ops.open([1 + i % 60 for i in range(40)])  # whole blocks: no partial-block copy
    while not engine.seq_ops.is_idle(stream):
        engine.step()
    policy = QuestPolicy(budget_tokens=16, sink_tokens=4, recent_tokens=4)
    fork = engine.add_fork_request("q", stream, 40, [5, 6, 7], GREEDY, read=policy)
    assert fork.read_from == 40 and not fork.cacheable
    engine.step()                            # the fork's own rows get KV
    assert fork.num_computed > 40
    engine.scheduler._preempt(fork)          # recompute: back to the fork point, still running
    assert fork.num_computed == fork.forked_rows == 40 and fork.status.name == "RUNNING"
    assert engine.scheduler.preemptions_by_kind["recompute"] == 1
    engine.run_to_completion(["q"])
    items = [s for p in runner.plans for s in p.seqs if s.seq_id == fork.seq_id]
    assert [s.start for s in items][:2] == [40, 40]  # its rows computed twice, the prefix never
    assert all(s.read is policy for s in items)


def test_a_waiting_request_that_cannot_fit_does_not_stall_pinned_streams():
    """The pool is held by pinned streams that need one more block each to finish; a waiting
    request larger than everything free (and nothing unpinned to preempt) must not take the
    step budget nor block them (it would never fit until they finish: a deadlock)."""
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=12, block_size=4, budget=4)
    ops = engine.seq_ops
    streams = [ops.open(list(range(1, 16))) for _ in range(2)]  # 2 x 4 blocks
    for _ in range(20):
        engine.step()
    assert all(ops.is_idle(s) for s in streams)
    engine.add_request("big", list(range(1, 30)), SamplingParams(max_tokens=2, temperature=0))  # 8 blocks > 4 free
    for s in streams:
        ops.append(s, [7, 8, 9, 10, 11])  # each needs 2 more blocks
    for _ in range(10):
        engine.step()
    assert all(ops.is_idle(s) for s in streams)  # the streams progressed past the blocked request
    for s in streams:
        ops.close(s)
    done = engine.run_to_completion(["big"])
    assert done["big"].finish_reason == "length"
    engine.check_integrity()


def test_adaptive_chunks_share_the_budget_between_prefilling_sequences():
    from streamkv.config import SchedulerConfig

    cfg = SchedulerConfig(max_num_batched_tokens=2048)
    assert [cfg.chunk_for(n) for n in (1, 2, 4, 16, 64)] == [1024, 1024, 512, 128, 128]
    # between prompts the gauge read 2048, the static cap, above chunk_max_tokens (review)
    assert cfg.chunk_for(0) == 1024 and SchedulerConfig(chunking="static").chunk_for(0) == 2048
    assert SchedulerConfig(max_num_batched_tokens=2048, chunking="static").chunk_for(4) == 2048
    assert SchedulerConfig(max_num_batched_tokens=2048, max_chunk_tokens=300).chunk_for(1) == 300
    with pytest.raises(ValueError, match="chunking"):
        SchedulerConfig(chunking="fair")
    with pytest.raises(ValueError, match="chunk_min_tokens"):
        SchedulerConfig(chunk_min_tokens=64, chunk_max_tokens=32)
    # in the engine: one long prompt takes 32-row chunks; four prompts take 16-row chunks each
    engine, runner = fake_engine(num_blocks=256, budget=64, chunk_min_tokens=8, chunk_max_tokens=32)
    _run(engine, [[3] * 100])
    assert max(it.num_tokens for plan in runner.plans for it in plan.seqs) == 32
    engine, runner = fake_engine(num_blocks=256, budget=64, chunk_min_tokens=8, chunk_max_tokens=32)
    _run(engine, _prompts(4, seed=9, lo=60, hi=61))
    first = runner.plans[0]
    assert [it.num_tokens for it in first.seqs] == [16, 16, 16, 16]
    engine, runner = fake_engine(num_blocks=256, budget=64, chunk_min_tokens=8, chunk_max_tokens=32,
                                 chunking="static")
    _run(engine, _prompts(4, seed=9, lo=60, hi=61))
    assert [it.num_tokens for it in runner.plans[0].seqs] == [60, 4]


def test_cell_budget_admission_delays_never_rejects_and_keeps_outputs():
    # 64 blocks x 4 = 256 tokens; ceiling 0.5 -> 128 projected tokens; each request projects 20 + 30 = 50
    prompts = _prompts(6, seed=11, lo=20, hi=21)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain, _ = fake_engine(num_blocks=64, budget=64)
    want, _ = _run(plain, prompts, params)
    engine, runner = fake_engine(num_blocks=64, budget=64, admission="cell-budget")
    got, done = _run(engine, prompts, params)
    assert got == want and all(o.finish_reason == "length" for o in done.values())
    admitted: set[int] = set()
    for plan in runner.plans:  # at most two requests (100 projected tokens) hold KV at once
        admitted |= {it.seq_id for it in plan.seqs}
        admitted -= set(plan.released)
        assert len(admitted) <= 2
    assert engine.scheduler.admission.stats.deferred_requests > 0
    # a request larger than the ceiling still runs, alone
    engine, _ = fake_engine(num_blocks=64, budget=64, admission="cell-budget")
    out, _ = _run(engine, [[5] * 100], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    assert len(out[0]) == 60
    with pytest.raises(ValueError, match="admission"):
        fake_engine(admission="fair")


def test_a_fork_is_charged_only_its_own_rows():
    # a session query forks the session's window: charged prompt + max_tokens, one 100-token
    # window's query held back every new request under a 128-token ceiling (helper-23)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine, _ = fake_engine(num_blocks=64, budget=64, admission="cell-budget")
    stream = engine.seq_ops.open([1 + i % 60 for i in range(100)])  # a pinned window: exempt
    while not engine.seq_ops.is_idle(stream):
        engine.step()
    engine.add_fork_request("q", stream, 100, [5, 6], params)  # its own rows: 2 + 10
    engine.step()
    engine.add_request("r", [7] * 20, params)  # 30 more: well under the ceiling beside 12
    engine.step()
    assert engine.scheduler.admission.stats.charged_tokens == 12 + 30  # the fork's own rows, then r's
    assert engine.scheduler.admission.stats.deferred_requests == 0
    assert engine.run_to_completion(["q", "r"])["r"].finish_reason == "length"
    # the gauge (/metrics: streamkv_admission_charged_tokens) is current once they finish, with
    # no step after them: an idle server showed its last request's charge for good (helper-33)
    assert engine.scheduler.admission.stats.charged_tokens == 0
    engine.add_request("s", [7] * 20, params)
    engine.step()
    assert engine.scheduler.admission.stats.charged_tokens == 30
    engine.abort("s")
    assert engine.scheduler.admission.stats.charged_tokens == 0


@pytest.mark.parametrize("first,second,queue", [(5, -5, "fcfs"), (0, 0, "lcas")])
def test_a_deferred_request_ranked_above_a_running_one_lets_it_finish(first, second, queue):
    # the deferred request outranks the running one (a lower priority value; under LCAS, the
    # newer arrival): the running one must keep decoding, else the charge never drops and both
    # wait forever (the engine spun, counting ~40k deferrals a second, until the client left)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine, _ = fake_engine(num_blocks=64, budget=64, admission="cell-budget", queue_policy=queue)
    engine.add_request("a", [7] * 20, params, priority=first)  # projects 50 of the 128-token ceiling
    for _ in range(3):
        engine.step()
    engine.add_request("b", [9] * 70, params, priority=second)  # 100 more: deferred while "a" runs
    done = {}
    for _ in range(300):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if len(done) == 2:
            break
    assert sorted(done) == ["a", "b"] and all(len(o.token_ids) == 30 for o in done.values())
    assert engine.scheduler.admission.stats.deferred_requests > 0
    engine.check_integrity()


def test_a_request_over_the_ceiling_runs_while_session_questions_keep_coming():
    """A request projecting more than the ceiling runs only alone; questions (forks of a
    session's window, which enter running without admission) were charged too, so while they
    overlapped it never started, and the request behind it waited as long (review: both still
    waiting after 500 steps of one question every 4 steps). Forks no longer count against
    "alone"."""
    from streamkv.config import CacheConfig, EngineConfig, SchedulerConfig
    from streamkv.engine.engine import Engine
    from streamkv.engine.factory import ModelBundle
    from tests.fakes import VOCAB, FakeTokenizer, SlotFakeRunner

    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64), scheduler=SchedulerConfig(
        max_num_batched_tokens=64, admission="cell-budget", admission_ceiling=0.5, speculation="none"))
    engine = Engine(config, ModelBundle(SlotFakeRunner(4, 64), FakeTokenizer(), 512, VOCAB, 64))
    stream = engine.seq_ops.open([1 + i % 60 for i in range(40)])  # a session's window (pinned: exempt)
    while not engine.seq_ops.is_idle(stream):
        engine.step()
    params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    engine.add_request("big", [7] * 20, params(120))  # 140 projected tokens > 0.5 x 256
    engine.add_request("small", [9] * 10, params(10))
    done, asked = {}, 0
    for step in range(400):
        if step % 4 == 0:  # one short question every 4 steps, each living ~9
            engine.add_fork_request(f"q{asked}", stream, 40, [5, 6, 7], params(8))
            asked += 1
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [len(done[r].token_ids) for r in ("big", "small")] == [120, 10]
    assert sum(r.startswith("q") for r in done) >= asked - 3
    engine.check_integrity()


def test_adaptive_chunks_count_only_the_prompts_admission_lets_in():
    """Nine queued 120-token prompts, one admitted at a time by the cell budget: the admitted
    one got 64 / 9 = 7 rows a step, with the rest of the step's budget unused, because the
    adaptive chunk counted the deferred prompts too (review). It now gets whole chunks; the
    outputs are those without admission."""
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)  # 320 projected: one at a time
    prompts = [[1 + (i + j) % 60 for j in range(120)] for i in range(9)]
    outs = {}
    for admission in ("none", "cell-budget"):
        engine, runner = fake_engine(num_blocks=256, budget=64, chunk_min_tokens=4, chunk_max_tokens=64,
                                     admission=admission, admission_ceiling=0.3)
        outs[admission], _ = _run(engine, prompts, params)
        first = runner.plans[0].seqs
        if admission == "none":
            assert [it.num_tokens for it in first] == [7] * 9
        else:
            assert [it.num_tokens for it in first] == [64]  # the one admitted prompt: a whole chunk
            assert engine.scheduler.admission.stats.deferred_requests > 0
    assert outs["cell-budget"] == outs["none"]


def test_high_water_holds_prompt_chunks_back_and_outputs_stay():
    prompts = _prompts(5, seed=12, lo=30, hi=40)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain, _ = fake_engine(num_blocks=48, budget=32, chunk=8)
    want, _ = _run(plain, prompts, params)
    engine, runner = fake_engine(num_blocks=48, budget=32, chunk=8, admission="cell-budget", admission_ceiling=1.0,
                                 admission_high_water=0.3)
    got, _ = _run(engine, prompts, params)
    assert got == want
    assert engine.scheduler.admission.stats.deferred_chunks > 0
    # every step still makes progress: some sequence computes rows
    assert all(plan.num_tokens > 0 for plan in runner.plans if plan.seqs or not plan.released)


def test_above_high_water_the_one_chunk_goes_to_a_prompt_that_can_move():
    """Above the high-water mark one prompt chunk moves per step. It was marked taken when first
    asked for, so it went to a fork the fork gate then held: the started fork's chunks were
    held too, nothing moved, and the held fork failed (retryable) 64 steps later (review).
    Now the chunk is taken by the prompt that gets rows; both forks answer in full."""
    from streamkv.config import CacheConfig, EngineConfig, SchedulerConfig
    from streamkv.engine.engine import Engine
    from streamkv.engine.factory import ModelBundle
    from streamkv.sched.sequence import PriorityClass
    from tests.fakes import VOCAB, FakeTokenizer, SlotFakeRunner

    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=40), scheduler=SchedulerConfig(
        max_num_batched_tokens=32, max_chunk_tokens=4, fork_gate=True, speculation="none",
        admission="cell-budget", admission_ceiling=1.0, admission_high_water=0.3))
    engine = Engine(config, ModelBundle(SlotFakeRunner(4, 40), FakeTokenizer(), 512, VOCAB, 40))
    stream = engine.seq_ops.open([1 + i % 60 for i in range(58)])  # pinned: 15 of 40 blocks, above 30%
    while not engine.seq_ops.is_idle(stream):
        engine.step()
    params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    s = engine.add_fork_request("S", stream, 58, list(range(1, 13)), params(60), klass=PriorityClass.POOL)
    engine.step()
    assert s.num_computed > s.forked_rows  # S started
    engine.add_fork_request("P", stream, 58, list(range(20, 28)), params(30), priority=-1, klass=PriorityClass.POOL)
    done, stuck = {}, 0
    for _ in range(400):
        before = s.num_computed
        done.update({o.request_id: o for o in engine.step() if o.finished})
        stuck += "S" not in done and s.num_computed == before
        if len(done) == 2:
            break
    assert {k: (o.finish_reason, len(o.token_ids)) for k, o in done.items()} == {"S": ("length", 60),
                                                                              "P": ("length", 30)}
    assert stuck == 0
    engine.check_integrity()


def test_above_high_water_a_chunk_taker_that_finds_no_block_lets_the_next_prompt_move():
    """Question A needs 3 new blocks of a 19-block pool that a session's stream mostly holds;
    question B needs none. Above the high-water mark A took the step's one chunk, found no
    block, and B's chunk was held: nothing moved, and after 64 quiet steps A failed (503),
    where without admission B answers at once and A after it (review). A taker that found no
    block sits the next step out; both answer as without admission."""
    from streamkv.config import CacheConfig, EngineConfig, SchedulerConfig
    from streamkv.engine.engine import Engine
    from streamkv.engine.factory import ModelBundle
    from streamkv.sched.sequence import PriorityClass
    from tests.fakes import VOCAB, FakeTokenizer, SlotFakeRunner

    def run(admission: str) -> tuple[dict, int]:
        config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=19), scheduler=SchedulerConfig(
            max_num_batched_tokens=64, speculation="none", admission=admission, admission_high_water=0.85))
        engine = Engine(config, ModelBundle(SlotFakeRunner(4, 19), FakeTokenizer(), 512, VOCAB, 19))
        stream = engine.seq_ops.open([1 + i % 60 for i in range(58)])
        while not engine.seq_ops.is_idle(stream):
            engine.step()
        params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
        engine.add_fork_request("A", stream, 58, list(range(1, 13)), params(2), klass=PriorityClass.POOL)
        engine.add_fork_request("B", stream, 58, [5, 6], params(1), klass=PriorityClass.POOL)
        done: dict = {}
        for step in range(100):
            done.update({o.request_id: (o.finish_reason, o.token_ids) for o in engine.step() if o.finished})
            if len(done) == 2:
                break
        engine.check_integrity()
        return done, step

    want, _ = run("none")
    got, steps = run("cell-budget")
    assert got == want and all(reason == "length" for reason, _ in got.values())
    assert steps < 8  # not 64 quiet steps and a failure


def test_the_cell_budget_counts_every_request_it_holds_and_charges_only_those_that_start():
    """``deferred_requests`` is the (request, step) pairs a new request waited: the requests
    ranked after the first held one were not counted (20 of 40). A request admitted in phase 1
    that then got no rows (here the cadence's 8 prompt rows went to a prompt ranked first) was
    charged all the same: the gauge read 118 of 85 admitted tokens and the next request was
    held for room that was free (review)."""
    from streamkv.sched.cadence import StepAllowance
    from streamkv.sched.sequence import SeqStatus

    engine, _ = fake_engine(num_blocks=64, budget=256, admission="cell-budget", speculation="none",
                            grouped_prefill=False)
    schedule, held = engine.scheduler.schedule, [0]

    def counted():
        before = {s.seq_id for s in engine.scheduler.seqs.values() if s.status is SeqStatus.WAITING}
        plan = schedule()
        held[0] += len(before & {s.seq_id for s in engine.scheduler.seqs.values() if s.status is SeqStatus.WAITING})
        return plan

    engine.scheduler.schedule = counted
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    _run(engine, [[1 + (7 * i + j) % 60 for j in range(20)] for i in range(5)], params)  # 40 tokens each, ceiling 128
    assert engine.scheduler.admission.stats.deferred_requests == held[0] > 20

    engine, _ = fake_engine(num_blocks=64, budget=64, chunk=8, admission="cell-budget", stall_factor=3.0,
                            speculation="none", grouped_prefill=False)
    sched = engine.scheduler
    sched.cadence.allowance = lambda budget: StepAllowance(seconds=8.0, row_s=1.0, row_context_s=0.0)  # 8 rows
    p = lambda m: SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)  # noqa: E731
    engine.add_request("D", [1, 2, 3], p(40))  # a decoder: 43 tokens
    engine.step()
    engine.step()
    for rid, prompt, m in (("P", list(range(1, 41)), 2), ("R", [5, 6, 7], 30), ("S", [8, 9, 10], 30)):
        engine.add_request(rid, prompt, p(m))  # 42 + 33 + 33: S fits beside what starts (D, P)
    engine.step()
    running = [s for s in sched.seqs.values() if s.status is SeqStatus.RUNNING]
    assert sched.admission.stats.charged_tokens == sum(s.num_prompt_tokens + s.params.max_tokens for s in running)
    assert sched.admission.stats.deferred_requests == 0


def test_a_started_question_finishes_beside_a_request_that_cannot_fit_with_its_session():
    """A session's pinned stream holds 15 of 24 blocks; a question (a fork of it) has started
    when a request ranked above it arrives that needs 9 blocks and will need 12. Phase 1
    counted every block the question held (its session's too) as reclaimable, so the request
    preempted the question every step, never fit, and neither ever finished. Now the request
    waits (for the session to go: here it is closed) and the question runs past it, as a fork
    at its fork point does."""
    from streamkv.sched.sequence import PriorityClass
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=24, block_size=4, budget=16, repeat=5, speculation="pld")
    stream = engine.seq_ops.open([1 + i % 60 for i in range(58)])
    while not engine.seq_ops.is_idle(stream):
        engine.step()
    params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    engine.add_request("big", [1, 2, 3, 4, 5] * 3, params(30), priority=-1)
    for _ in range(3):
        engine.step()
    engine.add_fork_request("q", stream, 58, list(range(1, 13)), params(2), klass=PriorityClass.POOL)
    done: dict = {}
    for _ in range(60):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
    assert done["q"].finish_reason == "length" and len(done["q"].token_ids) == 2
    assert "big" not in done  # it cannot fit beside the session
    engine.seq_ops.close(stream)
    assert engine.run_to_completion(["big"])["big"].finish_reason == "length"
    engine.check_integrity()
    assert engine.pool.num_used == 0


def test_a_request_that_fits_once_two_sharers_of_a_prefix_go_is_not_held_for_good():
    """A and B share a 16-token prefix (a prefix hit) and run; C, ranked above them, needs 13
    of 16 blocks: free blocks and both requests' own ones are 12, the prefix's 4 more come back
    only when both go. Counted one by one (as 39c03f1 counted them), the prefix never came
    back: C was found not to fit, held A and B behind it, and nothing ever ran (review)."""
    engine, _ = fake_engine(num_blocks=16, block_size=4, budget=64)
    params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    engine.add_request("A", [7] * 16 + [1, 2], params(20))
    engine.step()
    engine.step()
    engine.add_request("B", [7] * 16 + [3, 4], params(20))
    for _ in range(3):
        engine.step()
    engine.add_request("C", [10 + i % 50 for i in range(52)], params(4), priority=-1)
    done: dict = {}
    for _ in range(100):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if len(done) == 3:
            break
    assert {k: o.finish_reason for k, o in done.items()} == {"A": "length", "B": "length", "C": "length"}
    engine.check_integrity()


def test_above_high_water_prompts_go_one_at_a_time_and_outputs_stay():
    # a pinned stream holds 40 of 64 blocks, above the 60% high water from the first step. New
    # requests then start only when no admitted prompt is still prefilling: admitting them beside
    # held chunks piled up half-computed prompts, each holding KV, that preempted one another on
    # a tight pool (README, "tight pool": 10-25 preemptions where no admission had none)
    prompts = _prompts(4, seed=13, lo=24, hi=25)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain, _ = fake_engine(num_blocks=64, budget=32, chunk=8)
    want, _ = _run(plain, prompts, params)
    engine, runner = fake_engine(num_blocks=64, budget=32, chunk=8, admission="cell-budget",
                                 admission_ceiling=1.0, admission_high_water=0.6)
    stream = engine.seq_ops.open([1 + i % 60 for i in range(160)])
    while not engine.seq_ops.is_idle(stream):
        engine.step()
    assert engine.kv.pool.num_used > 0.6 * 64
    runner.plans.clear()
    got, _ = _run(engine, prompts, params)
    assert got == want
    mid: set[int] = set()  # unpinned sequences with part of their prompt computed
    for plan in runner.plans:
        for it in plan.seqs:
            if it.seq_id != stream and it.start < it.num_prompt:
                mid.add(it.seq_id)
                if it.start + it.num_tokens >= it.num_prompt:
                    mid.discard(it.seq_id)
        assert len(mid) <= 1 and not plan.preempted
    assert engine.scheduler.admission.stats.deferred_requests > 0


def test_a_fork_that_can_never_grow_fails_as_retryable():
    # a fork keeps its parent's rows (never dropped); when the rest of the pool is pinned and
    # nothing runs, its request fails after STALL_STEPS empty steps (a 503), not a spin for ever
    from streamkv.engine.engine import STALL_STEPS
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=20, block_size=4)
    stream = engine.seq_ops.open([1 + i % 60 for i in range(60)])  # 15 of the 20 blocks, pinned
    other = engine.seq_ops.open([2 + i % 50 for i in range(16)])  # 4 more: one block left
    while not (engine.seq_ops.is_idle(stream) and engine.seq_ops.is_idle(other)):
        engine.step()
    fork = engine.add_fork_request("q", stream, 60, list(range(1, 9)), SamplingParams(max_tokens=4, temperature=0))
    assert fork.forked_rows == 60
    done = {}
    for _ in range(STALL_STEPS + 20):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if done:
            break
    out = done["q"]
    assert out.finish_reason == "error" and out.retry and "KVCacheFullError" in out.error
    assert engine.scheduler.preemptions_by_kind["recompute"] == 0  # waited: nothing of its own to drop
    engine.seq_ops.close(stream)
    engine.seq_ops.close(other)
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks


def _forked_stream(engine, rows=58):
    """A pinned stream of ``rows`` tokens, computed (block size 4: its last block is partial)."""
    stream = engine.seq_ops.open([1 + i % 60 for i in range(rows)])
    while not engine.seq_ops.is_idle(stream):
        engine.step()
    return stream


def _finish_all(engine, ids, steps=200):
    done = {}
    for _ in range(steps):
        done.update({o.request_id: o for o in engine.step() if o.finished and o.request_id in ids})
        if len(done) == len(ids):
            break
    return done


def test_a_fork_at_its_fork_point_runs_past_a_request_that_cannot_fit_until_it_ends():
    # helper-29's hang (80-block pool, 24 session questions): a request ranked above forks at
    # their fork point could not fit, and nothing below it ran; preempting such a fork gives
    # nothing back, so only its finishing frees the blocks the request needs. The engine spun
    # (~180 empty steps a second, no stall counted) until every client gave up.
    from streamkv.sched.sequence import PriorityClass
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=20, block_size=4)
    stream = _forked_stream(engine)  # 15 blocks, pinned
    params = SamplingParams(max_tokens=4, temperature=0)
    engine.add_fork_request("q", stream, 58, [5, 6, 7], params, klass=PriorityClass.POOL)  # copies the partial block
    assert engine.pool.num_free == 4
    engine.add_request("w", [9] * 17, SamplingParams(max_tokens=1, temperature=0), priority=-1)  # 5 blocks
    done = _finish_all(engine, {"q", "w"})
    assert sorted(done) == ["q", "w"] and all(o.finish_reason == "length" for o in done.values())
    alone, _ = slot_engine(num_blocks=40, block_size=4)
    fork = alone.add_fork_request("q", _forked_stream(alone), 58, [5, 6, 7], params)
    assert _finish_all(alone, {"q"})["q"].token_ids == done["q"].token_ids and fork.forked_rows == 58
    engine.seq_ops.close(stream)
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_a_preempted_fork_keeps_sharing_its_parents_blocks(preemption):
    # swapping a fork out moved its parent's rows too, and brought them back as private copies:
    # here it then needed 16 free blocks of the 9 a pinned parent leaves, and waited for good
    from streamkv.sched.sequence import PriorityClass
    from tests.fakes import slot_engine

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine, _ = slot_engine(num_blocks=24, block_size=4, swap_blocks=64, preemption=preemption)
    stream = _forked_stream(engine)
    fork = engine.add_fork_request("q", stream, 58, [5, 6, 7], params, klass=PriorityClass.POOL)
    for _ in range(4):  # past its fork point: 3 question rows and 3 generated ones
        engine.step()
    assert fork.num_computed > fork.forked_rows
    engine.add_request("w", [9] * 32, SamplingParams(max_tokens=1, temperature=0), priority=-1)  # 8 blocks of 7 free
    shared = engine.kv.block_table(stream.seq_id)[:14]
    done = {}
    for _ in range(200):
        if engine.kv.has(fork.seq_id):
            assert engine.kv.block_table(fork.seq_id)[:14] == shared
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if len(done) == 2:
            break
    assert sorted(done) == ["q", "w"]
    assert engine.scheduler.preemptions_by_kind == {"recompute": 1, "swap": 0}
    alone, _ = slot_engine(num_blocks=40, block_size=4)
    alone.add_fork_request("q", _forked_stream(alone), 58, [5, 6, 7], params)
    assert _finish_all(alone, {"q"})["q"].token_ids == done["q"].token_ids
    engine.seq_ops.close(stream)
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks and engine.kv.host.num_free == engine.kv.host.num_blocks


@pytest.mark.parametrize("num_blocks,forks,max_tokens,chunk", [(24, 5, 30, None), (30, 8, 40, 8), (28, 6, 50, 16)])
def test_forks_that_cannot_all_fit_beside_their_parent_end_without_thrashing(num_blocks, forks, max_tokens, chunk):
    # question forks, each holding its copy of the parent's partial block, beside a pinned
    # parent: the first needs more than the pool has left. (24, 5): letting forks at their fork
    # point pass a running fork that could not grow made them take the blocks it had just given
    # back (truncating itself), step after step: 1,017 preemptions in 2,000 steps, nothing
    # finished. (30, 8) and (28, 6): a fork that could not grow truncated itself and recomputed
    # its rows, step after step; those steps counted as work, so the forks waiting behind it
    # never counted as stalled (nothing finished in 3,000 steps; the 128-block burst of
    # /tmp/s48 spun so for two minutes). Steps that only recompute rows are not progress now.
    from tests.fakes import slot_engine

    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, seed=i) for i in range(forks)]
    engine, _ = slot_engine(num_blocks=num_blocks, block_size=4, chunk=chunk)
    stream = _forked_stream(engine)
    for i, p in enumerate(params):
        engine.add_fork_request(f"q{i}", stream, 58, [5 + i, 6, 7], p)
    done = _finish_all(engine, {f"q{i}" for i in range(forks)}, steps=1500)
    assert len(done) == forks and engine.scheduler.num_preemptions < 400
    served = {rid: o for rid, o in done.items() if o.finish_reason == "length"}
    assert all(o.retry for o in done.values() if o.finish_reason == "error")
    alone, _ = slot_engine(num_blocks=64, block_size=4)
    parent = _forked_stream(alone)
    for rid in served:
        i = int(rid[1:])
        alone.add_fork_request(rid, parent, 58, [5 + i, 6, 7], params[i])
    assert {rid: o.token_ids for rid, o in _finish_all(alone, set(served)).items()} == {
        rid: o.token_ids for rid, o in served.items()}
    engine.seq_ops.close(stream)
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks


def _two_forks_and(engine, extra):
    """Two forks of a pinned 58-token parent that each fit beside it alone, not together,
    then ``extra(engine)`` adds a third request; returns each request's end (step, output)."""
    from streamkv.sched.sequence import PriorityClass

    stream = _forked_stream(engine)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(2):
        engine.add_fork_request(f"q{i}", stream, 58, [5 + i, 6, 7, 8, 9, 10, 11, 12, 13, 14], params,
                                klass=PriorityClass.POOL)
    ids = {"q0", "q1", extra(engine)}
    done = _finish_all(engine, ids, steps=1500)
    engine.seq_ops.close(stream)
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks
    return done


@pytest.mark.parametrize("chunk", [4, 8, 16, None])
def test_a_stall_fails_one_fork_then_waits_for_the_survivor_to_recompute(chunk):
    # helper-30: once one fork failed, the survivor recomputed the rows it had had (no new
    # row for a few steps), and the rule failed it the very next step: both forks 503'd
    from tests.fakes import slot_engine

    def urgent(engine):
        for _ in range(3):
            engine.step()
        engine.add_request("w", [9] * 30, SamplingParams(max_tokens=1, temperature=0), priority=-1)
        return "w"

    done = _two_forks_and(slot_engine(num_blocks=28, block_size=4, chunk=chunk)[0], urgent)
    assert len(done) == 3 and done["w"].finish_reason == "length"
    assert sorted(done[q].finish_reason for q in ("q0", "q1")) == ["error", "length"]


def test_a_plain_request_is_never_failed_for_a_sessions_blocks():
    # helper-30: a plain request that preempted itself (holding nothing afterwards) counted as
    # held back and was failed with "held by sessions and their queries", freeing nothing
    from tests.fakes import slot_engine

    def plain(engine):
        engine.add_request("r1", [(7 * i) % 50 + 1 for i in range(12)],
                           SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        return "r1"

    done = _two_forks_and(slot_engine(num_blocks=28, block_size=4, chunk=8)[0], plain)
    assert len(done) == 3 and done["r1"].finish_reason == "length"


def test_a_small_fork_runs_past_a_fork_at_its_fork_point_that_gave_nothing_back():
    # helper-30: fork A (16 question rows: 4 blocks of 3 free) waits at its fork point; fork B
    # (1 row) held back behind it meant neither ran, and one failed after 64 steps; B's finish
    # gives A the block it lacks
    from streamkv.sched.sequence import PriorityClass
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=20, block_size=4)
    stream = _forked_stream(engine)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_fork_request("A", stream, 58, list(range(1, 17)), params, klass=PriorityClass.POOL)
    engine.add_fork_request("B", stream, 58, [5], params, klass=PriorityClass.POOL)
    done = _finish_all(engine, {"A", "B"}, steps=200)
    assert {rid: o.finish_reason for rid, o in done.items()} == {"A": "length", "B": "length"}


def test_reclaiming_for_a_restore_preempts_nobody_when_everyone_could_not_free_enough():
    # helper-28: a question restoring its offloaded session preempted running requests that
    # together freed too little; the restore failed anyway (503) and their work was lost
    from streamkv.sched.sequence import PriorityClass
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=24, block_size=4)
    stream = _forked_stream(engine)  # 15 blocks, pinned
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("r0", [3] * 10, params)
    engine.add_request("r1", [4] * 10, params)
    for _ in range(2):
        engine.step()
    held = sum(engine.kv.num_unshared(s.seq_id) for s in engine.scheduler.seqs.values() if s.samples)
    free = engine.pool.num_free
    assert held >= 4
    engine.seq_ops.reclaim(free + held + 1, below=PriorityClass.SESSION)
    assert engine.scheduler.num_preemptions == 0 and engine.pool.num_free == free
    engine.seq_ops.reclaim(free + 1, below=PriorityClass.SESSION)  # one request's blocks suffice
    assert engine.scheduler.num_preemptions == 1 and engine.pool.num_free > free
    done = engine.run_to_completion(["r0", "r1"])
    alone, _ = slot_engine(num_blocks=64, block_size=4)
    alone.add_request("r0", [3] * 10, params)
    alone.add_request("r1", [4] * 10, params)
    want = alone.run_to_completion(["r0", "r1"])
    assert [done[r].token_ids for r in ("r0", "r1")] == [want[r].token_ids for r in ("r0", "r1")]
    engine.seq_ops.close(stream)
    engine.check_integrity()


@pytest.mark.parametrize("num_blocks,forks,max_tokens", [(48, 12, 50), (40, 8, 30)])
def test_the_fork_gate_starts_only_the_forks_the_pool_can_hold_to_their_end(num_blocks, forks, max_tokens):
    # without the gate the forks all start, run out of blocks mid-answer and truncate one
    # another back to their fork points (48 blocks, 12 forks of 3 + 50 rows: 97 preemptions)
    from streamkv.server.metrics import _scheduler_metrics
    from tests.fakes import slot_engine

    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, seed=i) for i in range(forks)]
    runs = {}
    for gate in (True, False):
        engine, _ = slot_engine(num_blocks=num_blocks, block_size=4, fork_gate=gate)
        stream = _forked_stream(engine)
        for i, p in enumerate(params):
            engine.add_fork_request(f"q{i}", stream, 58, [5 + i, 6, 7], p)
        done = _finish_all(engine, {f"q{i}" for i in range(forks)}, steps=2000)
        assert len(done) == forks and all(o.finish_reason == "length" for o in done.values())
        runs[gate] = ({rid: o.token_ids for rid, o in done.items()}, engine.scheduler.num_preemptions,
                      engine.scheduler.fork_gate.stats.deferred if gate else 0)
        metrics = {f.name: f.samples[0].value for f in _scheduler_metrics(engine.scheduler) if f.samples}
        assert metrics["streamkv_fork_gate_reserved_blocks"] == 0  # current once idle, not the last step's
        assert metrics["streamkv_fork_gate_deferred"] == runs[gate][2]
        engine.seq_ops.close(stream)
        engine.check_integrity()
        assert engine.pool.num_free == engine.pool.num_blocks
    (gated_out, gated_preempted, deferred), (free_out, free_preempted, _) = runs[True], runs[False]
    assert gated_out == free_out  # the same answers, in another order of steps
    assert gated_preempted == 0 and deferred > 0 and free_preempted > 0


def test_a_fork_the_gate_holds_is_the_one_failed_when_nothing_progresses():
    # 24 blocks: each fork needs 8 more blocks beyond its copy, 4 are free; the started fork can
    # only finish once held forks give their copied blocks back (failed as retryable, latest first)
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=24, block_size=4)
    stream = _forked_stream(engine)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i in range(5):
        engine.add_fork_request(f"q{i}", stream, 58, [5 + i, 6, 7], params)
    done = _finish_all(engine, {f"q{i}" for i in range(5)}, steps=1500)
    assert done["q0"].finish_reason == "length"  # the first, started, fork is never the one failed
    assert all(done[f"q{i}"].finish_reason == "error" and done[f"q{i}"].retry for i in range(1, 5))
    engine.seq_ops.close(stream)
    engine.check_integrity()


def test_a_fork_admitted_then_given_no_rows_hands_its_reservation_back():
    # the decode cadence may cut an admitted question fork to 0 rows (a prompt ranked above it
    # took the allowance): the blocks its admission reserved go back, so a fork ranked after it
    # that fits starts this step instead of waiting for a step in which nobody computes either
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=24, block_size=4)
    stream = _forked_stream(engine)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    a = engine.add_fork_request("qa", stream, 58, [5, 6, 7], params)
    b = engine.add_fork_request("qb", stream, 58, [8, 6, 7], params)
    gate, seqs = engine.scheduler.fork_gate, engine.scheduler.seqs.values
    gate.begin(seqs())
    free = engine.pool.num_free
    assert max(gate.need(a), gate.need(b)) <= free < gate.need(a) + gate.need(b)  # room for one
    assert gate.admits(a)
    gate.starts(a)
    assert not gate.admits(b)  # b waits while a computes
    gate.begin(seqs())
    assert gate.admits(a)  # a gets no rows after all: it never starts, so it reserves nothing
    assert gate.admits(b) and gate.held == []
    gate.starts(b)
    assert not gate.admits(a) and gate.held == [a.seq_id]
    done = _finish_all(engine, {"qa", "qb"})
    assert all(o.finish_reason == "length" for o in done.values())
    assert gate.stats.reserved == 0  # the gauge is current once idle (it kept the last step's: 1)
    engine.seq_ops.close(stream)
    engine.check_integrity()


def test_a_new_fork_takes_its_copy_only_while_the_gate_can_still_start_a_fork():
    # 24 blocks, a 58-row stream holds 15: a fork of it to 91 rows needs its copied block and 8
    # more. After one such fork 8 blocks are free; a second copy would leave 7, less than any
    # fork at its fork point needs, and the forks' copies would hold the pool with none able to
    # start (the test above: the engine fails them, 64 steps later). A fork that needs 1 more fits.
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=24, block_size=4)
    stream = _forked_stream(engine)
    gate, seqs = engine.scheduler.fork_gate, engine.scheduler.seqs.values
    assert engine.pool.num_free == 9 and gate.room_for(seqs(), 58, 91)
    engine.add_fork_request("q0", stream, 58, [5, 6, 7], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert engine.pool.num_free == 8
    assert not gate.room_for(seqs(), 58, 91)
    assert gate.room_for(seqs(), 58, 63)  # 3 + 2 rows: one block past its copy
    assert gate.room_for(seqs(), 56, 91)  # block-aligned: no copy, and q0 can still start
    done = _finish_all(engine, {"q0"})
    assert done["q0"].finish_reason == "length" and engine.scheduler.fork_gate.stats.deferred == 0
    assert gate.room_for(seqs(), 58, 91)  # q0's blocks came back
    engine.seq_ops.close(stream)
    engine.check_integrity()


def _small_session(num_blocks: int, budget: int):
    """A slot engine with one ingested 17-row session (no scaffold), and the session."""
    from streamkv.sessions.spec import SessionSpec
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=num_blocks, block_size=4, budget=budget, speculation="none")
    s = engine.sessions.create(SessionSpec(system="sys", chat=False, retention_tokens=16, query_prefix="",
                                           query_suffix="", ingest_batch_tokens=8))
    engine.sessions.push(s.id, ["abcdefg"])
    for _ in range(30):
        engine.step()
    return engine, s


def test_a_flash_batch_never_truncates_a_running_question_it_then_cannot_start_beside():
    # helper-59: with the pool full, a due flash batch preempted (truncated to its fork point)
    # the running session question for its copy block, then the fork gate refused the batch;
    # retried every step, the question lost its rows each time and never finished (131
    # preemptions in 400 steps). Running requests are preempted only if that frees what the
    # gate asks for.
    engine, s = _small_session(num_blocks=9, budget=4)
    engine.sessions.query(s.id, "q", "hij", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    while engine.pool.num_free:
        assert not [o for o in engine.step() if o.finished]
    engine.sessions.flash.register(s, "xyz", max_tokens=16)
    done = None
    for _ in range(60):
        done = next((o for o in engine.step() if o.request_id == "q" and o.finished), done)
        engine.check_integrity()
        if done is not None and s.flash.counters["batches"]:
            break
    assert done is not None and done.finish_reason == "length" and len(done.token_ids) == 12
    assert engine.scheduler.num_preemptions == 0 and s.flash.counters["batches"] == 1


def test_a_question_before_the_stream_computed_its_version_is_retryable_and_preempts_nobody():
    # right after create the snapshot is the system prompt, not computed yet: the fork failed
    # with a plain 400 ("cannot fork"), and only after start_query had preempted running
    # requests for its block (a flash batch retried that every step: helper-59's fuzz, seed 828)
    from streamkv.errors import KVCacheFullError
    from streamkv.sessions.spec import SessionSpec
    from tests.fakes import slot_engine

    engine, _ = slot_engine(num_blocks=32, block_size=4)
    s = engine.sessions.create(SessionSpec(system="a system prompt of some length", chat=False, retention_tokens=64,
                                           query_prefix="", query_suffix=""))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with pytest.raises(KVCacheFullError, match="retry later"):
        engine.sessions.query(s.id, "q", "hij", params)
    assert engine.scheduler.num_preemptions == 0 and not engine.has_request("q")
    while s.stream.num_computed < s.data.snapshot_len():
        engine.step()
    engine.sessions.query(s.id, "q", "hij", params)
    assert _finish_all(engine, {"q"}, steps=50)["q"].finish_reason == "length"


def test_a_flash_batch_that_cannot_start_whole_starts_question_by_question():
    # a batch started whole or not at all: when the pool held one question's fork but not two,
    # the first was aborted at every try and the batch never ran (158 aborts in 80 steps, no
    # answer); now the forks started stay, and the rest start as room comes back
    engine, s = _small_session(num_blocks=10, budget=8)
    assert engine.pool.num_free == 5  # one fork's growth fits, two at once do not
    a = engine.sessions.flash.register(s, "xyz", max_tokens=14)
    b = engine.sessions.flash.register(s, "uvw", max_tokens=14)
    aborted = []
    for _ in range(80):
        aborted += [o.request_id for o in engine.step() if o.finish_reason == "abort"]
        engine.check_integrity()
        if s.flash.evaluated_version == s.data.data_version:
            break
    version = s.data.data_version
    assert s.flash.cached(a.id, version) is not None and s.flash.cached(b.id, version) is not None
    assert not aborted and s.flash.counters["batches"] == 1 and s.flash.counters["evaluations"] == 2


def _half_started_batch():
    """A session whose flash batch of two questions has started one fork; the other waits."""
    engine, s = _small_session(num_blocks=10, budget=8)
    flash = engine.sessions.flash
    a, b = flash.register(s, "xyz", max_tokens=14), flash.register(s, "uvw", max_tokens=14)
    while not (s.flash.inflight and s.flash.to_start):
        engine.step()
    return engine, s, a, b


def test_unregistering_a_half_started_batchs_questions_ends_the_batch():
    # helper-63: to_start kept the unregistered question, so the batch never ended, the engine
    # never went idle, and a question registered later was never answered at its version
    engine, s, a, b = _half_started_batch()
    flash = engine.sessions.flash
    flash.unregister(s, a.id)
    flash.unregister(s, b.id)
    for _ in range(40):
        engine.step()
    assert not s.flash.to_start and s.flash.batch_version is None and not engine.has_unfinished()
    c = flash.register(s, "rst", max_tokens=4)
    for _ in range(40):
        engine.step()
    assert s.flash.cached(c.id, s.data.data_version) is not None


def test_a_half_started_batch_releases_its_waiters_when_the_session_goes():
    # helper-63: a delete (or an offload, which strands the questions not started) left the
    # waiters queued: an HTTP flash query then waited out its 120 s timeout
    engine, s, a, b = _half_started_batch()
    landed: list = []
    assert engine.sessions.flash.lookup(s, "uvw", landed.append)[0] == "wait"
    assert engine.sessions.flash.lookup(s, "xyz", landed.append)[0] == "wait"
    engine.sessions.delete(s.id)
    for _ in range(10):
        assert not [o for o in engine.step() if o.request_id.startswith("flash-")]  # none leaks out
    assert landed == [None, None] and not s.flash.waiters and not engine.sessions.flash._owner
    engine.check_integrity()


def test_offloading_a_half_started_batchs_session_ends_the_batch():
    engine, s, a, b = _half_started_batch()
    landed: list = []
    assert engine.sessions.flash.lookup(s, "uvw", landed.append)[0] == "wait"
    assert engine.sessions.offload.offload(s) > 0 and s.where != "pool"
    assert landed == [None] and not s.flash.to_start  # the question falls back to a plain one
    for _ in range(10):
        engine.step()
    engine.check_integrity()


def test_a_flash_question_registered_while_a_batch_runs_is_answered_at_that_version():
    # helper-64: the batch's delivery marked the version evaluated without the new question,
    # which then had no answer until the next push; a next batch answers only it (joining the
    # running batch instead stranded it when the session was offloaded meanwhile: helper-65)
    engine, s = _small_session(num_blocks=32, budget=8)
    flash = engine.sessions.flash
    flash.register(s, "xyz", max_tokens=6)
    while not s.flash.inflight:
        engine.step()
    late = flash.register(s, "uvw", max_tokens=6)
    for _ in range(40):
        engine.step()
    assert s.flash.cached(late.id, s.data.data_version) is not None
    assert s.flash.counters["batches"] == 2 and s.flash.counters["evaluations"] == 2  # nothing evaluated twice
    assert s.flash.evaluated_version == s.data.data_version and not engine.has_unfinished()


def test_a_question_registered_after_its_sessions_offload_mid_batch_strands_nothing():
    # helper-65: a question joining the running batch of a session offloaded meanwhile kept the
    # batch from ever delivering: the answer already computed was never stored, its waiter never
    # released, and the engine idle
    engine, s = _small_session(num_blocks=12, budget=8)
    flash = engine.sessions.flash
    a = flash.register(s, "xyz", max_tokens=14)
    while not (s.flash.inflight and not s.flash.to_start):
        engine.step()
    landed: list = []
    assert flash.lookup(s, "xyz", landed.append)[0] == "wait"
    assert engine.sessions.offload.offload(s) > 0
    flash.register(s, "uvw", max_tokens=4)
    stray = [o.request_id for _ in range(80) for o in engine.step()]
    assert not stray and len(landed) == 1 and landed[0] is not None
    assert s.flash.cached(a.id, s.data.data_version) is not None and not s.flash.waiters
