"""The batch-invariant kernels on random data: correct (against float64) and invariant (a row's
bits do not depend on the rows around it, their number, the thread count, or, for attention,
on whether the row is a decode or part of a prefill chunk of any split)."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from streamkv.models.linear import pack_dense
from streamkv.native import (compile_steps, invariant_attention, invariant_attention_amx, invariant_attention_bf16,
                             invariant_attention_bf16f, invariant_gemm, invariant_gemm_bf16_path, invariant_isa,
                             run_all)

gemm, attn, attn_bf16, attn_amx = invariant_gemm(), invariant_attention(), invariant_attention_bf16(), \
    invariant_attention_amx()
attn_bf16f = invariant_attention_bf16f()
pytestmark = pytest.mark.skipif(gemm is None, reason="no C compiler: the native kernels are not built")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_the_build_names_its_vector_isa():
    assert invariant_isa() in ("avx512f", "avx2", "scalar")


def test_the_built_library_is_named_for_its_cpu(monkeypatch):
    """The library is built with -march=native but was named by the sources and flags only, so a
    cache directory shared with another CPU handed it a library built for this one (illegal
    instructions there, or other bits)."""
    import streamkv.native.loader as native

    try:
        native.build_tag.cache_clear()
        here = native.build_tag()
        monkeypatch.setattr(native, "cpu_flags", lambda: ["fpu", "avx2"])
        native.build_tag.cache_clear()
        fewer_flags = native.build_tag()
        monkeypatch.setattr(native, "cpu_model", lambda: "Another CPU")
        native.build_tag.cache_clear()
        assert len({here, fewer_flags, native.build_tag()}) == 3
    finally:
        monkeypatch.undo()
        native.build_tag.cache_clear()
    assert native.build_tag() == here


def test_a_cache_directory_that_cannot_hold_the_build_costs_the_cache_not_the_start(tmp_path, monkeypatch):
    """A cache root under a plain file: the build raised NotADirectoryError, the start then failed
    with "numerics=invariant needs the native kernels (a C compiler ...)"."""
    import streamkv.native.loader as native

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path / "file" / "sub"))
    built: list = []
    monkeypatch.setattr(native, "_compiler", lambda: "cc")
    monkeypatch.setattr(native, "_compile", lambda cc, target: built.append(target) or target)
    path = native._build()
    assert path == built[0] and path.parent.is_dir() and not str(path).startswith(str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1728, 576), (37, 64), (4099, 130), (576, 96)])  # 576: units of 6 panels
def test_gemm_is_correct_and_row_invariant(dtype, shape):
    n, k = shape
    w = torch.randn(n, k, generator=_gen(0)).to(dtype)
    x = torch.randn(211, k, generator=_gen(1)).to(dtype)
    wp = pack_dense(w)
    full = gemm(x, wp, n, torch.float32)
    exact = x.double() @ w.double().t()
    bound = (x.double().abs() @ w.double().abs().t()) * k * torch.finfo(torch.float32).eps
    assert ((full.double() - exact).abs() <= bound).all()
    for m in (1, 2, 3, 5, 6, 7, 13, 64, 97):
        for start in (0, 1, 211 - m):
            part = gemm(x[start:start + m], wp, n, torch.float32)
            assert torch.equal(part, full[start:start + m]), f"rows {start}..{start + m} differ"
    # bf16 output is the float32 result rounded to nearest even
    assert torch.equal(gemm(x, wp, n, torch.bfloat16), full.bfloat16())


def test_gemm_does_not_depend_on_the_thread_count():
    w = torch.randn(1000, 256, generator=_gen(2))
    x = torch.randn(50, 256, generator=_gen(3))
    wp = pack_dense(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm(x, wp, 1000, torch.float32)
        torch.set_num_threads(max(2, before))
        many = gemm(x, wp, 1000, torch.float32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@pytest.mark.skipif(invariant_gemm_bf16_path() != "amx", reason="no AMX on this CPU: the tile path is not compiled")
def test_gemm_on_amx_tiles_is_correct_and_row_invariant():
    """AMX CPUs: bf16 GEMMs on tiles (K a multiple of 32), checked like the AVX-512 path."""
    w = torch.randn(300, 576, generator=_gen(0)).bfloat16()
    x = torch.randn(40, 576, generator=_gen(1)).bfloat16()
    wp = pack_dense(w)
    full = gemm(x, wp, 300, torch.float32, True)
    exact = x.double() @ w.double().t()
    bound = (x.double().abs() @ w.double().abs().t()) * 576 * torch.finfo(torch.float32).eps
    assert ((full.double() - exact).abs() <= bound).all()
    for m in (1, 3, 17, 33):
        for i in (0, 40 - m):
            assert torch.equal(gemm(x[i:i + m], wp, 300, torch.float32, True), full[i:i + m])


def _gate_up_two_ways(x: torch.Tensor, wp: torch.Tensor, inter: int,
                     tiles: bool) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(rc, fused, two-pass) act [M, inter] bf16: streamkv_inv_gemm_silu, and the GEMM (on tiles
    where asked and possible) followed by streamkv_silu_mul (layer.c's two passes)."""
    from streamkv.native import loader

    lib, m, k = loader._library(), x.shape[0], x.shape[1]
    gu = gemm(x, wp, 2 * inter, torch.float32, tiles)
    two = torch.empty(m, inter, dtype=torch.bfloat16)
    assert lib.streamkv_silu_mul(gu.data_ptr(), m, inter, two.data_ptr(), 1) == 0
    fused = torch.full((m, inter), float("nan"), dtype=torch.bfloat16)
    rc = lib.streamkv_inv_gemm_silu(x.data_ptr(), m, k, wp.data_ptr(), inter, fused.data_ptr(), int(tiles))
    return rc, fused, two


