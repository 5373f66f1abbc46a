"""Prefix-aware grouped prefill: concurrent prompts that share tokens past the prefix cache
compute them once (the Attention Once design, mechanism 3).

Requests that arrive together with one long system prompt all miss the prefix cache (none of
it is computed yet), so each would compute it. Grouping makes the highest-ranked of them the
leader. A waiting request whose next ``key_tokens`` tokens after its prefix-cache match point
hash like a leader's at the same point (then verified token by token) is a follower: it
waits while the leader computes the shared blocks, then is admitted with them as a prefix hit.
Its table aliases the leader's blocks (one more reference each, no copy: the metadata-only
fork sessions use) and it computes only its own tokens::

    leader    [ shared system prompt ............ | leader's question   ]  computes all of it
    follower  [ aliased blocks (prefix hit)       | follower's question ]  computes only this
              c (match point)            shared end (full blocks, verified)

A follower spends no budget while it waits, nothing ranked below it waits for it, and it is
not counted among the prefilling sequences that share the step's budget (adaptive chunks), so
the leader gets the bigger chunk. Outputs are unchanged: a prefix hit is bit-identical to
computing the rows (``numerics=invariant``), which ``tests/test_grouped_prefill.py`` checks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from streamkv.kv.manager import KVManager, PrefixHit
from streamkv.sched.sequence import Sequence, SeqStatus

_Key = tuple[int, int, int]  # (cache key, block-aligned position, hash of the next tokens)


@dataclass
class GroupStats:
    followers: int = 0       # requests admitted after waiting for a leader
    deferred_steps: int = 0  # (follower, step) pairs
    tokens_saved: int = 0    # prompt tokens followers took from their leaders' blocks


class PrefillGroups:
    """Per step, :meth:`plan` names the followers among the ranked sequences; the scheduler
    reports each follower's admission to :meth:`admitted`."""

    def __init__(self, kv: KVManager, key_tokens: int = 8) -> None:
        if key_tokens < 1:
            raise ValueError(f"key_tokens must be >= 1, got {key_tokens}")
        self.kv = kv
        self.key_tokens = key_tokens
        self.stats = GroupStats()

    def plan(self, ranked: list[Sequence], background: Callable[[Sequence], bool]
             ) -> tuple[set[int], dict[int, PrefixHit]]:
        """Followers this step (ids), and the prefix hits looked up for waiting sequences (the
        scheduler reuses them). Leaders are prefilling sequences ranked above their followers:
        running ones from their computed blocks, waiting ones from their match point. A
        ``background`` leader (a streaming input, whose prefill yields to complete requests')
        leads only background followers, so a complete request never waits behind one."""
        bs = self.kv.block_size
        leaders: dict[_Key, list[Sequence]] = {}  # every candidate: the first may diverge within a block
        followers: set[int] = set()
        hits: dict[int, PrefixHit] = {}
        for seq in ranked:
            if seq.swapped or not seq.cacheable or seq.layout is not None:
                continue
            if seq.status is SeqStatus.WAITING:
                hits[seq.seq_id] = hit = self.kv.match_prefix(seq.match_tokens, seq.cache_key)
                start = hit.num_tokens(bs)
                candidates = leaders.get(self._key(seq.match_tokens, start, seq.cache_key), ())
                if any((background(seq) or not background(lead)) and self._shared_end(seq, lead, start) > start
                       for lead in candidates):
                    followers.add(seq.seq_id)
                    seq.grouped_from = start if seq.grouped_from < 0 else seq.grouped_from
                    self.stats.deferred_steps += 1
                    continue
            elif seq.prefilling:
                start = seq.num_computed // bs * bs  # its full computed blocks are prefix hits by now
            else:
                continue
            leaders.setdefault(self._key(seq.tokens, start, seq.cache_key), []).append(seq)
        return followers, hits

    def admitted(self, seq: Sequence, computed: int) -> None:
        """``seq`` was admitted with ``computed`` tokens of prefix hit."""
        if seq.grouped_from >= 0:
            self.stats.followers += 1
            self.stats.tokens_saved += max(0, computed - seq.grouped_from)
            seq.grouped_from = -1

    def _key(self, tokens: list[int], start: int, cache_key: int) -> _Key:
        return cache_key, start, hash(tuple(tokens[start:start + self.key_tokens]))

    def _shared_end(self, follower: Sequence, leader: Sequence, start: int) -> int:
        """End of the full blocks the follower can alias once the leader has computed them
        (0 when the hash named a leader whose tokens differ)."""
        bs = self.kv.block_size
        f, lead = follower.match_tokens, leader.tokens
        limit = min(len(f) - 1, leader.computable) // bs * bs  # the follower computes its last token
        if f[:start] != lead[:start]:
            return 0
        end = start
        while end < limit and f[end:end + bs] == lead[end:end + bs]:
            end += bs
        return end
