"""Streaming input on the embedded model: after any appends, updates (LCP invalidation),
chunking, prefix hits and preemption, the output equals a fresh request on the final prompt
bit for bit (tokens and logprobs), in the default dtype and in float32."""
from __future__ import annotations

import pytest
import torch

from streamkv import LLM, SamplingParams
from streamkv.engine.dtype import resolve_dtype

PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
DOC = ("Page one: the river Loire flows through Orleans, Tours and Nantes. "
       "Page two: the chateau of Chambord was built for Francis I. "
       "Page three: the Loire valley is known for its white wines. ")
QUESTION = "Question: which king was Chambord built for?"
DEFAULT = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


@pytest.fixture(scope="module", params=sorted({DEFAULT, "float32"}))
def llm(request) -> LLM:
    # 64-token steps: the input is prefilled in chunks while it arrives; a 640-token pool
    return LLM(dtype=request.param, max_num_batched_tokens=64, num_blocks=40)


def _result(out) -> tuple:
    return out.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]


def _fresh(llm: LLM, prompt) -> tuple:
    llm.engine.pool.reset_prefix_cache()
    return _result(llm.generate(prompt, PARAMS)[0])


def test_appends_in_pieces_equal_the_fresh_request(llm):
    text = DOC + QUESTION
    h = llm.open_input(text[:37], PARAMS)
    h.advance()
    for a, b in ((37, 90), (90, 151), (151, len(text))):  # cuts inside words: the tail re-tokenizes
        h.append(text[a:b])
        h.advance()
    out = h.result()
    assert out.metrics["tokens_invalidated"] >= 1
    assert _result(out) == _fresh(llm, text)
    llm.engine.check_integrity()


def test_updates_keep_the_lcp_and_equal_the_fresh_request(llm):
    docs = ["Doc A: tides follow the moon. ", "Doc B: owls hunt at night. ", "Doc C: bees make honey. "]
    h = llm.open_input("Context:\n" + "".join(docs), PARAMS)
    h.advance()
    r = h.update("Context:\n" + docs[0] + docs[2] + "Doc D: salmon swim upstream. ")
    assert 0 < r["lcp"] < r["tokens"] and r["invalidated"] > 0
    h.advance()
    final = "Context:\n" + docs[0] + docs[2] + "Doc E: ravens are clever. " + QUESTION
    h.update(final)
    assert _result(h.result()) == _fresh(llm, final)


def test_every_handle_gets_its_answer_whoever_steps_the_engine(llm):
    # h2 finishes while h1.result() steps the engine, then h3 while h2.advance() does: their
    # results used to be dropped by that call, and result() then stepped forever
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    h1, h2 = llm.open_input(DOC, PARAMS), llm.open_input(QUESTION, short)
    h1.finish()
    h2.finish()
    h3 = llm.open_input(QUESTION, short)
    h3.finish()
    assert _result(h1.result()) == _fresh(llm, DOC)
    h4 = llm.open_input(DOC[:40], PARAMS)
    h4.append(DOC[40:])
    h4.advance()
    assert h2.result().token_ids == h3.result().token_ids == llm.generate(QUESTION, short)[0].token_ids
    assert _result(h4.result()) == _fresh(llm, DOC)
    assert not llm.engine._kept  # taken, not kept for good
    llm.engine.check_integrity()


def test_chat_input_equals_llm_chat(llm):
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": DOC + QUESTION}]
    h = llm.open_input([msgs[0], {"role": "user", "content": DOC[:60]}], PARAMS)
    h.advance()
    h.append(DOC[60:] + QUESTION)
    out = h.result()
    llm.engine.pool.reset_prefix_cache()
    assert _result(out) == _result(llm.chat(msgs, PARAMS)[0])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_while_streaming_and_batched_with_others(llm, mode):
    """A small pool: competing long requests preempt the partial input (recompute, or swap to
    host blocks and back), which then resumes; the output is the fresh one's, bit for bit."""
    from streamkv.kv.host_pool import HostPool
    from streamkv.sched.preemption import make_preemption

    engine = llm.engine
    if mode == "swap" and not engine.kv.host.num_blocks:
        engine.kv_ops.attach_host(32)
        engine.kv.host = HostPool(32)
    engine.scheduler.preemption = make_preemption(mode)
    kinds = dict(engine.scheduler.preemptions_by_kind)
    text = DOC + QUESTION
    h = llm.open_input(text[:120], PARAMS)
    h.advance()
    before = engine.scheduler.num_preemptions
    # three 250-token requests overfill the 640-token pool: the partial input (lower tier) is
    # preempted while they grow
    filler = [" ".join(f"w{i}x{j}" for j in range(62)) for i in range(3)]
    ids = [f"fill{i}" for i in range(len(filler))]
    for rid, prompt in zip(ids, filler):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    h.append(text[120:])
    done = {}
    while len(done) < len(ids):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    out = h.result()
    assert engine.scheduler.num_preemptions > before
    assert engine.scheduler.preemptions_by_kind[mode] > kinds[mode]
    assert out.metrics["num_preemptions"] >= 1
    assert engine.kv.host.num_used == 0
    assert _result(out) == _fresh(llm, text)
    engine.check_integrity()