@pytest.mark.skipif(invariant_gemm_bf16_path() == "fma", reason="no bf16 dot products on this CPU: the fused "
                                                                "gate_up declines (tested below)")
@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "vector"])
def test_the_fused_gate_up_gives_the_two_pass_bits(tiles):
    """layer.c runs a bf16 dense gate_up as one GEMM whose epilogue applies silu(g) * u (g panel t
    beside u panel t + I/16), on AMX tiles or with vdpbf16ps: the bits of the GEMM plus the separate
    pass, at row counts with partial row tiles and past the 512 rows where the tiles' row blocks
    change, with K a multiple of 32 and not (tiles asked for but not possible: the vector path, as
    the plain GEMM)."""
    inter = 160
    for k in (96, 80):
        wp = pack_dense((torch.randn(2 * inter, k, generator=_gen(6)) * 0.1).bfloat16())
        for m in (1, 5, 16, 33, 130, 600):
            x = torch.randn(m, k, generator=_gen(7 + m)).bfloat16()
            rc, fused, two = _gate_up_two_ways(x, wp, inter, tiles)
            assert rc == 0 and torch.equal(fused, two), f"{m} rows, K {k}"


def test_the_fused_gate_up_declines_what_it_cannot_run():
    """I not a multiple of 16 (u panel t + I/16 would not start a panel), or no bf16 dot products
    here: nonzero, nothing written, so layer.c takes the two passes instead."""
    cases = [(64, 40, True), (64, 40, False)]
    if invariant_gemm_bf16_path() == "fma":
        cases += [(64, 32, True), (64, 32, False)]
    for k, inter, tiles in cases:
        wp = pack_dense(torch.randn(2 * inter, k, generator=_gen(8)).bfloat16())
        rc, fused, _ = _gate_up_two_ways(torch.randn(3, k, generator=_gen(9)).bfloat16(), wp, inter, tiles)
        assert rc != 0 and torch.isnan(fused.float()).all(), (k, inter, tiles)


def test_the_fused_float32_gate_up_gives_the_two_pass_bits():
    """A float32 dense gate_up (a float32 model's prompt rows) runs as one GEMM whose epilogue
    applies silu(g) * u: the bits of the GEMM followed by layer.c's separate pass, at row counts
    around the 6-row register block and past one 96-row block; I not a multiple of 16 is
    declined with nothing written (layer.c then takes the two passes)."""
    from streamkv.native import loader

    lib = loader._library()
    for k, inter in ((96, 160), (80, 48)):
        wp = pack_dense(torch.randn(2 * inter, k, generator=_gen(10)))
        for m in (1, 5, 6, 7, 97, 200):
            x = torch.randn(m, k, generator=_gen(11))
            two = torch.empty(m, inter)
            gu = gemm(x, wp, 2 * inter, torch.float32)
            assert lib.streamkv_silu_mul(gu.data_ptr(), m, inter, two.data_ptr(), 0) == 0
            fused = torch.full((m, inter), float("nan"))
            assert lib.streamkv_inv_gemm_silu_f32(x.data_ptr(), m, k, wp.data_ptr(), inter, fused.data_ptr()) == 0
            assert torch.equal(fused, two), f"{m} rows, K {k}, I {inter}"
    x, wp = torch.randn(3, 64, generator=_gen(12)), pack_dense(torch.randn(80, 64, generator=_gen(13)))
    fused = torch.full((3, 40), float("nan"))
    assert lib.streamkv_inv_gemm_silu_f32(x.data_ptr(), 3, 64, wp.data_ptr(), 40, fused.data_ptr()) != 0
    assert torch.isnan(fused).all()


