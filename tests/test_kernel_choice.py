"""Kernels chosen by measurement (native/tuning.py): the flag, the scoring, the per-CPU cache,
forced choices, and that every path that can run here keeps the outputs invariant."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamkv import LLM, SamplingParams
from streamkv.cli import main as cli_main
from streamkv.config import RuntimeConfig
from streamkv.native import invariant_gemm
from streamkv.native.choice import parse_kernels
from streamkv.native.tuning import (ALL_ROWS, EXACT_PACKED, KINDS, SWITCHED, ModelShapes, choose, crossover, is_exact,
                                    pick, pick_switched, runnable)
from tests.tiny_checkpoints import Q4_LINEARS, make_tiny_gguf, make_tiny_hf_checkpoint

pytestmark = pytest.mark.skipif(invariant_gemm() is None, reason="no C compiler: the native kernels are not built")
TINY = ModelShapes(hidden=64, inter=128, heads=4, kv_heads=2, head_dim=16, vocab=384, layers=2,
                   numerics="invariant", bf16=True, q4=True, q8_head=True)


def test_the_flag_parses_and_rejects_what_it_cannot_mean():
    assert parse_kernels("auto") == {} and parse_kernels("") == {}
    assert parse_kernels("linear=q4, attention=f32") == {"linear": "q4", "attention": "f32"}
    for bad, msg in (("linear", "KIND=PATH"), ("lin=q4", "KIND=PATH"), ("linear=q5", "one of"),
                     ("linear=q4,linear=dense", "twice")):
        with pytest.raises(ValueError, match=msg):
            parse_kernels(bad)
    assert parse_kernels("   ") == {}  # blank is auto, as "" is
    for bad in (123, {"linear": "q4"}, ["linear=q4"], b"linear=q4"):  # the Python API: a ValueError, not an AttributeError
        with pytest.raises(ValueError, match="expected a string"):
            parse_kernels(bad)
    with pytest.raises(ValueError, match="one of"):
        RuntimeConfig(kernels="attention=fast")
    assert set(KINDS) == {"linear", "gemm", "lm_head", "attention_gather", "attention", "prefill_attention"}


def test_the_score_is_the_geometric_mean_of_each_paths_slowdown():
    # a: 2x slower at one shape of three, equal elsewhere; b: 1.5x slower at two shapes
    times = {"a": {"x": 2.0, "y": 1.0, "z": 1.0}, "b": {"x": 1.0, "y": 1.5, "z": 1.5}}
    assert pick(times) == "a"  # 2^(1/3) = 1.26 < 1.5^(2/3) = 1.31
    times["a"]["x"] = 2.5
    assert pick(times) == "b"  # 2.5^(1/3) = 1.36


def test_a_preferred_path_stays_unless_another_beats_it_by_the_margin():
    times = {"a": {"x": 2.5, "y": 1.0, "z": 1.0}, "b": {"x": 1.0, "y": 1.5, "z": 1.5}}
    assert pick(times, prefer="a") == "a"  # 1.36 <= 1.1 x 1.31
    assert pick(times, prefer="a", margin=1.0) == "b"
    times["a"]["x"] = 4.0
    assert pick(times, prefer="a") == "b"  # 1.59 > 1.1 x 1.31
    assert pick(times, prefer="gone") == "b"  # a path that cannot run here is no preference


def test_a_rebuild_keeps_the_machines_choice_through_near_ties(tmp_path, monkeypatch):
    """The choice is measured again for new kernel sources, but the path this machine chose last
    time stays unless the newcomer wins by more than the margin: a near-tie measured the other way
    does not change the outputs (numerics) of an upgraded server."""
    import streamkv.native as native
    import streamkv.native.kernel_bench as kernel_bench

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    shapes = ModelShapes(**{**TINY.__dict__, "hidden": 96})  # a key of its own
    kind = "lm_head"
    if not {"q8", "dense"} <= set(runnable(shapes).get(kind, [])):  # (deq, where built, is not timed here)
        pytest.skip("the int8 LM head kernel is not built on this CPU: lm_head has one path")
    timings = {"q8": {"decode x1": 1.0, "decode x8": 1.0}, "dense": {"decode x1": 0.5, "decode x8": 0.5}}
    monkeypatch.setattr(kernel_bench, "measure", lambda k, s, chosen: timings if k == kind else {})
    monkeypatch.setattr(native, "build_tag", lambda: "build-1")
    forced = {k: runnable(shapes)[k][0] for k in runnable(shapes) if k != kind}
    assert choose(shapes, forced).paths[kind] == "dense"  # 2x faster: not a tie
    monkeypatch.setattr(native, "build_tag", lambda: "build-2")
    timings["q8"] = {"decode x1": 0.48, "decode x8": 0.48}  # q8 now 4% faster: a tie, dense stays
    again = choose(shapes, forced)
    assert again.paths[kind] == "dense" and again.source[kind] == "measured"
    monkeypatch.setattr(native, "build_tag", lambda: "build-3")
    timings["q8"] = {"decode x1": 0.25, "decode x8": 0.25}  # 2x faster: it takes over
    assert choose(shapes, forced).paths[kind] == "q8"


TINY_F32 = ModelShapes(**{**TINY.__dict__, "bf16": False})


@pytest.mark.parametrize("retune", [False, True], ids=["cached", "measured-again"])
def test_forcing_one_kind_never_re_decides_the_others(retune, tmp_path, monkeypatch):
    """A force (even to the path already in use) filed its measurement and its near-tie memory
    under a key of its own, so the other kinds were decided afresh and could flip (helper-20:
    `--kernels gemm=avx512`, this CPU's only gemm path, turned linear=q4 into dense)."""
    import streamkv.native.kernel_bench as kernel_bench

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    shapes = ModelShapes(**{**TINY.__dict__, "hidden": 112})  # a key of its own
    paths = runnable(shapes)
    choices = [k for k in paths if len(paths[k]) > 1 and k != "gemm"]
    if len(choices) < 2:
        pytest.skip("fewer than two kinds with a choice on this CPU")
    timings = {}
    monkeypatch.setattr(kernel_bench, "measure", lambda k, s, chosen: timings[k])

    def favour(rank: int, ms: float) -> None:  # the path at ``rank`` takes ``ms``, the others 1.0
        for k, ps in paths.items():
            timings[k] = {p: {"decode x1": ms if i == rank % len(ps) else 1.0} for i, p in enumerate(ps)}

    favour(-1, 0.5)  # the last path of each kind, 2x faster: chosen
    first = choose(shapes, {}).paths
    favour(0, 0.95)  # the first paths now 5% faster: a near tie, the machine's numerics stay
    again = choose(shapes, {}, retune=True).paths
    # linear=deq is the dense bits (4-bit blocks while they measure faster): deq <-> dense is no flip
    bits = lambda p: {k: "dense" if v == SWITCHED.get(k) else v for k, v in p.items()}  # noqa: E731
    assert bits(again) == bits(first)
    for kind in [*choices, *(["gemm"] if len(paths.get("gemm", [])) == 1 else [])]:
        forced = choose(shapes, {kind: first[kind]}, retune=retune)
        assert bits(forced.paths) == bits(first), kind
        assert forced.source[kind] == "forced"


@pytest.mark.parametrize("shapes", [TINY, TINY_F32], ids=["bfloat16", "float32"])
def test_measured_once_then_read_from_the_cache(shapes, tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    first = choose(shapes, {})
    measured = [k for k, how in first.source.items() if how == "measured"]
    if not measured:
        assert shapes.bf16, "float32 models measure their packed layers against dense wherever the kernels build"
        pytest.skip("no kind has two runnable paths for a bfloat16 model on this CPU (no AVX512-BF16)")
    for kind in measured:
        on_tiles = first.paths.get("gemm") == "amx"  # deq is a candidate there only (it can be forced anywhere)
        assert set(first.timings[kind]) == set(runnable(shapes)[kind]) - ({"deq"} if not on_tiles else set())
        if is_exact(shapes, kind):  # same bits either way: packed up to the measured crossover
            rows = crossover(first.timings[kind], runnable(shapes)[kind][0])
            assert first.rows.get(kind) == rows and first.paths[kind] == ("dense" if rows == 0 else "q4" if
                                                                          kind == "linear" else "q8")
        elif SWITCHED.get(kind) in first.timings[kind]:  # the dense bits, switched by rows
            path, rows = pick_switched(first.timings[kind], SWITCHED[kind], runnable(shapes)[kind][0])
            assert first.paths[kind] == path and first.rows.get(kind, 0) == rows
        else:  # the first measurement on a machine prefers each kind's first path
            assert first.paths[kind] == pick(first.timings[kind], prefer=runnable(shapes)[kind][0])
    files = [f for f in (tmp_path / "kernels").glob("*.json") if not f.name.startswith("last-")]
    assert len(files) == 1 and json.loads(files[0].read_text())["paths"] == {k: first.paths[k] for k in measured}
    again = choose(shapes, {})
    assert again.paths == first.paths and again.rows == first.rows
    assert all(again.source[k] == "cached" for k in measured)
    good = files[0].read_text()
    lock = files[0].with_suffix(".lock")
    lock.unlink()
    lock.mkdir()  # the lock cannot be taken (a read-only cache): the cached choice is still read
    assert all(choose(shapes, {}).source[k] == "cached" for k in measured)
    lock.rmdir()
    g, k0 = json.loads(good), measured[0]
    p0 = next(iter(g["timings"][k0]))
    # timings that `streamkv info` crashed on (AttributeError, StopIteration, a format error, NaN
    # printed as invalid JSON), and row thresholds that contradict the kind's path or exactness
    p1 = list(g["timings"][k0])[1]
    bad_timings = ["x", {}, {p0: {"decode x1": "fast"}}, {p0: {"decode x1": float("nan")}}, {"bogus": {"x1": 1.0}},
                   {p0: {"decode x1": 1.0}, p1: {"decode x2": 1.0}}]  # paths timed on other shapes: KeyError
    bad_rows = [{**g["rows"], k0: 2 ** 40}, {**g["rows"], k0: (0 if g["paths"][k0] == EXACT_PACKED.get(k0) else 5)}]
    # from here on a measurement replays the first one's timings: what is tested is which caches
    # are trusted (a real measurement takes ~1.3 s and ran 13 more times)
    monkeypatch.setattr("streamkv.native.kernel_bench.measure", lambda kind, *_: first.timings[kind])
    for damaged in ("{not json", json.dumps({"paths": {k: "bogus" for k in measured}, "timings": {}}),
                    json.dumps({"paths": {k: 1 for k in measured}, "timings": {}}),
                    json.dumps({**g, "rows": {k: "many" for k in measured}}),
                    *(json.dumps({**g, "timings": {**g["timings"], k0: t}}) for t in bad_timings),
                    *(json.dumps({**g, "rows": r}) for r in bad_rows)):
        files[0].write_text(damaged)  # a damaged kind is measured again, not trusted (k0 is damaged in each)
        third = choose(shapes, {})
        assert third.source[k0] == "measured" and all(third.source[k] in ("measured", "cached") for k in measured), \
            (damaged, third.source)
        assert all(third.paths[k] in runnable(shapes)[k] for k in measured)
    last = next((tmp_path / "kernels").glob("last-*.json"))
    last.write_text(json.dumps({"paths": {k0: [g["paths"][k0]]}, "timings": {}}))  # crashed every start (a
    assert choose(shapes, {}, retune=True).source[k0] == "measured"                 # list is unhashable)


def test_a_run_that_forced_a_kind_leaves_the_next_start_only_the_forced_kind_to_measure(tmp_path, monkeypatch):
    """A forced run on an empty cache measured the other kinds and wrote them alone under the
    unforced key; the next plain start found the forced kind missing, warned that the cache names
    paths that cannot run here, and measured every kind again (review)."""
    shapes = next((s for s in (TINY, TINY_F32) if sum(len(v) > 1 for v in runnable(s).values()) >= 2), None)
    if shapes is None:
        pytest.skip("fewer than two kernel kinds have two runnable paths on this CPU")
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    kinds = [k for k, v in runnable(shapes).items() if len(v) > 1 and k != "gemm"]
    forced = {kinds[0]: runnable(shapes)[kinds[0]][-1]}
    timed: list[str] = []
    from streamkv.native import kernel_bench
    real = kernel_bench.measure
    monkeypatch.setattr(kernel_bench, "measure", lambda kind, *a: timed.append(kind) or real(kind, *a))
    first = choose(shapes, forced)
    assert first.source[kinds[0]] == "forced" and kinds[0] not in timed
    timed.clear()
    plain = choose(shapes, {})
    assert timed == [kinds[0]] and plain.source[kinds[0]] == "measured"
    assert all(plain.source[k] == "cached" and plain.paths[k] == first.paths[k] for k in kinds[1:])
    timed.clear()
    assert choose(shapes, {}).source == {**plain.source, **{k: "cached" for k in kinds}} and timed == []


def test_kinds_timed_on_an_older_gemm_choice_are_not_kept_beside_a_new_one(tmp_path, monkeypatch):
    """A cache whose gemm entry was damaged, then a run that forced lm_head: gemm was measured
    again (another winner) and the cached lm_head, timed on the old gemm, was written back beside
    it, so every later start ran a choice nobody measured (review). An AMX machine, faked."""
    from streamkv.native import kernel_bench, tuning

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    allowed = {"gemm": ["amx", "avx512"], "lm_head": ["q8", "dense"]}
    monkeypatch.setattr(tuning, "runnable", lambda s: allowed)
    monkeypatch.setattr(tuning, "_measurable", lambda s, k: True)
    winner = ["amx"]

    def measure(kind, s, chosen):  # q8 wins beside amx, dense beside avx512
        if kind == "gemm":
            return {p: {"decode x1": 1.0 if p == winner[0] else 5.0} for p in allowed["gemm"]}
        return {p: {"decode x1": 1.0 if (p == "q8") == (chosen.get("gemm") == "amx") else 3.0} for p in allowed[kind]}
    monkeypatch.setattr(kernel_bench, "measure", measure)
    shapes = ModelShapes(64, 128, 4, 2, 16, 384, 2, "invariant", True, True, True)
    assert choose(shapes, {}).paths == {"gemm": "amx", "lm_head": "q8"}
    f = next(p for p in (tmp_path / "kernels").glob("*.json") if not p.name.startswith("last-"))
    damaged = json.loads(f.read_text())
    del damaged["timings"]["gemm"]
    f.write_text(json.dumps(damaged))
    winner[0] = "avx512"
    assert choose(shapes, {"lm_head": "dense"}).paths == {"gemm": "avx512", "lm_head": "dense"}
    plain = choose(shapes, {})
    assert plain.paths == {"gemm": "avx512", "lm_head": "dense"} and plain.source["lm_head"] == "measured"


def test_a_cache_directory_that_cannot_be_written_costs_the_cache_not_the_start(tmp_path, monkeypatch):
    """The kernels folder a plain file, or the choice's file a directory: the start measured and
    then crashed (FileExistsError, IsADirectoryError); now it measures and runs uncached."""
    # shapes with a kind to measure here (an AVX2-only CPU has no bf16 4-bit path: TINY's
    # choice is all "only path", measured and cached by nobody)
    shapes = next((s for s in (TINY, TINY_F32) if any(len(v) > 1 for v in runnable(s).values())), None)
    if shapes is None:
        pytest.skip("no kernel kind has two runnable paths on this CPU: nothing is measured or cached")
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path / "a"))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "kernels").write_text("not a folder")
    first = choose(shapes, {})
    assert all(first.paths[k] in v for k, v in runnable(shapes).items())
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path / "b"))
    choose(shapes, {})
    for f in (tmp_path / "b" / "kernels").glob("*.json"):  # every file the choice is written to: a folder now
        f.unlink()
        f.mkdir()
    again = choose(shapes, {})
    assert again.paths.keys() == first.paths.keys()
    assert not [f for f in (tmp_path / "b" / "kernels").iterdir() if f.name.endswith(".tmp")]


