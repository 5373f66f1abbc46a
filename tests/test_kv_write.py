"""Write-time KV policies (``snapstream``, ``streaming_llm``): hyper-parameters, the selection
against kvpress's presses, and compressed requests on the embedded model (memory comes back,
bit-identical under batching, chunking and preemption, the prefix cache untouched)."""
from __future__ import annotations

import math

import pytest
import torch

from streamkv.errors import InvalidRequestError
from streamkv.policies import KVLayout, SnapStreamPolicy, StreamingLLMPolicy, make_write_policy
from streamkv.sampling.params import SamplingParams

SNAP = {"policy": "snapstream", "budget_tokens": 128, "sink_tokens": 16, "window_tokens": 64,
        "observation_tokens": 16, "pool_kernel": 7}
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


def _doc(i: int, words: int = 200) -> str:
    return f"Record {i}. " + " ".join(f"item{(i * 7 + j) % 97} weighs {j % 13} kg;" for j in range(words // 4)) + \
        "\nWhich item weighs the most?"


def _result(out) -> tuple:
    return tuple(out.token_ids), tuple(lp.logprob for lp in out.logprobs or ())


# ----------------------------------------------------------------------------- hyper-parameters
def test_write_policies_are_built_and_validated_from_json_objects():
    p = make_write_policy(SNAP)
    assert p == SnapStreamPolicy(budget_tokens=128, sink_tokens=16, window_tokens=64, observation_tokens=16)
    assert make_write_policy(p.to_dict()) == p
    assert make_write_policy({"policy": "streaming_llm"}) == StreamingLLMPolicy()
    assert make_write_policy({"policy": "none"}) is None and make_write_policy(None) is None
    assert SnapStreamPolicy().to_dict() == {"policy": "snapstream", "sink_tokens": 64, "window_tokens": 512,
                                            "budget_tokens": 1024, "observation_tokens": 32, "pool_kernel": 7,
                                            "pooling": "max"}
    bad = [{"policy": "snap"}, {"budget_tokens": 5}, {"policy": "snapstream", "budget_tokens": -1},
           {"policy": "snapstream", "pool_kernel": 4}, {"policy": "snapstream", "window_tokens": 8},
           {"policy": "snapstream", "pooling": "mean"}, {"policy": "streaming_llm", "window_tokens": 0},
           {"policy": "snapstream", "budget_tokens": "1024"}, {"policy": "none", "budget_tokens": 1},
           {"policy": "streaming_llm", "budget_tokens": 10}, "snapstream",
           # a pooling this wide froze the engine thread for good (the server hung; now a 400)
           {"policy": "snapstream", "pool_kernel": 1_000_000_001}, {"policy": "snapstream", "pool_kernel": 129},
           {"policy": "snapstream", "budget_tokens": 10**30}, {"policy": "streaming_llm", "sink_tokens": 2**24 + 1}]
    for spec in bad:
        with pytest.raises(ValueError, match="kv_write"):
            make_write_policy(spec)
    assert make_write_policy({"policy": "snapstream", "pool_kernel": 127}).pool_kernel == 127


def test_the_ring_overwrites_the_oldest_recent_row():
    layout = SnapStreamPolicy(budget_tokens=10, sink_tokens=2, window_tokens=4, observation_tokens=2).layout(100)
    assert layout == KVLayout(at=100, sink=2, kept=10, window=4) and layout.rows == 16
    # after compression rows 12..15 hold tokens 96..99; token 100 replaces 96, 101 replaces 97, ...
    assert [layout.row(i) for i in range(100, 106)] == [12, 13, 14, 15, 12, 13]
    short = StreamingLLMPolicy(sink_tokens=4, window_tokens=8)
    assert short.point(5) == 12 and not short.moves(5) and short.moves(13)
    assert short.layout(5) == KVLayout(at=12, sink=4, kept=0, window=8)  # the ring starts in place
    assert short.layout(5).row(12) == 4  # token 12 replaces token 4, the oldest of the window


# ----------------------------------------------------------------------------- against kvpress
def _attention_module(heads: int, kv_heads: int, dim: int, seed: int):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=dim, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=4096)
    return LlamaAttention(config, layer_idx=0).eval(), LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("seed,length,window,kernel,ratio", [(0, 300, 16, 5, 0.5), (1, 517, 32, 7, 0.75),
                                                              (2, 1024, 64, 5, 0.9)])
def test_snapstream_picks_exactly_what_kvpress_snapkv_picks(seed, length, window, kernel, ratio):
    """Identical keys, queries and hyper-parameters: the same scores, bit for bit, and the same
    kept indices per kv head. Where kvpress differs (no sinks; its window is its observation
    window; average pooling) our policy is set to match: ``sink_tokens=0``, ``window_tokens =
    observation_tokens = window_size``, ``budget_tokens = n_kept - window_size``, ``pooling=avg``."""
    kvpress = pytest.importorskip("kvpress", reason="kvpress (the reference presses) is not installed")
    from kvpress.utils import compute_n_kept, get_prerope_query_states
    from transformers.models.llama.modeling_llama import rotate_half

    heads, kv_heads, dim = 8, 2, 64
    module, rope = _attention_module(heads, kv_heads, dim, seed)
    with torch.no_grad():
        hidden = torch.randn(1, length, heads * dim)
        keys, values = torch.randn(1, kv_heads, length, dim), torch.randn(1, kv_heads, length, dim)
        cos, sin = rope(hidden, torch.arange(length)[None])
        press = kvpress.SnapKVPress(compression_ratio=ratio, window_size=window, kernel_size=kernel)
        ref_scores = press.score(module, hidden, keys, values, None, {"position_embeddings": (cos, sin)})[0]
        n_kept = compute_n_kept(length, ratio)
        ref_keep = ref_scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values
        # the same queries kvpress computes: the last rows', after RoPE
        q = get_prerope_query_states(module, hidden[:, -window:])
        c, s = cos[:, -window:].unsqueeze(1), sin[:, -window:].unsqueeze(1)
        q = (q * c + rotate_half(q) * s)[0].transpose(0, 1)                     # [window, heads, dim]
    ours = SnapStreamPolicy(budget_tokens=n_kept - window, sink_tokens=0, window_tokens=window,
                            observation_tokens=window, pool_kernel=kernel, pooling="avg")
    k = keys[0].transpose(0, 1)                                                  # [length, kv_heads, dim]
    assert torch.equal(ours.scores(q, k, 1 / math.sqrt(dim)), ref_scores[:, :-window])
    picks = ours.select(q, k, 1 / math.sqrt(dim))
    window_rows = torch.arange(length - window, length).expand(kv_heads, -1)
    assert torch.equal(torch.cat([picks, window_rows], dim=1), ref_keep)
    rows = ours.rows(picks[None], length)[0].T                                  # our kept rows, per head
    assert torch.equal(rows, ref_keep)


@pytest.mark.parametrize("length,sinks,ratio", [(300, 4, 0.5), (1000, 64, 0.8)])
def test_streaming_llm_keeps_what_kvpress_streaming_llm_keeps(length, sinks, ratio):
    kvpress = pytest.importorskip("kvpress", reason="kvpress (the reference presses) is not installed")
    from kvpress.utils import compute_n_kept

    keys = torch.randn(1, 2, length, 16)
    scores = kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=sinks).score(None, None, keys, keys, None, {})
    ref_keep = scores[0].topk(compute_n_kept(length, ratio), dim=-1).indices.sort(dim=-1).values
    ours = StreamingLLMPolicy(sink_tokens=sinks, window_tokens=compute_n_kept(length, ratio) - sinks)
    rows = ours.rows(torch.empty(1, 2, 0, dtype=torch.int64), length)[0].T
    assert torch.equal(rows, ref_keep)


