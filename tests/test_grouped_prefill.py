"""Prefix-aware grouped prefill (``sched/grouping.py``) with fake runners: followers alias a
leader's blocks instead of computing them, and nothing else changes."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from streamkv.sampling.params import SamplingParams
from tests.fakes import fake_engine, slot_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _run(engine, prompts, arrive_at=None, params=GREEDY):
    """Add ``prompts[i]`` before step ``arrive_at[i]`` (all at once by default); outputs in order."""
    arrive_at = arrive_at or [0] * len(prompts)
    done = {}
    step = 0
    while len(done) < len(prompts):
        for i, at in enumerate(arrive_at):
            if at == step:
                engine.add_request(f"r{i}", prompts[i], params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
        step += 1
    return [done[f"r{i}"].token_ids for i in range(len(prompts))]


def _prompt_rows(runner) -> int:
    """Prompt rows the runner computed, summed over requests (decode rows excluded)."""
    rows = 0
    for plan in runner.plans:
        for it in plan.seqs:
            rows += max(0, min(it.start + it.num_tokens, it.num_prompt) - it.start)
    return rows


def _burst(n=8, shared=96, seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(1, 64) for _ in range(shared)]
    return [system + [rng.randrange(1, 64) for _ in range(rng.randrange(5, 12))] for _ in range(n)]


def test_a_burst_sharing_a_system_prompt_computes_it_once():
    prompts = _burst()
    kw = dict(num_blocks=256, budget=64, chunk_min_tokens=8, chunk_max_tokens=32)
    plain, plain_runner = fake_engine(grouped_prefill=False, **kw)
    grouped, runner = fake_engine(**kw)
    assert _run(grouped, prompts) == _run(plain, prompts)
    want = _prompt_rows(plain_runner)
    got = _prompt_rows(runner)
    assert got <= 0.5 * want, (got, want)
    stats = grouped.scheduler.groups.stats
    assert stats.followers == 7
    assert stats.tokens_saved == 7 * 96  # 96 = 24 full blocks of 4: every follower aliased all of it
    assert want - got == stats.tokens_saved
    assert plain.scheduler.groups is None and fake_engine(prefix=False)[0].scheduler.groups is None


def test_followers_spend_no_budget_and_the_leader_gets_the_whole_chunk():
    prompts = _burst(n=4)
    engine, runner = fake_engine(num_blocks=256, budget=64, chunk_min_tokens=8, chunk_max_tokens=32)
    _run(engine, prompts)
    first = runner.plans[0]
    assert [it.seq_id for it in first.seqs] == [min(it.seq_id for it in first.seqs)]  # only the leader
    assert first.seqs[0].num_tokens == 32  # adaptive chunks count one prefilling sequence, not four


def test_a_follower_arriving_mid_prefill_waits_for_the_rest_of_the_shared_part():
    prompts = _burst(n=2, shared=120)
    kw = dict(num_blocks=256, budget=16, chunk_min_tokens=8, chunk_max_tokens=16)
    plain, _ = fake_engine(grouped_prefill=False, **kw)
    grouped, _ = fake_engine(**kw)
    assert _run(grouped, prompts, arrive_at=[0, 3]) == _run(plain, prompts, arrive_at=[0, 3])
    stats = grouped.scheduler.groups.stats
    # at step 3 the leader has computed 48 rows (12 blocks): the follower aliases those as an
    # ordinary prefix hit, then waits for, and aliases, the other 72 shared rows
    assert stats.followers == 1 and stats.tokens_saved == 120 - 48


def test_different_prompts_and_different_cache_keys_are_never_grouped():
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 64) for _ in range(60)] for _ in range(4)]
    engine, _ = fake_engine(num_blocks=256, budget=64)
    _run(engine, prompts)
    assert engine.scheduler.groups.stats.deferred_steps == 0
    # the same tokens after a differing first token: a same-hash key at position 0 never matches
    base = _burst(n=1)[0]
    engine, _ = fake_engine(num_blocks=256, budget=64)
    _run(engine, [base, [base[0] % 63 + 1] + base[1:]])
    assert engine.scheduler.groups.stats.deferred_steps == 0


def test_a_complete_request_never_waits_for_a_streaming_input_leader():
    # the stream ranks above "c" (priority 0 vs 1) but its prefill yields to "o"'s (the lower
    # tier), so "c" following it would wait as long as complete requests keep prefilling
    engine, _ = slot_engine(num_blocks=256, budget=16)
    shared = "abcdefghijklmnopqrstuvwxyz" * 4
    engine.inputs.open("s", prompt=shared, params=GREEDY)
    engine.add_request("o", "zyxwvutsrq" * 8, GREEDY)
    engine.add_request("c", shared + "xyz", GREEDY, priority=1)
    engine.run_to_completion(["o", "c"])
    assert engine.scheduler.groups.stats.deferred_steps == 0
    engine.inputs.finish("s")
    engine.run_to_completion(["s"])
    engine.check_integrity()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), blocks=st.sampled_from([24, 40, 128]), budget=st.sampled_from([8, 16, 64]),
       swap=st.sampled_from([0, 8]))
def test_slot_kv_stays_exact_with_grouping_preemption_and_staggered_arrivals(seed, blocks, budget, swap):
    """Slot-level KV (every row a step reads is checked against the sequence's tokens) when
    followers alias leaders' blocks, leaders are preempted, and requests arrive mid-prefill."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 64) for _ in range(rng.randrange(8, 60))] for _ in range(2)]
    prompts = [rng.choice(systems) + [rng.randrange(1, 64) for _ in range(rng.randrange(1, 10))]
               for _ in range(rng.randrange(2, 7))]
    arrive = [rng.randrange(0, 6) for _ in prompts]
    kw = dict(num_blocks=blocks, budget=budget, swap_blocks=swap, preemption="swap" if swap else "recompute",
              speculation="none")
    plain, _ = slot_engine(grouped_prefill=False, **kw)
    grouped, _ = slot_engine(**kw)
    assert _run(grouped, prompts, arrive) == _run(plain, prompts, arrive)
    assert not grouped.scheduler.has_work() and grouped.pool.num_used == 0  # every alias released


def test_a_leader_diverging_inside_the_first_block_does_not_hide_one_that_shares_it():
    # the next-8-token hash named the first candidate only; A shares C's first 8 tokens but not
    # its first 16-token block, so C computed the part B shares with it (review: helper-56)
    rng = random.Random(3)
    head = [rng.randrange(1, 64) for _ in range(8)]
    shared = head + [rng.randrange(1, 64) for _ in range(88)]
    a = head + [rng.randrange(1, 64) for _ in range(40)]
    b, c = shared + [1, 2, 3], shared + [4, 5, 6, 7]
    kw = dict(num_blocks=64, block_size=16, budget=32, chunk_min_tokens=8, chunk_max_tokens=16)
    plain, _ = fake_engine(grouped_prefill=False, **kw)
    grouped, _ = fake_engine(**kw)
    assert _run(grouped, [a, b, c]) == _run(plain, [a, b, c])
    stats = grouped.scheduler.groups.stats
    assert stats.followers == 1 and stats.tokens_saved == 96  # C aliased B's 6 full blocks
