"""``streamkv info``: the machine, the native kernels it built, and the kernel choice for a model."""
from __future__ import annotations

import os
from typing import Any

import torch

from streamkv.config import EngineConfig
from streamkv.native.tuning import ALL_ROWS


def machine_and_kernels(config: EngineConfig, retune: bool = False) -> dict[str, Any]:
    """A JSON-able report; measures the kernel candidates if this machine has no cached choice."""
    from streamkv import native
    from streamkv.engine.dtype import resolve_dtype
    from streamkv.engine.factory import kernel_choice, set_threads
    from streamkv.loading import load_checkpoint
    from streamkv.native.cpu import cpu_flags, cpu_model, usable_cores

    device = torch.device(config.runtime.device)
    set_threads(config)
    dtype = resolve_dtype(config.model.dtype, device)
    ckpt = load_checkpoint(config.model.model, dtype=dtype)
    choice = kernel_choice(config, ckpt, dtype, device, retune=retune)
    return {
        "cpu": cpu_model(), "flags": cpu_flags(), "cores": usable_cores(), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "native": {"built": native.invariant_gemm() is not None, "isa": native.invariant_isa(),
                   "bf16 GEMM on": native.invariant_gemm_bf16_path(), "build": native.build_tag()},
        "model": os.path.basename(ckpt.source), "dtype": str(dtype).replace("torch.", ""),
        "numerics": config.runtime.numerics,
        "kernels": {k: {"path": v, "how": choice.source.get(k), "packed_rows": choice.packed_rows(k),
                        "busy_others": choice.busy.get(k)}
                    for k, v in choice.paths.items()},
        "timings_ms": choice.timings,
    }


def render(r: dict[str, Any]) -> str:
    lines = [f"CPU: {r['cpu']} ({r['cores']} cores; {' '.join(r['flags']) or 'no AVX2/AVX-512 flags'})",
             f"torch {r['torch']}, {r['threads']} threads; native kernels: " +
             (f"built for {r['native']['isa']}, bf16 GEMMs on {r['native']['bf16 GEMM on']} "
              f"(build {r['native']['build']})" if r["native"]["built"] else "not built (no C compiler?)"),
             f"model: {r['model']}, {r['dtype']}, numerics {r['numerics']}", "", "kernel choice:"]
    for kind, c in r["kernels"].items():
        rows = c.get("packed_rows") or 0
        upto = "" if not rows else ", every step" if rows >= ALL_ROWS else f", steps of <= {rows} rows (then dense)"
        busy = c.get("busy_others")
        beside = "" if busy is None else f"; measured beside other load: {busy:.0%} of the CPUs, --retune when quiet"
        lines.append(f"  {kind:18s} {c['path']:7s} ({c['how']}{upto}{beside})")
    for kind, paths in r["timings_ms"].items():
        shapes = list(next(iter(paths.values())))
        lines += ["", f"{kind} (ms; lower is better):", "  " + f"{'path':8s}" + "".join(f"{sh:>20s}" for sh in shapes)]
        for path, t in paths.items():
            lines.append("  " + f"{path:8s}" + "".join(f"{t[sh]:>20.3f}" for sh in shapes))
    if not r["timings_ms"]:
        why = "every kind here has one path, or was forced"
        if any(c["how"] == "default" for c in r["kernels"].values()):  # two paths, not timeable here
            why = "the kinds marked default are timed through the native kernels, not built here"
        lines += ["", f"(no kernel was measured: {why})"]
    return "\n".join(lines)
