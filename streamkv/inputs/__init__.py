"""Streaming input: requests whose prompt grows (append) or changes (update) while it is
prefilled, on the engine's one sequence model (an ordinary ``Sequence`` with ``partial``
set, changed through :class:`streamkv.ops.SeqOps` ``truncate``/``append``)."""
from __future__ import annotations

from streamkv.inputs.manager import InputStream, InputStreams
from streamkv.inputs.source import ChatSource, InputSource, PromptSource, make_source

__all__ = ["ChatSource", "InputSource", "InputStream", "InputStreams", "PromptSource", "make_source"]
