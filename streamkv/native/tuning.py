"""Kernels chosen by measurement: at first start, time each candidate path at the model's real
shapes on this CPU, keep the fastest, and cache the choice.

Kinds and their paths (a kind only exists where more than one path can run):

    kind               paths            what it decides
    linear             q4 | dense | deq GGUF 4-bit layers: the 4-bit kernel, dense weights, or (bf16) both
                 | q4f                  with the dense bits: 4-bit blocks for small steps (deq_bf16.c); q4f:
                                        the 4-bit kernel's float32 fma chain (bf16, invariant numerics; its
                                        own bits), for CPUs whose bf16 dot products run at half the fma rate
    gemm               amx | avx512     dense bf16 GEMMs (the bf16 LM head and dense layers) on AMX tiles, on the
                 | fma                  vector units (vdpbf16ps), or fma: vdpbf16ps's chain on float32 fmas (the
                                        same bits but for denormals; AVX512-BF16 builds), for CPUs whose bf16
                                        dot products run at half the fma rate
    lm_head            q8 | dense | deq a Q8_0 LM head read as int8, dense, or (bf16) both with the dense
                                        bits: the int8 blocks for small steps (deq_bf16.c)
    attention          bf16 | f32 | amx invariant attention: bf16 dot products, float32, bf16 on AMX tiles, or
                 | bf16f                bf16f: the bf16 kernel's products as float32 fmas (vdpbf16ps's bits but
                                        for denormals), for CPUs whose bf16 dot products run at half the fma rate
    attention_gather   stage | direct   the bf16 attention kernels' decode items: copy a super-block's cache
                                        rows (every head) to a staging buffer first, or transpose each head's
                                        blocks straight from the pool (the same bits; measured on the decode
                                        cases before attention, whose bf16 paths are then timed on it)
    prefill_attention  native | sdpa    fast numerics: the paged prefill kernel or torch's SDPA

With the default invariant numerics one path serves every row of every step (a row's bits must
not depend on the batch), so a kind is scored over its whole range of row counts: the geometric
mean of each path's time relative to the fastest path at every shape (decode rows 1, 8 and 32,
prompt chunks of 256 rows). Near-ties do not flip: the path this machine chose last time for the
same model (any kernel build), else the kind's first path, stays unless another scores more than
``MARGIN`` lower, so a rebuild or a noisy minute does not change a machine's numerics (the LM head's
q8 and dense scored within 0-15% of each other across runs on the EPYC and took turns without this).
Float32 models are the exception: their packed 4-bit layers and int8 head give the dense
weights' bits (``native/deq_gemm.c``), so ``linear`` and ``lm_head`` are *exact* kinds there: no
single path is chosen, a step takes the packed weights when it has at most ``rows[kind]`` rows
(the largest row count, from 1 up, at which they measured faster) and the dense ones above.
bf16 models get the same through ``linear=deq`` and ``lm_head=deq`` (``native/deq_bf16.c`` rebuilds
the dense bf16 weights from the 4-bit blocks / the int8 head on the fly): each is scored as one path with ``dense`` (a step takes
whichever its row count measured faster, so the path's time at a shape is that one's), the row
threshold set as for the exact kinds, and when the dense bits win the near-tie rule is not needed
between the two (switching changes no bit): ``deq`` whenever its threshold is above 0.
``--kernels KIND=PATH,...`` forces any of them (an exact kind forced to its packed path takes it at
every row count); ``--kernels auto`` measures the rest. The choice is
cached under ``~/.cache/streamkv/kernels`` (``STREAMKV_CACHE_DIR``), keyed by the CPU model and
flags, torch's version and threads, the kernels' sources and the model's shapes; another process
starting meanwhile waits for the first one's measurement (a file lock), so all of them run the
same kernels. A cached choice that names a path which cannot run here (a damaged file) is measured
again; a cache folder that cannot be written (a read-only image) costs the cache, not the start.
A measurement watches what other processes use of its CPUs (``native/contention.py``): where they
keep more than ``contention.BUSY`` of them busy (a look before, a second look a second later, and
during the measurement), the kind is timed on one thread instead (an OpenMP team beside a busy
job times its barriers); such a choice is cached with that share
(``busy``), warned about at every start that reads it and shown by ``streamkv info``, but not
measured again by itself (a later start with other kernels would give other bits than the
processes already running): ``streamkv info --retune`` on a quiet machine does that.
Which paths can run follows the model's dtype, the KV cache's dtype (the bf16 attention kernels read
bf16 caches only) and, under fast numerics, the attention backend (``prefill_attention`` is the
native backend's). ``streamkv info`` prints the machine, the timings and the choice.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from streamkv.native import choice as choice_file
from streamkv.native.choice import ALL_ROWS, EXACT_PACKED, KINDS, SWITCHED, KernelChoice, ModelShapes
from streamkv.native.contention import contended, timed_quietly, watch
from streamkv.native.cpu import cache_dir, cpu_flags, cpu_model

log = logging.getLogger(__name__)

CACHE_VERSION = 6  # 2: the near-tie rule (MARGIN); 3: float32 models' exact kinds and their row thresholds; 4: linear=deq;
# 5: lm_head=deq; 6: measurements watch other processes' load (an older choice may have been made beside a busy job)
MARGIN = 1.10  # another path displaces the preferred one only with a score more than 10% lower


def runnable(s: ModelShapes) -> dict[str, list[str]]:
    """kind -> the paths that can run on this CPU for this model, in KINDS order (the first is the
    default when a kind is not measured); kinds that do not apply are absent."""
    from streamkv import native

    fast, amx = s.numerics == "fast", native.invariant_gemm_bf16_path() == "amx"
    fits = s.bf16 and s.kv_bf16 and s.head_dim % 16 == 0 and s.head_dim <= 128
    exact = not s.bf16 and not fast and native.deq_gemm() is not None  # float32: deq_gemm.c, the dense bits
    ok = {
        ("linear", "q4"): s.q4 and (exact or s.bf16 and (fast or native.q4_gemm() is not None)),
        ("linear", "dense"): True,
        ("linear", "deq"): s.q4 and s.bf16 and not fast and native.deq_gemm_bf16() is not None,
        ("linear", "q4f"): s.q4 and s.bf16 and not fast and native.q4_gemm() is not None,
        ("gemm", "amx"): s.bf16 and amx,
        ("gemm", "avx512"): True,
        ("gemm", "fma"): s.bf16 and native.invariant_gemm_uses_bf16_dot(),
        ("lm_head", "q8"): s.q8_head and (exact or s.bf16 and (fast or native.q8_gemm() is not None)),
        ("lm_head", "dense"): True,
        ("lm_head", "deq"): s.q8_head and s.bf16 and not fast and native.deq_gemm_bf16() is not None,
        ("attention", "bf16"): not fast and fits and native.invariant_attention_bf16() is not None,
        ("attention", "f32"): not fast,
        ("attention", "bf16f"): not fast and fits and native.invariant_attention_bf16f() is not None,
        ("attention_gather", "stage"): not fast and fits and native.invariant_attention_bf16() is not None,
        ("attention_gather", "direct"): not fast and fits and native.invariant_attention_bf16() is not None,
        ("attention", "amx"): not fast and fits and native.invariant_attention_amx() is not None,
        ("prefill_attention", "native"): fast and s.backend == "cpu" and s.bf16 and s.kv_bf16 and s.head_dim == 64
                                         and native.paged_attention() is not None,
        ("prefill_attention", "sdpa"): fast and s.backend == "cpu",
    }
    out = {k: [p for p in paths if ok[(k, p)]] for k, paths in KINDS.items()}
    return {k: v for k, v in out.items() if v}


def is_exact(s: ModelShapes, kind: str) -> bool:
    """Whether the kind's paths give the same bits here (float32 models' packed weights), so a step
    may take either by its row count."""
    return kind in EXACT_PACKED and not s.bf16 and s.numerics == "invariant"


def _measurable(s: ModelShapes, kind: str) -> bool:
    """Whether kernel_bench can time every path of the kind here (the 4-bit and int8 paths are
    timed through the native kernels only)."""
    from streamkv import native

    if kind in EXACT_PACKED and is_exact(s, kind):
        return native.deq_gemm() is not None and native.invariant_gemm() is not None
    if kind == "linear":
        return native.q4_gemm() is not None and native.invariant_gemm() is not None
    if kind == "lm_head":
        return native.q8_gemm() is not None and native.invariant_gemm() is not None
    return True


def rows_of(shape: str) -> int:
    """The row count of a measured shape's label (``decode x8`` -> 8)."""
    return int(shape.rsplit("x", 1)[1])


