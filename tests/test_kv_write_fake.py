"""Hypothesis on a slot-level fake runner: requests with a write policy (compressed prompts,
rings started in place) among plain ones, in small pools, preempted by recompute or swap.
Every row a step reads is checked through the block table (sinks, kept rows, the ring), the
outputs equal the solo runs, the block bound holds, and the pools end clean."""
from __future__ import annotations

from hypothesis import example, given, settings, strategies as st

from streamkv.policies import StreamingLLMPolicy
from streamkv.sampling.params import SamplingParams
from tests.fakes import slot_engine

POLICY = StreamingLLMPolicy(sink_tokens=3, window_tokens=6)  # capacity 9 rows: 3 blocks of 4


def _run(requests, **kw):
    engine, runner = slot_engine(max_model_len=256, **kw)
    runner.write = POLICY
    for i, (text, n, compress) in enumerate(requests):
        engine.add_request(f"r{i}", text, SamplingParams(max_tokens=n, ignore_eos=True),
                           kv_write=POLICY.to_dict() if compress else {"policy": "none"})
    out = {}
    for _ in range(5_000):  # a few hundred steps at most here: more is a livelock, not slowness
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        engine.check_integrity()
        for rid in list(engine._requests):
            seq = engine._requests[rid].seq
            if seq.layout is not None and not seq.swapped:
                assert engine.kv.num_blocks_held(seq.seq_id) <= -(-POLICY.capacity // 4)
    assert not engine.has_unfinished(), f"still running after 5,000 steps: {sorted(engine._requests)}"
    assert engine.pool.num_used == 0 and engine.kv.host.num_used == 0
    return out, engine


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(st.tuples(st.text("abcdefgh", min_size=2, max_size=40), st.integers(1, 24), st.booleans()),
                         min_size=1, max_size=6),
       num_blocks=st.integers(16, 40), budget=st.integers(4, 32), swap=st.booleans())
# recomputed after a preemption, r2's prompt hit r1's cached blocks up to exactly its write point,
# which left its chunks 0 rows: it never ran again (seed 131 of this test, shrunk)
@example(requests=[("aa", 20, False), ("a" * 16, 14, False), ("a" * 16, 11, True)], num_blocks=16, budget=4,
         swap=False)
def test_compressed_rows_stay_right_under_pressure(requests, num_blocks, budget, swap):
    kw = dict(budget=budget, swap_blocks=24 if swap else 0, preemption="swap" if swap else "recompute")
    together, engine = _run(requests, num_blocks=num_blocks, **kw)
    for i, req in enumerate(requests):
        alone, _ = _run([req], num_blocks=64, budget=budget)
        assert together[f"r{i}"] == alone["r0"]
