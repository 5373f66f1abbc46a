"""Batch invariance on tiny random checkpoints of every family (head_dim 16, GQA, biases,
Qwen3's qk-norm), both dtypes: tokens and logprobs alone == batched == chunked by 7 ==
preempted and recomputed, bit for bit. Needs no model file, so it runs on any machine."""
from __future__ import annotations

import pytest
import torch

from streamkv import LLM, SamplingParams
from streamkv.native import q4_gemm
from tests.tiny_checkpoints import Q4_LINEARS, make_tiny_gguf, make_tiny_hf_checkpoint

pytest.importorskip("transformers")

PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)




@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3", "llama-q4_1-gguf"])
def checkpoint(request, tmp_path_factory):
    """HF directories, and a GGUF with Q4_1 linears: in bfloat16 on CPUs with the native 4-bit
    kernel every row (prompt chunks too) takes those 4-bit weights."""
    family = request.param.split("-")[0]
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(family), family)
    if request.param.endswith("gguf"):
        path = make_tiny_gguf(path / "q4.gguf", path, Q4_LINEARS)
    return str(path)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, vocab, (9,), generator=g).tolist()  # a common prefix: prefix-cache hits
    return [shared + torch.randint(0, vocab, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 60, (12,), generator=g)]


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    outs = llm.generate(prompts, PARAMS)
    return [(o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_alone_batched_chunked_preempted_are_identical(checkpoint, dtype):
    q4 = checkpoint.endswith(".gguf") and dtype == "bfloat16" and q4_gemm() is not None
    # explicit, never measured: on AMX CPUs auto picks the dense tile GEMM, and a float32 GGUF's
    # exact packed path wins or not by measurement (tests/test_deq_gemm.py runs it, and switching)
    weights = "q4" if q4 else "dense"
    llm = LLM(model=checkpoint, dtype=dtype, num_blocks=256, block_size=4, decode_weights=weights)
    assert llm.engine.bundle.decode_weights == ("q4" if q4 else "dense")
    prompts = _prompts(llm.engine.bundle.vocab_size)
    solo = []
    for p in prompts:
        llm.engine.pool.reset_prefix_cache()
        solo += _run(llm, [p])
    assert _run(llm, prompts) == solo, "batched (with prefix hits) differs from alone"
    chunked = LLM(model=checkpoint, dtype=dtype, num_blocks=256, block_size=4, max_chunk_tokens=7,
                  decode_weights=weights)
    assert _run(chunked, prompts) == solo, "chunks of 7 differ from one prefill"
    tight = LLM(model=checkpoint, dtype=dtype, num_blocks=60, block_size=4, decode_weights=weights)
    assert _run(tight, prompts) == solo, "preempted and recomputed differs"
    assert tight.engine.scheduler.num_preemptions > 0
    for engine in (llm, chunked, tight):
        engine.engine.check_integrity()
