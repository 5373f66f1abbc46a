"""``gemm=fma``: the dense bf16 GEMM (``native/inv_gemm.c``: the bf16 LM head, dense bf16 layers and
their fused gate_up) with each vdpbf16ps as two float32 fmas, the pair's odd element first, for
CPUs whose vdpbf16ps issues at half the float32 fma rate. Here: the same bits as vdpbf16ps where
the CPU's instruction adds as documented, one chain per element whatever the batch, and the
path through the engine (dense layers, the fused gate_up and the LM head)."""
from __future__ import annotations

import pytest
import torch

from streamkv.models.linear import KernelOptions, pack_dense
from streamkv.native import gemm_path, invariant_gemm, invariant_gemm_uses_bf16_dot
from tests.test_attention_fma import _documented_vdpbf16ps

GEMM = invariant_gemm()
needs_dot = pytest.mark.skipif(GEMM is None or not invariant_gemm_uses_bf16_dot(),
                               reason="no AVX512-BF16 build: bf16 weights run on fmas here already (path 2 is "
                                      "that path)")
SHAPES = [(1, 100, 64), (7, 960, 576), (13, 3072, 576), (37, 576, 1536), (101, 200, 34), (6, 16, 2)]


def _case(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] and w [n, k] bf16 spread over many binades (products that round in every way), and w packed."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-12, 13, (m, k), generator=g)).bfloat16()
    w = (torch.randn(n, k, generator=g) * 2.0 ** torch.randint(-8, 4, (n, k), generator=g)).bfloat16()
    return x, w, pack_dense(w)


@needs_dot
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_where_vdpbf16ps_adds_as_documented_the_fma_chain_gives_its_bits(m, n, k, out_dtype):
    if not _documented_vdpbf16ps():
        pytest.skip("this CPU's vdpbf16ps does not add a pair as documented: gemm=fma has bits of its own, "
                    "which the kernel choice allows")
    x, w, wp = _case(m, n, k, seed=m * n + k)
    fma = GEMM(x, wp, n, out_dtype, False, True)
    assert torch.equal(fma, GEMM(x, wp, n, out_dtype, False, False))
    ref = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()  # float32 sums of k terms: error <= ~k eps of this
    rounding = ref.abs() * 2.0 ** -8 if out_dtype == torch.bfloat16 else 0.0
    assert ((fma.double() - ref).abs() <= k * 2.0 ** -24 * scale + rounding).all()


@needs_dot
def test_the_fma_chain_gives_a_row_the_same_bits_in_any_batch():
    """One chain per element: a row's output does not depend on the rows beside it (every row
    grouping of the micro-kernels, 1-6 rows, and both work splits)."""
    x, _, wp = _case(45, 700, 576, seed=3)
    full = GEMM(x, wp, 700, torch.float32, False, True)
    for rows in ([0], [5, 6, 7], list(range(9, 22)), list(range(44, 25, -1))):
        assert torch.equal(GEMM(x[rows], wp, 700, torch.float32, False, True), full[rows])


def test_a_gemm_runs_on_tiles_or_the_fma_chain_not_both():
    assert (gemm_path(), gemm_path(tiles=True), gemm_path(fma=True)) == (0, 1, 2)
    with pytest.raises(ValueError, match="not both"):
        gemm_path(tiles=True, fma=True)
    with pytest.raises(ValueError, match="not both"):
        KernelOptions(tiles=True, gemm_fma=True)


@needs_dot
def test_forcing_gemm_fma_runs_dense_layers_the_fused_gate_up_and_the_lm_head_on_it(tmp_path):
    """A dense bf16 checkpoint: every linear (the native layers' gate_up fused with SiLU) and the
    LM head take path 2; the tokens equal gemm=avx512's where vdpbf16ps adds as documented."""
    from streamkv import LLM, SamplingParams
    from tests.tiny_checkpoints import make_tiny_hf_checkpoint

    path = make_tiny_hf_checkpoint(tmp_path, "llama3")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 3], list(range(40, 77))]
    outs = {}
    for name, want in (("fma", 2), ("avx512", 0)):
        llm = LLM(model=str(path), dtype="bfloat16", num_blocks=64, block_size=4, kernels=f"gemm={name}")
        model = llm.engine.bundle.runner.model
        assert model.lm_head.dense is not None and model.lm_head.dense.fma == (name == "fma")
        native = model.native
        assert native is not None
        for layer in native.layers:
            assert {lin.tiles for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)} == {want}
        outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
        assert all(len(t) == 8 for t in outs[name])
    if _documented_vdpbf16ps():
        assert outs["fma"] == outs["avx512"]


def test_the_gemm_kind_offers_fma_exactly_where_bf16_dot_products_are_built():
    """``streamkv info`` lists gemm=fma as a candidate on AVX512-BF16 builds for bf16 models, never
    for float32 ones (their dense GEMM is float32 fmas already)."""
    from streamkv.native.tuning import ModelShapes, runnable

    shapes = dict(hidden=64, inter=128, heads=4, kv_heads=2, head_dim=16, vocab=100, layers=2, numerics="invariant",
                  q4=False, q8_head=False)
    offered = "fma" in runnable(ModelShapes(bf16=True, **shapes)).get("gemm", [])
    assert offered == (GEMM is not None and invariant_gemm_uses_bf16_dot())
    assert "fma" not in runnable(ModelShapes(bf16=False, **shapes)).get("gemm", [])
