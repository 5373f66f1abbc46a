"""Sequence operations: the one set every workload uses (DESIGN.md section 3).

``fork`` (copy-on-write), ``append``, ``truncate`` (LCP invalidation), ``evict`` (with
re-positioning), ``export``/``restore``. Sessions and streaming-input requests both use
them; neither touches block tables or KV tensors directly.

*Persistent streams* are long-lived, non-sampling sequences that session ingestion extends.
A stream is pinned (never preempted; it waits for blocks), computes KV only, and is idle
whenever ``num_computed == len(tokens)``. Every change happens on the engine thread
between steps. Eviction removes a token range and moves the later keys down, rotated::

    before   [ frozen | r0 r1 r2 | r3 r4 ]         positions 0 .. n-1
    evict    [ frozen |  ......  | r3 r4 ]         r0..r2 dropped (k tokens)
    after    [ frozen | r3 r4 ]                    r3.. re-positioned by -k (RoPE rotation)
"""
from __future__ import annotations

from typing import Iterator, Sequence as Seq

import torch

from streamkv.errors import InvalidRequestError, KVCacheFullError
from streamkv.kv.block_pool import OutOfBlocksError
from streamkv.kv.manager import KVManager
from streamkv.policies.write import WritePolicy
from streamkv.runner.kv_ops import KVOps, slots_at, slots_of
from streamkv.runner.recent_queries import RecentQueries
from streamkv.sampling.params import SamplingParams
from streamkv.sched.scheduler import Scheduler
from streamkv.sched.sequence import PriorityClass, Sequence

_NO_SAMPLING = SamplingParams(max_tokens=1)


