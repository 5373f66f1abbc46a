"""In-process handle of one streaming-input request (``LLM.open_input``)."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from streamkv.errors import InvalidRequestError, KVCacheFullError, is_int_in

if TYPE_CHECKING:
    from streamkv.ops.core import EngineCore


STALL_STEPS = 100  # advance() gives up after this many steps in a row without progress


class InputHandle:
    """``append`` / ``update`` / ``finish`` / ``result`` on a synchronous engine.

    Nothing runs in the background here: :meth:`advance` (or ``LLM.step``) runs engine
    steps so the arrived input is prefilled while more is coming. The engine keeps the
    final output for :meth:`result` (``Engine.keep_output``), whoever steps it meanwhile.
    :meth:`abort` gives the request up; so does dropping the handle (its KV, its place among
    ``max_input_streams`` and its kept output go back at the next step). ``input_stream_ttl_s``
    is the server's (its loop expires streams no client changed): in-process, the handle's owner
    may be busy in another engine call for any time, so nothing expires its input.
    """

    def __init__(self, engine: "EngineCore", request_id: str) -> None:
        self._engine = engine
        self.request_id = request_id
        self._output: Any = None
        self._aborted = False
        self._release = weakref.finalize(self, engine.drop_output, request_id)
        self._release.atexit = False

    def append(self, text: str) -> dict[str, int]:
        """Add ``text`` at the end; returns ``{"tokens": N, "computed": M}``."""
        s = self._engine.inputs.append(self.request_id, text)
        return {"tokens": len(s.seq.tokens), "computed": s.seq.num_computed}

    def update(self, text: str) -> dict[str, int]:
        """Replace the whole text; returns ``{"tokens": N, "lcp": K, "invalidated": J}``."""
        s, lcp, dropped = self._engine.inputs.update(self.request_id, text)
        return {"tokens": len(s.seq.tokens), "lcp": lcp, "invalidated": dropped}

    def advance(self, max_steps: int = 1 << 30) -> int:
        """Run engine steps until every arrived token has KV (or ``max_steps``); returns steps run.
        Raises KVCacheFullError when STALL_STEPS steps in a row computed none of it (the pool is
        held by others: open inputs rank above nobody; ``result()`` still gets its turn)."""
        if not is_int_in(max_steps, 0):
            raise InvalidRequestError(f"max_steps must be an integer >= 0, got {max_steps!r}")
        seq = self._engine.inputs.get(self.request_id).seq
        steps = stalled = 0
        while steps < max_steps and seq.num_computed < seq.computable and not seq.finished:
            before = seq.num_computed
            self._engine.step()
            steps += 1
            stalled = stalled + 1 if seq.num_computed == before else 0
            if stalled >= STALL_STEPS:
                raise KVCacheFullError(f"input {self.request_id!r}: no KV block for {STALL_STEPS} steps "
                                       f"({seq.num_computed} of {seq.computable} tokens computed); it stays open")
        return steps

    def finish(self) -> None:
        """The input is complete: generation starts at the next step."""
        self._engine.inputs.finish(self.request_id)

    def abort(self) -> None:
        """Give the request up, open or answering: it ends at the next step ("abort") and its
        KV goes back. :meth:`result` then raises."""
        self._aborted = True
        self._release()

    def result(self) -> Any:
        """Finish (if still open) and run to completion; the request's final RequestOutput."""
        if self._aborted and self._output is None:
            raise InvalidRequestError(f"input {self.request_id!r} was aborted")
        if self._output is None:
            try:
                self.finish()
            except Exception:
                if self._engine.inputs.get_state(self.request_id) != "finished":
                    raise
            self._output = self._engine.run_to_completion([self.request_id])[self.request_id]
            self._release.detach()  # answered and its output taken: nothing to release (the id must not be aborted later)
        return self._output
