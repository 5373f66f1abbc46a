"""The queries of a sequence's newest rows, kept as they are computed (a rolling window).

A session stream with ``"evict": "snapkv"`` scores the span it evicts with the queries of its
newest records (SnapKV's observation window). Queries are not cached, so the runner copies
the last rows of every chunk the stream computes::

    stream   [ frozen | ... | r7 r8 r9 ]            rows [0, end)
    window                 [ . . . . . ]             rows [end - filled, end) -> buf[:, n - filled:]
    next chunk [end, end + c): the window rolls left by min(c, n), the chunk's last rows land at the end

Queries are after RoPE. An eviction re-positions the rows it keeps, so :meth:`shift` rotates
the window's rows by the same deltas (RoPE composes), and the scores stay those of the
stream as it now is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from streamkv.attention.backend import Observation
from streamkv.models.rope import RotaryEmbedding
from streamkv.sched.plan import ScheduledSeq


@dataclass
class Window:
    buf: torch.Tensor  # [layers, n, heads, head_dim] float32; the held rows are the last ``filled``
    end: int           # position after the newest held row
    filled: int = 0

    def rows(self) -> torch.Tensor:
        """[layers, filled, heads, head_dim]: the held rows, oldest first."""
        return self.buf[:, self.buf.shape[1] - self.filled:]


class RecentQueries:
    """Rolling query windows of the sequences whose plan items ask for them (``item.observe``)."""

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, rope: RotaryEmbedding | None,
                 scale: float) -> None:
        self.shape = (num_layers, num_heads, head_dim)
        self.rope = rope
        self.scale = scale  # the attention's softmax scale (scores use it)
        self._windows: dict[int, Window] = {}

    def release(self, seq_ids: list[int] | tuple[int, ...]) -> None:
        for sid in seq_ids:
            self._windows.pop(sid, None)

    def observe(self, item: ScheduledSeq, q_row: int) -> Observation | None:
        """Where this step's queries of ``item`` (its first row is row ``q_row``) go."""
        n = item.observe
        if n <= 0:
            return None
        layers, heads, dim = self.shape
        win = self._windows.get(item.seq_id)
        if win is None or win.buf.shape[1] != n or win.end != item.start:  # new, or not contiguous: start over
            win = self._windows[item.seq_id] = Window(torch.zeros(layers, n, heads, dim), item.start)
        take = min(item.num_tokens, n)
        if take < n:
            win.buf[:, :n - take] = win.buf[:, take:].clone()
        win.end = item.start + item.num_tokens
        win.filled = min(n, win.filled + take)
        return Observation(q_row + item.num_tokens - take, take, n - take, win.buf)

    def get(self, seq_id: int, end: int) -> torch.Tensor | None:
        """The window of ``seq_id`` if it ends at row ``end`` (else None): [layers, filled, heads, D]."""
        win = self._windows.get(seq_id)
        if win is None or win.end != end or not win.filled:
            return None
        return win.rows()

    @torch.inference_mode()
    def shift(self, seq_id: int, start: int, count: int, moved: dict[int, int], old_end: int) -> None:
        """Follow an eviction of rows ``[start, start+count)``: a held row in that range moves to
        ``moved[p]`` (the window is dropped if one was not kept), a later row moves down by the
        rows removed; the keys moved alike, so every query keeps its place relative to them."""
        win = self._windows.get(seq_id)
        if win is None:
            return
        if win.end != old_end:  # not the stream's newest rows
            del self._windows[seq_id]
            return
        removed = count - len(moved)
        first = win.end - win.filled
        deltas = []
        for p in range(first, win.end):
            to = p if p < start else p - removed if p >= start + count else moved.get(p)
            if to is None:
                del self._windows[seq_id]
                return
            deltas.append(to - p)
        if self.rope is None:
            raise RuntimeError("re-positioning queries needs the model's rotary embedding")
        rows = win.rows()
        layers, n, heads, dim = rows.shape
        delta = torch.tensor(deltas, dtype=torch.float32).repeat(layers)
        rotated = self.rope.rotate(rows.reshape(layers * n, heads, dim), delta).reshape(layers, n, heads, dim)
        win.buf[:, win.buf.shape[1] - n:] = rotated
        win.end = old_end - removed

    def export(self, seq_id: int, end: int) -> torch.Tensor | None:
        rows = self.get(seq_id, end)
        return None if rows is None else rows.clone()

    @torch.inference_mode()
    def load(self, seq_id: int, rows: torch.Tensor, end: int, n: int) -> None:
        """Give ``seq_id`` a window of ``n`` rows holding ``rows`` [layers, filled, heads, D], ending at ``end``."""
        layers, heads, dim = self.shape
        filled = min(rows.shape[1], n)
        win = Window(torch.zeros(layers, n, heads, dim), end, filled)
        win.buf[:, n - filled:] = rows[:, rows.shape[1] - filled:].float()
        self._windows[seq_id] = win
