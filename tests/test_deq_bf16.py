"""bf16 models read their GGUF's 4-bit layers with the dense bf16 GEMM's bits (``native/deq_bf16.c``,
``--kernels linear=deq``): table lookups rebuild the weights on the fly, on AMX tiles with the
operands' roles swapped (tested where the CPU has AMX), elsewhere through the dense kernel itself.
So a step takes the 4-bit blocks or the dense weights by its row count and no bit changes."""
from __future__ import annotations

import pytest
import torch

from streamkv.models.deq_linear import pack_deq8_bf16, pack_deq_bf16
from streamkv.models.linear import pack_dense
from streamkv.native import deq_gemm_bf16, invariant_gemm, invariant_gemm_bf16_path
from streamkv.native.tuning import ModelShapes, pick_switched, runnable
from tests.engine_checks import same_everywhere
from tests.tiny_checkpoints import Q4_LINEARS, make_tiny_gguf, make_tiny_hf_checkpoint

pytestmark = pytest.mark.skipif(deq_gemm_bf16() is None,
                                reason="no AVX512-BF16 with VBMI (or no C compiler): the bf16 4-bit path is not built")
TILES = [False, pytest.param(True, marks=pytest.mark.skipif(invariant_gemm_bf16_path() != "amx",
                                                            reason="no AMX on this CPU: the tile path is not compiled"))]


def _q4(n: int, k: int, g: torch.Generator):
    """Q4_1-like blocks and the loader's bf16 weights: bf16(d * q + m), d * q exact in float32."""
    q = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    w = d.repeat_interleave(32, 1) * q.float() + m.repeat_interleave(32, 1)
    return q, d, m, w.to(torch.bfloat16)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (600, 96), (200, 576)])
def test_packed_weights_give_the_dense_bf16_gemms_bits(n, k, tiles):
    """Every row count (one to four row tiles, then the dense kernel over rebuilt panels), a partial
    last panel, float32 and bf16 outputs: equal to the dense bf16 GEMM (tiles alike) to the bit."""
    g = torch.Generator().manual_seed(n + k)
    q, d, m, w = _q4(n, k, g)
    qp, dm = pack_deq_bf16(q, d, m)
    panels, gemm, deq = pack_dense(w), invariant_gemm(), deq_gemm_bf16()
    for rows in (1, 2, 5, 15, 16, 17, 33, 48, 64, 65, 130):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        for out in (torch.float32, torch.bfloat16):
            assert torch.equal(deq(x, qp, dm, n, out, tiles), gemm(x, panels, n, out, tiles)), (rows, out)
    with pytest.raises(TypeError, match="uint8"):
        deq(x, qp.to(torch.int32), dm, n)
    with pytest.raises(ValueError, match="do not hold"):  # another matrix's blocks: the kernel would read past them
        deq(x, qp, dm, n + 16)


def test_the_switched_path_is_scored_with_dense_and_keeps_its_threshold():
    fine = {"decode x1": 1, "decode x4": 4, "decode x8": 8, "decode x16": 16, "decode x32": 32, "prompt x256": 256}
    dense = {sh: float(r) for sh, r in fine.items()}
    deq = {sh: t * (0.4 if fine[sh] <= 8 else 1.5) for sh, t in dense.items()}
    q4 = {sh: t * (0.5 if fine[sh] <= 8 else 4.0) for sh, t in dense.items()}
    assert pick_switched({"q4": q4, "dense": dense, "deq": deq}, "deq", "dense") == ("deq", 8)
    assert pick_switched({"q4": q4, "dense": dense, "deq": deq}, "deq", "q4") == ("deq", 8)  # 0.4 beats 0.5
    slow = {sh: t * 2 for sh, t in dense.items()}
    assert pick_switched({"q4": q4, "dense": dense, "deq": slow}, "deq", "deq") == ("dense", 0)
    fast_q4 = {sh: t * 0.1 for sh, t in dense.items()}
    assert pick_switched({"q4": fast_q4, "dense": dense, "deq": deq}, "deq", "deq") == ("q4", 0)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama_deq_bf16"), "llama")
    return str(make_tiny_gguf(path / "q4.gguf", path, Q4_LINEARS))


def _deq_wins_up_to_8_rows(monkeypatch, tmp_path, kind: str, other: str, rows: dict[str, int]) -> None:
    """A fresh kernel cache whose measurement finds ``kind``'s deq faster than dense up to 8 rows
    (``other``, its own-bits path, far slower); every other kind a tie (its default)."""
    import streamkv.native.kernel_bench as kernel_bench

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))

    def measure(k, shapes, chosen):
        if k != kind:
            return {p: {"decode x1": 1.0} for p in runnable(shapes)[k]}
        return {other: {sh: 9.0 for sh in rows}, "dense": {sh: 1.0 for sh in rows},
                "deq": {sh: 0.5 if r <= 8 else 2.0 for sh, r in rows.items()}}
    monkeypatch.setattr(kernel_bench, "measure", measure)