def test_the_kinds_follow_the_cache_dtype_and_the_attention_backend():
    """A bf16 model with a float32 KV cache has one attention path (the bf16 kernel reads only
    bf16 caches: a measured bf16 used to stop the server); the fast numerics' prefill kernel is a
    kind only on the native backend (with --attention-backend torch it was reported, not used)."""
    assert runnable(ModelShapes(**{**TINY.__dict__, "cache_bf16": False})).get("attention") == ["f32"]
    fast = ModelShapes(**{**TINY.__dict__, "numerics": "fast", "head_dim": 64})
    assert "prefill_attention" not in runnable(ModelShapes(**{**fast.__dict__, "backend": "torch"}))
    assert "native" not in runnable(ModelShapes(**{**fast.__dict__, "cache_bf16": False})).get("prefill_attention", [])
    with pytest.raises(ValueError, match="cannot run here"):
        choose(ModelShapes(**{**fast.__dict__, "backend": "torch"}), {"prefill_attention": "sdpa"})


def test_an_exact_kind_switches_at_the_measured_crossover():
    """Float32 packed weights give the dense bits, so no single winner: the packed path serves steps
    up to the largest row count from which on (counting up) it stops being faster."""
    dense = {"decode x1": 1.0, "decode x8": 1.0, "decode x32": 1.0, "prompt x256": 1.0}
    assert crossover({"q4": {**dense, "decode x1": 0.5, "decode x8": 0.9}, "dense": dense}, "q4") == 8
    assert crossover({"q4": {sh: 0.5 for sh in dense}, "dense": dense}, "q4") == 256
    assert crossover({"q4": {**dense, "decode x1": 1.2, "decode x8": 0.5}, "dense": dense}, "q4") == 0
    assert crossover({"q4": {**dense, "decode x1": 0.5, "decode x32": 0.5}, "dense": dense}, "q4") == 1
    assert is_exact(TINY_F32, "linear") and is_exact(TINY_F32, "lm_head") and not is_exact(TINY, "linear")
    assert not is_exact(ModelShapes(**{**TINY_F32.__dict__, "numerics": "fast"}), "linear")


