"""A fake runner and tokenizer so the scheduler and engine are testable without a model."""
from __future__ import annotations

from streamkv.config import CacheConfig, EngineConfig, SchedulerConfig
from streamkv.engine.engine import Engine
from streamkv.engine.factory import ModelBundle
from streamkv.sched.plan import StepOutput, StepPlan

VOCAB = 64
EOS = 0


class FakeTokenizer:
    """Token t <-> the character chr(ord('a') + t % 26); token 0 is EOS."""

    vocab_size = VOCAB
    eos_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1 + (ord(c) - ord("a")) % 26 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.token_bytes(t).decode() for t in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return b"" if token_id == EOS else chr(ord("a") + (token_id - 1) % 26).encode()


class FakeRunner:
    """Next token = a hash of the full history (so any KV mix-up changes the output).

    Checks the runner-side contract on every step: chunks start exactly at the KV already
    computed for that sequence, and block tables cover every position written.
    """

    def __init__(self, block_size: int, vocab: int = VOCAB, eos_after: int | None = None,
                 repeat: int | None = None) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.eos_after = eos_after
        self.repeat = repeat  # next token = the one ``repeat`` back (a repetitive task), when set
        self.computed: dict[int, list[int]] = {}
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        for seq_id in plan.released + plan.preempted:
            self.computed.pop(seq_id, None)
        out = StepOutput()
        for item in plan.seqs:
            have = self.computed.setdefault(item.seq_id, [])
            if item.start < len(have):  # prefix hit or recompute: KV came from elsewhere
                del have[item.start:]
            if item.start > len(have):
                have.extend(item.history[len(have):item.start])
            assert list(item.history[:item.start]) == have, "chunk does not continue the computed KV"
            have.extend(item.token_ids)
            end = item.start + item.num_tokens
            rows = item.rows if item.rows >= 0 else end  # a write policy's layout holds a fixed set of rows
            assert len(item.block_table) * self.block_size >= rows, "block table too short"
            if item.sample and item.draft:  # verify: sample every draft row, keep the matching prefix
                rows = list(item.history[:item.start]) + list(item.token_ids)
                base = end - len(item.draft)
                emitted = []
                for i in range(len(item.draft) + 1):
                    emitted.append(self._next(rows[:base + i], item.num_prompt))
                    if i == len(item.draft) or emitted[-1] != item.draft[i]:
                        break
                out.drafts[item.seq_id] = tuple(emitted)
            elif item.sample:
                out.tokens[item.seq_id] = self._next(list(item.history[:end]), item.num_prompt)
        return out

    def _next(self, hist: list[int], num_prompt: int) -> int:
        if self.eos_after is not None and len(hist) - num_prompt >= self.eos_after:
            return EOS
        if self.repeat is not None and len(hist) >= self.repeat:
            return hist[-self.repeat]
        return 1 + hash(tuple(hist)) % (self.vocab - 1)


def fake_engine(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 16, budget: int = 64,
                max_model_len: int = 512, prefix: bool = True, eos_after: int | None = None,
                chunk: int | None = None, repeat: int | None = None,
                **scheduler: object) -> tuple[Engine, FakeRunner]:
    config = EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                            enable_prefix_caching=prefix),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                    max_chunk_tokens=chunk, **scheduler))  # type: ignore[arg-type]
    runner = FakeRunner(block_size, eos_after=eos_after, repeat=repeat)
    bundle = ModelBundle(runner, FakeTokenizer(), max_model_len, VOCAB, num_blocks)
    return Engine(config, bundle), runner


class _HostRows(list):
    """Exported rows; ``nbytes`` as a tensor has it (64 "bytes" per token), for the host budget."""

    @property
    def nbytes(self) -> int:
        return 64 * len(self)


class FakeKVOps:
    """Slot-level KV moves for :class:`SlotFakeRunner` (what ``runner.kv_ops`` does to tensors)."""

    def __init__(self, slots: dict[int, tuple[int, int]], num_blocks: int, block_size: int) -> None:
        from types import SimpleNamespace

        self.slots = slots
        self.copies = 0
        self.cache = SimpleNamespace(nbytes=num_blocks * block_size * 64, num_blocks=num_blocks,
                                     block_size=block_size)  # 64 "bytes" per token
        self.bytes_per_block = 64 * block_size
        self.host: dict[int, tuple[int, int]] | None = None
        self.swap_bytes = 0

    def attach_host(self, num_blocks: int) -> None:
        self.host = {}

    def swap(self, out, into) -> None:
        self.flush()
        bs = self.cache.block_size
        # copies, as KVOps.swap does: a swapped-out block that another sequence shares (a
        # prefix hit) keeps its rows on the device for that sequence
        for src_map, dst_map, pairs in ((self.slots, self.host, out), (self.host, self.slots, into)):
            for src, dst in pairs:
                for i in range(bs):
                    entry = src_map.get(src * bs + i)
                    if entry is None:
                        dst_map.pop(dst * bs + i, None)
                    else:
                        dst_map[dst * bs + i] = entry
            self.swap_bytes += len(pairs) * self.bytes_per_block

    def flush(self) -> None:
        pending, self.pending = getattr(self, "pending", []), []
        for src, dst, shift in pending:
            self.copy(src, dst, shift)

    def copy(self, src, dst, shift=0, defer: bool = False) -> None:
        if defer:  # what KVOps does: queued until flush (the engine flushes before each step)
            self.pending = getattr(self, "pending", []) + [(src, dst, shift)]
            return
        self.flush()
        moved = [self.slots.get(int(s)) for s in src.tolist()]
        shifts = shift.tolist() if hasattr(shift, "tolist") else [shift] * len(moved)  # per row or one int
        for d, entry, sh in zip(dst.tolist(), moved, shifts):
            if entry is None:
                self.slots.pop(d, None)
            else:
                self.slots[d] = (entry[0] + sh, entry[1])
        self.copies += 1

    def export(self, slots):
        self.flush()
        return _HostRows(self.slots.get(int(s)) for s in slots.tolist()), None

    def load(self, slots, k, v, start: int = 0) -> None:
        self.flush()
        for d, entry in zip(slots.tolist(), k[start:]):
            self.slots[d] = entry