def test_a_bf16_engine_gives_the_same_bits_deq_dense_or_switching(tiny_gguf, tmp_path, monkeypatch):
    """linear=deq (4-bit blocks at every step), linear=dense, and a measured switch at 8 rows: the
    same tokens and logprobs, alone, batched, chunked and preempted."""
    _deq_wins_up_to_8_rows(monkeypatch, tmp_path, "linear", "q4",
                           {"decode x1": 1, "decode x8": 8, "decode x16": 16, "decode x32": 32, "prompt x256": 256})

    def check(kernels):
        def look(llm):
            layer = llm.engine.bundle.runner.model.layers[0].qkv
            assert llm.engine.bundle.kernels.get("linear") == ("dense" if "linear=dense" in kernels else "deq")
            assert (layer.deq is None) == ("linear=dense" in kernels) and layer.q4 is None, kernels
            if "linear" not in kernels:
                assert layer.deq.max_rows == 8 and llm.engine.bundle.kernels.packed_rows("linear") == 8
        return look

    results = [same_everywhere(tiny_gguf, "bfloat16", kernels, check=check(kernels))
               for kernels in ("lm_head=dense,linear=deq", "lm_head=dense,linear=dense", "lm_head=dense")]
    assert results[0] == results[1] == results[2]


def test_a_remembered_deq_keeps_the_dense_bits_in_a_build_without_it(tmp_path, monkeypatch):
    """The last-choice file is shared by every build on a machine: one without deq (no VBMI, not
    measured) read linear=deq as an unknown preference, dropped the near-tie rule and took q4 (5%
    faster, bits of its own: other outputs). deq is dense's bits, so dense stays."""
    import streamkv.native.kernel_bench as kernel_bench
    from streamkv.native.choice import KernelChoice, write
    from streamkv.native.tuning import _cache_dir, _cache_key, choose

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    shapes = ModelShapes(64, 128, 4, 2, 16, 384, 2, "invariant", True, True, False)
    rows = {"decode x1": 1, "decode x8": 8, "decode x32": 32, "prompt x256": 256}

    def measure(kind, s, chosen):  # this build: no deq; q4 5% faster than dense everywhere
        if kind != "linear":
            return {p: dict.fromkeys(rows, 1.0) for p in runnable(s)[kind]}
        return {"q4": dict.fromkeys(rows, 0.95), "dense": dict.fromkeys(rows, 1.0)}
    monkeypatch.setattr(kernel_bench, "measure", measure)
    last = _cache_dir() / f"last-{_cache_key(shapes, {}, build=False)}.json"
    last.parent.mkdir(parents=True)
    write(last, KernelChoice({"linear": "deq"}, {"linear": {p: dict.fromkeys(rows, 1.0) for p in ("q4", "dense", "deq")}},
                             rows={"linear": 8}))
    assert choose(shapes, {}).paths["linear"] == "dense"


def test_refusals_of_deq_say_what_it_needs(tiny_gguf):
    from streamkv import LLM

    for kwargs in ({"dtype": "float32"}, {"dtype": "bfloat16", "numerics": "fast"}):
        with pytest.raises(ValueError, match="linear=deq needs a bfloat16 GGUF model with Q4_0/Q4_1 layers"):
            LLM(model=tiny_gguf, kernels="linear=deq", **kwargs)


def _q8(n: int, k: int, g: torch.Generator):
    """Q8_0-like blocks and the loader's bf16 weights: bf16(d * q), the product exact in float32."""
    q = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    return q, d, (d.repeat_interleave(32, 1) * q.float()).to(torch.bfloat16)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (600, 96), (200, 576)])
def test_an_int8_head_gives_the_dense_bf16_gemms_bits(n, k, tiles):
    """lm_head=deq: the Q8_0 head's int8 blocks, every row count (four panels at once, a partial
    quad, row tiles, then the dense kernel over rebuilt panels): the dense bf16 GEMM's bits."""
    g = torch.Generator().manual_seed(n * k)
    q, d, w = _q8(n, k, g)
    qp, dd = pack_deq8_bf16(q, d)
    panels, gemm, deq = pack_dense(w), invariant_gemm(), deq_gemm_bf16()
    for rows in (1, 3, 16, 17, 64, 65):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        for out in (torch.float32, torch.bfloat16):
            assert torch.equal(deq(x, qp, dd, n, out, tiles), gemm(x, panels, n, out, tiles)), (rows, out)
    with pytest.raises(ValueError, match="do not hold"):
        deq(x, qp, dd, n + 16)


def test_a_bf16_engine_gives_the_same_bits_with_the_int8_head_or_the_dense_one(tmp_path_factory, tmp_path, monkeypatch):
    """A GGUF with a Q8_0 head: lm_head=deq forced (every step on the int8 blocks), measured (up to
    8 rows, then dense) and lm_head=dense give the same tokens and logprobs, alone, batched,
    chunked and preempted."""
    hf = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama_deq_head"), "llama")
    model = str(make_tiny_gguf(hf / "q8.gguf", hf, {"token_embd": "Q8_0", "output": "Q8_0"}))
    _deq_wins_up_to_8_rows(monkeypatch, tmp_path, "lm_head", "q8",
                           {"decode x1": 1, "decode x4": 4, "decode x8": 8, "decode x16": 16, "decode x32": 32})

    def check(kernels):
        def look(llm):
            head = llm.engine.bundle.runner.model.lm_head
            assert llm.engine.bundle.kernels.get("lm_head") == ("dense" if "lm_head=dense" in kernels else "deq")
            assert (head.deq is None) == ("lm_head=dense" in kernels) and head.packed is None, kernels
            if "lm_head" not in kernels:
                assert head.deq.max_rows == 8 and head.deq.bits == 8
        return look

    results = [same_everywhere(model, "bfloat16", kernels, check=check(kernels))
               for kernels in ("linear=dense,lm_head=deq", "linear=dense,lm_head=dense", "linear=dense")]
    assert results[0] == results[1] == results[2]
    from streamkv import LLM

    with pytest.raises(ValueError, match="lm_head=deq needs a bfloat16 GGUF model with a Q8_0 LM head"):
        LLM(model=model, dtype="float32", kernels="lm_head=deq")
