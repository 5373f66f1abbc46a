"""``linear=q4f``: the 4-bit kernel's float32 fma chain (``native/q4_gemm.c``), for CPUs whose
bf16 dot products issue at half the float32 fma rate. Its bits are its own, defined in the
kernel's header: per 32-wide group, s = fma(x[2p], q[2p] - 8, fma(x[2p + 1], q[2p + 1] - 8, s))
over the pairs in order, then o = fma(s, scale, o) and o = fma(zero, xsum, o)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from streamkv.models.q4_linear import PackedQ4, pack_native
from streamkv.native import q4_gemm

KERNEL = q4_gemm()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the native 4-bit kernel needs AVX512-BF16 and a C compiler")


def _weights(n: int, k: int, seed: int, zero: bool = True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.05
    zeros = torch.randn(n, k // 32, generator=g) * 0.05 if zero else torch.zeros(n, k // 32)
    return q, scale, zeros


def _chain(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """The fma chain in numpy, without the zero term: float32 additions of exact float32 products
    (a bf16 x times a 4-bit integer), odd k first; o = fma(s, scale, o) through float64 (s x scale
    is exact there, and these sums round once)."""
    xf, qm = x.float().numpy(), (q.int() - 8).float().numpy()
    sc = scale.to(torch.bfloat16).double().numpy()
    o = np.zeros((x.shape[0], q.shape[0]), np.float32)
    for g in range(q.shape[1] // 32):
        s = np.zeros_like(o)
        for p in range(16):
            for k in (32 * g + 2 * p + 1, 32 * g + 2 * p):
                s = s + xf[:, k, None] * qm[None, :, k]
        o = (s.astype(np.float64) * sc[None, :, g] + o.astype(np.float64)).astype(np.float32)
    return o


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 13, 16, 17, 32, 33, 100, 397])
def test_the_fma_chain_gives_its_documented_bits(m):
    """Both fma blockings (up to 32 rows in chunks of at most 16, pairs expanded as they are read:
    17 rows are chunks of 9 and 8, 32 two of 16; 33 rows or more: pairs widened once per block of
    rows, 397 rows are three blocks, the last of 13) against the chain computed in numpy, with an
    odd number of 16-row tiles (72 outputs) and 10 groups (passes of 8 groups and of 2). Each x
    has its own power of two in [2^-12, 2^12], so that most additions round and the order of a
    pair's two products shows (with the even one first, most of these outputs differ)."""
    q, scale, zero = _weights(72, 320, seed=m, zero=False)
    w, sz = pack_native(q, scale, zero)
    g = torch.Generator().manual_seed(100 + m)
    x = (torch.randn(m, 320, generator=g) * 2.0 ** torch.randint(-12, 13, (m, 320), generator=g)).bfloat16()
    out = KERNEL(x, w, sz, 72, torch.float32, True)
    assert np.array_equal(out.numpy(), _chain(x, q, scale))


@needs_kernel
def test_the_fma_chain_is_row_invariant_and_close_to_the_dense_product():
    q, scale, zero = _weights(200, 576, seed=3)
    w, sz = pack_native(q, scale, zero)
    x = torch.randn(400, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    full = KERNEL(x, w, sz, 200, torch.float32, True)
    for lo, hi in ((0, 1), (5, 6), (3, 10), (10, 17), (40, 70), (69, 70), (150, 400), (1, 390)):
        assert torch.equal(KERNEL(x[lo:hi], w, sz, 200, torch.float32, True), full[lo:hi]), (lo, hi)
    dense = (q.float() - 8) * scale.bfloat16().float().repeat_interleave(32, 1) \
        + zero.bfloat16().float().repeat_interleave(32, 1)
    ref = x.double() @ dense.double().t()
    assert (full.double() - ref).abs().max() <= 1e-4 * ref.abs().max()


@needs_kernel
def test_a_packed_layer_takes_the_chain_it_was_built_with():
    q, scale, zero = _weights(48, 64, seed=7)
    x = (torch.randn(9, 64, generator=torch.Generator().manual_seed(8)) * torch.logspace(-3, 3, 64)).bfloat16()
    dot, fma = PackedQ4(q, scale, zero), PackedQ4(q, scale, zero, fma=True)
    w, sz = pack_native(q, scale, zero)
    assert torch.equal(fma.forward_f32(x), KERNEL(x, w, sz, 48, torch.float32, True))
    assert torch.equal(dot.forward_f32(x), KERNEL(x, w, sz, 48, torch.float32, False))
    assert torch.equal(fma(x), KERNEL(x, w, sz, 48, torch.bfloat16, True))


@needs_kernel
def test_forcing_q4f_builds_every_4bit_layer_on_the_fma_chain(tmp_path):
    from streamkv import LLM, SamplingParams
    from tests.tiny_checkpoints import Q4_LINEARS, make_tiny_gguf, make_tiny_hf_checkpoint

    path = make_tiny_hf_checkpoint(tmp_path, "llama3")
    gguf = str(make_tiny_gguf(path / "q4.gguf", path, Q4_LINEARS))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(model=gguf, dtype="bfloat16", num_blocks=64, block_size=4, kernels="linear=q4f")
    layers = llm.engine.bundle.runner.model.layers
    assert all(layer.qkv.q4 is not None and layer.qkv.q4.fma for layer in layers)
    native = llm.engine.bundle.runner.model.native
    assert native is not None
    assert all(lin.kind == 1 and lin.tiles == 1 for sk in native.layers for lin in (sk.qkv, sk.o, sk.gate_up, sk.down))
    out = llm.generate([[5, 9, 14, 3]], params)[0]
    plain = LLM(model=gguf, dtype="bfloat16", num_blocks=64, block_size=4, kernels="linear=q4")
    assert all(not layer.qkv.q4.fma for layer in plain.engine.bundle.runner.model.layers)
    assert len(out.token_ids) == 6


@needs_kernel
def test_where_vdpbf16ps_adds_a_pair_odd_first_the_two_chains_agree_to_the_bit():
    """vdpbf16ps is defined as the same two additions, odd product first, each rounded to nearest
    even (denormals flushed; none occur here). Where this CPU's instruction matches that on a
    probe (the documented chain in numpy), the dot-product chain and the fma chain must give the
    same bits at every blocking, so choosing between q4 and q4f changes no output here."""
    q, scale, zero = _weights(72, 320, seed=11, zero=False)
    w, sz = pack_native(q, scale, zero)
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(8, 320, generator=g) * 2.0 ** torch.randint(-12, 13, (8, 320), generator=g)).bfloat16()
    if not np.array_equal(KERNEL(x, w, sz, 72, torch.float32, False).numpy(), _chain(x, q, scale)):
        pytest.skip("this CPU's vdpbf16ps does not add a pair as documented (odd product first, each addition "
                    "rounded): its q4 and q4f chains differ, which the kernel choice allows")
    q, scale, zero = _weights(1536, 576, seed=13)
    w, sz = pack_native(q, scale, zero)
    for m in (1, 5, 8, 100):
        x = (torch.randn(m, 576, generator=g) * 2.0 ** torch.randint(-12, 13, (m, 576), generator=g)).bfloat16()
        assert torch.equal(KERNEL(x, w, sz, 1536, torch.float32, True), KERNEL(x, w, sz, 1536, torch.float32, False)), m
