"""``attention=bf16f``: the bf16 attention kernel with each bf16 dot product as two float32 fmas,
the pair's odd element first (``native/attn_bf16_rows.h``), for CPUs whose vdpbf16ps issues at
half the float32 fma rate. Correctness, row invariance and chunking are in
tests/test_invariant_kernels.py (its ``bf16f-bfloat16`` cases); here: the same bits as vdpbf16ps
where the CPU's instruction adds as documented, and the path through the engine."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from streamkv.native import invariant_attention_bf16, invariant_attention_bf16f, q4_gemm
from tests.test_invariant_kernels import _step
from tests.test_q4_fma import _chain, _weights

DOT, FMA = invariant_attention_bf16(), invariant_attention_bf16f()
needs_kernel = pytest.mark.skipif(FMA is None, reason="no AVX512-BF16: the bf16 attention kernel is not built here")


def _documented_vdpbf16ps() -> bool:
    """Whether this CPU's vdpbf16ps adds a pair as its definition says (odd product first, each
    addition rounded to nearest even): the 4-bit kernel's dot chain against numpy (test_q4_fma)."""
    from streamkv.models.q4_linear import pack_native

    q, scale, zero = _weights(72, 320, seed=11, zero=False)
    w, sz = pack_native(q, scale, zero)
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(8, 320, generator=g) * 2.0 ** torch.randint(-12, 13, (8, 320), generator=g)).bfloat16()
    return np.array_equal(q4_gemm()(x, w, sz, 72, torch.float32, False).numpy(), _chain(x, q, scale))


@needs_kernel
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 128), (6, 2, 48), (8, 1, 32)])
def test_where_vdpbf16ps_adds_as_documented_the_fma_chain_gives_its_bits(heads):
    """A mixed step (prompt tiles, split decodes, a decode with drafts, partly visible blocks; head
    dims 32-128 take every row grouping of the P V loops): bf16f == bf16 to the bit wherever the
    CPU's vdpbf16ps matches its definition, so choosing between the two changes no answer there."""
    if not _documented_vdpbf16ps():
        pytest.skip("this CPU's vdpbf16ps does not add a pair as documented: its bf16 and bf16f attention "
                    "differ, which the kernel choice allows")
    h, hk, d = heads
    shapes = [(1, 1), (1, 37), (17, 17), (40, 900), (1, 1600), (4, 1026), (70, 600), (3, 6000)]
    q, kc, vc, seqs, slots = _step(shapes, h, hk, d, torch.bfloat16, seed=d + 1)
    q = q * 4  # peakier softmax weights: small P values in the bf16 products
    assert torch.equal(FMA(q, kc, vc, seqs, slots, d ** -0.5), DOT(q, kc, vc, seqs, slots, d ** -0.5))


@needs_kernel
def test_forcing_bf16f_runs_the_backend_and_the_native_layers_on_the_fma_chain(tmp_path):
    from streamkv import LLM, SamplingParams
    from streamkv.models.native_layers import ATTENTION_MODES, DIRECT
    from tests.tiny_checkpoints import Q4_LINEARS, make_tiny_gguf, make_tiny_hf_checkpoint

    path = make_tiny_hf_checkpoint(tmp_path, "llama3")
    gguf = str(make_tiny_gguf(path / "q4.gguf", path, Q4_LINEARS))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 3], list(range(40, 77))]
    outs = {}
    for path_name in ("bf16f", "bf16"):
        llm = LLM(model=gguf, dtype="bfloat16", num_blocks=64, block_size=4, kernels=f"attention={path_name}")
        runner = llm.engine.bundle.runner
        assert runner.backend.path == path_name
        native = runner.model.native
        assert native is not None and native.model.attn_bf16 & ~DIRECT == ATTENTION_MODES[path_name]
        outs[path_name] = [o.token_ids for o in llm.generate(prompts, params)]
        assert all(len(t) == 8 for t in outs[path_name])
    if _documented_vdpbf16ps():
        assert outs["bf16f"] == outs["bf16"]


def test_the_backend_refuses_bf16f_where_it_cannot_run():
    """bf16f is the bf16 kernel's chain: with tiles, or without the bf16 kernel, a clear error."""
    from streamkv.attention.backend import KVCache, make_backend

    cache = KVCache(1, 4, 16, 2, 64, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="bf16f"):
        make_backend("cpu_invariant", cache, 0.125, bf16=DOT is not None, tiles=DOT is not None, fma=True)
    f32 = KVCache(1, 4, 16, 2, 64, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError):
        make_backend("cpu_invariant", f32, 0.125, bf16=False, fma=True)


@pytest.mark.skipif(DOT is None, reason="no AVX512-BF16: the bf16 attention kernels are not built here")
@pytest.mark.parametrize("path", ["bf16", "bf16f"])
def test_gathering_from_the_pool_gives_the_staged_bits(path):
    """``attention_gather=direct``: decode items (split per chunk: one row, a row with drafts, a
    lone short decode per kv head) transpose each head's blocks straight from the pool instead of
    from a staging copy; super-blocks in one run of slots, scattered 16-slot pages and single
    scattered slots all give the staged bits."""
    fn = DOT if path == "bf16" else FMA
    for h, hk, d in ((9, 3, 64), (6, 2, 48), (4, 4, 128)):
        shapes = [(1, 1700), (1, 600), (4, 1026), (3, 6000), (1, 77)]
        q, kc, vc, seqs, slots = _step(shapes, h, hk, d, torch.bfloat16, seed=d + 3)
        staged = fn(q, kc, vc, seqs, slots, d ** -0.5)
        assert torch.equal(fn(q, kc, vc, seqs, slots, d ** -0.5, direct=True), staged), (h, hk, d)
        n, pages = len(slots), 2 * (len(slots) // 16 + 1)
        paged = (torch.randperm(pages)[:, None] * 16 + torch.arange(16)).flatten()[:n]
        run = torch.arange(n)
        for layout in (paged, run):
            kc2, vc2 = kc.new_zeros(pages * 16, hk, d), vc.new_zeros(pages * 16, hk, d)
            kc2[layout], vc2[layout] = kc[slots], vc[slots]
            assert torch.equal(fn(q, kc2, vc2, seqs, layout, d ** -0.5, direct=True), staged), (h, hk, d)
            assert torch.equal(fn(q, kc2, vc2, seqs, layout, d ** -0.5), staged), (h, hk, d)


@pytest.mark.skipif(DOT is None, reason="no AVX512-BF16: the bf16 attention kernels are not built here")
def test_the_gather_choice_reaches_the_backend_and_the_native_layers(tmp_path):
    from streamkv import LLM, SamplingParams
    from streamkv.models.native_layers import DIRECT
    from tests.tiny_checkpoints import make_tiny_hf_checkpoint

    path = str(make_tiny_hf_checkpoint(tmp_path, "llama3"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 90)), [7, 8, 9]]
    outs = []
    for gather in ("stage", "direct"):
        llm = LLM(model=path, dtype="bfloat16", num_blocks=64, block_size=4,
                  kernels=f"attention=bf16,attention_gather={gather}")
        runner = llm.engine.bundle.runner
        assert runner.backend.gather == gather
        assert bool(runner.model.native.model.attn_bf16 & DIRECT) == (gather == "direct")
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]
    f32 = LLM(model=path, dtype="bfloat16", num_blocks=64, block_size=4, kernels="attention=f32,attention_gather=direct")
    assert f32.engine.bundle.runner.backend.gather == "stage"  # the float32 kernel never stages: nothing to pick
