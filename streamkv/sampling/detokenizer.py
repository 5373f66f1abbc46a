"""Incremental detokenization with stop strings held back until they cannot match."""
from __future__ import annotations

import codecs
from typing import Protocol


class _TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


class IncrementalDetokenizer:
    """Turns a token stream into text, exact for multi-byte characters split across tokens.

    Bytes go through an incremental UTF-8 decoder, so a character is emitted only once all
    of its bytes have arrived. ``text`` is the output so far (cut at a stop string);
    :meth:`take_delta` returns the part that is safe to stream: it withholds the longest
    tail of ``text`` that is a proper prefix of a stop string (it may still become one).
    """

    def __init__(self, tokenizer: _TokenBytes, stop: tuple[str, ...] = (), include_stop: bool = False) -> None:
        self._tok = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = stop
        self.include_stop = include_stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped = False
        self.matched_stop: str | None = None

    def add(self, token_id: int) -> bool:
        """Append one token; True if a stop string completed (``text`` is then final)."""
        if self.stopped:
            return True
        before = len(self.text)
        self.text += self._decoder.decode(self._tok.token_bytes(token_id))
        return self._check_stop(before)

    def finish(self) -> None:
        """Flush an incomplete trailing character (as U+FFFD) at end of stream."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        self._hold = 0

    def _check_stop(self, before: int) -> bool:
        if not self.stop:
            return False
        from_ = max(0, before - self._hold)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, from_)) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self.matched_stop = s
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stopped = True
        self._hold = 0
        return True

    def _pending_stop_prefix(self) -> int:
        if not self._hold:
            return 0
        tail = self.text[-self._hold:]
        return max((k for s in self.stop for k in range(min(len(s) - 1, len(tail)), 0, -1)
                    if tail.endswith(s[:k])), default=0)

    def take_delta(self) -> str:
        """New text that can no longer change."""
        safe = len(self.text) - (0 if self.stopped else self._pending_stop_prefix())
        if safe <= self._emitted:
            return ""
        delta = self.text[self._emitted:safe]
        self._emitted = safe
        return delta
