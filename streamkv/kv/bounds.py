"""Per-page key bounds for query-aware page selection (:class:`streamkv.policies.QuestPolicy`).

For block b of layer l, ``data[l, b]`` is [kv_heads, 2 * head_dim] bfloat16: the channel-wise
max of the block's keys, then their min (exact for a bfloat16 cache; rounded outward from a
float32 one). In bf16, scoring reads 1/16 of the K/V bytes of the pages it scores. Bounds are
computed lazily, for whole blocks, the first time a policy scores them; any write into a
block (a step's new K/V, a copy, a re-positioning, a restore) marks it stale, so a block's
bounds always describe its current keys once refreshed. Invariant (tested): for every key k in a fresh block and any q,
``q . k <= [q+ | q-] . data[l, b]``.
"""
from __future__ import annotations

import torch

from streamkv.native import page_bounds


class PageBounds:
    def __init__(self, k_cache: torch.Tensor, block_size: int) -> None:
        layers, slots, heads, dim = k_cache.shape
        self._k = k_cache
        self.block_size = block_size
        self.num_blocks = slots // block_size
        self.data = torch.zeros(layers, self.num_blocks, heads, 2 * dim, dtype=torch.bfloat16, device=k_cache.device)
        self.fresh = torch.zeros(self.num_blocks, dtype=torch.bool, device=k_cache.device)
        native = k_cache.dtype in (torch.bfloat16, torch.float32) and k_cache.device.type == "cpu" \
            and heads * dim <= 1024 and k_cache.is_contiguous()
        self._native = page_bounds() if native else None

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def invalidate(self, slots: torch.Tensor) -> None:
        """Blocks holding any of ``slots`` [N] are stale."""
        if slots.numel():
            self.fresh[slots // self.block_size] = False

    def refresh(self, blocks: torch.Tensor) -> None:
        """Recompute the stale ones among ``blocks`` [N] (all layers at once)."""
        stale = blocks[~self.fresh[blocks]]
        if stale.numel() == 0:
            return
        if self._native is not None:
            self._native(self._k, self.block_size, stale, self.data)
        else:
            layers, _, heads, dim = self._k.shape
            keys = self._k.view(layers, self.num_blocks, self.block_size, heads, dim).index_select(1, stale)
            hi, lo = keys.amax(dim=2), keys.amin(dim=2)
            if keys.dtype != torch.bfloat16:  # round outward so the bf16 bounds stay bounds
                hi, lo = _round(hi.float(), up=True), _round(lo.float(), up=False)
            self.data[:, stale] = torch.cat([hi, lo], dim=-1).to(self.data.dtype)
        self.fresh[stale] = True


def _round(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x (float32) in bfloat16, rounded toward +inf (``up``) or -inf, so bounds stay bounds."""
    y = x.bfloat16()
    off = y.float() < x if up else y.float() > x
    step = torch.nextafter(y, torch.full_like(y, float("inf") if up else float("-inf")))
    return torch.where(off, step, y)
