"""Preemption cost profile: prefill time T(tokens) and swap time C(blocks), measured per machine.

``streamkv profile`` measures and caches it; an engine with ``--preemption cost`` and swap
space loads the cached profile or makes a quick one at first start. Cached under
``~/.cache/streamkv/profiles`` keyed by CPU, device, model, dtype, KV cache dtype, threads,
block size and the largest sizes the pool, the swap space and max_model_len let it time
(``profile_key``), so a narrow or differently typed measurement never replaces another's.
A profile measured while other processes took more than ``contention.BUSY`` of the CPUs the
engine's threads need is used by this process but not cached: it times the load, and since
swap and recompute give the same bits, the next start can measure it again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from streamkv.native.contention import contended, watch
from streamkv.native.cpu import cache_dir
from streamkv.sampling.params import SamplingParams
from streamkv.sched.plan import ScheduledSeq, StepPlan
from streamkv.sched.preemption import CostProfile

log = logging.getLogger(__name__)
FULL = {"prefill": (16, 64, 256, 1024), "swap": (1, 8, 64)}
QUICK = {"prefill": (16, 256), "swap": (1, 16)}
_MAX_PREFILL = max(FULL["prefill"] + QUICK["prefill"])  # past these every size fits: one profile
MAX_SWAP = max(FULL["swap"] + QUICK["swap"])
BESIDE_LOAD = "measured beside other load, not cached"  # a profile's source when load_or_measure did not cache it


def profile_key(engine: Any) -> str:
    """The cache key of ``engine``'s profile: what the timings depend on (machine, device, model,
    dtypes, threads, numerics) and the largest sizes ``measure()`` can time in it (``limits()``,
    capped where every size fits), so that identical configs share one profile and a small pool,
    swap space or max_model_len gets its own."""
    from streamkv.native.cpu import cpu_flags, cpu_model

    cfg = engine.config
    kv_dtype, device = _kv_cache(engine)
    prefill, swap = limits(engine, free=False)
    # the model by its file (a name alone: two checkpoints in folders of one name shared a
    # profile) and its KV block's bytes (what a swap moves); the kernels that run the prefill
    rt = cfg.runtime
    raw = json.dumps([cpu_model(), cpu_flags(), torch.__version__, engine.bundle.model_name, _model_file(cfg.model.model),
                      str(engine.bundle.dtype), engine.kv_ops.bytes_per_block, cfg.model.decode_weights,
                      torch.get_num_threads(), cfg.cache.block_size, rt.numerics, rt.attention_backend, rt.kernels,
                      kv_dtype, device, min(prefill, _MAX_PREFILL), min(swap, MAX_SWAP)])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _model_file(path: str | None) -> list[Any] | None:
    """``[absolute path, bytes, mtime]`` of a model file or folder (None: the embedded model)."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return [os.path.abspath(path)]
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def limits(engine: Any, free: bool = True) -> tuple[int, int]:
    """``(tokens, blocks)``: the longest prefill and the largest swap ``measure()`` can time, in
    the pool's free blocks (``free``) or all of them, the context and the swap space."""
    pool = engine.pool
    blocks = pool.num_free if free else pool.num_blocks
    host_k = getattr(engine.kv_ops, "host_k", None)
    host = host_k.shape[1] // pool.block_size if host_k is not None else 0
    return min(blocks * pool.block_size, engine.max_model_len - 1), min(blocks, host)


def make_room(engine: Any) -> None:
    """Give ``engine`` host swap room for the largest swap a profile times (``MAX_SWAP`` blocks,
    whatever a block's size), so that ``streamkv profile`` without ``--swap-space`` files its
    profile under the key of an engine with ample swap space (a fixed 64 MiB held 32 blocks of
    Llama-3-8B's bf16 KV, or 22 of a float32 cache in 64-token blocks: another key)."""
    if limits(engine, free=False)[1] < MAX_SWAP:
        engine.kv_ops.attach_host(MAX_SWAP)


def _kv_cache(engine: Any) -> tuple[str, str]:
    """The dtype and device of the KV cache the engine allocated (swap copies it; attention reads
    it): the config's ``kv_cache_dtype`` resolved, not the raw "auto"."""
    cache = getattr(engine.kv_ops, "cache", None)
    k = getattr(cache, "k", None)
    if isinstance(k, torch.Tensor):
        dtype, device = k.dtype, k.device
    else:  # a runner without a tensor cache: what build_bundle would allocate
        from streamkv.engine.factory import kv_dtype

        dtype, device = kv_dtype(engine.config, engine.bundle.dtype), torch.device(engine.config.runtime.device)
    name = str(device)
    if device.type == "cuda":
        name += " " + torch.cuda.get_device_name(device)
    return str(dtype), name


