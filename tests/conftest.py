"""Shared fixtures: the embedded model (loaded once per session) and fake-runner engines."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(min(2, os.cpu_count() or 1))
# The suite's kernel choices, native builds and preemption cost profiles live in a cache of their
# own (processes it starts inherit it): a measurement made beside the suite's own load (servers,
# Ray replicas) must not become what `make serve` or a benchmark on this machine runs.
os.environ.setdefault("STREAMKV_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "streamkv-tests"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def embedded_checkpoint_read_once():
    """Engines built in this process read the embedded model's GGUF once per dtype.

    About 70 tests build an engine of the embedded model, each of which read, parsed and
    dequantized the same file (~1 s of a ~2 s build on a 2-vCPU AMD EPYC Zen 3). Loading
    returns fresh, never-mutated tensors and an immutable tokenizer, so engines may share one
    :class:`LoadedCheckpoint`: the model, kernels, KV cache and runner are still built per
    engine. Only ``streamkv.loading.load_checkpoint`` as ``build_bundle`` finds it is wrapped,
    and only for the default model without a progress bar; ``tests/test_loading.py`` imported
    the real function before this runs and checks loading itself."""
    import streamkv.loading as loading

    real = loading.load_checkpoint
    default = loading.default_model_path()
    kept: dict = {}

    def load_checkpoint(path=None, dtype=torch.float32, *, show_progress=False):
        if show_progress or (path is not None and os.path.realpath(os.fspath(path)) != os.path.realpath(default)):
            return real(path, dtype, show_progress=show_progress)
        if dtype not in kept:
            kept[dtype] = real(None, dtype)
        return kept[dtype]

    loading.load_checkpoint = load_checkpoint
    yield kept
    loading.load_checkpoint = real


@pytest.fixture(scope="session")
def smol_fp32():
    """The embedded SmolLM2-135M-Instruct in float32 (the exactness reference)."""
    from streamkv import LLM

    return LLM(dtype="float32")


@pytest.fixture(scope="session")
def smol_path() -> str:
    from streamkv.loading import default_model_path

    return default_model_path()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (torch, transformers, hypothesis, every test module: the
    objects of the whole run's imports), as ``streamkv serve`` freezes its loaded heap. Every
    engine build runs a full collection (``loading/heap.py``: dropped engines' cycles), and
    each one traversed all of it: 0.42 s per build in a one-test process, 18 builds in 7.5 s
    of a 17 s test (AMD EPYC Zen 3); frozen, that test takes 8.7 s. Objects made later,
    fixtures and engines included, are collected as usual."""
    from streamkv.loading.heap import freeze_loaded_heap

    freeze_loaded_heap()
