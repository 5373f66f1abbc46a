"""Typed errors raised at streamkv's user-facing boundaries."""
from __future__ import annotations


class StreamKVError(Exception):
    """Base class of every error streamkv raises on purpose."""


class ModelLoadError(StreamKVError, ValueError):
    """The model path is missing, corrupt, or names an unsupported format."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture has no registered implementation."""


class InvalidRequestError(StreamKVError, ValueError):
    """A request (prompt or sampling parameters) is invalid; nothing was scheduled. ``param``:
    the request field at fault, when one is (the HTTP error body's ``param``)."""

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class KVCacheFullError(InvalidRequestError):
    """No free KV block for a copy-on-write fork right now (retry later); nothing changed."""


class EngineDeadError(StreamKVError, RuntimeError):
    """The engine loop stopped and cannot serve requests any more."""


class SessionNotFoundError(StreamKVError, KeyError):
    """No session has this id (never created, deleted, or not restored)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "session not found"


class SessionExistsError(StreamKVError):
    """A session with this id already exists (live here, or stored in the shared session dir)."""


class SessionMovedError(StreamKVError):
    """This replica released the session moments ago (a migration): retry, the cluster routes
    the retry to the new owner. Nothing of the request was applied."""


class QueueFullError(StreamKVError):
    """A session's ingestion queue is full and its overflow policy is ``reject`` (or ``block``
    timed out); nothing from the push was accepted."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class InputStreamNotFoundError(StreamKVError, KeyError):
    """No open streaming-input request has this id (never opened, or expired)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "input stream not found"


class InputStreamClosedError(StreamKVError):
    """The streaming-input request's input is finished (or it was aborted): no more changes."""


def is_int_in(value: object, lo: int, hi: int | None = None) -> bool:
    """An int (not a bool, a float or NaN) in ``[lo, hi]`` (no upper bound when ``hi`` is None)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)


def check_unicode(text: str, what: str = "text") -> None:
    """InvalidRequestError if ``text`` is not valid Unicode (JSON can carry lone surrogates, e.g.
    ``"\\ud800"``, which no tokenizer or grammar can take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{what} is not valid Unicode: a lone surrogate at character {exc.start}") from None