def _with_swap_space(llm):
    """The fixture's engine, with 32 blocks of host swap space if it has none (the profile times swaps)."""
    from streamkv.kv.host_pool import HostPool

    engine = llm.engine
    if not engine.kv.host.num_blocks:
        engine.kv_ops.attach_host(32)
        engine.kv.host = HostPool(32)
    return engine


def test_cost_profile_is_measured_cached_and_used(llm, tmp_path, monkeypatch):
    from streamkv.engine import profile

    engine = _with_swap_space(llm)
    monkeypatch.setattr(profile, "profile_path", lambda e: tmp_path / "profile.json")
    monkeypatch.setattr(profile, "watch", _load(0.0))  # caching is what this test checks, not the machine's load
    measured = profile.load_or_measure(engine)
    assert (tmp_path / "profile.json").exists() and engine.pool.num_used == 0
    assert all(t > 0 for _, t in measured.prefill + measured.swap_out + measured.swap_in)
    assert profile.load_or_measure(engine).to_dict()["prefill"] == measured.to_dict()["prefill"]  # cached
    assert engine.kv_ops.swap_bytes == 0


def _load(share: float):
    """A stand-in for ``contention.watch``: other processes took ``share`` of our CPUs meanwhile."""
    from contextlib import contextmanager

    from streamkv.native.contention import Watch

    @contextmanager
    def watch(threads):
        w = Watch()
        yield w
        w.others = share
    return watch


def test_a_profile_measured_beside_a_busy_job_is_used_but_not_cached(llm, tmp_path, monkeypatch):
    from streamkv.engine import profile

    engine = _with_swap_space(llm)
    path = tmp_path / "profile.json"
    monkeypatch.setattr(profile, "profile_path", lambda e: path)
    monkeypatch.setattr(profile, "watch", _load(0.7))
    busy = profile.load_or_measure(engine)
    assert all(t > 0 for _, t in busy.prefill) and not path.exists() and busy.source == profile.BESIDE_LOAD
    monkeypatch.setattr(profile, "watch", _load(0.02))  # quiet: cached
    quiet = profile.load_or_measure(engine)
    assert all(t > 0 for _, t in quiet.prefill) and path.exists() and quiet.source != profile.BESIDE_LOAD
    # `streamkv profile` measuring again beside load over an older cached file: says not cached,
    # and the file keeps the quiet measurement
    cached = path.read_text()
    monkeypatch.setattr(profile, "watch", _load(0.7))
    assert profile.load_or_measure(engine, remeasure=True).source == profile.BESIDE_LOAD and path.read_text() == cached


