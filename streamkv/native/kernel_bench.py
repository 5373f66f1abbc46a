"""The measurements behind ``native/tuning.py``: each candidate path of a kind, timed at the
model's shapes on random data (the kernels' speed does not depend on the values).

Small row counts are bound by weight bytes, so the linear candidates cycle through enough
distinct copies of a layer's weights (up to the model's layer count) to stream ~48 MB, as a
real decode step streams the whole model instead of re-reading one warm layer. Every time is
the best of a few repetitions (other tenants of a shared machine only ever slow a run down),
the candidates of a kind measured in turn (`_best_each`) so a passing load slows them alike.
"""
from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from streamkv.native.choice import dense_gemm

STREAM_BYTES = 48 << 20
ROWS = {"decode x1": 1, "decode x8": 8, "decode x32": 32, "prompt x256": 256}
# exact kinds (float32 models) find a crossover rather than one winner: finer steps
EXACT_ROWS = {"decode x1": 1, "decode x4": 4, "decode x8": 8, "decode x16": 16, "decode x32": 32,
              "prompt x64": 64, "prompt x128": 128, "prompt x256": 256}


def _best_each(fns: dict[str, Callable[[], object]], budget_s: float = 0.03, tries: int = 3) -> dict[str, float]:
    """Milliseconds per call of each candidate: the best of ``tries`` runs of about ``budget_s``
    each, a run's time the median of its calls, the candidates' runs interleaved (A B, B A, A B):
    a load that comes and goes while a busy machine measures slows them alike, instead of
    whichever ran during it (a first start beside other jobs once timed the dense LM head faster
    than the int8 one and cached that), and the calls that a descheduled thread held up (an OpenMP
    team waits for it at every barrier) do not move the median. A load that lasts is the
    caller's to see (``native/contention.py``)."""
    reps = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        reps[name] = max(1, min(200, int(budget_s / max(time.perf_counter() - t0, 1e-6))))
    best = dict.fromkeys(fns, math.inf)
    names = list(fns)
    for i in range(tries):
        for name in names if i % 2 == 0 else names[::-1]:
            fn, calls = fns[name], []
            for _ in range(reps[name]):
                t0 = time.perf_counter()
                fn()
                calls.append(time.perf_counter() - t0)
            best[name] = min(best[name], statistics.median(calls))
    return {name: t * 1e3 for name, t in best.items()}