def test_max_pooling_ranks_a_token_next_to_a_hot_one_above_a_cold_one():
    """The specified pooling (max) keeps the neighbours of strongly attended tokens."""
    length, dim = 200, 16
    keys = torch.randn(length, 1, dim) * 0.01
    q = torch.zeros(8, 1, dim)
    keys[100, 0], q[:, 0] = 10.0, 1.0  # every observed row attends to token 100
    policy = SnapStreamPolicy(budget_tokens=7, sink_tokens=0, window_tokens=8, observation_tokens=8, pool_kernel=7)
    assert policy.select(q, keys, 1.0)[0].tolist() == list(range(97, 104))


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_scores_follow_their_definition(pooling):
    """Mean softmax attention of the observed rows (causal), pooled as named, averaged over the
    query heads of each kv head; written here from scratch in float64."""
    g = torch.Generator().manual_seed(3)
    length, obs, heads, kvh, dim = 90, 6, 4, 2, 16
    q, keys = torch.randn(obs, heads, dim, generator=g), torch.randn(length, kvh, dim, generator=g)
    policy = SnapStreamPolicy(budget_tokens=10, sink_tokens=2, window_tokens=8, observation_tokens=obs,
                              pool_kernel=5, pooling=pooling)
    ref = torch.zeros(kvh, length - obs, dtype=torch.float64)
    for h in range(heads):
        kv = h // (heads // kvh)
        att = torch.zeros(length - obs, dtype=torch.float64)
        for r in range(obs):
            visible = length - obs + r + 1
            att += torch.softmax(keys[:visible, kv].double() @ q[r, h].double() * 0.25, dim=0)[:length - obs] / obs
        pad = torch.nn.functional.pad(att, (2, 2), value=float("-inf") if pooling == "max" else 0.0)
        win = pad.unfold(0, 5, 1)
        ref[kv] += (win.amax(-1) if pooling == "max" else win.sum(-1) / 5) / (heads // kvh)
    torch.testing.assert_close(policy.scores(q, keys, 0.25).double(), ref, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def llm():
    from streamkv import LLM

    return LLM(max_num_batched_tokens=256, num_blocks=160, block_size=16)


@pytest.fixture(scope="module")
def solo(llm):
    llm.engine.pool.reset_prefix_cache()
    return [_result(llm.generate([_doc(i)], PARAMS, kv_write=SNAP)[0]) for i in range(3)]


def test_a_compressed_request_gives_its_blocks_back(llm):
    engine = llm.engine
    bound = math.ceil((16 + 128 + 64) / 16) + 1
    engine.add_request("big", _doc(9), SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True),
                       kv_write=SNAP)
    held, free = [], []
    while engine.has_unfinished():
        engine.step()
        if engine.has_request("big"):
            seq = engine._requests["big"].seq
            if seq.layout is not None:
                held.append(engine.kv.num_blocks_held(seq.seq_id))
                free.append(engine.pool.num_free)
                engine.check_integrity()
    prompt = len(engine.tokenizer.encode(_doc(9), add_special_tokens=True))
    assert prompt > 16 + 128 + 64 and len(held) >= 89  # decoded 90 tokens through a 64-row ring
    assert max(held) <= bound and len(set(held)) == 1  # constant: the ring overwrites in place
    assert free[0] >= engine.pool.num_blocks - bound    # the prompt's blocks went back to the pool
    engine.check_integrity()


def test_compressed_output_is_the_same_batched_chunked_and_repeated(llm, solo):
    from streamkv import LLM

    outs = llm.generate([_doc(i) for i in range(3)] + ["Say hi.", "Count to five."], PARAMS, kv_write=SNAP)
    assert [_result(o) for o in outs[:3]] == solo
    assert all(o.kv["compressed"] for o in outs[:3]) and not outs[3].kv["compressed"]
    assert outs[0].kv["tokens_kept"] == 16 + 128 + 64 < outs[0].kv["tokens_seen"]
    chunked = LLM(max_num_batched_tokens=256, max_chunk_tokens=40, num_blocks=160, enable_prefix_caching=False)
    assert [_result(o) for o in chunked.generate([_doc(i) for i in range(3)], PARAMS, kv_write=SNAP)] == solo


def test_cell_budget_admission_charges_a_compressed_request_what_its_phase_holds(solo):
    """Charged prompt + max_tokens for good, compressed requests that keep 208 rows each were
    held back for KV they no longer held: under a 1,280-token ceiling two of these ~460-token
    requests ran at once. Charged their prompt and layout while they prefill, then the layout's
    208 rows, all four come to hold KV at once. Outputs stay the same bits."""
    from streamkv import LLM
    from streamkv.sched.admission import projected_tokens

    def most_at_once(kv_write):
        llm = LLM(max_num_batched_tokens=256, num_blocks=160, block_size=16, admission="cell-budget",
                  admission_ceiling=0.5)
        engine, ids = llm.engine, [f"c{i}" for i in range(4)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, _doc(i % 3), PARAMS, kv_write=kv_write)
        seqs, most, done = [engine._requests[rid].seq for rid in ids], 0, {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            most = max(most, engine.scheduler.num_running)
            for s in seqs:
                if s.layout is not None and s.finish_reason is None:
                    assert projected_tokens(s) == 16 + 128 + 64
        return most, [done[rid] for rid in ids], engine.scheduler.admission.stats

    plain, _, _ = most_at_once(None)
    most, outs, stats = most_at_once(SNAP)
    assert plain == 2 and most == 4 and stats.deferred_requests > 0  # still paced while they prefill
    assert [_result(o) for o in outs] == [solo[i % 3] for i in range(4)]


def test_a_request_that_never_reaches_its_compression_point_is_charged_its_plain_size():
    # prompt + max_tokens == the point: the last token is never fed, so the layout never starts
    # (as check_write_fits agrees); it was charged point + capacity, twice its KV (review)
    from types import SimpleNamespace

    from streamkv.sched.admission import projected_tokens

    write = make_write_policy(SNAP)  # capacity 208
    for prompt, max_tokens, charged in ((100, 108, 208), (100, 109, 208 + 208), (300, 1, 300 + 208)):
        seq = SimpleNamespace(num_prompt_tokens=prompt, params=SimpleNamespace(max_tokens=max_tokens),
                              max_len=4096, write=write, layout=None, forked_rows=0)
        assert projected_tokens(seq) == charged, (prompt, max_tokens)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_compressed_output_survives_preemption(solo, mode):
    """A pool too small for everyone: compressed requests are preempted (before or after their
    compression) and recompute prefill + compression + their ring rows, or swap; same bits."""
    from streamkv import LLM

    tight = LLM(max_num_batched_tokens=256, num_blocks=72, block_size=16, preemption=mode,
                swap_space=(64 << 20) if mode == "swap" else 0)
    engine = tight.engine
    ids = [f"c{i}" for i in range(3)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, _doc(i), PARAMS, kv_write=SNAP)
    seqs = {rid: engine._requests[rid].seq for rid in ids}
    done = {}
    while any(s.layout is None for s in seqs.values()):  # they preempt each other while prefilling
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    # then higher-priority requests take the pool from the compressed ones, mid-answer
    filler = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"f{i}", " ".join(f"w{i}x{j}" for j in range(90)), filler, priority=-1)
        ids.append(f"f{i}")
        seqs[f"f{i}"] = engine._requests[f"f{i}"].seq
    after_compression = 0
    while len(done) < len(ids):
        compressed = {rid: s.layout is not None and s.num_preemptions for rid, s in seqs.items()}
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        after_compression += sum(1 for rid, s in seqs.items()
                                 if compressed[rid] is not False and s.num_preemptions > compressed[rid])
    assert after_compression >= 1  # at least one was preempted holding its compressed rows
    assert [_result(done[f"c{i}"]) for i in range(3)] == solo
    assert engine.kv.host.num_used == 0
    engine.check_integrity()


def test_the_prefix_cache_keeps_the_prompt_and_never_the_compressed_rows(llm, solo):
    engine = llm.engine
    engine.pool.reset_prefix_cache()
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    fresh = _result(llm.generate([_doc(0)], plain)[0])
    engine.pool.reset_prefix_cache()
    assert _result(llm.generate([_doc(0)], PARAMS, kv_write=SNAP)[0]) == solo[0]
    again = llm.generate([_doc(0)], plain)[0]  # hits the blocks the compressed request prefilled
    assert again.num_cached_tokens > 300 and _result(again) == fresh
    twice = llm.generate([_doc(0)], PARAMS, kv_write=SNAP)[0]  # a hit, but never into its observed rows
    assert twice.num_cached_tokens > 300 and _result(twice) == solo[0]
    assert _result(llm.generate([_doc(0)], plain)[0]) == fresh
    engine.check_integrity()


def test_a_short_prompt_decodes_exactly_until_its_ring_starts(llm):
    policy = {"policy": "streaming_llm", "sink_tokens": 8, "window_tokens": 40}
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=1)
    plain = llm.generate(["Write a long story about a cat."], long)[0]
    ring = llm.generate(["Write a long story about a cat."], long, kv_write=policy)[0]
    prompt = len(plain.prompt_token_ids)
    exact = 48 - prompt  # tokens decoded before the sequence reaches 48 rows
    assert 0 < exact < 60 and ring.kv["tokens_kept"] == 48 and not ring.kv["compressed"]
    assert ring.token_ids[:exact + 1] == plain.token_ids[:exact + 1]
    assert [lp.logprob for lp in ring.logprobs[:exact + 1]] == [lp.logprob for lp in plain.logprobs[:exact + 1]]