def test_a_corrupt_profile_is_remeasured_and_a_small_pool_still_gets_two_points(llm, tmp_path, monkeypatch):
    """Profiles with an infinite size, a NaN time or JSON nested past the parser's depth crashed
    engine start (only ValueError/KeyError/TypeError were caught); sizes past a small pool or
    swap space left one point, and a CostProfile needs two, so `--preemption cost` with
    `--num-blocks 8` and a swap space could not start without a cached profile."""
    import json

    from streamkv.engine import profile

    engine = _with_swap_space(llm)
    path = tmp_path / "profile.json"
    monkeypatch.setattr(profile, "profile_path", lambda e: path)
    line = [[1, 0.001], [16, 0.002]]
    for bad in (json.dumps({"prefill": [[16, 0.01], [1e999, 1.0]], "swap_out": line, "swap_in": line}),
                json.dumps({"prefill": [[16, 0.01], [64, float("nan")]], "swap_out": line, "swap_in": line}),
                "[" * 100_000 + "]" * 100_000):
        path.write_text(bad)
        assert all(t > 0 for _, t in profile.load_or_measure(engine).prefill)   # re-measured
    # a folder where the file should be, or a cache that cannot be written: measured, not cached
    # (both raised OSError out of engine start)
    path.unlink()
    path.mkdir()
    assert all(t > 0 for _, t in profile.load_or_measure(engine).prefill) and path.is_dir()
    monkeypatch.setattr(profile, "profile_path", lambda e: tmp_path / "profile.json" / "sub" / "p.json")
    assert all(t > 0 for _, t in profile.load_or_measure(engine).prefill)
    monkeypatch.setattr(profile, "profile_path", lambda e: path)
    sizes = {"prefill": (16, 10 ** 6), "swap": (1, 10 ** 6)}             # only the first of each fits
    measured = profile.measure(engine, sizes, repeats=1)
    room = min(engine.pool.num_free, engine.kv_ops.host_k.shape[1] // engine.pool.block_size)
    assert [n for n, _ in measured.prefill] == [16, min(engine.pool.num_free * 16, engine.max_model_len - 1)]
    assert [n for n, _ in measured.swap_out] == [n for n, _ in measured.swap_in] == [1, room]
    assert engine.pool.num_used == 0
    monkeypatch.setattr(engine.kv_ops, "host_k", None)                  # no room to swap 2 blocks
    with pytest.raises(ValueError, match="swaps 2 blocks at least"):
        profile.measure(engine, sizes, repeats=1)


def test_profile_key_names_the_kv_cache_dtype_and_the_measurable_sizes(tmp_path, monkeypatch):
    """The cached profile's key lacked the KV cache dtype (a float32 cache swaps twice the bytes) and
    the limits on the sizes measured: `streamkv profile --max-model-len 3` or `--num-blocks 2`
    overwrote the shared profile with a narrow curve that default runs then used, and a float32
    KV cache reused a bfloat16 one's. Identical configs (and pools past every measured size)
    must still share one profile; `--max-model-len 2` must say which flag to raise."""
    from streamkv.config import EngineConfig
    from streamkv.engine import profile
    from streamkv.engine.engine import Engine
    from tests.tiny_checkpoints import make_tiny_hf_checkpoint

    pytest.importorskip("transformers")
    # a tiny model: the embedded one's seventeen loads took 75 s of the suite. 80 x 16 tokens, swap room for 64 blocks: every
    # size fits; recompute: no profile at start
    model = str(make_tiny_hf_checkpoint(tmp_path / "m", "llama", max_position_embeddings=2048))
    base = dict(model=model, dtype=DEFAULT, kv_cache_dtype="bfloat16", num_blocks=80, swap_space=64 << 20,
                preemption="recompute", threads=torch.get_num_threads())

    def make(**kw) -> Engine:
        return Engine(EngineConfig.from_flat(**{**base, **kw}))

    def key(**kw) -> str:
        return profile.profile_key(make(**kw))

    ref = key()
    assert key() == ref                                          # a second start hits the same profile
    assert key(num_blocks=200) == ref                            # a bigger pool times the same sizes
    assert key(kv_cache_dtype="float32") != ref
    if DEFAULT == "bfloat16":
        assert key(kv_cache_dtype="auto") == ref                 # keyed by the dtype allocated, not "auto"
    assert key(max_model_len=3) != ref
    assert key(num_blocks=2) != ref
    assert key(num_blocks=40) != ref                             # 640 tokens: the 1024-token prefill is cut
    assert key(swap_space=8 * make().kv_ops.bytes_per_block) != ref
    assert key(max_model_len=3) == key(max_model_len=3) != key(max_model_len=4)
    # another checkpoint in a folder of the same name (another KV block size), or other
    # attention kernels: another profile (both shared the first one's, review)
    other = str(make_tiny_hf_checkpoint(tmp_path / "other" / "m", "qwen2", num_hidden_layers=4, hidden_size=128,
                                        intermediate_size=512, max_position_embeddings=2048))
    fast = dict(numerics="fast")
    assert key(model=other) != ref and key(**fast, attention_backend="torch") != key(**fast, attention_backend="cpu")
    # `streamkv profile` without --swap-space makes room for the largest swap, so its profile is
    # found by an engine with ample swap space, not by one whose swap space holds fewer blocks (64
    # MiB did, of the embedded model's float32 KV in 64-token blocks)
    big = dict(block_size=64, kv_cache_dtype="float32")
    room = make(**big, swap_space=0)
    profile.make_room(room)
    per_block = room.kv_ops.bytes_per_block
    ample = make(**big, swap_space=100 * per_block)
    assert profile.profile_key(room) == profile.profile_key(ample) != key(**big, swap_space=20 * per_block)

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path / "cache"))  # after the engines: kernel tunings stay cached
    narrow, wide = make(max_model_len=3), make()
    assert profile.profile_path(narrow) != profile.profile_path(wide)
    monkeypatch.setattr(profile, "watch", _load(0.0))  # a quiet machine: cached
    measured = profile.load_or_measure(narrow)
    assert [n for n, _ in measured.prefill] == [1, 2]
    assert profile.profile_path(narrow).exists() and not profile.profile_path(wide).exists()
    with pytest.raises(ValueError, match="max_model_len 2 .*raise max_model_len"):
        profile.measure(make(max_model_len=2), repeats=1)