class SlotFakeRunner(FakeRunner):
    """A FakeRunner whose KV lives in slots: every row written is ``(position, token)`` at its
    block-table slot, and every sampling step reads back all earlier rows through the block
    table. A block shared by mistake, a missing copy-on-write or a stale row fails an assert."""

    def __init__(self, block_size: int, num_blocks: int, vocab: int = VOCAB) -> None:
        super().__init__(block_size, vocab)
        self.slots: dict[int, tuple[int, int]] = {}
        self.kv_ops = FakeKVOps(self.slots, num_blocks, block_size)
        self.write = None  # the write policy a test's compressed requests use

    def _slot(self, table, pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, plan: StepPlan) -> StepOutput:
        # every row is checked in its slot below; the base runner's per-sequence memory of the
        # ids it computed cannot follow a session's eviction (its stream loses rows in place)
        for item in plan.seqs:
            self.computed[item.seq_id] = list(item.history[:item.start])
        self.kv_ops.swap(plan.swap_out, plan.swap_in)
        compressed: dict[int, float] = {}
        for item in plan.seqs:
            end = item.start + item.num_tokens
            if item.rows >= 0:  # a write policy's layout: check every row, write the ring's
                self._check_layout(item)
                self.slots[self._slot(item.block_table, item.write_row)] = (item.start, item.history[item.start])
                continue
            for p in range(item.start):
                got = self.slots.get(self._slot(item.block_table, p))
                assert got == (p, item.history[p]), f"seq {item.seq_id}: row {p} holds {got}"
            for p in range(item.start, end):  # token_ids: a speculating chunk ends with drafts, not yet history
                self.slots[self._slot(item.block_table, p)] = (p, item.token_ids[p - item.start])
            if item.write is not None and end == item.write.point(item.num_prompt):
                self._compact(item)
                compressed[item.seq_id] = 0.0
        out = super().execute(plan)
        out.compressed = compressed
        return out

    @staticmethod
    def _kept(write, prompt: int) -> list[int]:
        """Tokens a compressed prompt keeps, row by row (the fake picks the middle's first ones)."""
        s, k, w = write.sink_tokens, write.budget, write.window_tokens
        return list(range(s)) + list(range(s, s + k)) + list(range(prompt - w, prompt))

    def _compact(self, item) -> None:
        """What ``runner/compression.py`` does: the kept rows into the blocks after the point."""
        point = item.write.point(item.num_prompt)
        first = -(-point // self.block_size)
        for row, p in enumerate(self._kept(item.write, point)):
            self.slots[self._slot(item.block_table[first:], row)] = self.slots[self._slot(item.block_table, p)]

    def _check_layout(self, item) -> None:
        """Rows of a sequence in its layout (``self.write``: the policy the test uses): sinks and
        kept rows in order, then the ring holding the last ``window - 1`` tokens where
        ``KVLayout.row`` puts them."""
        w = self.write
        layout = w.layout(item.num_prompt)
        assert item.rows == layout.rows and len(item.block_table) <= -(-layout.rows // self.block_size)
        head = self._kept(w, layout.at)[:layout.sink + layout.kept]
        expect = {row: p for row, p in enumerate(head)}
        expect.update({layout.row(j): j for j in range(item.start - layout.window + 1, item.start)})
        for row, p in expect.items():
            got = self.slots.get(self._slot(item.block_table, row))
            assert got == (p, item.history[p]), f"seq {item.seq_id}: row {row} holds {got}, not token {p}"


def slot_engine(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_model_len: int = 512,
                chunk: int | None = None, queue_policy: str = "fcfs", max_wait_s: float | None = None,
                swap_blocks: int = 0, preemption: str = "recompute", speculation: str = "auto",
                repeat: int | None = None, grouped_prefill: bool = True, span_host_bytes: int = 1 << 30,
                fork_gate: bool = True, **inputs: object) -> tuple[Engine, SlotFakeRunner]:
    """An engine on a :class:`SlotFakeRunner` (swap space in blocks: ``swap_blocks``; KV bytes
    are 64 per token)."""
    from streamkv.config import InputStreamConfig

    config = EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                            swap_space=swap_blocks * 64 * block_size,
                                            span_host_bytes=span_host_bytes),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_chunk_tokens=chunk,
                                                    queue_policy=queue_policy, max_wait_s=max_wait_s,
                                                    preemption=preemption, speculation=speculation,
                                                    spec_ngram_min=1, grouped_prefill=grouped_prefill,
                                                    fork_gate=fork_gate),
                          inputs=InputStreamConfig(**inputs))  # type: ignore[arg-type]
    runner = SlotFakeRunner(block_size, num_blocks)
    runner.repeat = repeat
    bundle = ModelBundle(runner, FakeTokenizer(), max_model_len, VOCAB, num_blocks)
    return Engine(config, bundle), runner
