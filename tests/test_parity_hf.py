"""Parity with Hugging Face transformers on tiny random-weight checkpoints (float32)."""
from __future__ import annotations

import pytest
import torch

from streamkv import LLM, SamplingParams
from streamkv.attention.backend import SeqSpan
from tests.tiny_checkpoints import make_tiny_hf_checkpoint

transformers = pytest.importorskip("transformers")

FAMILIES = [
    ("llama", {}),
    ("llama3", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("qwen2", {}),
    ("qwen3", {}),
]


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f[0] + ("-bias" if f[1] else ""))
def checkpoint(request, tmp_path_factory):
    family, overrides = request.param
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(family), family, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, block_size=4)
    return hf, llm


def test_prefill_and_20_decode_steps_match(checkpoint):
    hf, llm = checkpoint
    runner = llm.engine.bundle.runner
    vocab = llm.engine.bundle.vocab_size
    ids = torch.randint(0, vocab, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    table = tuple(range(16))  # 64 slots, block size 4
    with torch.inference_mode():
        ref = hf(torch.tensor([ids]), use_cache=True)
        ours = _forward(runner, ids, 0, table, all_logits=True)
        torch.testing.assert_close(ours, ref.logits[0].float(), atol=1e-4, rtol=1e-4)
        past, pos = ref.past_key_values, len(ids)
        token = int(ref.logits[0, -1].argmax())
        for _ in range(20):
            ref = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            ours = _forward(runner, [token], pos, table)
            torch.testing.assert_close(ours, ref.logits[0, -1:].float(), atol=1e-4, rtol=1e-4)
            past, pos, token = ref.past_key_values, pos + 1, int(ref.logits[0, -1].argmax())


def _forward(runner, ids, start, table, all_logits=False):
    backend, model = runner.backend, runner.model
    meta = backend.prepare([SeqSpan(0, len(ids), start, table)], len(ids))
    hidden = model(torch.tensor(ids), torch.arange(start, start + len(ids)), backend, meta)
    return model.compute_logits(hidden if all_logits else hidden[-1:])


def test_engine_greedy_matches_transformers(checkpoint):
    hf, llm = checkpoint
    vocab = llm.engine.bundle.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19, 33)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, min_new_tokens=20,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long), eos_token_id=None,
                              pad_token_id=0)
        assert out.token_ids == ref[0, len(ids):].tolist()