def test_bad_policies_are_refused_before_anything_is_queued(llm):
    engine = llm.engine
    for kv in [dict(kv_write={"policy": "snap"}), dict(kv_write={"policy": "snapstream", "budget_tokens": -3}),
               dict(kv_read={"policy": "quest", "budget_tokens": 8}),
               dict(kv_write=SNAP, kv_read={"policy": "quest", "budget_tokens": 8})]:
        with pytest.raises(InvalidRequestError):
            engine.add_request("bad", "hello", PARAMS, **kv)
        assert not engine.has_request("bad")
    with pytest.raises(InvalidRequestError, match="InputStreams.open"):  # a stream's policies apply at finish
        engine.add_request("bad", "", PARAMS, partial=True, kv_write=SNAP)


def test_a_compression_that_can_never_fit_the_pool_is_refused_not_queued(llm):
    """The chunk reaching the compression point holds the prompt's blocks and the kept rows' new
    ones at once; a request whose peak exceeds the pool used to wait for blocks forever, and
    every request after it with it. It is refused (a request, or a stream at finish, which keeps
    its input), and the engine still serves."""
    engine = llm.engine
    big = {"policy": "snapstream"}  # defaults: 64 + 1,024 + 512 = 1,600 rows kept = 100 blocks
    prompt = list(range(1000, 3000))  # 2,000 tokens = 125 blocks: fits the 160-block pool alone
    assert engine.kv.blocks_for(len(prompt) + 1) <= engine.pool.num_blocks
    with pytest.raises(InvalidRequestError, match="kv_write: compressing this 2000-token prompt holds up to 225") as err:
        engine.add_request("huge", prompt, PARAMS, kv_write=big)
    assert err.value.param == "kv_write"  # the 400 body's param (it was null: review)
    assert not engine.has_request("huge")
    # a prompt below the capacity compresses only if its answer reaches the capacity: this one never does
    engine.add_request("short", prompt[:100], PARAMS, kv_write=big)
    assert engine.has_request("short")
    engine.abort("short")
    h = llm.open_input(" word" * 1999, PARAMS, kv_write=big)
    with pytest.raises(InvalidRequestError, match="kv_write: compressing"):
        h.finish()
    assert engine.inputs.get(h.request_id).text == " word" * 1999  # still open, input kept
    engine.abort(h.request_id)
    out = llm.generate(["A short prompt."], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(out.token_ids) == 4


# ----------------------------------------------------------------------------- transformers oracle
def _reference_compressed_decode(hf, ids: list[int], policy: SnapStreamPolicy, tokens: list[int]) -> list[torch.Tensor]:
    """Log-probabilities [vocab] (float64) of each of ``tokens``' positions, decoded with
    transformers over the KV the policy keeps: SnapKV picks from the layer's own observed
    queries and cached keys, sinks, and a window whose oldest entry is dropped after each new
    token (the ring, in logical order). ``tokens`` are fed back (teacher forcing)."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import rotate_half

    cfg = hf.config
    heads, dim, obs = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads, policy.observation_tokens
    seen: dict[int, torch.Tensor] = {}

    def keep_queries(module, args, kwargs, output):
        hidden, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
        q = module.q_proj(hidden[:, -obs:]).view(1, obs, heads, dim).transpose(1, 2)
        q = q * cos[:, -obs:].unsqueeze(1) + rotate_half(q) * sin[:, -obs:].unsqueeze(1)
        seen[module.layer_idx] = q[0].transpose(0, 1)                            # [obs, heads, dim]

    hooks = [layer.self_attn.register_forward_hook(keep_queries, with_kwargs=True) for layer in hf.model.layers]
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
    for h in hooks:
        h.remove()
    length, full = len(ids), out.past_key_values
    cache = DynamicCache()
    for layer in range(cfg.num_hidden_layers):
        keys, values = full.layers[layer].keys[0], full.layers[layer].values[0]  # [kv_heads, L, dim]
        picks = policy.select(seen[layer], keys.transpose(0, 1), dim ** -0.5)
        rows = policy.rows(picks[None], length)[0].T[..., None].expand(-1, -1, dim)  # [kv_heads, R, dim]
        cache.update(keys.gather(1, rows)[None], values.gather(1, rows)[None], layer)
    oldest = policy.sink_tokens + policy.budget_tokens
    result = [torch.log_softmax(out.logits[0, -1].double(), -1)]
    for t, token in enumerate(tokens[:-1]):
        for layer in cache.layers:  # the new token replaces the oldest recent one (it never sees it)
            layer.keys = torch.cat([layer.keys[:, :, :oldest], layer.keys[:, :, oldest + 1:]], dim=2)
            layer.values = torch.cat([layer.values[:, :, :oldest], layer.values[:, :, oldest + 1:]], dim=2)
        with torch.no_grad():
            out = hf(torch.tensor([[token]]), position_ids=torch.tensor([[length + t]]), past_key_values=cache,
                     cache_position=torch.tensor([policy.capacity - 1]), use_cache=True)
        result.append(torch.log_softmax(out.logits[0, -1].double(), -1))
    return result


def test_compressed_decoding_matches_a_transformers_reference(tmp_path):
    transformers = pytest.importorskip("transformers")
    from streamkv import LLM
    from tests.tiny_checkpoints import make_tiny_hf_checkpoint

    path = make_tiny_hf_checkpoint(tmp_path, "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="float32", num_blocks=96, block_size=4, max_num_batched_tokens=48)
    policy = SnapStreamPolicy(budget_tokens=24, sink_tokens=4, window_tokens=16, observation_tokens=8, pool_kernel=5)
    ids = torch.randint(3, 384, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    steps = 40  # the 16-row ring wraps twice
    out = llm.generate([ids], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=0),
                       kv_write=policy.to_dict())[0]
    assert out.kv["compressed"] and out.kv["tokens_kept"] == policy.capacity
    ref = _reference_compressed_decode(hf, ids, policy, out.token_ids)
    for token, lp, ref_lp in zip(out.token_ids, out.logprobs, ref):
        assert abs(lp.logprob - float(ref_lp[token])) < 1e-4
        assert float(ref_lp[token]) >= float(ref_lp.max()) - 1e-4  # greedy there too (up to near-ties)
    full = llm.generate([ids], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=0))[0]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(full.logprobs, out.logprobs)) > 1e-2  # it did compress