def test_the_amx_tile_path_compiles_for_an_amx_cpu(tmp_path):
    """Built for an AMX CPU (-march=sapphirerapids, the library's own flags otherwise), every kernel
    source compiles and the GEMM emits tile instructions: the path this machine cannot run (or
    not compile natively) still builds wherever CI runs."""
    cc = shutil.which("gcc")
    probe = subprocess.run([cc, "-march=sapphirerapids", "-dM", "-E", "-"], input="", capture_output=True,
                           text=True) if cc else None
    if probe is None or probe.returncode != 0 or "__AMX_BF16__" not in probe.stdout:
        pytest.skip("no gcc that targets -march=sapphirerapids")
    for proc in run_all(compile_steps(cc, tmp_path, march="sapphirerapids")):
        assert proc.returncode == 0, proc.stderr[-2000:]
    for obj in ("inv_gemm.o", "inv_attn_bf16.o"):  # the tile GEMM and the tile attention
        dis = subprocess.run(["objdump", "-d", str(tmp_path / obj)], capture_output=True, text=True, check=True)
        assert "tdpbf16ps" in dis.stdout and "ldtilecfg" in dis.stdout, obj


def test_gemm_tiles_flag_is_ignored_without_amx():
    """Elsewhere the per-call tiles flag changes nothing (the same AVX-512 / FMA chains)."""
    if invariant_gemm_bf16_path() == "amx":
        pytest.skip("AMX CPU: the flag selects the tile path here (tested above)")
    wp = pack_dense(torch.randn(64, 96, generator=_gen(4)).bfloat16())
    x = torch.randn(5, 96, generator=_gen(5)).bfloat16()
    assert torch.equal(gemm(x, wp, 64, torch.float32, True), gemm(x, wp, 64, torch.float32))


def test_gemm_rejects_bad_input():
    wp = pack_dense(torch.randn(32, 64))
    with pytest.raises(TypeError):
        gemm(torch.randn(4, 64).bfloat16(), wp, 32, torch.float32)
    with pytest.raises(ValueError, match="even"):
        pack_dense(torch.randn(32, 63).bfloat16())


def _reference(q, kc, vc, seqs, slots, scale):
    """float64 causal attention of every sequence's rows over its context slots."""
    h, hk = q.shape[1], kc.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row0, nq, off, length in seqs.tolist():
        s = slots[off:off + length]
        ks = kc[s].double().transpose(0, 1).repeat_interleave(h // hk, 0)
        vs = vc[s].double().transpose(0, 1).repeat_interleave(h // hk, 0)
        scores = q[row0:row0 + nq].double().transpose(0, 1) @ ks.transpose(1, 2) * scale
        visible = torch.arange(length)[None, :] <= torch.arange(length - nq, length)[:, None]
        out[row0:row0 + nq] = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vs).transpose(0, 1)
    return out


def _step(shapes, h, hk, d, dtype, seed):
    g = _gen(seed)
    kc = torch.randn(8192, hk, d, generator=g).to(dtype)
    vc = torch.randn(8192, hk, d, generator=g).to(dtype)
    rows, parts, row0, off = [], [], 0, 0
    for nq, length in shapes:
        rows.append((row0, nq, off, length))
        parts.append(torch.randperm(8192, generator=g)[:length])
        row0, off = row0 + nq, off + length
    q = torch.randn(row0, h, d, generator=g)
    return q, kc, vc, torch.tensor(rows), torch.cat(parts)


# (kernel, cache dtype, tolerance against float64): the bf16 kernel rounds q and the softmax
# weights to bf16 before its dot products, so it is as close as bf16 inputs allow
KERNELS = [pytest.param((attn, torch.float32, 1e-5), id="f32-float32"),
           pytest.param((attn, torch.bfloat16, 1e-5), id="f32-bfloat16"),
           pytest.param((attn_bf16, torch.bfloat16, 2e-2), id="bf16-bfloat16",
                        marks=pytest.mark.skipif(attn_bf16 is None, reason="no AVX512-BF16: the bf16 kernel "
                                                                            "is not built on this CPU")),
           pytest.param((attn_bf16f, torch.bfloat16, 2e-2), id="bf16f-bfloat16",
                        marks=pytest.mark.skipif(attn_bf16f is None, reason="no AVX512-BF16: the bf16 kernel "
                                                                             "is not built on this CPU")),
           pytest.param((attn_amx, torch.bfloat16, 2e-2), id="amx-bfloat16",
                        marks=pytest.mark.skipif(attn_amx is None, reason="no AMX on this CPU: the tile attention "
                                                                           "is not compiled"))]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 16), (8, 1, 32), (4, 4, 128), (6, 2, 48), (64, 4, 16),
                                   (6, 3, 16)])
