"""Where the time of one engine step goes: batch-1 decode, 32 concurrent decodes, the last chunk
of a 2048-token prefill.

    .venv/bin/python benchmarks/step_profile.py                    # the default engine
    .venv/bin/python benchmarks/step_profile.py --torch-layers     # the layers as torch ops (before native/layer.c)
    .venv/bin/python benchmarks/step_profile.py --engine-kwargs '{"numerics": "fast"}'

Per step (20th percentile over the measured steps, repeated --repeat times): the whole ``Engine.step``, the runner's ``execute``,
the model's forward and, inside it with the native layers, native/layer.c's own phases (GEMMs,
attention, norms, RoPE + KV writes, SiLU, residual adds; timed in C), the LM head with its norm,
and the sampler. "overhead" = step - GEMMs - attention - page selection (kv_read quest) - LM head:
what is neither a kernel
doing the model's arithmetic nor reading its weights (Python, dispatch, scheduling, glue).
Prints the CPU model and flags. Speculation is off unless --engine-kwargs turns it on (a step is
then one forward per sequence).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


class Timer:
    """Wraps obj.name and records each call's wall time under ``key``."""

    def __init__(self) -> None:
        self.t: dict[str, list[float]] = {}

    def wrap(self, obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t.setdefault(key, []).append(time.perf_counter() - t0)
        setattr(obj, name, timed)


class _TimedCall:
    """Times calls of a callable object; everything else passes through."""

    def __init__(self, inner, into: list[float]) -> None:
        self.inner, self.into = inner, into

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self.inner(*a, **k)
        finally:
            self.into.append(time.perf_counter() - t0)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def profile(llm, prompts: list[list[int]], max_tokens: int, native_ok: bool,
            kv_read: dict | None = None) -> dict[str, float]:
    """Run the prompts together; returns median ms per step of every recorded part, over the
    steps where every sequence decodes (or the prefill's last step when max_tokens == 1)."""
    from streamkv import SamplingParams

    engine = llm.engine
    runner = engine.bundle.runner
    runner.sampler = getattr(runner.sampler, "inner", runner.sampler)
    for name in ("execute", "compute_logits"):  # undo an earlier call's wrapping
        for obj in (runner, runner.model):
            obj.__dict__.pop(name, None)
    timer = Timer()
    timer.wrap(runner, "execute", "execute")
    timer.wrap(runner.model, "compute_logits", "lm_head")
    runner.sampler = _TimedCall(runner.sampler, timer.t.setdefault("sampler", []))
    native = getattr(runner.model, "native", None) if native_ok else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}-{time.monotonic_ns()}", p, params, kv_read=kv_read)
    steps, phases, parts = [], [], []  # parts: per step, each wrapped call's summed time
    while engine.has_unfinished():
        timings = native.profile(True) if native is not None else None
        seen = {k: len(v) for k, v in timer.t.items()}
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
        parts.append({k: sum(v[seen.get(k, 0):]) for k, v in timer.t.items()})
        phases.append(timings.clone() if timings is not None else None)
        if native is not None:
            native.profile(False)
    # the measured steps: all decoding (skip the prefill steps), or the prefill's last step: adaptive
    # chunking makes a 2,048-token prompt two 1,024-token chunks, the second over all 2,048 keys
    n = len(steps)
    keep = list(range(n - max_tokens + 2, n)) if max_tokens > 1 else [n - 1]
    # the 20th percentile: this machine's neighbours slow whole runs down by 10-30% at random;
    # the fast steps are the ones that show what the code costs
    med = lambda xs: 1000 * statistics.quantiles(xs, n=5)[0] if len(xs) > 1 else 1000 * xs[0]  # noqa: E731
    out = {"step": med([steps[i] for i in keep])}
    for key in timer.t:
        out[key] = med([parts[i].get(key, 0.0) for i in keep])
    if native is not None:
        from streamkv.models.native_layers import PHASES

        for j, name in enumerate(PHASES):
            out["layers." + name] = med([float(phases[i][j]) for i in keep])
    if native is not None:  # per step, then its percentile: a difference of percentiles of
        # different steps went negative (decode x1: step 184.19 - gemm 134.50 - attention 49.03 - head 10.30)
        from streamkv.models.native_layers import PHASES

        arithmetic = [PHASES.index(p) for p in ("gemm", "attention", "select")]

        def kernels(i: int) -> float:
            return sum(float(phases[i][j]) for j in arithmetic) + parts[i].get("lm_head", 0.0)
        out["overhead"] = med([steps[i] - kernels(i) for i in keep])
    return out


def _best(llm, prompts: list[list[int]], max_tokens: int, repeat: int, kv_read: dict | None = None) -> dict[str, float]:
    """Each key's lowest value over ``repeat`` runs (fresh prompts each time)."""
    runs = [profile(llm, [[t + 1 + r for t in p] for p in prompts], max_tokens, True, kv_read) for r in range(repeat)]
    return {k: min(run[k] for run in runs if k in run) for k in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-kwargs", default="{}", help="LLM(...) options as JSON")
    ap.add_argument("--torch-layers", action="store_true", help="run the layers as torch ops (no native/layer.c)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each case (steps of all runs pooled)")
    ap.add_argument("--long-context", type=int, default=6000,
                    help="also decode batch 1 after this many prompt tokens, exact and with kv_read quest(1024) (0: skip)")
    args = ap.parse_args()
    from streamkv import LLM

    info = common.machine_info(args.threads)
    print(f"CPU: {info['cpu']['model']} ({', '.join(info['cpu']['flags'])}); torch {info.get('torch')}, "
          f"{info.get('torch_threads')} threads")
    # one forward per step: prompt-lookup speculation (on by default) verifies several drafted
    # tokens per step, so a run has fewer steps than tokens; --engine-kwargs may turn it back on
    llm = LLM(threads=args.threads, **{"speculation": "none", **json.loads(args.engine_kwargs)})
    model = llm.engine.bundle.runner.model
    if args.torch_layers:
        model.native = None
    b = llm.engine.bundle
    print(f"engine: dtype {b.dtype}, decode weights {b.decode_weights}, numerics {llm.engine.config.runtime.numerics}, "
          f"native layers {getattr(model, 'native', None) is not None}")
    g = iter(range(10**6))
    prompt = lambda n: [1000 + (next(g) * 7919 + i) % 40000 for i in range(n)]  # noqa: E731
    profile(llm, [prompt(64)], 4, True)  # warm-up
    cases = {"decode b1 (ctx 512)": ([prompt(512)], 64), "decode b32 (ctx 128)": ([prompt(128) for _ in range(32)], 32),
             "prefill 2048, last chunk": ([prompt(2048)], 1)}
    if args.long_context:  # issue 15's decode: what exact and quest steps spend beside the attention
        quest = {"policy": "quest", "budget_tokens": 1024}
        cases |= {f"decode b1 (ctx {args.long_context})": ([prompt(args.long_context)], 24),
                  f"quest b1 (ctx {args.long_context})": ([prompt(args.long_context)], 24, quest)}
    rows, keys = {}, []
    for name, (prompts, n, *kv) in cases.items():
        rows[name] = _best(llm, prompts, n, args.repeat, *kv)
        keys += [k for k in rows[name] if k not in keys]
    print()
    print(common.md_table(["ms per step"] + list(cases),
                          [[k] + [common.fmt(rows[c].get(k), 2) if k in rows[c] else "" for c in cases] for k in keys]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