def test_forced_paths_are_not_measured_and_impossible_ones_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    forced = {kind: paths[-1] for kind, paths in runnable(TINY).items()}
    choice = choose(TINY, forced)
    assert choice.paths == forced and set(choice.source.values()) == {"forced"} and not choice.timings
    assert not list((tmp_path / "kernels").glob("*.json"))
    with pytest.raises(ValueError, match="cannot run here"):
        choose(TINY, {"prefill_attention": "native"})  # a fast-numerics kind under invariant numerics
    f32_fast = ModelShapes(**{**TINY.__dict__, "bf16": False, "numerics": "fast"})
    with pytest.raises(ValueError, match="cannot run here"):
        choose(f32_fast, {"linear": "q4"})  # fast numerics read 4-bit layers into bf16 models only
    packed = choose(TINY_F32, {"linear": "q4", "lm_head": "q8"})  # float32: the packed path at every step
    assert packed.packed_rows("linear") == packed.packed_rows("lm_head") == ALL_ROWS
    assert choose(TINY_F32, {"linear": "dense", "lm_head": "dense"}).packed_rows("linear") == 0
    for kind in ("gemm", "attention"):  # the tile paths, where the CPU has no AMX
        if "amx" not in runnable(TINY).get(kind, []):
            with pytest.raises(ValueError, match="cannot run here"):
                choose(TINY, {kind: "amx"})


