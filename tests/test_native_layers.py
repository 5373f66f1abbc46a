"""The invariant numerics' native decoder layers (``native/layer.c``, ``models/native_layers.py``).

A step runs every layer in one native call; with a read policy it runs each layer in three
calls around the policy's page choice. Both must give the same bits, on every family (Qwen2
biases, Qwen3 qk-norm, 4-bit GGUF weights), and the native layers must compute what the
torch-op layers compute (float32, to rounding).
"""
from __future__ import annotations

import pytest
import torch

from streamkv import LLM, SamplingParams
from streamkv.attention.torch_ref import span_slots
from tests.tiny_checkpoints import Q4_LINEARS, make_tiny_gguf, make_tiny_hf_checkpoint

pytest.importorskip("transformers")
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3", "llama-q4_1-gguf"])
def checkpoint(request, tmp_path_factory):
    family = request.param.split("-")[0]
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(family), family)
    if request.param.endswith("gguf"):
        path = make_tiny_gguf(path / "q4.gguf", path, Q4_LINEARS)
    return str(path)


class _EveryPage:
    """A read-policy selector that keeps every page: forces the per-layer path, changes nothing."""

    def __init__(self, spans, slots):
        self.spans, self.slots = spans, slots

    def fused(self):
        return None  # never the one-call selecting step: this selector exists to force the per-layer path

    def for_layer(self, layer, q):
        return list(self.spans), list(self.slots)


def _run(llm, prompts):
    outs = llm.generate(prompts, PARAMS)
    return [(o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


def _prompts(vocab):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in (3, 17, 40)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_per_layer_calls_equal_the_whole_step(checkpoint, dtype):
    llm = LLM(model=checkpoint, dtype=dtype, num_blocks=128, block_size=4, enable_prefix_caching=False)
    assert llm.engine.bundle.runner.model.native is not None
    prompts = _prompts(llm.engine.bundle.vocab_size)
    whole = _run(llm, prompts)
    backend = llm.engine.bundle.runner.backend
    prepare, calls = backend.prepare, []

    def every_page(spans, num_tokens, *rest):
        meta = prepare(spans, num_tokens, *rest)
        slots = [span_slots(s.block_table, s.ctx_len, backend.cache.block_size, torch.device("cpu")) for s in spans]
        meta.selector = _EveryPage(spans, slots)
        calls.append(len(spans))
        return meta

    backend.prepare = every_page
    assert _run(llm, prompts) == whole
    assert calls, "the per-layer path never ran"


def test_native_layers_compute_what_the_torch_layers_compute(checkpoint):
    """float32: the native step against the torch-op layers over the same cache (to rounding)."""
    llm = LLM(model=checkpoint, dtype="float32", num_blocks=128, block_size=4)
    runner = llm.engine.bundle.runner
    model, backend = runner.model, runner.backend
    from streamkv.attention.backend import SeqSpan

    ids = torch.tensor(_prompts(llm.engine.bundle.vocab_size)[2])
    pos = torch.arange(len(ids))
    meta = backend.prepare([SeqSpan(0, len(ids), 0, tuple(range(10)))], len(ids))
    with torch.inference_mode():
        native = model.compute_logits(model(ids, pos, backend, meta))
        model.native, keep = None, model.native
        try:
            torch_ops = model.compute_logits(model(ids, pos, backend, meta))
        finally:
            model.native = keep
    torch.testing.assert_close(native, torch_ops, atol=1e-4, rtol=1e-4)
