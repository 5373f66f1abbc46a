"""The fast-numerics native CPU kernels (decode, paged mixed-batch) equal reference attention,
and the cpu backend tracks the reference backend end to end under ``numerics="fast"``.

What each guarantees: both compute exact attention up to the rounding of their own reduction
orders. In float32 that is ~1e-6 per layer, so generations agree in tokens and closely in
logprobs. In bfloat16 the two kernels round differently (bf16 dot products vs SDPA): their
layer outputs agree to a few bf16 ulps (checked layer by layer below), and end to end only
tokens chosen by a clear margin are guaranteed equal. Bit-identical results are the business
of the default invariant numerics (``tests/test_invariance.py``), not of these kernels."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streamkv import LLM, SamplingParams
from streamkv.native import decode_attention, paged_attention

kernel = decode_attention()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler: the native kernel is not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1), (32, 4)])
def test_kernel_matches_sdpa_on_scattered_slots(dtype, heads):
    """(32, 4): more than 16 query heads, so the bf16 path makes one item per kv head."""
    h, hk = heads
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(4096, hk, 64, generator=g).to(dtype)
    vc = torch.randn(4096, hk, 64, generator=g).to(dtype)
    lengths = [1, 7, 513, 1500]
    slots = [torch.randperm(4096, generator=g)[:n] for n in lengths]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    q = torch.randn(len(lengths), h, 64, generator=g).to(dtype).float()  # q comes from a `dtype` projection
    out = kernel(q, kc, vc, torch.cat(slots), offsets, 0.125, chunk_len=256)
    for b, s in enumerate(slots):
        ks, vs = kc[s].float().transpose(0, 1)[None], vc[s].float().transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(q[b][None, :, None], ks, vs, scale=0.125, enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[b], ref, atol=2e-5, rtol=1e-4)


PROMPTS = ["The history of the printing press", "List three colors:", "1, 2, 3, 4,"]


def _generate_with_each_backend(dtype: str, params: SamplingParams) -> dict[str, list]:
    """Outputs of PROMPTS from the reference ("torch") and the native ("cpu") backend. In bfloat16
    the native backend is forced onto the paged prefill kernel: by measurement an AMX CPU picks
    torch's SDPA for prefill (oneDNN on tiles), which would leave that kernel untested."""
    outs = {}
    for backend in ("torch", "cpu"):
        forced = "prefill_attention=native" if backend == "cpu" and dtype == "bfloat16" else "auto"
        llm = LLM(dtype=dtype, attention_backend=backend, numerics="fast", kernels=forced)
        used = llm.engine.bundle.runner.backend
        assert type(used).__name__ == {"torch": "TorchReferenceBackend", "cpu": "CpuNativeBackend"}[backend]
        if backend == "cpu" and dtype == "bfloat16":
            assert used.paged is not None  # the paged prefill kernel is what this dtype exercises
        outs[backend] = llm.generate(PROMPTS, params)
    return outs


def test_cpu_backend_generates_like_the_reference_backend():
    outs = _generate_with_each_backend("float32", SamplingParams(max_tokens=24, temperature=0, logprobs=3))
    for a, b in zip(outs["torch"], outs["cpu"]):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert abs(la.logprob - lb.logprob) < 1e-3


paged = paged_attention()
needs_paged = pytest.mark.skipif(paged is None, reason="no AVX512-BF16 (or no C compiler): paged kernel not built")


