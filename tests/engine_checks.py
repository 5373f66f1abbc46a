"""A shared engine check: the same greedy tokens and logprobs however a prompt is served."""
from __future__ import annotations

from typing import Any

import torch

from streamkv import LLM, SamplingParams


def tokens_and_logprobs(llm: LLM, batch: list[list[int]], params: SamplingParams) -> list[Any]:
    return [(o.token_ids, [(lp.token_id, lp.logprob) for lp in o.logprobs]) for o in llm.generate(batch, params)]


def tiny_prompts() -> list[list[int]]:
    """Four prompts of 3-31 ids below the tiny checkpoints' vocabulary (384)."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 384, (int(n),), generator=g).tolist() for n in (3, 9, 22, 31)]


def same_everywhere(model: str, dtype: str, kernels: str, prompts: list[list[int]] | None = None,
                    params: SamplingParams | None = None, check: Any = None) -> list[Any]:
    """The prompts (default ``tiny_prompts``; 10 greedy tokens with logprobs) batched, then each
    alone (prefix cache reset), chunked (5-token chunks) and preempted (a 24-block pool): all
    equal; returns the batched outputs. ``check(llm)`` looks at the first engine before it runs."""
    prompts = tiny_prompts() if prompts is None else prompts
    params = params or SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(model=model, dtype=dtype, num_blocks=128, block_size=4, kernels=kernels)
    if check is not None:
        check(llm)
    batched = tokens_and_logprobs(llm, prompts, params)
    for p, expected in zip(prompts, batched):
        llm.engine.pool.reset_prefix_cache()
        assert tokens_and_logprobs(llm, [p], params) == [expected], kernels
    chunked = LLM(model=model, dtype=dtype, num_blocks=128, block_size=4, kernels=kernels, max_chunk_tokens=5)
    assert tokens_and_logprobs(chunked, prompts, params) == batched, kernels
    tight = LLM(model=model, dtype=dtype, num_blocks=24, block_size=4, kernels=kernels)
    assert tokens_and_logprobs(tight, prompts, params) == batched, kernels
    assert tight.engine.scheduler.num_preemptions > 0, kernels
    return batched
