"""The native KV mover (``native/kv_move.c``): rows move between slots in every layer, keys
rotated exactly as ``RotaryEmbedding.rotate`` does (within one bf16 rounding), values and
unshifted keys copied bit for bit."""
from __future__ import annotations

import pytest
import torch

from streamkv import native
from streamkv.models.rope import RotaryEmbedding

move = native.kv_move()
pytestmark = pytest.mark.skipif(move is None, reason="native kernels unavailable (no C compiler)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_move_and_keys_rotate_like_the_torch_path(dtype):
    g = torch.Generator().manual_seed(0)
    layers, slots, heads, dim = 3, 64, 2, 64
    k = torch.randn(layers, slots, heads, dim, generator=g).to(dtype)
    v = torch.randn(layers, slots, heads, dim, generator=g).to(dtype)
    rope = RotaryEmbedding(dim, 10000.0, None, 4096)
    src, dst = torch.tensor([0, 1, 2, 3, 9]), torch.tensor([40, 41, 50, 51, 60])
    shift = torch.tensor([5, 5, -3, 700, 0])
    want_k = rope.rotate(k[:, src].reshape(-1, heads, dim).float(), shift.repeat(layers)).to(dtype)
    want_v = v[:, src].clone()
    move(k, v, src, dst, rope.rotation_table(shift))
    got = k[:, dst].reshape(-1, heads, dim)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(got.float(), want_k.float(), rtol=ulp, atol=ulp)
    assert torch.equal(v[:, dst], want_v)
    assert torch.equal(k[:, 60], k[:, 9])  # shift 0: the same bits
    before = k.clone()
    move(k, v, torch.tensor([4]), torch.tensor([30]), None)
    assert torch.equal(k[:, 30], before[:, 4]) and torch.equal(v[:, 30], v[:, 4])


def test_bad_slots_are_rejected():
    k = torch.zeros(1, 8, 1, 4)
    with pytest.raises(ValueError, match="code 2"):
        move(k, k.clone(), torch.tensor([0]), torch.tensor([8]), None)


def test_deferred_moves_land_together_before_anything_reads_the_cache():
    from streamkv.attention.backend import KVCache
    from streamkv.runner.kv_ops import KVOps

    cache = KVCache(2, 8, 4, 1, 8, torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(1)))
    cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(2)))
    ops = KVOps(cache, RotaryEmbedding(8, 10000.0, None, 256))
    want = KVOps(KVCache(2, 8, 4, 1, 8, torch.float32), ops.rope)
    want.cache.k.copy_(cache.k)
    want.cache.v.copy_(cache.v)
    a, b = (torch.tensor([0, 1]), torch.tensor([16, 17])), (torch.tensor([4, 5, 6]), torch.tensor([20, 21, 22]))
    ops.copy(*a, torch.tensor([3, 3]), defer=True)  # two span queries' splices in one step
    ops.copy(*b, 7, defer=True)
    assert ops.moves == 0 and not torch.equal(cache.k[:, 16], want.cache.k[:, 0])  # nothing moved yet
    k_export, _ = ops.export(torch.tensor([16, 20]))  # any read flushes first
    assert ops.moves == 1
    want.copy(*a, torch.tensor([3, 3]))
    want.copy(*b, 7)
    assert torch.equal(cache.k, want.cache.k) and torch.equal(cache.v, want.cache.v)
    assert torch.equal(k_export, want.cache.k[:, [16, 20]])


class _Calls:
    """Counts the calls that reach one native entry point."""

    def __init__(self, fn):
        self.fn, self.count = fn, 0

    def __call__(self, *args):
        self.count += 1
        return self.fn(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("direction", ["down", "up"])
def test_an_in_place_move_whose_ranges_overlap_equals_a_move_into_fresh_slots(dtype, direction):
    """An eviction moves rows down within the same blocks: a destination slot is another
    row's source. Rows in index order read every such slot before writing it, so the mover
    takes them in that order within each layer, with no staging copy of the sources (a
    6,000-token window's staging was ~45 ms of the eviction's 125); a move up (a slot written
    before the row that reads it) still stages them. Either way the result is bit-identical to
    the same move into untouched slots."""
    from streamkv.native.exact_ops import _kv_move
    from streamkv.native.loader import _library

    lib = _library()
    between, ordered = _Calls(lib.streamkv_kv_move_between), _Calls(lib.streamkv_kv_move_ordered)
    g = torch.Generator().manual_seed(3)
    layers, slots, heads, dim = 3, 700, 2, 64  # an odd layer count: layers split unevenly over threads
    k = torch.randn(layers, slots, heads, dim, generator=g).to(dtype)
    v = torch.randn(layers, slots, heads, dim, generator=g).to(dtype)
    rope = RotaryEmbedding(dim, 10000.0, None, 4096)
    src = torch.cat([torch.tensor([5, 12]), torch.arange(20, 300)])
    dst = torch.arange(3, 3 + src.numel())
    if direction == "up":
        src, dst = dst, src
    shift = dst - src
    fresh_k, fresh_v = k.clone(), v.clone()
    _kv_move(between, ordered, fresh_k, fresh_v, src, dst + 400, rope.rotation_table(shift))
    assert (between.count, ordered.count) == (1, 0)
    _kv_move(between, ordered, k, v, src, dst, rope.rotation_table(shift))
    assert (between.count, ordered.count) == ((1, 1) if direction == "down" else (2, 0))
    assert torch.equal(k[:, dst], fresh_k[:, dst + 400]) and torch.equal(v[:, dst], fresh_v[:, dst + 400])
    _kv_move(between, ordered, k, v, dst, dst, None)  # every row onto itself: unchanged
    assert torch.equal(k[:, dst], fresh_k[:, dst + 400]) and torch.equal(v[:, dst], fresh_v[:, dst + 400])


def test_a_cache_or_swap_space_past_the_machine_is_a_value_error():
    """A huge --kv-cache-memory or --swap-space ended in an OSError / RuntimeError traceback
    (rc 1) instead of the CLI's clean error: both allocations now raise a ValueError naming the
    setting, and the swap space stays unattached."""
    from streamkv.attention.backend import KVCache, lazy_zeros
    from streamkv.runner.kv_ops import KVOps

    with pytest.raises(ValueError, match="lower kv_cache_memory"):
        lazy_zeros((1 << 62,), torch.uint8, "cpu")
    ops = KVOps(KVCache(2, 8, 4, 1, 8, torch.float32), None)
    with pytest.raises(ValueError, match="lower swap_space"):
        ops.attach_host(1 << 50)
    assert ops.host_k is None and ops.host_v is None
