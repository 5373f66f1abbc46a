"""Float32 models read their GGUF's packed 4-bit layers and int8 head with the dense GEMM's bits
(``native/deq_gemm.c``, ``models/deq_linear.py``): the packed path and the dense one are
interchangeable at any row count, so a step takes the faster one and nothing changes."""
from __future__ import annotations

import pytest
import torch

from streamkv.loading.q4_blocks import Q4Matrix, read_q4_matrices, read_q8_lm_head
from streamkv.models.deq_linear import DeqWeights, pack_deq, pack_deq8
from streamkv.models.linear import KernelOptions, LogitsHead, make_linear, pack_dense
from streamkv.native import deq_gemm, invariant_gemm
from tests.engine_checks import same_everywhere

pytestmark = pytest.mark.skipif(deq_gemm() is None, reason="no C compiler: the native kernels are not built")


def _q4(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random Q4_1-like blocks (float16 scales and offsets) and the loader's float32 weights
    (gguf's numpy dequantization: d * q, then + m)."""
    q = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    w = d.repeat_interleave(32, 1) * q.float() + m.repeat_interleave(32, 1)
    return q, d, m, w


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(72, 256), (40, 64), (600, 96), (960, 64)])
def test_packed_weights_give_the_dense_float32_gemms_bits(n, k, threads):
    """Every row count (the fused few-row path in blocks of up to 6 rows, 11 as 6 + 5, 13 as 5 + 4 + 4;
    the buffered path, partial row blocks), a partial last
    panel, units of 4 or 3 panels (960 columns on 2 threads: 20 units of 3), 1 or 2 threads: equal to the
    dense float32 GEMM to the bit, and close to float64."""
    g = torch.Generator().manual_seed(n + k)
    gemm, deq = invariant_gemm(), deq_gemm()
    q, d, m, w = _q4(n, k, g)
    q8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    w8 = q8.float() * d.repeat_interleave(32, 1)
    packed4, packed8 = pack_deq(q, d, m), pack_deq8(q8, d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 16, 17, 33, 97, 200):
            x = torch.randn(rows, k, generator=g)
            for (qp, dm), weight in ((packed4, w), (packed8, w8)):
                dense = gemm(x, pack_dense(weight), n, torch.float32)
                out = deq(x, qp, dm, n)
                assert torch.equal(out, dense), (rows, qp.dtype)
                ref = x.double() @ weight.double().t()
                assert (out.double() - ref).abs().max() <= 1e-5 * (x.double().abs() @ weight.double().abs().t()).max()
            assert torch.equal(deq(x, *packed4, n, torch.bfloat16), gemm(x, pack_dense(w), n, torch.bfloat16))
    finally:
        torch.set_num_threads(before)


def test_the_embedded_models_packed_weights_are_the_loaders_weights():
    """One-hot rows pull every weight out of the kernel (fma(1, w, 0) = w): the Q4_1 layers (Llama's
    q/k rows permuted back) and the Q8_0 head rebuild gguf's float32 dequantization bit for bit."""
    from streamkv.loading import load_checkpoint

    ckpt = load_checkpoint(None, dtype=torch.float32)
    q4 = read_q4_matrices(ckpt.gguf, ckpt.arch, permuted_qk=True)
    for name in ("layers.0.q_proj.weight", "layers.0.k_proj.weight", "layers.11.down_proj.weight"):
        n, k = q4[name].q.shape
        packed = DeqWeights.from_q4(q4[name], max_rows=1 << 20)
        for rows in (torch.arange(8), torch.arange(k)):  # the few-row path, then the buffered one
            eye = torch.eye(k)[rows]
            assert torch.equal(packed(eye), ckpt.weights[name].t()[rows]), name
    head = DeqWeights.from_q8(read_q8_lm_head(ckpt.gguf, tied=True), max_rows=1 << 20)
    assert torch.equal(head(torch.eye(576)[:16]), ckpt.weights["embed.weight"][:, :16].t())


