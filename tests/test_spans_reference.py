"""Span reuse is exact w.r.t. its own definition: a float64 dense reference, built by hand.

The reference computes each ``plus`` operand right after the prefix with transformers
(float64), rotates each operand's cached keys to where the query places it, concatenates
prefix + operands into one KV cache, and runs the tail over it::

    prefix P | A (computed at P, placed at P)  | B (computed at P, placed at P+|A|) | tail (causal over all)

streamkv (float32 engine, paged KV, its own rotation) must give the same next-token
distribution; and that distribution must differ from the plain causal prompt of the same
tokens (so the test fails if operands attended to each other).
"""
from __future__ import annotations

import pytest
import torch

from streamkv import LLM
from streamkv.spans import ir
from streamkv.spans.lower import Piece, PlusPlan
from tests.session_reference import rotate_keys
from tests.tiny_checkpoints import make_tiny_hf_checkpoint

transformers = pytest.importorskip("transformers")

PREFIX = "Paris is the capital of France. "
DOCS = ["The quick brown fox jumps over the lazy dog. ", "Streaming inference keeps the cache alive. ",
        "def add(a, b): return a + b "]
TAIL = "Hello, world! How are you"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request, tmp_path_factory):
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    return hf, LLM(model=str(path), dtype="float32", num_blocks=128, block_size=4)


def _query(docs):
    return ir.gen(ir.seq(ir.fragment(PREFIX), ir.plus(*[ir.fragment(d) for d in docs]), ir.fragment(TAIL)),
                  max_tokens=1, temperature=0, logprobs=5, ignore_eos=True)


def _reference(hf, plan) -> torch.Tensor:
    pieces, plus, tail = plan.segments[:-2], plan.segments[-2], plan.segments[-1]
    assert isinstance(plus, PlusPlan) and isinstance(tail, Piece)
    prefix = [t for p in pieces for t in p.ids]
    P = len(prefix)
    inv_freq = hf.model.rotary_emb.inv_freq
    layers = hf.config.num_hidden_layers
    ks = [[] for _ in range(layers)]
    vs = [[] for _ in range(layers)]
    placed = P
    with torch.inference_mode():
        for i, op in enumerate(plus.operands):
            ids = prefix + list(op.segments[0].ids)
            past = hf(torch.tensor([ids]), use_cache=True).past_key_values
            for layer in range(layers):
                k, v = past.layers[layer].keys, past.layers[layer].values
                if i == 0:
                    ks[layer].append(k[:, :, :P])
                    vs[layer].append(v[:, :, :P])
                ks[layer].append(rotate_keys(k[:, :, P:], placed - P, inv_freq))
                vs[layer].append(v[:, :, P:])
            placed += len(ids) - P
        cache = transformers.DynamicCache(config=hf.config)
        for layer in range(layers):
            cache.update(torch.cat(ks[layer], 2), torch.cat(vs[layer], 2), layer)
        tail_ids = list(tail.ids) + list(plan.gen.prompt)  # then the generation prompt
        n = len(tail_ids)
        out = hf(torch.tensor([tail_ids]), past_key_values=cache, use_cache=True,
                 position_ids=torch.arange(placed, placed + n)[None],
                 attention_mask=torch.ones(1, placed + n, dtype=torch.long))
    return torch.log_softmax(out.logits[0, -1], -1)


def _top(out) -> list[tuple[int, float]]:
    return [(t, lp) for t, lp in out.logprobs[0].top]


def test_span_query_matches_the_float64_dense_reference(models):
    hf, llm = models
    q = _query(DOCS)
    _, plan = llm.engine.spans.plan(q)
    ref = _reference(hf, plan)
    out = llm.span_queries(q)[0]
    top = _top(out)
    assert len(top) == 5
    for token, lp in top:
        assert abs(lp - float(ref[token])) < 2e-4, (token, lp, float(ref[token]))
    # a plain causal prompt of the same tokens is a different distribution
    ids = [t for s in plan.segments for t in (s.ids if isinstance(s, Piece) else
                                             [u for o in s.operands for u in o.segments[0].ids])]
    ids += list(plan.gen.prompt)
    with torch.inference_mode():
        plain = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], -1)
    assert max(abs(float(plain[t]) - float(ref[t])) for t, _ in top) > 1e-3
    llm.engine.check_integrity()


def test_reuse_at_a_new_position_matches_the_reference(models):
    hf, llm = models
    llm.span_queries(_query(DOCS[:2]))  # caches the first two documents' operand states
    q = _query([DOCS[2], DOCS[0]])      # reuses DOCS[0] (re-positioned when it lands second)
    _, plan = llm.engine.spans.plan(q)
    ref = _reference(hf, plan)
    out = llm.span_queries(q)[0]
    assert out.metrics["spans"]["usage"]["reused_tokens"] > 0
    for token, lp in _top(out):
        assert abs(lp - float(ref[token])) < 2e-4
