"""transformers' own GGUF loading (the oracle of the embedded-model tests), without its repeated work.

transformers parses a GGUF file's metadata once for the config and again for the weights (or the
tokenizer), and rebuilds gguf's ``TensorNameMap`` once per tensor (397 times for the embedded
model): ~12 of the ~18 s its load takes on a 2-core CPU. Both are pure functions of their
arguments (a read-only file, an architecture and a layer count), so while ``cached_gguf()`` is
active each is computed once per argument; what transformers builds from them is unchanged.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock


@functools.lru_cache(maxsize=4)
def _reader(path: str) -> Any:
    from gguf.gguf_reader import GGUFReader  # the class itself, never the patched name

    return GGUFReader(path)


@contextlib.contextmanager
def cached_gguf() -> Iterator[None]:
    import gguf

    name_map = functools.lru_cache(maxsize=8)(gguf.get_tensor_name_map)

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        assert mode == "r", mode  # shared readers are only safe read-only
        return _reader(os.fspath(path))

    with mock.patch.object(gguf, "get_tensor_name_map", name_map), mock.patch.object(gguf, "GGUFReader", reader):
        yield


def model(path: str, dtype: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` of a GGUF file, in eval mode."""
    import transformers

    with cached_gguf():
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype).eval()


def tokenizer(path: str) -> Any:
    """``AutoTokenizer.from_pretrained`` of a GGUF file."""
    import transformers

    with cached_gguf():
        return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