def _layer_shapes(s) -> list[tuple[int, int]]:
    """(N, K) of a decoder layer's four fused linears."""
    return [((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden), (s.hidden, s.heads * s.head_dim),
            (2 * s.inter, s.hidden), (s.hidden, s.inter)]


def _copies(bytes_per_layer: int, layers: int) -> int:
    return max(1, min(layers, math.ceil(STREAM_BYTES / max(bytes_per_layer, 1))))


def _q4_layer(shapes: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Random packed 4-bit weights in q4_gemm.c's layout: (w [T, G, 16, 16] u8, sz [T, G, 2, 16] bf16, N)."""
    out = []
    for n, k in shapes:
        t, g = -(-n // 16), k // 32
        w = torch.randint(0, 256, (t, g, 16, 16), dtype=torch.uint8)
        sz = (torch.rand(t, g, 2, 16) * 0.01).to(torch.bfloat16)
        out.append((w, sz, n))
    return out


def _dense_layer(shapes: list[tuple[int, int]]) -> list[tuple[torch.Tensor, int]]:
    """Random bf16 panels in inv_gemm.c's layout: ([T, K/2, 16, 2], N)."""
    return [((torch.randn(-(-n // 16), k // 2, 16, 2) * 0.02).to(torch.bfloat16), n) for n, k in shapes]


def _torch_layer(shapes: list[tuple[int, int]]) -> list[tuple[torch.Tensor, int]]:
    """Random bf16 weights as F.linear takes them: ([N, K], N)."""
    return [((torch.randn(n, k) * 0.02).to(torch.bfloat16), n) for n, k in shapes]


def _random_q4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, k] in 0..15 and float16-valued scales d, offsets m [n, k / 32]."""
    return (torch.randint(0, 16, (n, k)), (torch.rand(n, k // 32) * 0.01).half().float(),
            (-torch.rand(n, k // 32) * 0.08).half().float())


def _linear_f32(s) -> dict[str, dict[str, float]]:
    """Float32 models: deq_gemm.c over packed 4-bit layers vs the dense float32 GEMM (same bits)."""
    from streamkv.models.deq_linear import pack_deq
    from streamkv.native import deq_gemm, invariant_gemm

    shapes = _layer_shapes(s)
    deq, dense = deq_gemm(), invariant_gemm()
    params = sum(n * k for n, k in shapes)
    packed = [[(*pack_deq(*_random_q4(n, k)), n) for n, k in shapes] for _ in range(_copies(params * 5 // 8, s.layers))]
    panels = [[(torch.randn(-(-n // 16), k, 16) * 0.02, n) for n, k in shapes]
              for _ in range(_copies(params * 4, s.layers))]
    out: dict[str, dict[str, float]] = {"q4": {}, "dense": {}}
    for label, m in EXACT_ROWS.items():
        xs = {k: torch.randn(m, k) for _, k in shapes}
        t = _best_each({"q4": lambda: [deq(xs[k], q, dm, n) for layer in packed
                                       for (q, dm, n), (_, k) in zip(layer, shapes)],
                        "dense": lambda: [dense(xs[k], wp, n, torch.float32) for layer in panels
                                          for (wp, n), (_, k) in zip(layer, shapes)]})
        out["q4"][label], out["dense"][label] = t["q4"] / len(packed), t["dense"] / len(panels)
    return out


def _linear(s, chosen: dict[str, str]) -> dict[str, dict[str, float]]:
    from streamkv.models.deq_linear import pack_deq_bf16
    from streamkv.native import deq_gemm_bf16, invariant_gemm, q4_gemm

    if not s.bf16:
        return _linear_f32(s)
    shapes = _layer_shapes(s)
    q4k, dense = q4_gemm(), invariant_gemm()
    tiles, fma = dense_gemm(chosen)
    # linear=deq (the dense bits from the 4-bit blocks) switches with dense by row count: finer
    # rows. A candidate only on tiles: elsewhere it rebuilds the panels and then runs dense's own
    # kernel, so it cannot be faster (only forced, e.g. to test it, does it run there)
    deq = deq_gemm_bf16() if s.q4 and s.numerics == "invariant" and tiles else None
    params = sum(n * k for n, k in shapes)
    # fast numerics run dense layers, and every prompt row, through torch (F.linear: oneDNN,
    # AMX tiles where present), and only decode rows through the 4-bit kernel (RowSplit)
    fast = s.numerics == "fast"
    q4_layers = [_q4_layer(shapes) for _ in range(_copies(params * 5 // 8, s.layers))]
    dense_layers = [_torch_layer(shapes) if fast else _dense_layer(shapes)
                    for _ in range(_copies(params * 2, s.layers))]
    deq_layers = [[(*pack_deq_bf16(*_random_q4(n, k)), n) for n, k in shapes]
                  for _ in range(_copies(params * 3 // 4, s.layers))] if deq else []
    q4f = not fast  # the fma chain: invariant numerics only (fast ones read prompt rows through torch)
    out: dict[str, dict[str, float]] = {"q4": {}, "dense": {}, **({"deq": {}} if deq else {}),
                                        **({"q4f": {}} if q4f else {})}
    for label, m in (EXACT_ROWS if deq else ROWS).items():
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for _, k in shapes}

        def run_deq() -> None:
            for layer in deq_layers:
                for (q, dm, n), (_, k) in zip(layer, shapes):
                    deq(xs[k], q, dm, n, torch.bfloat16, tiles, fma)

        def run_q4(fma: bool = False) -> None:
            for layer in q4_layers:
                for (w, sz, n), (_, k) in zip(layer, shapes):
                    q4k(xs[k], w, sz, n, torch.bfloat16, fma)

        def run_dense() -> None:
            for layer in dense_layers:
                for (wp, n), (_, k) in zip(layer, shapes):
                    F.linear(xs[k], wp) if fast else dense(xs[k], wp, n, torch.bfloat16, tiles, fma)

        # a fast-numerics prompt chunk takes torch's GEMM on either path: one time for both
        same = fast and label.startswith("prompt")
        t = _best_each({"dense": run_dense} if same else {"q4": run_q4, "dense": run_dense,
                                                          **({"deq": run_deq} if deq else {}),
                                                          **({"q4f": lambda: run_q4(True)} if q4f else {})})
        out["dense"][label] = t["dense"] / len(dense_layers)
        out["q4"][label] = out["dense"][label] if same else t["q4"] / len(q4_layers)
        if deq:
            out["deq"][label] = t["deq"] / len(deq_layers)
        if q4f:
            out["q4f"][label] = t["q4f"] / len(q4_layers)
    return out


def _gemm(s, chosen: dict[str, str]) -> dict[str, dict[str, float]]:
    """The dense bf16 GEMM on each path this CPU has: the vector units (vdpbf16ps), AMX tiles,
    vdpbf16ps's chain on float32 fmas (CPUs that issue vdpbf16ps at half the fma rate)."""
    from streamkv.native import invariant_gemm, invariant_gemm_bf16_path, invariant_gemm_uses_bf16_dot

    shapes = _layer_shapes(s)
    dense = invariant_gemm()
    layers = [_dense_layer(shapes) for _ in range(_copies(sum(n * k for n, k in shapes) * 2, s.layers))]
    paths = ["avx512"] + ["amx"] * (invariant_gemm_bf16_path() == "amx") + ["fma"] * invariant_gemm_uses_bf16_dot()
    out: dict[str, dict[str, float]] = {path: {} for path in paths}
    for label, m in ROWS.items():
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for _, k in shapes}

        def run(path: str) -> None:
            for layer in layers:
                for (wp, n), (_, k) in zip(layer, shapes):
                    dense(xs[k], wp, n, torch.bfloat16, path == "amx", path == "fma")
        t = _best_each({path: functools.partial(run, path) for path in out})
        for path in out:
            out[path][label] = t[path] / len(layers)
    return out


def _lm_head_f32(s) -> dict[str, dict[str, float]]:
    """Float32 models: deq_gemm.c over the int8 head vs the dense float32 GEMM (same bits)."""
    from streamkv.models.deq_linear import pack_deq8
    from streamkv.native import deq_gemm, invariant_gemm

    n, k = s.vocab, s.hidden
    q, dm = pack_deq8(torch.randint(-128, 128, (n, k), dtype=torch.int8), (torch.rand(n, k // 32) * 0.01).half().float())
    wp = torch.randn(-(-n // 16), k, 16) * 0.02
    deq, dense = deq_gemm(), invariant_gemm()
    out: dict[str, dict[str, float]] = {"q8": {}, "dense": {}}
    for label, m in list(EXACT_ROWS.items())[:6]:  # sampled rows: one per sequence (and its drafts)
        x = torch.randn(m, k)
        t = _best_each({"q8": lambda: deq(x, q, dm, n), "dense": lambda: dense(x, wp, n, torch.float32)})
        out["q8"][label], out["dense"][label] = t["q8"], t["dense"]
    return out


def _lm_head(s, chosen: dict[str, str]) -> dict[str, dict[str, float]]:
    from streamkv.models.deq_linear import pack_deq8_bf16
    from streamkv.native import deq_gemm_bf16, invariant_gemm, q8_gemm

    if not s.bf16:
        return _lm_head_f32(s)
    n, k = s.vocab, s.hidden
    t, g = -(-n // 16), k // 32
    w8 = torch.randint(-128, 128, (t, g, 16, 32), dtype=torch.int8)
    d8 = torch.rand(t, g, 16) * 0.01
    wp = (torch.randn(t, k // 2, 16, 2) * 0.02).to(torch.bfloat16)
    q8k, dense = q8_gemm(), invariant_gemm()
    tiles, fma = dense_gemm(chosen)
    # lm_head=deq (the dense bits from the int8 head) switches with dense by row count: finer rows.
    # A candidate only on tiles, as linear=deq (kernel_bench._linear)
    deq = deq_gemm_bf16() if s.numerics == "invariant" and tiles else None
    qd, dd = pack_deq8_bf16(torch.randint(-128, 128, (n, k), dtype=torch.int8),
                            (torch.rand(n, k // 32) * 0.01).half().float()) if deq else (None, None)
    out: dict[str, dict[str, float]] = {"q8": {}, "dense": {}, **({"deq": {}} if deq else {})}
    # sampled rows: one per sequence (and its drafts)
    for label, m in list(EXACT_ROWS.items())[:6] if deq else list(ROWS.items())[:3]:
        x = torch.randn(m, k).to(torch.bfloat16)
        t = _best_each({"q8": lambda: q8k(x, w8, d8, n), "dense": lambda: dense(x, wp, n, torch.float32, tiles, fma),
                        **({"deq": lambda: deq(x, qd, dd, n, torch.float32, tiles, fma)} if deq else {})})
        for path in out:
            out[path][label] = t[path]
    return out


PAGE = 16  # the engine's default KV block (EngineConfig.block_size): its slots are contiguous


def _attention_case(s, rows: list[tuple[int, int]]):
    """A step of sequences (query rows, context length) over a paged bf16 cache: blocks of PAGE
    slots in scattered order, as a pool that has served a while holds them."""
    pages = -(-2 * sum(length for _, length in rows) // PAGE) + 1
    slots_total = pages * PAGE
    kc = (torch.randn(slots_total, s.kv_heads, s.head_dim) * 0.5).to(torch.bfloat16)
    vc = torch.randn(slots_total, s.kv_heads, s.head_dim).to(torch.bfloat16)
    seqs, parts, r0, off = [], [], 0, 0
    perm = (torch.randperm(pages)[:, None] * PAGE + torch.arange(PAGE)).flatten()
    for nq, length in rows:
        seqs.append((r0, nq, off, length))
        parts.append(perm[off:off + length])
        r0, off = r0 + nq, off + length
    q = torch.randn(r0, s.heads, s.head_dim)
    return q, kc, vc, torch.tensor(seqs), torch.cat(parts)


ATTENTION_CASES = {"prompt 512": [(512, 512)], "decode ctx 2048": [(1, 2048)], "decode 8 x ctx 512": [(1, 512)] * 8}
DECODE_COPIES = 16  # a decode case's calls cycle through this many caches (~48 MB at ctx 2048, as a step's layers)


def _attention_calls(s, label: str, fns: dict[str, Callable[..., torch.Tensor]]) -> dict[str, Callable[[], object]]:
    """One call per path of ``fns`` on case ``label``. A decode case's calls go round DECODE_COPIES
    caches with other data in the same pages, so its keys come from L3 or memory as in a step
    (30 layers, each its own cache), not from the L2 a single cache would stay in: how the rows
    are gathered (``attention_gather``) measured faster on a hot cache and slower inside a step
    on the EPYC. A prompt case is bound by its arithmetic: one cache."""
    q, kc, vc, seqs, slots = _attention_case(s, ATTENTION_CASES[label])
    caches = [(kc, vc)] + [((torch.randn_like(kc, dtype=torch.float32) * 0.5).to(kc.dtype),
                            torch.randn_like(vc, dtype=torch.float32).to(vc.dtype))
                           for _ in range(DECODE_COPIES - 1 if label.startswith("decode") else 0)]
    turn = itertools.count()

    def call(fn: Callable[..., torch.Tensor]) -> Callable[[], object]:
        return lambda: fn(q, *caches[next(turn) % len(caches)], seqs, slots, s.head_dim ** -0.5)
    return {path: call(fn) for path, fn in fns.items()}


def _attention(s, chosen: dict[str, str]) -> dict[str, dict[str, float]]:
    from streamkv.native import (invariant_attention, invariant_attention_amx, invariant_attention_bf16,
                                 invariant_attention_bf16f)

    found = {"bf16": invariant_attention_bf16(), "f32": invariant_attention(), "amx": invariant_attention_amx(),
             "bf16f": invariant_attention_bf16f()}
    kernels = {path: fn for path, fn in found.items() if fn is not None}
    if chosen.get("attention_gather") == "direct":  # the bf16 kernels' decode items as they will run
        kernels = {p: functools.partial(fn, direct=True) if p != "f32" else fn for p, fn in kernels.items()}
    out: dict[str, dict[str, float]] = {p: {} for p in kernels}
    for label in ATTENTION_CASES:
        t = _best_each(_attention_calls(s, label, kernels))
        for path in kernels:
            out[path][label] = t[path]
    return out


def _attention_gather(s, chosen: dict[str, str]) -> dict[str, dict[str, float]]:
    """The bf16 kernels' few-row items (decodes) staging a super-block's rows or gathering each
    head's blocks from the pool: the same bits, timed before ``attention`` (whose bf16 paths then
    run on the choice) on a forced bf16-family attention path, else on bf16 (the data movement
    this decides is the same for all of them)."""
    from streamkv.native import invariant_attention_amx, invariant_attention_bf16, invariant_attention_bf16f

    fn = {"amx": invariant_attention_amx, "bf16f": invariant_attention_bf16f}.get(
        chosen.get("attention", "bf16"), invariant_attention_bf16)()
    out: dict[str, dict[str, float]] = {"stage": {}, "direct": {}}
    for label in (lb for lb in ATTENTION_CASES if lb.startswith("decode")):  # prompt tiles never stage
        t = _best_each(_attention_calls(s, label, {p: functools.partial(fn, direct=p == "direct") for p in out}))
        for p in out:
            out[p][label] = t[p]
    return out


def _prefill_attention(s, chosen: dict[str, str]) -> dict[str, dict[str, float]]:
    from streamkv.native import paged_attention

    paged = paged_attention()
    q, kc, vc, seqs, slots = _attention_case(s, ATTENTION_CASES["prompt 512"])
    qb = q.to(torch.bfloat16)
    g = s.heads // s.kv_heads
    q4 = qb.transpose(0, 1)[None]

    def sdpa() -> torch.Tensor:  # the torch backend's path: gather the context, then SDPA
        k4 = kc[slots].transpose(0, 1).repeat_interleave(g, 0)[None]
        v4 = vc[slots].transpose(0, 1).repeat_interleave(g, 0)[None]
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
    t = _best_each({"native": lambda: paged(qb, kc, vc, seqs, slots, s.head_dim ** -0.5), "sdpa": sdpa})
    return {path: {"prompt 512": ms} for path, ms in t.items()}


MEASURES = {"linear": _linear, "gemm": _gemm, "lm_head": _lm_head, "attention": _attention,
            "attention_gather": _attention_gather, "prefill_attention": _prefill_attention}


def measure(kind: str, shapes, chosen: dict[str, str]) -> dict[str, dict[str, float]]:
    """{path: {shape: ms}} for every path of ``kind``; ``chosen`` holds the kinds decided so far."""
    with torch.inference_mode():
        return MEASURES[kind](shapes, chosen)