def test_attention_is_correct_and_every_row_equals_its_decode(kernel, heads):
    """A mixed step (decodes, fresh chunks, chunks with context, lengths around the 512-key
    chunk boundary, decodes long enough to be split by chunk); then every row alone, as a decode
    over its own context, gives the same bits. The bf16 kernel runs a step's few-row sequences
    (decodes; a decode with its drafts, 4 rows at 1026 keys: two rows see nothing of the last
    chunk) one item per chunk over every kv head, one with more drafts (8 rows at 700 keys: more
    rows than one item holds for every kv head at 9/3 heads) one item per chunk and kv head, and a
    lone short decode one item per kv head (64 heads: per kv head always), so this also checks
    that the work split never changes a bit.
    Split items copy a super-block's cache rows (kv heads x head_dim) in whole vectors, or with
    memcpy when a row is not a multiple of 32 (3 x 16 here). On AMX tiles a split item of 8 rows x 3
    heads (6/2/48) runs a 16-row tile and a partial one."""
    fn, dtype, tol = kernel
    h, hk, d = heads
    shapes = [(1, 1), (1, 37), (5, 5), (17, 17), (40, 900), (1, 1025), (1, 1600), (3, 512), (30, 540),
              (4, 1026), (2, 1700), (8, 700)]
    q, kc, vc, seqs, slots = _step(shapes, h, hk, d, dtype, seed=d)
    out = fn(q, kc, vc, seqs, slots, d ** -0.5)
    torch.testing.assert_close(out.double(), _reference(q, kc, vc, seqs, slots, d ** -0.5), atol=tol, rtol=tol)
    for row0, nq, off, length in seqs.tolist():
        for i in range(nq):
            lim = length - nq + i + 1
            alone = fn(q[row0 + i:row0 + i + 1], kc, vc, torch.tensor([(0, 1, 0, lim)]), slots[off:off + lim],
                       d ** -0.5)
            assert torch.equal(alone[0], out[row0 + i]), f"row {i} of sequence at {row0} differs alone"


@pytest.mark.parametrize("kernel", KERNELS[1:])
def test_attention_does_not_depend_on_chunking_or_neighbours(kernel):
    """One 70-row prompt prefilled at once, in chunks of 7, and next to other sequences."""
    fn = kernel[0]
    q, kc, vc, seqs, slots = _step([(70, 600)], 9, 3, 64, torch.bfloat16, seed=5)
    whole = fn(q, kc, vc, seqs, slots, 0.125)
    for cut in (7, 33):
        parts = [fn(q[i:i + cut], kc, vc, torch.tensor([(0, min(cut, 70 - i), 0, 530 + i + min(cut, 70 - i))]),
                    slots, 0.125) for i in range(0, 70, cut)]
        assert torch.equal(torch.cat(parts), whole), f"chunks of {cut} differ"
    q2, kc2, vc2, seqs2, slots2 = _step([(1, 300), (12, 12)], 9, 3, 64, torch.bfloat16, seed=6)
    both = torch.cat([q2[:1], q, q2[1:]])
    seqs_both = torch.tensor([(0, 1, 0, 300), (1, 70, 300, 600), (71, 12, 900, 12)])
    slots_both = torch.cat([slots2[:300], slots, slots2[300:]])
    out = fn(both, kc, vc, seqs_both, slots_both, 0.125)
    assert torch.equal(out[1:71], whole)


