"""A kernel choice and its file (``native/tuning.py`` measures and decides): the kinds and their
paths, the model's shapes a measurement needs, the choice, and the cache file it is written to
(atomically, read back only when well formed: a damaged file is measured again).

    KINDS        kind -> its paths (the first: the preferred one on a near-tie)
    KernelChoice paths[kind], timings[kind][path][shape] ms, rows[kind] (packed up to), busy[kind]
    file         {"paths", "timings", "rows", "busy"} as JSON, under an exclusive lock while chosen
"""
from __future__ import annotations

import fcntl
import json
import logging
import math
import os
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

KINDS: dict[str, tuple[str, ...]] = {
    "linear": ("q4", "dense", "deq", "q4f"),
    "gemm": ("amx", "avx512", "fma"),       # fma: vdpbf16ps's chain on float32 fmas (same bits)
    "lm_head": ("q8", "dense", "deq"),
    "attention_gather": ("stage", "direct"),   # measured before attention: its bf16 paths run on it
    "attention": ("bf16", "f32", "amx", "bf16f"),
    "prefill_attention": ("native", "sdpa"),
}
EXACT_PACKED = {"linear": "q4", "lm_head": "q8"}  # exact kinds (float32 models) and their packed path
ALL_ROWS = 2 ** 31 - 1  # an exact kind forced to its packed path takes it at every row count
SWITCHED = {"linear": "deq", "lm_head": "deq"}  # bf16 paths that switch by row count between packed and dense, same bits


def dense_gemm(paths: dict[str, str]) -> tuple[bool, bool]:
    """(tiles, fma): how the dense bf16 GEMM runs for a choice's ``gemm`` path (``amx``: AMX tiles,
    ``fma``: vdpbf16ps's chain on float32 fmas, else neither)."""
    path = paths.get("gemm")
    return path == "amx", path == "fma"


def parse_kernels(spec: str) -> dict[str, str]:
    """``auto`` -> {}; ``linear=q4,attention=bf16`` -> {kind: path} (ValueError naming the problem)."""
    if spec is not None and not isinstance(spec, str):
        raise ValueError(f"kernels: expected a string, auto or KIND=PATH,..., got {type(spec).__name__} {spec!r}")
    spec = (spec or "").strip() or "auto"
    if spec == "auto":
        return {}
    out: dict[str, str] = {}
    for part in spec.split(","):
        kind, sep, path = part.strip().partition("=")
        if not sep or kind not in KINDS:
            raise ValueError(f"kernels: expected auto or KIND=PATH,... with KIND one of {sorted(KINDS)}, got {part!r}")
        if path not in KINDS[kind]:
            raise ValueError(f"kernels: {kind} takes one of {KINDS[kind]}, got {path!r}")
        if kind in out:
            raise ValueError(f"kernels: {kind} given twice")
        out[kind] = path
    return out


@dataclass(frozen=True)
class ModelShapes:
    """What the measurements need to know about the model and the engine."""

    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    numerics: str
    bf16: bool           # bf16 weights and cache
    q4: bool             # GGUF Q4_0/Q4_1 layers usable by the 4-bit kernel
    q8_head: bool        # a Q8_0 LM head usable by the int8 kernel
    cache_bf16: bool | None = None  # a bf16 KV cache (None: as the weights)
    backend: str = "cpu"            # the attention backend (fast numerics): prefill_attention needs "cpu"

    @property
    def kv_bf16(self) -> bool:
        return self.bf16 if self.cache_bf16 is None else self.cache_bf16


@dataclass
class KernelChoice:
    """kind -> path for every kind that exists here; timings[kind][path][shape] in ms; for an exact
    kind whose path is the packed one, rows[kind]: the largest step that reads it (above: dense)."""

    paths: dict[str, str] = field(default_factory=dict)
    timings: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)  # kind -> measured | cached | forced
    rows: dict[str, int] = field(default_factory=dict)
    # kind -> the share of the CPUs its threads need that other processes took while it was measured,
    # where that was above contention.BUSY (then timed on one thread; the choice may be the load's)
    busy: dict[str, float] = field(default_factory=dict)

    def get(self, kind: str, default: str | None = None) -> str | None:
        return self.paths.get(kind, default)

    def packed_rows(self, kind: str) -> int:
        """Steps of at most this many rows read an exact kind's packed weights (0: none)."""
        return self.rows.get(kind, 0) if self.paths.get(kind) in (EXACT_PACKED.get(kind), SWITCHED.get(kind)) else 0

    def describe(self) -> str:
        def one(k: str, v: str) -> str:
            rows = self.packed_rows(k)
            upto = "" if not rows else " at every step" if rows == ALL_ROWS else f" up to {rows} rows, then dense"
            beside = f", measured beside other load: {self.busy[k]:.0%} of the CPUs" if k in self.busy else ""
            return f"{k}={v}{upto} ({self.source.get(k, '?')}{beside})"
        return ", ".join(one(k, v) for k, v in self.paths.items()) or "no choices here"


@contextmanager
def lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``; where the cache directory cannot hold it, none (logged)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "w")
    except OSError as exc:
        log.warning("kernel cache %s not writable (%s): choosing without a lock or a cache", path.parent, exc)
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write(path: Path, choice: KernelChoice) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # the last-choice file has no lock of its own
    try:
        tmp.write_text(json.dumps({"paths": choice.paths, "timings": choice.timings, "rows": choice.rows,
                                   "busy": choice.busy}, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("kernel choice not cached at %s (%s)", path, exc)
        with suppress(OSError):
            tmp.unlink()


def read(path: Path) -> KernelChoice | None:
    """The choice filed at ``path``; None when missing, unreadable or not shaped as ``write``
    writes it (known kinds and paths, positive finite ms per shape, row thresholds in [0,
    ALL_ROWS] for exact kinds only): measure again (a damaged last-choice file is ignored)."""
    try:
        data = json.loads(path.read_text())
        choice = KernelChoice(dict(data["paths"]), dict(data["timings"]), rows=dict(data.get("rows", {})),
                              busy=dict(data.get("busy", {})))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return choice if well_formed(choice) else None


def well_formed(c: KernelChoice) -> bool:
    def positive_ms(v: object) -> bool:
        return isinstance(v, float) and math.isfinite(v) and v > 0

    def timed(kind: str, per_path: object) -> bool:  # every path timed on the same shapes
        return (isinstance(per_path, dict) and bool(per_path) and all(
            p in KINDS[kind] and isinstance(t, dict) and t and all(isinstance(sh, str) and positive_ms(v) for sh, v in t.items())
            for p, t in per_path.items()) and len({frozenset(t) for t in per_path.values()}) == 1)
    return (all(k in KINDS and isinstance(p, str) and p in KINDS[k] for k, p in c.paths.items())
            and all(k in KINDS and timed(k, t) for k, t in c.timings.items())
            and all(k in EXACT_PACKED and isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= ALL_ROWS
                    for k, v in c.rows.items())
            and all(k in c.paths and isinstance(v, float) and 0 <= v <= 1 for k, v in c.busy.items()))
