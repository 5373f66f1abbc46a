"""Micro-benchmark: a decoder layer's four linears on each bf16 `linear` path, at SmolLM2-135M's
shapes, by row count (what `native/tuning.py` weighs, printed in full).

    .venv/bin/python benchmarks/linear_paths.py [--threads 2] [--tiles]

Paths: `dense` (`native/inv_gemm.c` over bf16 panels; `--tiles`: on AMX tiles where present),
`deq` (`native/deq_bf16.c`: the 4-bit blocks rebuilt to the dense bits; tiles alike) and `q4`
(`native/q4_gemm.c`, bits of its own). Each time is ms per layer: the best of interleaved runs over
8 copies of a layer's weights (a decode step streams the model, not one warm layer). Before
timing, `deq` is checked to equal `dense` to the bit at every row count. Needs only torch and a
C compiler (no model files).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info  # noqa: E402
from streamkv.models.deq_linear import pack_deq_bf16  # noqa: E402
from streamkv.models.linear import pack_dense  # noqa: E402
from streamkv.native import deq_gemm_bf16, invariant_gemm, q4_gemm  # noqa: E402
from streamkv.native.kernel_bench import _best_each, _dense_layer, _layer_shapes, _q4_layer, _random_q4  # noqa: E402
from streamkv.native.tuning import ModelShapes  # noqa: E402

ROWS = (1, 4, 8, 16, 32, 64, 256)


def _loaded(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """bf16(d * q + m), as the GGUF loader makes a bf16 model's weights."""
    return (d.repeat_interleave(32, 1) * q.float() + m.repeat_interleave(32, 1)).to(torch.bfloat16)
COPIES = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiles", action="store_true", help="dense and deq on AMX tiles (where the CPU has them)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = machine_info(args.threads)
    print(f"CPU: {m['cpu']['model']}, flags {' '.join(m['cpu']['flags'])}; {args.threads} threads; "
          f"torch {torch.__version__}")
    deq, dense, q4k = deq_gemm_bf16(), invariant_gemm(), q4_gemm()
    if deq is None or dense is None:
        sys.exit("the bf16 deq path needs AVX512-BF16 with VBMI and a C compiler")
    shapes = _layer_shapes(ModelShapes(576, 1536, 9, 3, 64, 49152, 30, "invariant", True, True, True))
    blocks = [[_random_q4(n, k) for n, k in shapes] for _ in range(COPIES)]
    deq_l = [[(*pack_deq_bf16(*b), n) for b, (n, _) in zip(layer, shapes)] for layer in blocks]
    same = [(pack_dense(_loaded(*b)), n) for b, (n, _) in zip(blocks[0], shapes)]  # the loader's bf16 weights
    dense_l = [_dense_layer(shapes) for _ in range(COPIES)]
    q4_l = [_q4_layer(shapes) for _ in range(COPIES)] if q4k else []
    print(f"{'rows':>6} {'dense':>9} {'deq':>9} {'q4':>9}   (ms per layer)")
    for rows in ROWS:
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in shapes}
        for (qp, dm, n), (w, _), (_, k) in zip(deq_l[0], same, shapes):  # the dense bits, or stop
            if not torch.equal(deq(xs[k], qp, dm, n, torch.float32, args.tiles),
                               dense(xs[k], w, n, torch.float32, args.tiles)):
                sys.exit(f"deq differs from dense at {rows} rows ({n} x {k}): a bug")
        fns = {"dense": lambda: [dense(xs[k], wp, n, torch.bfloat16, args.tiles)
                                 for layer in dense_l for (wp, n), (_, k) in zip(layer, shapes)],
               "deq": lambda: [deq(xs[k], qp, dm, n, torch.bfloat16, args.tiles)
                               for layer in deq_l for (qp, dm, n), (_, k) in zip(layer, shapes)]}
        if q4k:
            fns["q4"] = lambda: [q4k(xs[k], w, sz, n, torch.bfloat16) for layer in q4_l
                                 for (w, sz, n), (_, k) in zip(layer, shapes)]
        t = {p: v / COPIES for p, v in _best_each(fns).items()}
        print(f"{rows:>6} {t['dense']:>9.3f} {t['deq']:>9.3f} {t.get('q4', float('nan')):>9.3f}")


if __name__ == "__main__":
    main()