@pytest.mark.parametrize("kernel", KERNELS)
def test_where_the_keys_live_in_the_pool_changes_no_bit(kernel):
    """Decodes (split items) over the same keys, once scattered over the pool and once in one run
    of slots, with one 16-key block moved away: a super-block whose slots are one run is read in
    place, the others through the staging copy; the bits must not care."""
    fn, dtype, _ = kernel
    shapes = [(1, 1700), (1, 700), (3, 900)]
    q, kc, vc, seqs, slots = _step(shapes, 9, 3, 64, dtype, seed=9)
    scattered = fn(q, kc, vc, seqs, slots, 0.125)
    n, spare = len(slots), torch.arange(len(slots), len(slots) + 16)
    kc2, vc2 = torch.cat([kc, kc[:16]]), torch.cat([vc, vc[:16]])       # room for the moved block
    run = torch.arange(n)
    run[320:336] = spare                                                # one block elsewhere
    kc2[run], vc2[run] = kc[slots], vc[slots]
    assert torch.equal(fn(q, kc2, vc2, seqs, run, 0.125), scattered)


@pytest.mark.skipif(attn_bf16 is None, reason="no AVX512-BF16: the bf16 kernel is not built on this CPU")
def test_bf16_attention_rejects_what_it_cannot_serve():
    q, kc, vc, seqs, slots = _step([(2, 4)], 4, 2, 160, torch.bfloat16, seed=8)
    with pytest.raises(ValueError, match="rejected"):
        attn_bf16(q, kc, vc, seqs, slots, 0.1)  # head_dim above 128
    q, kc, vc, seqs, slots = _step([(2, 4)], 4, 2, 16, torch.bfloat16, seed=8)
    with pytest.raises(TypeError):
        attn_bf16(q, kc.float(), vc.float(), seqs, slots, 0.25)


def test_the_amx_attention_path_is_refused_where_it_cannot_run():
    """Without AMX (or without the bf16 kernel) asking the backend for tiles is a clear error,
    never a silent fallback to another path's bits."""
    if attn_amx is not None:
        pytest.skip("AMX CPU: the tile path runs here (tested above)")
    from streamkv.attention.backend import KVCache, make_backend

    cache = KVCache(1, 4, 16, 2, 64, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="AMX"):
        make_backend("cpu_invariant", cache, 0.125, bf16=attn_bf16 is not None, tiles=True)


def test_attention_rejects_shapes_it_cannot_serve():
    q, kc, vc, seqs, slots = _step([(2, 4)], 4, 2, 16, torch.float32, seed=7)
    with pytest.raises(ValueError, match="rejected"):
        attn(q[..., :8].contiguous(), kc[..., :8].contiguous(), vc[..., :8].contiguous(), seqs, slots, 0.25)
    with pytest.raises(ValueError, match="rejected"):
        attn(q, kc, vc, torch.tensor([(0, 5, 0, 4)]), slots, 0.25)  # more rows than context
    with pytest.raises(TypeError):
        attn(q, kc.half(), vc.half(), seqs, slots, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [16, 37, 48])
def test_dense_panels_hold_each_column_at_its_place_and_pad_with_zeros(dtype, n):
    """pack_dense's layout (``inv_gemm.c``): panel t, input k, column c is w[16 t + c, k];
    bf16 keeps input pairs (2 j, 2 j + 1) adjacent; the last panel's missing columns are zero."""
    k = 6
    w = torch.arange(1, n * k + 1, dtype=torch.float32).view(n, k).to(dtype)
    wp = pack_dense(w)
    t = -(-n // 16)
    assert wp.is_contiguous() and wp.shape == ((t, k, 16) if dtype == torch.float32 else (t, k // 2, 16, 2))
    full = torch.zeros(t * 16, k, dtype=dtype)
    full[:n] = w
    for row in range(t * 16):
        for col in range(k):
            at = wp[row // 16, col, row % 16] if dtype == torch.float32 else wp[row // 16, col // 2, row % 16, col % 2]
            assert at == full[row, col], (row, col)
