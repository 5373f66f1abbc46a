"""Bulk execution order: queries that share spans run close together in time.

Once the span working set exceeds the KV pool, the cache keeps only recent states, so a
query hits when the queries just before it used the same pieces. Greedy clustering::

    order = [q0]; recent = spans(q0)
    repeat: next = the unscheduled query sharing the most spans with the last WINDOW ones
            (ties: the earliest given), append, update recent

O(n^2) set intersections: 500 queries of ~10 spans take a few ms.
"""
from __future__ import annotations

from collections import deque

from streamkv.spans.lower import Piece, PlusPlan, SpanPlan

WINDOW = 4


def span_keys(plan: SpanPlan) -> frozenset[bytes]:
    """Content keys of every operand (and inner operand) of ``plan``'s ``plus`` groups."""
    keys: set[bytes] = set()
    for seg in plan.segments:
        if isinstance(seg, PlusPlan):
            for op in seg.operands:
                keys.add(op.key)
                keys |= span_keys(op)
        elif isinstance(seg, Piece):
            continue
    return frozenset(keys)


def cluster_order(plans: list[SpanPlan], window: int = WINDOW) -> list[int]:
    """Indices of ``plans`` in execution order (see the module docstring)."""
    if not plans:
        return []
    feats = [span_keys(p) for p in plans]
    left = list(range(1, len(plans)))
    order = [0]
    recent: deque[frozenset[bytes]] = deque([feats[0]], maxlen=window)
    while left:
        pool = frozenset().union(*recent)
        best = max(left, key=lambda i: (len(feats[i] & pool), -i))
        left.remove(best)
        order.append(best)
        recent.append(feats[best])
    return order