class SeqOps:
    """Sequence operations of one engine: its scheduler, KV manager and KV tensors (``kv_ops``)."""

    def __init__(self, scheduler: Scheduler, kv: KVManager, kv_ops: KVOps | None, max_model_len: int,
                 seq_ids: Iterator[int], recent: RecentQueries | None = None) -> None:
        self._scheduler = scheduler
        self._recent = recent  # query windows of streams that observe their newest rows
        self._kv = kv
        self._kv_ops = kv_ops
        self._max_len = max_model_len
        self._seq_ids = seq_ids

    @property
    def ops(self) -> KVOps:
        if self._kv_ops is None:
            raise RuntimeError("this engine's runner cannot move KV (no kv_ops)")
        return self._kv_ops

    def next_id(self) -> int:
        return next(self._seq_ids)

    # ------------------------------------------------------------ any sequence
    def fork_kv(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """Give ``child`` a copy-on-write view of ``parent``'s first ``num_tokens`` KV rows."""
        if not self._kv.has(parent.seq_id) or parent.num_computed < num_tokens:
            raise InvalidRequestError(f"cannot fork {num_tokens} tokens: only {parent.num_computed} have KV")
        try:
            copy = self._kv.fork(parent.seq_id, child.seq_id, num_tokens)
        except OutOfBlocksError:
            raise KVCacheFullError("the KV cache is full; retry later") from None
        if copy is not None:
            self._copy_head(copy, num_tokens % self._kv.block_size)
        child.num_computed = child.num_cached_tokens = child.forked_rows = num_tokens

    def append(self, seq: Sequence, tokens: Seq[int]) -> None:
        """Add prompt ``tokens`` at the end of a sequence that has not sampled yet."""
        if len(seq.tokens) + len(tokens) >= self._max_len:
            raise InvalidRequestError(f"sequence would reach {len(seq.tokens) + len(tokens)} tokens; "
                                      f"the context is {self._max_len}")
        if seq.num_output:
            raise RuntimeError("append extends a prompt; this sequence has already generated")
        seq.tokens.extend(tokens)
        seq.num_prompt_tokens = len(seq.tokens)

    def truncate(self, seq: Sequence, num_tokens: int) -> int:
        """Cut ``seq`` to its first ``num_tokens`` tokens; returns how many computed rows were dropped.

        KV past the cut goes back to the pool; full blocks before it keep their prefix-cache
        entries. A partial last block that another sequence or the prefix cache holds is
        replaced by a private copy first (copy-on-write)::

            before  [b3 | b8 | b5:xxxxxxxx]   b5 indexed in the prefix cache, cut at 2 rows of it
            after   [b3 | b8 | b9:xx      ]   b5 untouched (still a prefix hit for others)

        With no free block for that copy, the cut moves down to the block boundary (those
        rows are recomputed instead): truncation never fails.
        """
        if not 0 <= num_tokens <= len(seq.tokens):
            raise ValueError(f"cannot truncate {len(seq.tokens)} tokens to {num_tokens}")
        before = seq.num_computed
        keep = min(before, num_tokens)
        if self._kv.is_swapped(seq.seq_id):
            self._kv.truncate_host(seq.seq_id, keep)  # host blocks past the cut go back
            if keep == 0:  # nothing left to swap in: it comes back as a new request (prefix lookup)
                self._kv.free(seq.seq_id)
                seq.swapped = False
        elif self._kv.has(seq.seq_id):
            try:
                copy = self._kv.truncate(seq.seq_id, keep)
            except OutOfBlocksError:
                keep -= keep % self._kv.block_size
                copy = self._kv.truncate(seq.seq_id, keep)
            if copy is not None:
                self._copy_head(copy, keep % self._kv.block_size)
        del seq.tokens[num_tokens:]
        seq.num_computed = keep
        seq.num_cached_tokens = min(seq.num_cached_tokens, keep)  # an update may cut into a prefix hit
        seq.reads_to = min(seq.reads_to, num_tokens)  # rows from num_tokens on are new tokens: their reads count
        seq.num_prompt_tokens = min(seq.num_prompt_tokens, num_tokens)
        return before - keep

    def reclaim(self, blocks: int, below: PriorityClass | None = None) -> None:
        """Free up to ``blocks`` blocks by preempting inputs still streaming, then (``below``) running
        requests of a less urgent class (``Scheduler.reclaim``); their swap-out copies are made
        now, so the released blocks can be written at once."""
        pairs = self._scheduler.reclaim(blocks, below)
        if pairs:
            self.ops.swap(pairs, [])

    def _copy_head(self, copy: tuple[int, int], rows: int) -> None:
        bs = self._kv.block_size
        self.ops.copy(slots_of([copy[0]], 0, rows, bs), slots_of([copy[1]], 0, rows, bs))

    # ------------------------------------------------------- persistent streams
    def open(self, tokens: Seq[int], klass: PriorityClass = PriorityClass.STREAM, observe: int = 0) -> Sequence:
        """A new stream over ``tokens`` (computed in the background at ``klass``); ``observe`` > 0
        keeps the queries of its newest rows (:meth:`rank` scores with them)."""
        seq = self._new(list(tokens), klass)
        seq.observe = observe
        self._scheduler.add(seq)
        return seq

    def fork(self, parent: Sequence, num_tokens: int, suffix: Seq[int],
             klass: PriorityClass = PriorityClass.SESSION, peek: SamplingParams | None = None) -> Sequence:
        """A stream over ``parent.tokens[:num_tokens] + suffix`` sharing the parent's KV;
        with ``peek``, its end's next-token logprobs land in ``seq.peeked`` once computed."""
        seq = self._new(list(parent.tokens[:num_tokens]) + list(suffix), klass)
        if peek is not None:
            seq.peek, seq.params = True, peek
        self.fork_kv(parent, seq, num_tokens)
        self._scheduler.add_running(seq)
        return seq

    def close(self, seq: Sequence) -> None:
        """Forget the stream and release its blocks (forks keep theirs)."""
        self._scheduler.finish(seq.seq_id, "closed")

    def release_kv(self, seq: Sequence) -> None:
        """Free the KV a finished ``keep_kv`` sequence left behind (forks keep theirs; no-op
        when already freed)."""
        if seq.finished:
            self._kv.free(seq.seq_id)

    def is_idle(self, seq: Sequence) -> bool:
        return self._kv.has(seq.seq_id) and seq.num_computed >= len(seq.tokens)

    def evict(self, seq: Sequence, start: int, count: int, keep: Seq[int] = ()) -> None:
        """Remove tokens ``[start, start+count)`` of an idle stream but the offsets ``keep``
        (ascending, into that range), re-positioning every later row::

            before   [ frozen | a b c d e | t t ]     keep = (1, 3)
            after    [ frozen | b d | t t ]          b by -1, d by -2, t by -3 (RoPE rotation)

        The stream's query window (``RecentQueries``) follows the same moves. Raises
        OutOfBlocksError (nothing changed) if forks share the tail and the pool has no room for
        a fresh copy of it.
        """
        if not self.is_idle(seq):
            raise RuntimeError("evict needs an idle stream (all tokens computed)")
        n, bs, kv = len(seq.tokens), self._kv.block_size, self._kv
        if not (0 <= start and count > 0 and start + count <= n):
            raise ValueError(f"bad eviction range [{start}, {start + count}) of {n} tokens")
        kept = torch.as_tensor(list(keep), dtype=torch.int64)
        if kept.numel() and (kept.min() < 0 or kept.max() >= count or bool((kept.diff() <= 0).any())):
            raise ValueError(f"kept offsets must ascend within [0, {count})")
        removed = count - kept.numel()
        first = start // bs
        old_table = list(kv.block_table(seq.seq_id))
        old, new = kv.rewrite_tail(seq.seq_id, first, n - removed)
        new_table = kv.block_table(seq.seq_id)
        head = start - first * bs
        if new[:1] != old[:1] and head:
            self.ops.copy(slots_of(old_table, first * bs, head, bs), slots_of(new_table, first * bs, head, bs))
        src = torch.cat([kept + start, torch.arange(start + count, n, dtype=torch.int64)])
        if src.numel():
            dst = torch.arange(start, start + src.numel(), dtype=torch.int64)
            self.ops.copy(slots_at(old_table, src, bs), slots_at(new_table, dst, bs), dst - src)
        kv.release_blocks([b for b in old if b not in set(new)])
        if self._recent is not None:
            moved = {int(a): int(b) for a, b in zip(kept + start, range(start, start + kept.numel()))}
            self._recent.shift(seq.seq_id, start, count, moved, n)
        ids = [seq.tokens[start + i] for i in kept.tolist()]
        seq.tokens[start:start + count] = ids
        seq.num_computed = seq.num_prompt_tokens = len(seq.tokens)
        seq.reads_to = min(seq.reads_to, len(seq.tokens))  # rows past the shorter stream are new

    def rank(self, seq: Sequence, start: int, count: int, keep: int, policy: WritePolicy) -> list[int] | None:
        """Offsets of the ``keep`` tokens of ``[start, start+count)`` that ``policy`` ranks highest
        (:meth:`SnapStreamPolicy.rank_span`), scored with the stream's query window; None when
        the stream has no window that ends at its last row (nothing observed yet)."""
        if self._recent is None or not self.is_idle(seq):
            return None
        q = self._recent.get(seq.seq_id, len(seq.tokens))
        if q is None:
            return None
        k, _ = self.export(seq, len(seq.tokens))
        with torch.inference_mode():
            picks = policy.rank_span(q, k, start, count, keep, self._recent.scale)  # type: ignore[attr-defined]
        return picks.tolist()

    def splice(self, dst: Sequence, parts: Seq[tuple[Sequence, int, int]]) -> int:
        """Append to idle stream ``dst`` the KV rows ``[start, start+count)`` of each
        ``(src, start, count)`` in ``parts``, re-positioned to follow each other::

            src A  [ prefix | a a a ]         src B  [ prefix | b b ]
            dst    [ prefix | a a a ]  ->     dst    [ prefix | a a a | b b ]   b's keys rotated by +3

        The rows are copied into fresh blocks (the sources keep theirs), all in one call,
        deferred until the next KV operation or model step (``KVOps.flush``), so the splices of
        every span query in a step move together.
        Returns the rows moved with a non-zero shift. Raises OutOfBlocksError (nothing
        changed) when the pool is short.
        """
        if not self.is_idle(dst):
            raise RuntimeError("splice needs an idle destination stream (all tokens computed)")
        n, bs = len(dst.tokens), self._kv.block_size
        total = sum(count for _, _, count in parts)
        if n + total >= self._max_len:
            raise InvalidRequestError(f"stream would reach {n + total} tokens; the context is {self._max_len}")
        if not self._kv.grow(dst.seq_id, n + total):
            raise OutOfBlocksError(f"splice needs {self._kv.growth_cost(dst.seq_id, n + total)} free blocks")
        src_slots, shifts, at = [], [], n
        for src, start, count in parts:
            if not self._kv.has(src.seq_id) or src.num_computed < start + count:
                raise RuntimeError(f"splice source has {src.num_computed} computed rows, needs {start + count}")
            src_slots.append(slots_of(self._kv.block_table(src.seq_id), start, count, bs))
            shifts.append(torch.full((count,), at - start, dtype=torch.int64))
            dst.tokens.extend(src.tokens[start:start + count])
            at += count
        if total:  # deferred: the engine flushes every splice of a step in one call before the model runs
            shift = torch.cat(shifts)
            self.ops.copy(torch.cat(src_slots), slots_of(self._kv.block_table(dst.seq_id), n, total, bs), shift,
                          defer=True)
        dst.num_computed = dst.num_prompt_tokens = len(dst.tokens)
        return int(sum(c for (_, s, c), sh in zip(parts, shifts) if c and int(sh[0]) != 0))

    # ----------------------------------------------------------- offload / restore
    def export(self, seq: Sequence, num_tokens: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [layers, num_tokens - start, kv_heads, head_dim] of a stream's rows ``start`` to
        ``num_tokens``, on the host."""
        if not self._kv.has(seq.seq_id) or seq.num_computed < num_tokens or not 0 <= start <= num_tokens:
            raise RuntimeError(f"export of rows {start}:{num_tokens} needs them computed ({seq.num_computed} are)")
        table = self._kv.block_table(seq.seq_id)
        return self.ops.export(slots_of(table, start, num_tokens - start, self._kv.block_size))

    def queries(self, seq: Sequence) -> torch.Tensor | None:
        """A copy of the stream's query window [layers, n, heads, head_dim] if it ends at the
        stream's last row (offload saves it with the KV), else None."""
        return None if self._recent is None else self._recent.export(seq.seq_id, len(seq.tokens))

    def restore(self, tokens: Seq[int], k: torch.Tensor, v: torch.Tensor,
                klass: PriorityClass = PriorityClass.STREAM, observe: int = 0,
                queries: torch.Tensor | None = None, base: Sequence | None = None, rows_from: int = 0) -> Sequence:
        """A stream over ``tokens`` whose KV is ``k``/``v`` (from :meth:`export`: rows
        ``rows_from`` on), observing its newest ``observe`` rows, its window ``queries`` (from
        :meth:`queries`) when given. With ``base`` (a computed stream whose tokens start
        ``tokens``), the stream forks the base's rows (sharing its full blocks, as the stream it
        was exported from did) and loads only the rows after them; rows before ``rows_from``
        must come from the base.

        Raises OutOfBlocksError (nothing changed) when the pool is short.
        """
        start = 0 if base is None else len(base.tokens)
        if start < rows_from:
            raise ValueError(f"KV rows from {rows_from} need a base of at least {rows_from} tokens, got {start}")
        seq = self._new(list(tokens), klass)
        seq.observe = observe
        try:
            if base is None:
                blocks = self._kv.adopt(seq.seq_id, len(tokens))
            else:
                self.fork_kv(base, seq, start)
                if not self._kv.grow(seq.seq_id, len(tokens)):
                    raise OutOfBlocksError(f"no blocks for {len(tokens) - start} restored rows")
                blocks = self._kv.block_table(seq.seq_id)
            self.ops.load(slots_of(blocks, start, len(tokens) - start, self._kv.block_size), k, v,
                          start - rows_from)
        except KVCacheFullError:
            raise OutOfBlocksError("no block for the fork's partial copy") from None
        except BaseException:
            if self._kv.has(seq.seq_id):
                self._kv.free(seq.seq_id)
            raise
        seq.num_computed = len(tokens)
        if queries is not None and observe and self._recent is not None:
            self._recent.load(seq.seq_id, queries, len(tokens), observe)
        self._scheduler.add_running(seq)
        return seq

    def _new(self, tokens: list[int], klass: PriorityClass) -> Sequence:
        if len(tokens) >= self._max_len:
            raise InvalidRequestError(f"stream of {len(tokens)} tokens exceeds the context ({self._max_len})")
        return Sequence(seq_id=self.next_id(), tokens=tokens, num_prompt_tokens=len(tokens),
                        params=_NO_SAMPLING, max_len=self._max_len, klass=klass,
                        samples=False, pinned=True, cacheable=False)