def test_a_layer_switches_by_row_count_without_changing_a_bit():
    g = torch.Generator().manual_seed(3)
    q, d, m, w = _q4(72, 128, g)
    bias = torch.randn(72, generator=g)
    layer = make_linear("invariant", w, bias, Q4Matrix(q, d, m + 8 * d, m), KernelOptions(deq_rows=4))
    dense = make_linear("invariant", w, bias, None)
    assert layer.deq is not None and layer.deq.max_rows == 4 and dense.deq is None
    x = torch.randn(9, 128, generator=g)
    assert torch.equal(layer(x), dense(x))  # 9 rows: the dense panels
    for i in range(9):
        assert torch.equal(layer(x[i:i + 1]), dense(x)[i:i + 1])  # 1 row: the packed weights
    assert torch.equal(layer(x[:4]), dense(x[:4]))
    head_w = torch.randint(-128, 128, (50, 64), generator=g, dtype=torch.int8)
    hd = (torch.rand(50, 2, generator=g) * 0.01).half().float()
    from streamkv.loading.q4_blocks import Q8Matrix

    weight = Q8Matrix(head_w, hd).dequantize()
    head = LogitsHead(weight, Q8Matrix(head_w, hd), "invariant", KernelOptions(head_deq_rows=2))
    plain = LogitsHead(weight, None, "invariant")
    h = torch.randn(5, 64, generator=g)
    assert head.deq is not None and torch.equal(head(h), plain(h)) and torch.equal(head(h[:2]), plain(h[:2]))


def test_packing_refuses_what_it_could_not_reproduce():
    q = torch.randint(0, 16, (16, 64))
    d = torch.full((16, 2), 0.1)  # 0.1 is not a float16 value
    with pytest.raises(ValueError, match="float16"):
        pack_deq(q, d, torch.zeros(16, 2))
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_deq(torch.randint(0, 16, (16, 48)), torch.ones(16, 1), torch.zeros(16, 1))
    with pytest.raises(ValueError, match="offset"):
        DeqWeights.from_q4(Q4Matrix(q, torch.ones(16, 2), torch.zeros(16, 2)), max_rows=4)
    with pytest.raises(TypeError, match="float32"):
        deq_gemm()(torch.ones(1, 64, dtype=torch.bfloat16), *pack_deq(q, torch.ones(16, 2), torch.zeros(16, 2)), 16)
    with pytest.raises(ValueError, match="rc=1"):  # K not a multiple of 32 reaches the kernel's own check
        deq_gemm()(torch.ones(1, 40), torch.zeros(1, 1, 32, 8, dtype=torch.uint8), torch.zeros(1, 1, 2, 16).half(), 16)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tests.tiny_checkpoints import Q4_LINEARS, make_tiny_gguf, make_tiny_hf_checkpoint

    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama3"), "llama3")
    return str(make_tiny_gguf(path / "q4.gguf", path, {**Q4_LINEARS, "token_embd": "Q8_0"}))


def test_a_float32_engine_gives_the_same_bits_packed_dense_or_switching(tiny_gguf, tmp_path, monkeypatch):
    """Forced packed weights at every step, forced dense, and a measured switch at 8 rows: the same
    tokens and logprobs, alone, batched, chunked and preempted."""
    import streamkv.native.kernel_bench as kernel_bench

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    dense = {"decode x1": 1.0, "decode x4": 1.0, "decode x8": 1.0, "decode x16": 3.0, "prompt x64": 9.0}

    def measure(kind, shapes, chosen):  # the packed path faster up to 8 rows, slower beyond
        packed = {sh: t * (0.5 if kernel_bench.EXACT_ROWS[sh] <= 8 else 2.0) for sh, t in dense.items()}
        return {{"linear": "q4", "lm_head": "q8"}[kind]: packed, "dense": dense}
    monkeypatch.setattr(kernel_bench, "measure", measure)
    def check(kernels):
        def look(llm):
            choice = llm.engine.bundle.kernels
            layer = llm.engine.bundle.runner.model.layers[0].qkv
            if kernels == "auto":
                assert choice.packed_rows("linear") == 8 and choice.packed_rows("lm_head") == 8
                assert layer.deq is not None and layer.deq.max_rows == 8
            assert (layer.deq is None) == (kernels.startswith("linear=dense"))
        return look

    results = [same_everywhere(tiny_gguf, "float32", kernels, check=check(kernels))
               for kernels in ("linear=q4,lm_head=q8", "linear=dense,lm_head=dense", "auto")]
    assert results[0] == results[1] == results[2]