def test_a_passing_load_slows_every_candidate_alike(monkeypatch):
    # a virtual clock: each call takes 1 ms, 5 ms while the first 20 calls run (another job on
    # the machine); timed one after the other, the first candidate took all of the load
    from streamkv.native import kernel_bench

    clock, calls = [0.0], [0]

    def work() -> None:
        calls[0] += 1
        clock[0] += 0.005 if calls[0] <= 20 else 0.001

    monkeypatch.setattr(kernel_bench.time, "perf_counter", lambda: clock[0])
    times = kernel_bench._best_each({"a": work, "b": work})
    assert times == {"a": pytest.approx(1.0), "b": pytest.approx(1.0)}


def test_fast_numerics_time_the_dense_layers_they_run(monkeypatch):
    # fast numerics run dense layers (and every prompt chunk) through F.linear, not the
    # invariant GEMM the default numerics use: the choice must time what will run
    from streamkv import native
    from streamkv.native import kernel_bench

    if native.q4_gemm() is None:
        pytest.skip("needs the native 4-bit kernel (an AVX512-BF16 CPU) to time the q4 path")
    calls = []
    monkeypatch.setattr(kernel_bench.F, "linear", lambda x, w: calls.append(x.shape[0]) or x @ w.t())
    monkeypatch.setattr(native, "invariant_gemm", lambda: lambda *a: pytest.fail("timed the invariant GEMM"))
    fast = ModelShapes(**{**TINY.__dict__, "numerics": "fast", "q4": True})
    times = kernel_bench.measure("linear", fast, {})
    assert set(calls) == set(kernel_bench.ROWS.values())
    assert times["q4"]["prompt x256"] == times["dense"]["prompt x256"]  # one path for prompt chunks


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama3"), "llama3")
    # Q4_1 layers and a Q8_0 (tied) embedding: every 4-bit and int8 path has something to read
    return str(make_tiny_gguf(path / "q4.gguf", path, {**Q4_LINEARS, "token_embd": "Q8_0"}))


