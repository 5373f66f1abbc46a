"""4-bit decode weights read straight from the GGUF's Q4_1 blocks."""
from __future__ import annotations

import pytest
import torch

from streamkv import LLM, SamplingParams
from streamkv.loading import load_checkpoint
from streamkv.loading.q4_blocks import read_q4_matrices
from streamkv.models.q4_linear import PackedQ4


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(None)


def test_blocks_equal_the_dequantized_weights(ckpt):
    q4 = read_q4_matrices(ckpt.gguf, ckpt.arch, permuted_qk=True)
    assert len(q4) == 7 * ckpt.arch.num_layers  # every projection of the embedded model is Q4_1
    for name in ("layers.0.q_proj.weight", "layers.0.k_proj.weight", "layers.17.v_proj.weight",
                 "layers.29.down_proj.weight"):
        torch.testing.assert_close(q4[name].dequantize(), ckpt.weights[name], atol=0, rtol=0)


def test_int4_kernel_matches_dense_product(ckpt):
    q4 = read_q4_matrices(ckpt.gguf, ckpt.arch, permuted_qk=True)["layers.5.gate_proj.weight"]
    x = torch.randn(3, q4.q.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    ref = x.float() @ q4.dequantize().t()
    out = PackedQ4(q4.q, q4.scale, q4.zero)(x).float()
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()


def test_q4_decode_agrees_with_dense_bf16():
    """Fast numerics: prompt rows dense, decode rows 4-bit (torch's int4 kernel or the native one)."""
    ids = [[504, 3575, 282, 4649, 314]]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    dense = LLM(dtype="bfloat16", decode_weights="dense", kv_cache_memory=1 << 26, numerics="fast")
    q4 = LLM(dtype="bfloat16", decode_weights="q4", kv_cache_memory=1 << 26, numerics="fast")
    assert any(layer.qkv.q4 is not None for layer in q4.engine.bundle.runner.model.layers)
    assert all(layer.qkv.q4 is None for layer in dense.engine.bundle.runner.model.layers)
    a, b = dense.generate(ids, params)[0], q4.generate(ids, params)[0]
    # the first token comes from the (dense) prefill in both; later ones from 4-bit decode steps
    assert a.token_ids[0] == b.token_ids[0]
    for la, lb in zip(a.logprobs[1:4], b.logprobs[1:4]):
        if la.token_id == lb.token_id:
            assert abs(la.logprob - lb.logprob) < 0.15


def test_q4_rejected_where_it_cannot_apply():
    """Fast numerics read 4-bit layers into bfloat16 models only (float32 invariant models read them
    with the dense bits: tests/test_deq_gemm.py)."""
    with pytest.raises(ValueError, match="q4"):
        LLM(dtype="float32", decode_weights="q4", numerics="fast")


def test_invariant_numerics_take_4bit_weights_only_through_the_native_kernel():
    """torch's int4 kernel is not batch-invariant: without the native one, invariant numerics
    refuse an explicit q4 and ``auto`` falls back to dense weights; with it, every row (prompt
    chunks too) takes the 4-bit weights, so a recomputed prompt row equals its decode."""
    from streamkv.native import q4_gemm

    auto = LLM(dtype="bfloat16", kv_cache_memory=1 << 26)
    # auto takes what the kernel measurement chose (native/tuning.py), 4-bit only with the native kernel
    assert auto.engine.bundle.decode_weights == auto.engine.bundle.kernels.get("linear")
    if q4_gemm() is None:
        with pytest.raises(ValueError, match="native 4-bit kernel"):
            LLM(dtype="bfloat16", decode_weights="q4", kv_cache_memory=1 << 26)
        assert auto.engine.bundle.decode_weights == "dense"
    else:
        q4 = LLM(dtype="bfloat16", kv_cache_memory=1 << 26, decode_weights="q4")
        model = q4.engine.bundle.runner.model
        assert all(layer.qkv.q4 is not None and layer.qkv.dense is None for layer in model.layers)
        assert model.q4_max_rows == 0  # no row split: one kernel for every row


def test_q8_lm_head_reads_exactly_and_splits_exactly_into_two_int4_halves(ckpt):
    from streamkv.loading.q4_blocks import read_q8_lm_head

    head = read_q8_lm_head(ckpt.gguf, tied=True)
    torch.testing.assert_close(head.dequantize(), ckpt.weights["embed.weight"], atol=0, rtol=0)
    hi, lo = head.halves()
    torch.testing.assert_close(hi.dequantize() + lo.dequantize(), ckpt.weights["embed.weight"], atol=0, rtol=0)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = x.float() @ ckpt.weights["embed.weight"].t()
    out = PackedQ4(hi.q, hi.scale, hi.zero)(x).float() + PackedQ4(lo.q, lo.scale, lo.zero)(x).float()
    assert (out - ref).abs().max() <= 0.01 * ref.abs().max()


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 13, 33, 100])
def test_native_q8_kernel_is_exact_to_float32_and_row_invariant(m):
    """Random Q8_0 weights: every product exact (int8 and bf16 values), sums in float32; each row's
    bits equal alone and in the batch (every row blocking: 1-7 rows x 1-4 tiles, 6-row blocks)."""
    from streamkv.models.q4_linear import PackedQ8
    from streamkv.native import q8_gemm

    if q8_gemm() is None:
        pytest.skip("no AVX512-BF16 (or no C compiler): the native Q8 kernel is not built")
    g = torch.Generator().manual_seed(m)
    n, k = 200, 96
    q = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    d = torch.rand(n, k // 32, generator=g) * 0.01
    x = torch.randn(m, k, generator=g).bfloat16()
    head = PackedQ8(q, d)
    out = head.forward_f32(x)
    ref = x.double() @ (q.double().view(n, k // 32, 32) * d.double()[..., None]).view(n, k).t()
    bound = (x.double().abs() @ (q.double().abs() * d.double().repeat_interleave(32, 1)).t()) * 1e-6
    assert ((out.double() - ref).abs() <= bound + 1e-12).all()
    for i in range(m):
        assert torch.equal(head.forward_f32(x[i:i + 1])[0], out[i])




@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 33])
def test_packed_kernels_match_the_dequantized_product(native, m):
    """Random 4-bit weights, every row-blocking path of the native kernel (8 / 4 / 2 / 1 rows),
    natively with a row count that leaves a partial 16-row tile (torch's kernel needs a
    multiple of 16)."""
    from streamkv.native import q4_gemm

    if native and q4_gemm() is None:
        pytest.skip("no AVX512-BF16 (or no C compiler): the native 4-bit kernel is not built")
    g = torch.Generator().manual_seed(m)
    n, k = (40 if native else 48), 256
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = (torch.rand(n, k // 32, generator=g) * 0.1).bfloat16().float()
    zero = (torch.randn(n, k // 32, generator=g) * 0.2).bfloat16().float()
    x = torch.randn(m, k, generator=g).bfloat16()
    w = ((q.double() - 8).view(n, k // 32, 32) * scale.double()[..., None] + zero.double()[..., None]).view(n, k)
    ref = x.double() @ w.t()
    layer = PackedQ4(q, scale, zero, native=native)
    assert layer.native == native
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert (out.double() - ref).abs().max() <= 2e-2 * ref.abs().max()
    exact = layer.forward_f32(x)
    assert exact.dtype == torch.float32
    tol = 1e-5 if native else 2e-2  # native: exact products summed in float32
    assert (exact.double() - ref).abs().max() <= tol * ref.abs().max()


def test_native_kernel_rows_do_not_depend_on_the_batch():
    """A row's result is bit-identical alone and inside batches of every blocking (1-7 rows in one
    pass, 6-row blocks and their 4 + 3 / 4 + 4 remainders, two 96-row blocks), so a decode token
    does not depend on what shares its step."""
    from streamkv.native import q4_gemm

    if q4_gemm() is None:
        pytest.skip("no AVX512-BF16 (or no C compiler): the native 4-bit kernel is not built")
    g = torch.Generator().manual_seed(7)
    n, k = 72, 256  # 5 tiles: runs of 4 tiles + 1 (few rows), pairs + 1 (more rows)
    layer = PackedQ4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32),
                     torch.rand(n, k // 32, generator=g) * 0.1, torch.randn(n, k // 32, generator=g) * 0.2)
    x = torch.randn(110, k, generator=g).bfloat16()
    alone = torch.cat([layer.forward_f32(x[i:i + 1]) for i in range(110)])
    for m in (2, 3, 5, 6, 7, 8, 13, 64, 97, 110):  # up to 7: one pass of every row; 97+: two 96-row blocks
        assert torch.equal(layer.forward_f32(x[:m]), alone[:m])


_FALLBACK = """
import sys, torch
from streamkv.models.q4_linear import PackedQ4
g = torch.Generator().manual_seed(11)
layer = PackedQ4(torch.randint(0, 16, (72, 256), generator=g, dtype=torch.int32),
                 torch.rand(72, 8, generator=g) * 0.1, torch.randn(72, 8, generator=g) * 0.2)
x = torch.randn(20, 256, generator=g).bfloat16()
assert layer.native
torch.save(torch.cat([layer.forward_f32(x[:1]), layer.forward_f32(x)]), sys.argv[1])
"""


def test_4bit_expansion_without_vbmi_gives_the_same_bits(tmp_path):
    """The 4-bit pairs are expanded with VBMI (vpmultishiftqb + vpermw) where the CPU has it and by
    widening elsewhere (e.g. Cooper Lake): a build without VBMI on this CPU must give the same bits."""
    import os
    import subprocess
    import sys

    from streamkv.native import q4_gemm
    from streamkv.native.cpu import has_flag

    if q4_gemm() is None or not has_flag("avx512vbmi"):
        pytest.skip("needs the native 4-bit kernel and a VBMI CPU (to build both expansions here)")
    outs = []
    for name, flags in (("vbmi", ""), ("widen", "-mno-avx512vbmi")):
        env = {**os.environ, "STREAMKV_NATIVE_FLAGS": flags, "STREAMKV_CACHE_DIR": str(tmp_path / name)}
        subprocess.run([sys.executable, "-c", _FALLBACK, str(tmp_path / f"{name}.pt")], check=True, env=env,
                       timeout=300)
        outs.append(torch.load(tmp_path / f"{name}.pt"))
    assert torch.equal(outs[0], outs[1])


def test_decode_rows_take_the_same_path_whatever_shares_the_step():
    """RowSplit: decode rows take the 4-bit weights and chunk rows the dense ones, in any mix."""
    from streamkv.models.q4_linear import DENSE, RowSplit, split_linear

    g = torch.Generator().manual_seed(8)
    q = torch.randint(0, 16, (48, 64), generator=g, dtype=torch.int32)
    scale, zero = torch.rand(48, 2, generator=g) * 0.1, torch.randn(48, 2, generator=g) * 0.1
    packed = PackedQ4(q, scale, zero)
    dense = packed.forward_f32(torch.eye(64).bfloat16()).t().bfloat16().contiguous()  # [48, 64]
    x = torch.randn(6, 64, generator=g).bfloat16()
    split = RowSplit.build([1, 4], 6, 64)
    mixed = split_linear(x, dense, None, packed, split)
    assert torch.equal(mixed[[1, 4]], packed(x[[1, 4]]))
    assert torch.equal(mixed[[0, 2, 3, 5]], torch.nn.functional.linear(x[[0, 2, 3, 5]], dense))
    assert RowSplit.build([0, 1], 2, 64).dense is None
    assert RowSplit.build(list(range(65)), 65, 64).q4 is None
    assert torch.equal(split_linear(x, dense, None, packed, DENSE), torch.nn.functional.linear(x, dense))
