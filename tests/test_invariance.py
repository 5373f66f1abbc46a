"""Batch-invariant numerics (the default): a request's tokens AND logprobs are bit-identical
whatever happens around it: alone or batched with 15 or 63 others, repeated with prefix-cache
hits, prefilled in chunks of 7 tokens, preempted and recomputed. Checked in the default dtype
(whatever ``auto`` picks on this CPU) and in the other dtype, on the embedded model."""
from __future__ import annotations

import pytest

from streamkv import LLM, SamplingParams
from streamkv.engine.dtype import resolve_dtype

import torch

CHAT = [
    "What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers.",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?", "Give me a Python one-liner to sum a list.",
    "What is 17 times 3?", "Describe a cat in one sentence.", "List the planets of the solar system.",
    "What does a compiler do?", "Suggest a name for a pet turtle.", "How many legs does a spider have?",
    "What is the boiling point of water?", "Write a two-line poem about autumn.", "Who wrote Hamlet?",
    "Explain recursion briefly.",
]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
DEFAULT = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
OTHER = "float32" if DEFAULT == "bfloat16" else "bfloat16"


def _chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _result(out) -> tuple:
    """Everything a client sees of a completion: ids, each token's logprob and its top-3."""
    return out.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]


def _same(a: list, b: list, what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x == y, f"{what}: request {i} differs (tokens and logprobs must be bit-identical)"


@pytest.fixture(scope="module", params=[DEFAULT, OTHER])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def llm(dtype):
    return LLM(dtype=dtype)


@pytest.fixture(scope="module")
def solo(llm):
    """Each request alone, with an empty prefix cache: the reference."""
    outs = []
    for text in CHAT:
        llm.engine.pool.reset_prefix_cache()
        out = llm.generate([_chat_ids(llm, text)], PARAMS)[0]
        assert out.num_cached_tokens == 0
        outs.append(_result(out))
    return outs


def test_default_numerics_are_invariant(llm):
    assert llm.engine.config.runtime.numerics == "invariant"
    assert type(llm.engine.bundle.runner.backend).__name__ == "InvariantCpuBackend"


def test_batched_and_repeated_equal_alone(llm, solo):
    prompts = [_chat_ids(llm, t) for t in CHAT]
    batched = llm.generate(prompts, PARAMS)  # 16 in one batch (the shared template prefix hits the cache)
    _same([_result(o) for o in batched], solo, "all 16 in one batch")
    again = llm.generate(prompts, PARAMS)
    assert all(o.num_cached_tokens > 0 for o in again)
    _same([_result(o) for o in again], solo, "repeated (prefix-cache hits)")
    llm.engine.check_integrity()


def test_with_63_others_equals_alone(llm, solo):
    """64 sequences share every step: 16 requests x 4 copies, prefilled and decoded together."""
    prompts = [_chat_ids(llm, t) for t in CHAT] * 4
    outs = llm.generate(prompts, PARAMS)
    _same([_result(o) for o in outs], solo * 4, "with 63 others")


def test_chunk_cap_7_equals_alone(dtype, solo):
    chunked = LLM(dtype=dtype, max_chunk_tokens=7, enable_prefix_caching=False)
    prompts = [_chat_ids(chunked, t) for t in CHAT]
    _same([_result(o) for o in chunked.generate(prompts, PARAMS)], solo, "prefilled in chunks of 7")


def test_preempted_and_recomputed_equals_uninterrupted(dtype, solo):
    """A pool too small for all 16: sequences are preempted and their tokens, generated ones
    included, recomputed as prompt rows; every token and logprob equals the uninterrupted run."""
    tight = LLM(dtype=dtype, num_blocks=40, block_size=16)
    prompts = [_chat_ids(tight, t) for t in CHAT]
    outs = tight.generate(prompts, PARAMS)
    assert tight.engine.scheduler.num_preemptions > 0
    _same([_result(o) for o in outs], solo, "preempted and recomputed")
    tight.engine.check_integrity()


def test_the_torch_backend_is_refused_under_invariant_numerics():
    with pytest.raises(ValueError, match="not batch-invariant"):
        LLM(attention_backend="torch")