def _combos(path: str, bf16: bool = True) -> list[str]:
    """Forced --kernels values that together run every path this model and CPU allow."""
    from streamkv.loading.q4_blocks import quant_summary

    q4, q8 = quant_summary(path, tied=True)
    kinds = runnable(ModelShapes(**{**TINY.__dict__, "q4": q4, "q8_head": q8, "bf16": bf16}))
    width = max(len(v) for v in kinds.values())
    return [",".join(f"{k}={v[min(i, len(v) - 1)]}" for k, v in kinds.items()) for i in range(width)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_path_that_can_run_here_keeps_outputs_invariant(tiny_gguf, dtype):
    """Each forced path (4-bit or dense layers, int8 or dense head, bf16, f32 or AMX attention, tiles
    or AVX-512 where AMX exists): alone = prefix hit = batched = chunked = preempted, to the bit. In
    float32 the packed and dense paths give the same bits, so every combination gives the same
    outputs."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 384, (int(n),), generator=g).tolist() for n in (3, 9, 22, 31)]

    def run(llm, batch):
        return [(o.token_ids, [(lp.token_id, lp.logprob) for lp in o.logprobs]) for o in llm.generate(batch, params)]

    combos = _combos(tiny_gguf, dtype == "bfloat16")
    assert len(combos) >= 2 or all("=" in c for c in combos)
    assert dtype == "bfloat16" or len(combos) >= 2  # float32: packed (4-bit, int8) and dense everywhere
    outputs = []
    for combo in combos:
        llm = LLM(model=tiny_gguf, dtype=dtype, num_blocks=128, block_size=4, kernels=combo)
        assert set(llm.engine.bundle.kernels.source.values()) <= {"forced"}, combo
        solo = []
        for p in prompts:
            llm.engine.pool.reset_prefix_cache()
            solo += run(llm, [p])
        hits = llm.engine.pool.prefix_hits  # the last prompt again: its blocks come from the prefix cache
        assert run(llm, prompts[-1:]) == solo[-1:] and llm.engine.pool.prefix_hits > hits, combo
        assert run(llm, prompts) == solo, combo
        chunked = LLM(model=tiny_gguf, dtype=dtype, num_blocks=128, block_size=4, kernels=combo,
                      max_chunk_tokens=5)
        assert run(chunked, prompts) == solo, combo
        tight = LLM(model=tiny_gguf, dtype=dtype, num_blocks=24, block_size=4, kernels=combo)
        assert run(tight, prompts) == solo and tight.engine.scheduler.num_preemptions > 0, combo
        outputs.append(solo)
    if dtype == "float32":
        assert all(o == outputs[0] for o in outputs), combos


def test_info_prints_the_machine_and_the_choice(tiny_gguf, capsys):
    assert cli_main(["info", "--model", tiny_gguf, "--dtype", "bfloat16", "--kernels", "linear=dense"]) == 0
    text = capsys.readouterr().out
    assert "CPU:" in text and "kernel choice:" in text and "linear             dense   (forced)" in text
    assert cli_main(["info", "--model", tiny_gguf, "--json", "--kernels", "linear=dense"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kernels"]["linear"] == {"path": "dense", "how": "forced", "packed_rows": 0, "busy_others": None}
    assert report["flags"] is not None


def test_invariant_numerics_without_native_kernels_are_a_clear_error(tiny_gguf, capsys, monkeypatch):
    # serve / generate died with a RuntimeError traceback while building the model, and `info`
    # printed a choice (exit 0) for a configuration that cannot run
    import streamkv.native.loader as loader

    monkeypatch.setattr(loader, "_library", lambda: None)
    for argv in (["info", "--model", tiny_gguf], ["generate", "--model", tiny_gguf, "--max-tokens", "2", "hi"]):
        assert cli_main(argv) == 2, argv
        assert "numerics=invariant needs the native kernels" in capsys.readouterr().err


def test_a_4bit_path_on_a_model_without_4bit_weights_names_the_flag_that_asked(tiny_gguf, capsys):
    hf = str(os.path.dirname(tiny_gguf))  # the same model as a transformers checkpoint: no 4-bit layers
    for flags, named in ((["--kernels", "linear=q4"], "kernels linear=q4"),
                         (["--decode-weights", "q4"], "decode_weights=q4")):
        assert cli_main(["info", "--model", hf, *flags]) != 0
        assert f"{named} needs a GGUF model" in capsys.readouterr().err  # not the flag the user did not pass
    # a 4-bit path that cannot run under fast float32 numerics: the message named --kernels too
    assert cli_main(["info", "--model", tiny_gguf, "--decode-weights", "q4", "--dtype", "float32",
                     "--numerics", "fast"]) == 2
    assert "decode_weights=q4 cannot run here" in capsys.readouterr().err


def test_a_kind_that_cannot_run_beside_linear_q4_is_the_one_named(tiny_gguf, capsys):
    """With linear=q4 forced, any other forced kind that could not run was reported as linear=q4
    needing the native 4-bit kernel (with wrong advice) though linear=q4 alone ran (review).
    prefill_attention is fast numerics' only: it cannot run under invariant numerics anywhere."""
    for dtype in ("float32", "bfloat16"):
        assert cli_main(["info", "--model", tiny_gguf, "--dtype", dtype,
                         "--kernels", "prefill_attention=sdpa,linear=q4"]) == 2
        err = capsys.readouterr().err
        assert "prefill_attention=sdpa cannot run here" in err and "4-bit" not in err, err


def test_a_thread_count_past_what_can_start_is_refused():
    """--threads 100000 crashed at start ("can't start new thread"), 1e20 overflowed a C long.
    The CLI runs in a child process (one for the three counts), which such a crash cannot take
    this one down with."""
    counts = [0, 4097, 10**20]
    for threads in counts:
        with pytest.raises(ValueError, match=r"threads must be an integer in \[1, 4096\]"):
            RuntimeConfig(threads=threads)
    code = ("import sys; from streamkv.cli import main\n"
            "for t in sys.argv[1:]:\n"
            "    print(main(['info', '--threads', t]), flush=True)\n"
            "    print('--', file=sys.stderr, flush=True)")
    run = subprocess.run([sys.executable, "-c", code, *map(str, counts)], capture_output=True, text=True, timeout=120)
    errors = run.stderr.split("--\n")[:-1]
    assert run.returncode == 0 and run.stdout.split() == ["2"] * len(counts) and len(errors) == len(counts)
    assert all("threads must be an integer in [1, 4096]" in e and "Traceback" not in e for e in errors)


@pytest.mark.parametrize("threads", ["2", 2.5, True])
def test_a_thread_count_that_is_not_an_integer_is_refused(threads):
    """Through the Python API "2" raised a TypeError, and 2.5 or True passed validation and
    failed at start in torch.set_num_threads."""
    with pytest.raises(ValueError, match=r"threads must be an integer"):
        RuntimeConfig(threads=threads)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a CPU affinity API and at least 2 usable cores")
def test_the_default_thread_count_follows_the_cpu_affinity(tiny_gguf):
    """Under `taskset -c N` (or a container's cpuset) the engine uses the cores it may run on, not
    every core of the machine: 16 threads pinned to 2 cores would oversubscribe them."""
    one = min(os.sched_getaffinity(0))
    code = ("import json, sys; from streamkv.cli import main; "
            "sys.exit(main(['info', '--json', '--model', sys.argv[1], '--kernels', 'linear=dense']))")
    out = subprocess.run([sys.executable, "-c", code, tiny_gguf], capture_output=True, text=True, timeout=300,
                         preexec_fn=lambda: os.sched_setaffinity(0, {one}), check=True).stdout
    report = json.loads(out)
    assert (report["cores"], report["threads"]) == (1, 1)


def test_a_damaged_cached_native_library_is_built_again(tmp_path, monkeypatch):
    """A truncated kernels-<tag>.so in the cache was loaded, failed, and disabled the native
    kernels on every start (invariant numerics then refused to run) until removed by hand."""
    import shutil

    import streamkv.native.loader as native

    built = native._build()  # this machine's library (already built for the suite)
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    damaged = tmp_path / "native" / built.name
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"")
    compiled = []
    monkeypatch.setattr(native, "_compile", lambda cc, target: compiled.append(target) or Path(shutil.copy(built, target)))
    lib = native._library.__wrapped__()  # the loader itself (the process keeps its cached library)
    assert lib is not None and compiled == [damaged] and damaged.stat().st_size == built.stat().st_size