def _reference(q, kc, vc, seqs, slots, scale):
    """Float64 causal attention of every sequence's rows over its context slots."""
    h, hk = q.shape[1], kc.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row0, nq, off, length in seqs.tolist():
        s = slots[off:off + length]
        ks = kc[s].double().transpose(0, 1).repeat_interleave(h // hk, 0)
        vs = vc[s].double().transpose(0, 1).repeat_interleave(h // hk, 0)
        scores = q[row0:row0 + nq].double().transpose(0, 1) @ ks.transpose(1, 2) * scale
        visible = torch.arange(length)[None, :] <= torch.arange(length - nq, length)[:, None]
        out[row0:row0 + nq] = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vs).transpose(0, 1)
    return out


@needs_paged
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1), (16, 2)])
@pytest.mark.parametrize("chunk_len", [16, 64, 512])
def test_paged_kernel_matches_reference_on_a_mixed_step(heads, chunk_len):
    """Decode rows, fresh prefill chunks and chunks with earlier context, of lengths that do
    and do not fill 16-key blocks and 64-key super-blocks, over scattered slots."""
    h, hk = heads
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(8192, hk, 64, generator=g).bfloat16()
    vc = torch.randn(8192, hk, 64, generator=g).bfloat16()
    shapes = [(1, 1), (1, 37), (5, 5), (17, 17), (28, 900), (64, 64), (1, 1000), (3, 20), (70, 700), (33, 33)]
    rows, parts, row0, off = [], [], 0, 0
    for nq, length in shapes:
        rows.append((row0, nq, off, length))
        parts.append(torch.randperm(8192, generator=g)[:length])
        row0, off = row0 + nq, off + length
    seqs, slots = torch.tensor(rows), torch.cat(parts)
    q = torch.randn(row0, h, 64, generator=g).bfloat16()
    out = paged(q, kc, vc, seqs, slots, 0.125, chunk_len)
    torch.testing.assert_close(out.double(), _reference(q, kc, vc, seqs, slots, 0.125), atol=1e-2, rtol=1e-2)


@needs_paged
def test_paged_kernel_rejects_what_it_cannot_serve():
    kc = torch.zeros(64, 3, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 9, 64, dtype=torch.bfloat16)
    seqs, slots = torch.tensor([[0, 1, 0, 4]]), torch.arange(4)
    with pytest.raises(TypeError):
        paged(q.float(), kc, kc, seqs, slots, 0.125)
    with pytest.raises(ValueError, match="head_dim 64"):
        paged(torch.zeros(1, 9, 32, dtype=torch.bfloat16), kc[..., :32].contiguous(), kc[..., :32].contiguous(),
              seqs, slots, 0.125)
    with pytest.raises(ValueError, match="rejected"):
        paged(q, kc, kc, seqs, slots, 0.125, chunk_len=24)


@needs_paged
def test_cpu_backend_with_the_paged_kernel_equals_the_reference_backend_in_bfloat16():
    """One step mixing a fresh prefill, a chunk with context and decodes, layer by layer."""
    from streamkv.attention.backend import KVCache, SeqSpan
    from streamkv.attention.cpu_native import CpuNativeBackend
    from streamkv.attention.torch_ref import TorchReferenceBackend

    g = torch.Generator().manual_seed(2)
    backends = []
    for cls in (TorchReferenceBackend, CpuNativeBackend):
        cache = KVCache(2, 64, 16, 3, 64, torch.bfloat16)
        cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(3)))
        cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(4)))
        backends.append(cls(cache, 0.125))
    assert backends[1].paged is not None
    spans = [SeqSpan(0, 40, 0, (0, 1, 2)), SeqSpan(40, 25, 100, tuple(range(3, 11))), SeqSpan(65, 1, 300, tuple(range(11, 30))),
             SeqSpan(66, 1, 7, (30,))]
    t = 67
    q = torch.randn(t, 9, 64, generator=g).bfloat16()
    k = torch.randn(t, 3, 64, generator=g).bfloat16()
    v = torch.randn(t, 3, 64, generator=g).bfloat16()
    ref, nat = (b.forward(1, q, k, v, b.prepare(spans, t)) for b in backends)
    torch.testing.assert_close(nat.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(backends[1].cache.k, backends[0].cache.k)


@needs_paged
def test_bfloat16_generation_with_the_paged_kernel_tracks_the_reference_backend():
    """bf16 rounding differs between the kernels (see the module docstring): the first greedy
    token must agree wherever the reference chose it by a clear margin (top-2 log-prob gap above
    0.25, several times the bf16 drift of 30 layers); near ties may go either way."""
    outs = _generate_with_each_backend("bfloat16", SamplingParams(max_tokens=16, temperature=0, logprobs=2))
    clear = 0
    for a, b in zip(outs["torch"], outs["cpu"]):
        (_, top1), (_, top2) = a.logprobs[0].top[:2]
        if top1 - top2 > 0.25:
            clear += 1
            assert a.token_ids[0] == b.token_ids[0]
    assert clear > 0, "no prompt had a clear first token: the test checked nothing"
