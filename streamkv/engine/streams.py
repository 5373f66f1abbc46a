"""Persistent streams: long-lived, non-sampling sequences that session ingestion extends.

A stream is pinned (never preempted; it waits for blocks), computes KV only, and is idle
whenever ``num_computed == len(tokens)``. Every change happens on the engine thread
between steps. Eviction removes a token range and moves the later keys down, rotated::

    before   [ frozen | r0 r1 r2 | r3 r4 ]         positions 0 .. n-1
    evict    [ frozen |  ......  | r3 r4 ]         r0..r2 dropped (k tokens)
    after    [ frozen | r3 r4 ]                    r3.. re-positioned by -k (RoPE rotation)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence as Seq

import torch

from streamkv.errors import InvalidRequestError
from streamkv.runner.kv_ops import KVOps, slots_of
from streamkv.sampling.params import SamplingParams
from streamkv.sched.sequence import PriorityClass, Sequence

if TYPE_CHECKING:
    from streamkv.engine.engine import Engine

_NO_SAMPLING = SamplingParams(max_tokens=1)


class Streams:
    """Stream operations of one engine (its scheduler, KV manager and KV tensors)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def ops(self) -> KVOps:
        ops = self._engine.kv_ops
        if ops is None:
            raise RuntimeError("this engine's runner cannot move KV (no kv_ops)")
        return ops

    def open(self, tokens: Seq[int], klass: PriorityClass = PriorityClass.STREAM) -> Sequence:
        """A new stream over ``tokens`` (computed in the background at ``klass``)."""
        seq = self._new(list(tokens), klass)
        self._engine.scheduler.add(seq)
        return seq

    def fork(self, parent: Sequence, num_tokens: int, suffix: Seq[int],
             klass: PriorityClass = PriorityClass.SESSION, peek: SamplingParams | None = None) -> Sequence:
        """A stream over ``parent.tokens[:num_tokens] + suffix`` sharing the parent's KV;
        with ``peek``, its end's next-token logprobs land in ``seq.peeked`` once computed."""
        seq = self._new(list(parent.tokens[:num_tokens]) + list(suffix), klass)
        if peek is not None:
            seq.peek, seq.params = True, peek
        self._engine.fork_kv(parent, seq, num_tokens)
        self._engine.scheduler.add_running(seq)
        return seq

    def extend(self, seq: Sequence, tokens: Seq[int]) -> None:
        if len(seq.tokens) + len(tokens) >= self._engine.max_model_len:
            raise InvalidRequestError(f"stream would reach {len(seq.tokens) + len(tokens)} tokens; "
                                      f"the context is {self._engine.max_model_len}")
        seq.tokens.extend(tokens)
        seq.num_prompt_tokens = len(seq.tokens)

    def close(self, seq: Sequence) -> None:
        """Forget the stream and release its blocks (forks keep theirs)."""
        self._engine.scheduler.finish(seq.seq_id, "closed")

    def is_idle(self, seq: Sequence) -> bool:
        return self._engine.kv.has(seq.seq_id) and seq.num_computed >= len(seq.tokens)

    def evict(self, seq: Sequence, start: int, count: int) -> None:
        """Remove tokens ``[start, start+count)`` of an idle stream, re-positioning the rest.

        Raises OutOfBlocksError (nothing changed) if forks share the tail and the pool has no
        room for a fresh copy of it.
        """
        if not self.is_idle(seq):
            raise RuntimeError("evict needs an idle stream (all tokens computed)")
        n, bs, kv = len(seq.tokens), self._engine.kv.block_size, self._engine.kv
        if not (0 <= start and count > 0 and start + count <= n):
            raise ValueError(f"bad eviction range [{start}, {start + count}) of {n} tokens")
        first = start // bs
        old_table = list(kv.block_table(seq.seq_id))
        old, new = kv.rewrite_tail(seq.seq_id, first, n - count)
        new_table = kv.block_table(seq.seq_id)
        head = start - first * bs
        if new[:1] != old[:1] and head:
            self.ops.copy(slots_of(old_table, first * bs, head, bs), slots_of(new_table, first * bs, head, bs))
        moved = n - start - count
        if moved:
            self.ops.copy(slots_of(old_table, start + count, moved, bs), slots_of(new_table, start, moved, bs),
                          shift=-count)
        keep = set(new)
        kv.release_blocks([b for b in old if b not in keep])
        del seq.tokens[start:start + count]
        seq.num_computed = seq.num_prompt_tokens = len(seq.tokens)

    # ----------------------------------------------------------- offload / restore
    def export(self, seq: Sequence, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [layers, num_tokens, kv_heads, head_dim] of a stream's first tokens, on the host."""
        if not self._engine.kv.has(seq.seq_id) or seq.num_computed < num_tokens:
            raise RuntimeError(f"export of {num_tokens} tokens needs them computed ({seq.num_computed} are)")
        table = self._engine.kv.block_table(seq.seq_id)
        return self.ops.export(slots_of(table, 0, num_tokens, self._engine.kv.block_size))

    def restore(self, tokens: Seq[int], k: torch.Tensor, v: torch.Tensor,
                klass: PriorityClass = PriorityClass.STREAM) -> Sequence:
        """A stream over ``tokens`` whose KV is ``k``/``v`` (from :meth:`export`).

        Raises OutOfBlocksError (nothing changed) when the pool is short.
        """
        seq = self._new(list(tokens), klass)
        blocks = self._engine.kv.adopt(seq.seq_id, len(tokens))
        try:
            self.ops.load(slots_of(blocks, 0, len(tokens), self._engine.kv.block_size), k, v)
        except Exception:
            self._engine.kv.free(seq.seq_id)
            raise
        seq.num_computed = len(tokens)
        self._engine.scheduler.add_running(seq)
        return seq

    def _new(self, tokens: list[int], klass: PriorityClass) -> Sequence:
        engine = self._engine
        if len(tokens) >= engine.max_model_len:
            raise InvalidRequestError(f"stream of {len(tokens)} tokens exceeds the context ({engine.max_model_len})")
        return Sequence(seq_id=next(engine._seq_ids), tokens=tokens, num_prompt_tokens=len(tokens),
                        params=_NO_SAMPLING, max_len=engine.max_model_len, klass=klass,
                        samples=False, pinned=True, cacheable=False)

