"""The native CPU decode kernel equals PyTorch SDPA, and the cpu backend equals the reference
backend end to end (it is the default on CPU whenever gcc can build it)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streamkv import LLM, SamplingParams
from streamkv.attention.native import decode_attention

kernel = decode_attention()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler: the native kernel is not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
def test_kernel_matches_sdpa_on_scattered_slots(dtype, heads):
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


def test_cpu_backend_generates_like_the_reference_backend():
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=3)
    prompts = ["The history of the printing press", "List three colors:", "1, 2, 3, 4,"]
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(dtype="float32", attention_backend=backend)
        assert type(llm.engine.bundle.runner.backend).__name__ == {"torch": "TorchReferenceBackend",
                                                                    "cpu": "CpuNativeBackend"}[backend]
        outs[backend] = llm.generate(prompts, params)
    for a, b in zip(outs["torch"], outs["cpu"]):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert abs(la.logprob - lb.logprob) < 1e-3