def test_info_says_why_nothing_was_measured():
    from streamkv.engine.info import render

    r = {"cpu": "x", "cores": 2, "flags": [], "torch": "2", "threads": 2, "native": {"built": False},
         "model": "m", "dtype": "bfloat16", "numerics": "fast", "timings_ms": {},
         "kernels": {"linear": {"path": "q4", "how": "default"}, "gemm": {"path": "avx512", "how": "only path"}}}
    assert "timed through the native kernels, not built here" in render(r)  # it said "one path, or forced"
    r["kernels"]["linear"]["how"] = "forced"
    assert "every kind here has one path, or was forced" in render(r)


def test_the_library_is_named_for_what_march_native_means_here(monkeypatch):
    # two CPUs alike in model name and VECTOR_FLAGS shared one library although -march=native
    # enables other extensions on each (instructions the other may not have)
    import streamkv.native.loader as native

    here = native._native_target.__wrapped__(native._compiler())
    if native._compiler() is not None and os.uname().machine == "x86_64":
        assert "-mavx2" in here or "-mno-avx2" in here, here  # the compiler's own expansion
    tags = set()
    for target in ("znver4 -mavx512f -mno-avx512vp2intersect", "znver5 -mavx512f -mavx512vp2intersect"):
        monkeypatch.setattr(native, "_native_target", lambda cc, t=target: t)
        tags.add(native.build_tag.__wrapped__())  # the process keeps its own tag (lru_cache)
    assert len(tags) == 2