def profile_path(engine: Any) -> Path:
    return cache_dir("profiles") / f"{profile_key(engine)}.json"


def load_or_measure(engine: Any, remeasure: bool = False, quick: bool = True) -> CostProfile:
    path = profile_path(engine)
    if path.exists() and not remeasure:
        try:
            return CostProfile.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
            log.warning("ignoring an unreadable or corrupt cost profile at %s", path)
    with watch(torch.get_num_threads()) as load:
        profile = measure(engine, QUICK if quick else FULL)
    if contended(load.others):
        log.warning("preemption cost profile measured while other processes took %.0f%% of the CPUs its threads "
                    "need: used now, not cached (the next start measures it again)", 100 * load.others)
        return dataclasses.replace(profile, source=BESIDE_LOAD)
    try:  # an unwritable cache costs a re-measure at the next start, never this start
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(profile.to_dict(), indent=1))
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot cache the preemption cost profile at %s: %s", path, exc)
        with contextlib.suppress(OSError):
            path.with_suffix(".tmp").unlink(missing_ok=True)
    log.info("preemption cost profile (%s): %s", path, profile.to_dict())
    return profile


def measure(engine: Any, sizes: dict[str, tuple[int, ...]] = FULL, repeats: int = 2) -> CostProfile:
    """Time prefill of n tokens on fresh blocks, and swapping n blocks out and in (best of ``repeats``)."""
    pool, kv_ops = engine.pool, engine.kv_ops
    usable = limits(engine)[1]
    if usable < 2:
        raise ValueError(f"the preemption cost profile swaps 2 blocks at least, but the swap space or the pool has "
                         f"room for {usable}: raise swap_space or num_blocks, or choose preemption swap or recompute")
    prefill = measure_prefill(engine, sizes["prefill"], repeats)
    swap_out, swap_in = [], []
    for n in fitting(sizes["swap"], usable):
        dev = pool.allocate(n)
        try:
            pairs = list(zip(dev, range(n)))
            swap_out.append((n, _best(repeats, lambda: kv_ops.swap(pairs, ()))))
            swap_in.append((n, _best(repeats, lambda: kv_ops.swap((), [(h, d) for d, h in pairs]))))
        finally:
            pool.release(dev)
    kv_ops.swap_bytes = 0
    return CostProfile(tuple(prefill), tuple(swap_out), tuple(swap_in))


def measure_prefill(engine: Any, sizes: tuple[int, ...], repeats: int = 2) -> list[tuple[int, float]]:
    """``[(n, seconds)]``: one prefill step of ``n`` fresh tokens, best of ``repeats``, for each
    size that fits the pool and the context (``fitting()``: two at least)."""
    runner, pool = engine.bundle.runner, engine.pool
    limit = limits(engine)[0]
    if limit < 2:
        raise ValueError(f"the preemption cost profile times prefills of 2 tokens at least, but max_model_len "
                         f"{engine.max_model_len} (and {pool.num_free} free blocks of {pool.block_size} tokens) "
                         f"leaves room for {limit}: raise max_model_len to 3 at least, or choose preemption "
                         f"swap or recompute")
    return [(n, _best(repeats, lambda n=n: _prefill(runner, pool, n))) for n in fitting(sizes, limit)]


def fitting(sizes: tuple[int, ...], limit: int) -> list[int]:
    """The sizes up to ``limit``, ascending; where fewer than two fit, ``limit`` joins them (and
    ``limit // 2`` if still alone), so a small pool or swap space still gets a line of two points."""
    fit = {n for n in sizes if n <= limit}
    if len(fit) < 2 and limit >= 2:
        fit |= {limit} if fit - {limit} else {limit // 2, limit}
    return sorted(fit)


def _prefill(runner: Any, pool: Any, n: int) -> None:
    blocks = pool.allocate(-(-n // pool.block_size))
    try:
        item = ScheduledSeq(seq_id=-1, start=0, token_ids=tuple(range(1, n + 1)), block_table=tuple(blocks),
                            sample=True, params=SamplingParams(max_tokens=1, temperature=0.0),
                            history=tuple(range(1, n + 1)), num_prompt=n)
        runner.execute(StepPlan((item,)))
        runner.execute(StepPlan((), released=(-1,)))
    finally:
        pool.release(blocks)


def _best(repeats: int, fn: Any) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
