"""Hash chain over full blocks: a block's key covers every token before it."""
from __future__ import annotations

from typing import Sequence

ROOT_HASH = 0x5EED


def hash_block_tokens(parent_hash: int, tokens: Sequence[int], extra: int = 0) -> int:
    """Chained key of one full block.

    ``extra`` separates caches that must not share blocks although their tokens agree
    (e.g. a different starting position); it is 0 for ordinary requests.
    """
    return hash((parent_hash, extra, tuple(tokens)))


def chain_hashes(tokens: Sequence[int], block_size: int, start_block: int = 0,
                 parent: int = ROOT_HASH, extra: int = 0) -> list[int]:
    """Hashes of the full blocks of ``tokens`` from ``start_block`` on."""
    out = []
    for b in range(start_block, len(tokens) // block_size):
        parent = hash_block_tokens(parent, tokens[b * block_size:(b + 1) * block_size], extra)
        out.append(parent)
    return out