def crossover(times: dict[str, dict[str, float]], packed: str) -> int:
    """An exact kind's threshold: the largest row count r such that the packed path measured
    faster at every measured row count up to r (0: not even at the smallest)."""
    other = next(p for p in times if p != packed)
    rows = 0
    for shape in sorted(times[packed], key=rows_of):
        if times[packed][shape] >= times[other][shape]:
            break
        rows = rows_of(shape)
    return rows


def pick(times: dict[str, dict[str, float]], prefer: str | None = None, margin: float = MARGIN) -> str:
    """The path whose geometric mean of (time / fastest time) over the shapes is lowest; but
    ``prefer`` (when it is one of the paths) stays unless that lowest score is more than
    ``margin`` times lower than its own."""
    shapes = set.intersection(*(set(t) for t in times.values()))
    best = {sh: min(t[sh] for t in times.values()) for sh in shapes}

    def score(path: str) -> float:
        return math.exp(sum(math.log(times[path][sh] / best[sh]) for sh in shapes) / len(shapes))
    winner = min(times, key=score)
    return prefer if prefer in times and score(prefer) <= margin * score(winner) else winner


def _cache_key(s: ModelShapes, forced: dict[str, str], build: bool = True) -> str:
    """The measurement's key; without ``build``, the same key minus the kernels' sources (what
    the previous choice on this machine and model is filed under)."""
    from streamkv.native import build_tag

    key = {"v": CACHE_VERSION, "cpu": cpu_model(), "flags": cpu_flags(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "native": build_tag() if build else None, "shapes": asdict(s),
           "forced": sorted(forced.items())}
    if s.numerics == "fast":  # measured since with F.linear as their dense linears (others' keys unchanged)
        key["dense_linear"] = "torch"
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _cache_dir() -> Path:
    return cache_dir("kernels")


def choose(s: ModelShapes, forced: dict[str, str], retune: bool = False) -> KernelChoice:
    """Forced paths; then, for every kind with a choice, the cached measurement, else measure now
    (and cache it); a kind with one path takes it."""
    paths = runnable(s)
    for kind, path in forced.items():
        if path not in paths.get(kind, []):
            raise ValueError(f"kernels: {kind}={path} cannot run here (this model and CPU allow {paths})")
    todo = [k for k in order(paths) if k not in forced and len(paths[k]) > 1 and _measurable(s, k)]
    choice = _measured(s, todo, forced, retune, paths) if todo else KernelChoice()
    for kind, options in paths.items():
        if kind in forced:
            choice.paths[kind], choice.source[kind] = forced[kind], "forced"
            if forced[kind] == SWITCHED.get(kind) or is_exact(s, kind) and forced[kind] == EXACT_PACKED[kind]:
                choice.rows[kind] = ALL_ROWS
        elif kind not in choice.paths:
            choice.paths[kind], choice.source[kind] = options[0], "only path" if len(options) == 1 else "default"
    return choice


def _measured(s: ModelShapes, kinds: list[str], forced: dict[str, str], retune: bool,
              allowed: dict[str, list[str]]) -> KernelChoice:
    """The cached choice of ``kinds`` when it names paths that can run here (``allowed``), else a
    new measurement, cached. A cache directory that cannot be written (read-only, not a directory)
    costs the cache, not the start: the measurement is used without it (logged)."""
    # a forced path changes the other kinds' measurements only through gemm (their dense
    # candidates run on it), and only where gemm has a choice: any other force reads and
    # writes the unforced measurement, so forcing one kind never re-decides the others
    path = _cache_dir() / f"{_cache_key(s, _shaping(forced, allowed))}.json"
    with choice_file.lock(path.with_suffix(".lock")):  # a concurrent start waits, then reads this measurement
        cached = None if retune else choice_file.read(path)
        have = _still_valid(cached, s, kinds, allowed)
        choice = _subset(cached, have) if cached is not None else KernelChoice()
        if choice.busy:
            log.warning("the cached kernel choice %s was measured while other processes used the CPUs (%s): it may "
                        "be slow here; `streamkv info --retune` on a quiet machine measures it again", path,
                        ", ".join(f"{k} {v:.0%}" for k, v in choice.busy.items()))
        if len(have) == len(kinds):
            return choice
        if cached is not None and any(k in cached.paths for k in kinds if k not in have):
            log.warning("the cached kernel choice %s names paths that cannot run here: measuring them again", path)
        t0 = time.perf_counter()
        from streamkv.native.kernel_bench import measure

        last_path = _cache_dir() / f"last-{_cache_key(s, {}, build=False)}.json"
        last = choice_file.read(last_path)
        for kind in (k for k in kinds if k not in have):  # gemm first: the others' dense candidates use it
            choice.timings[kind], share = _watched(lambda: measure(kind, s, {**forced, **choice.paths}))
            choice.source[kind] = "measured"
            if contended(share):
                choice.busy[kind] = round(share, 3)
                log.warning("kernels: %s measured while other processes took %.0f%% of the CPUs its threads "
                            "need (timed on one thread); the choice may be slow here (`streamkv info --retune` "
                            "on a quiet machine measures it again)", kind, 100 * share)
            if is_exact(s, kind):  # same bits either way: switch by row count, no near-tie rule
                choice.rows[kind] = crossover(choice.timings[kind], EXACT_PACKED[kind])
                choice.paths[kind] = EXACT_PACKED[kind] if choice.rows[kind] else "dense"
                continue
            default = next(p for p in KINDS[kind] if p in choice.timings[kind])
            prefer = last.paths.get(kind, default) if last else default
            if prefer == SWITCHED.get(kind):  # the dense bits, whether or not this build has deq
                prefer = "dense"
            if SWITCHED.get(kind) in choice.timings[kind]:
                choice.paths[kind], rows = pick_switched(choice.timings[kind], SWITCHED[kind], prefer)
                if rows:
                    choice.rows[kind] = rows
                continue
            choice.paths[kind] = pick(choice.timings[kind], prefer=prefer)
        # a run that forced some kinds measured only the rest: the cached ones are kept, unless
        # gemm was measured now (they were timed on the old gemm choice: review)
        choice_file.write(path, _merged(None if choice.source.get("gemm") == "measured" else cached,
                             choice))
        choice_file.write(last_path, _merged(last, choice))  # the kinds not measured now keep their last choice
        log.info("kernels measured in %.1f s: %s", time.perf_counter() - t0, choice.describe())
        return choice


def _watched(run: Callable[[], dict]) -> tuple[dict, float | None]:
    """``run()``'s timings and the share of our CPUs other processes used meanwhile, on one
    thread where they keep the CPUs busy (``contention.timed_quietly``). Beside a busy job an
    OpenMP team times the scheduler: on the 2-core Xeon with two CPU-bound neighbours every
    attention candidate took 11-18 ms on two threads against 0.5-2.8 alone, and f32 won; on one
    thread amx won, as on the quiet machine."""
    threads = torch.get_num_threads()

    def one_thread() -> dict:
        torch.set_num_threads(1)
        try:
            return run()
        finally:
            torch.set_num_threads(threads)
    return timed_quietly(run, one_thread if threads > 1 else None, watcher=lambda: watch(threads))


def pick_switched(times: dict[str, dict[str, float]], switched: str, prefer: str) -> tuple[str, int]:
    """(path, row threshold) where ``switched`` (packed up to the threshold, dense above, the dense
    bits) competes with the kind's other paths. The threshold comes from ``switched`` vs ``dense`` at
    every measured shape; the paths are then scored on the shapes they all share with ``dense``
    taking the switched times (the kind's usual shapes, ``kernel_bench.ROWS``; the finer ones only
    place the threshold), and the near-tie rule runs between the two numerics (dense or switched vs
    the rest). Threshold 0: plain ``dense``."""
    from streamkv.native.kernel_bench import ROWS

    rows = crossover({switched: times[switched], "dense": times["dense"]}, switched)
    scored = {p: {sh: v for sh, v in t.items() if sh in ROWS} for p, t in times.items() if p != switched}
    scored["dense"] = {sh: times[switched][sh] if rows_of(sh) <= rows else t for sh, t in scored["dense"].items()}
    winner = pick(scored, prefer="dense" if prefer == switched else prefer)
    if winner != "dense":
        return winner, 0
    return (switched, rows) if rows else ("dense", 0)


def _shaping(forced: dict[str, str], allowed: dict[str, list[str]]) -> dict[str, str]:
    """The forced paths that change other kinds' measurements (``kernel_bench.measure``'s
    ``chosen``: gemm), where the kind has more than one path."""
    return {k: v for k, v in forced.items() if k == "gemm" and len(allowed.get(k, ())) > 1}


def _still_valid(cached: KernelChoice | None, s: ModelShapes, kinds: list[str],
                 allowed: dict[str, list[str]]) -> list[str]:
    """The ``kinds`` a cached choice still decides: each that it covers validly (a run that forced
    a kind wrote the others only, and the next start measured them all again), none where gemm
    must be measured (the others' dense candidates were timed on its choice)."""
    have = [k for k in kinds if cached is not None and _valid(cached, s, [k], allowed)]
    return [] if "gemm" in kinds and "gemm" not in have else have


def _subset(cached: KernelChoice, kinds: list[str]) -> KernelChoice:
    return KernelChoice({k: cached.paths[k] for k in kinds}, {k: cached.timings[k] for k in kinds},
                        {k: "cached" for k in kinds}, {k: v for k, v in cached.rows.items() if k in kinds},
                        {k: v for k, v in cached.busy.items() if k in kinds})


def _merged(last: KernelChoice | None, new: KernelChoice) -> KernelChoice:
    """``new``'s kinds over ``last``'s (the last-choice file of a run that measured some kinds)."""
    if last is None:
        return new
    keep = [k for k in last.paths if k not in new.paths]
    return KernelChoice({**{k: last.paths[k] for k in keep}, **new.paths},
                        {**{k: last.timings[k] for k in keep if k in last.timings}, **new.timings},
                        rows={**{k: last.rows[k] for k in keep if k in last.rows}, **new.rows},
                        busy={**{k: last.busy[k] for k in keep if k in last.busy}, **new.busy})


def _valid(choice: KernelChoice, s: ModelShapes, kinds: list[str], allowed: dict[str, list[str]]) -> bool:
    """Whether a cached choice covers ``kinds`` with paths that can run here, their timings, and
    row thresholds exactly where a kind is exact here (packed path <=> a threshold above 0)."""
    def rows_ok(k: str) -> bool:
        if choice.paths.get(k) == SWITCHED.get(k):
            return choice.rows.get(k, 0) > 0
        if not is_exact(s, k):
            return k not in choice.rows
        return k in choice.rows and (choice.rows[k] > 0) == (choice.paths[k] == EXACT_PACKED[k])
    return all(choice.paths.get(k) in allowed.get(k, ()) and k in choice.timings and rows_ok(k) for k in kinds)


def order(kinds: dict) -> list[str]:
    """Measurement order: gemm before the kinds whose dense candidate runs on it."""
    return sorted(kinds, key=lambda k: (k != "gemm", list(KINDS).index(k)))

