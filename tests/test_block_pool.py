"""Block pool and KV manager invariants, including randomized (hypothesis) workloads."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from streamkv.kv.block_pool import BlockPool, OutOfBlocksError
from streamkv.kv.manager import KVManager


def test_allocate_release_lru_order():
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    pool.release(reversed(a))
    assert pool.allocate(1) == [a[0]]  # freed blocks holding no hash come first, last freed first
    assert pool.allocate(1) == [a[1]]
    assert pool.allocate(1) == [2]  # then never-used blocks
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)


def test_cached_blocks_leave_last_and_least_recently_freed_first():
    """Blocks holding a hash wait at the tail (LRU) while never-used and hashless blocks are
    taken: the prefix cache keeps its content as long as anything else is free."""
    pool = BlockPool(5, 2)
    a, b, c = pool.allocate(3)
    pool.cache(a, 11)
    pool.cache(b, 22)
    pool.release([a, c, b])  # a and b hashed (tail, a first), c hashless (front)
    assert pool.allocate(1) == [c]
    assert pool.allocate(2) == [3, 4]
    assert pool.lookup(11) == a and pool.lookup(22) == b
    assert pool.allocate(1) == [a] and pool.lookup(11) is None and pool.lookup(22) == b
    pool.check_integrity([[a], [c], [3, 4]])


def test_double_free_detected():
    pool = BlockPool(2, 2)
    b = pool.allocate(1)
    pool.release(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(b)


def test_cached_block_evicted_on_reuse():
    pool = BlockPool(1, 2)
    (b,) = pool.allocate(1)
    assert pool.cache(b, 123)
    pool.release([b])
    assert pool.lookup(123) == b
    pool.allocate(1)
    assert pool.lookup(123) is None
    pool.check_integrity([[b]])


def test_prefix_match_and_sharing():
    kv = KVManager(BlockPool(16, 4))
    toks = list(range(20))
    kv.admit(1, kv.match_prefix(toks))
    assert kv.grow(1, 20)
    kv.commit(1, toks, 20)
    hit = kv.match_prefix(toks)
    assert len(hit.block_ids) == 4  # 19 tokens matchable -> 4 full blocks
    kv.admit(2, hit)
    assert kv.grow(2, 20)
    assert kv.block_table(2)[:4] == kv.block_table(1)[:4]
    assert kv.block_table(2)[4] != kv.block_table(1)[4]
    kv.check_integrity()
    kv.free(1)
    kv.free(2)
    kv.check_integrity()
    assert kv.pool.num_free == 16


class KVWorkload(RuleBasedStateMachine):
    """Random admit / grow / commit / free sequences; integrity must hold after each."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVManager(BlockPool(24, 4))
        self.seqs: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.next_id = 0

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
          tail=st.lists(st.integers(0, 5), min_size=1, max_size=20))
    def admit(self, prefix: list[int], tail: list[int]) -> None:
        toks = prefix + tail
        hit = self.kv.match_prefix(toks)
        n = hit.num_tokens(4)
        if self.kv.admission_cost(hit, len(toks)) > self.kv.pool.num_free:
            return
        sid = self.next_id
        self.next_id += 1
        self.kv.admit(sid, hit, num_tokens=len(toks))
        assert self.kv.grow(sid, len(toks))
        self.seqs[sid] = toks
        self.computed[sid] = n

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.computed[sid] = len(self.seqs[sid])
        self.kv.commit(sid, self.seqs[sid], self.computed[sid])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 5), min_size=1, max_size=9))
    def extend(self, data: st.DataObject, extra: list[int]) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        before = list(self.kv.block_table(sid))
        if self.kv.grow(sid, len(self.seqs[sid]) + len(extra)):
            self.seqs[sid] += extra
        else:
            assert self.kv.block_table(sid) == before

    @precondition(lambda self: any(self.computed.values()))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """Copy-on-write fork of a computed prefix (session query / ready fork)."""
        sid = data.draw(st.sampled_from(sorted(s for s, c in self.computed.items() if c)))
        n = data.draw(st.integers(1, self.computed[sid]))
        new = self.next_id
        try:
            copy = self.kv.fork(sid, new, n)
        except OutOfBlocksError:
            return
        self.next_id += 1
        if n % 4:
            assert copy is not None and copy[0] == self.kv.block_table(sid)[n // 4]
            assert copy[1] == self.kv.block_table(new)[-1] and copy[1] not in self.kv.block_table(sid)
        assert self.kv.block_table(new)[:n // 4] == self.kv.block_table(sid)[:n // 4]
        self.seqs[new] = self.seqs[sid][:n]
        self.computed[new] = n

    @precondition(lambda self: any(c == len(self.seqs[s]) and c > 1 for s, c in self.computed.items()))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        """Drop a token range of an idle sequence (in place, or copy-on-write when shared)."""
        sid = data.draw(st.sampled_from(sorted(s for s, c in self.computed.items()
                                               if c == len(self.seqs[s]) and c > 1)))
        toks = self.seqs[sid]
        start = data.draw(st.integers(0, len(toks) - 1))
        count = data.draw(st.integers(1, len(toks) - start))
        try:
            old, new = self.kv.rewrite_tail(sid, start // 4, len(toks) - count)
        except OutOfBlocksError:
            return
        keep = set(new)
        self.kv.release_blocks([b for b in old if b not in keep])
        shared_before = [b for b in old if self.kv.pool.blocks[b].ref_count > 0 and b not in keep]
        assert not (set(shared_before) & set(new))
        del toks[start:start + count]
        self.computed[sid] = len(toks)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.kv.free(sid)
        del self.seqs[sid], self.computed[sid]

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()
        # a block shared by two sequences holds the same tokens in both
        owners: dict[int, tuple[int, ...]] = {}
        for sid, toks in self.seqs.items():
            for b, block_id in enumerate(self.kv.block_table(sid)):
                if (b + 1) * 4 <= self.computed[sid]:
                    chunk = tuple(toks[b * 4:(b + 1) * 4])
                    assert owners.setdefault(block_id, chunk) == chunk


TestKVWorkload = KVWorkload.TestCase
TestKVWorkload.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_scheduler_workload_keeps_integrity():
    """Random request mixes through the real scheduler with a fake runner."""
    from hypothesis import given

    from streamkv.sampling.params import SamplingParams
    from tests.fakes import fake_engine

    @settings(max_examples=25, deadline=None)
    @given(st.lists(st.tuples(st.lists(st.integers(1, 8), min_size=1, max_size=30), st.integers(1, 8),
                              st.integers(-1, 1)), min_size=1, max_size=10),
           st.integers(8, 40), st.integers(2, 32))
    def run(reqs, num_blocks, budget):
        engine, _ = fake_engine(num_blocks=num_blocks, block_size=4, budget=budget)
        ids = []
        for i, (prompt, n, prio) in enumerate(reqs):
            try:
                engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                   priority=prio)
            except ValueError:
                continue
            ids.append(f"r{i}")
        while engine.has_unfinished():
            engine.step()
            engine.check_integrity()
        assert engine.pool.num_free == num_blocks

    run()


def test_host_blocks_a_swap_in_reads_are_not_reused_by_a_swap_out_of_the_same_step():
    """The runner copies a step's swap-outs before its swap-ins, so a host block that a
    swap-in reads must not receive another sequence's swap-out in that step."""
    from streamkv.kv.host_pool import HostPool

    kv = KVManager(BlockPool(8, 4), HostPool(2))
    for seq in (1, 2):
        kv.admit(seq, kv.match_prefix([seq] * 8))
        assert kv.grow(seq, 8)
    kv.begin_step()
    kv.swap_out(1, 8)  # step 1: sequence 1 goes to host blocks 0 and 1
    kv.begin_step()
    read = [h for h, _ in kv.swap_in(1, 8)]  # step 2: it comes back ...
    assert not kv.can_swap_out(8)  # ... so sequence 2 cannot take those host blocks now
    kv.check_integrity()
    kv.begin_step()  # step 3: they are free again
    assert sorted(h for _, h in kv.swap_out(2, 8)) == sorted(read)
    kv.check_integrity()
    assert kv.host.num_used == 2
