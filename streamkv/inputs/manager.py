"""Open streaming-input requests of one engine (all calls on the engine thread).

Each change re-tokenizes the whole input and keeps the longest common prefix (LCP) of the
new ids and the ids the sequence holds; everything after it is invalidated::

    held     [ t0 t1 t2 t3 t4 | t5 t6 ]      num_computed = 5 (t5 t6 not computed yet)
    new      [ t0 t1 t2 u3 u4 u5 u6 u7 ]     LCP = 3
    after    [ t0 t1 t2 | u3 u4 u5 u6 u7 ]   2 computed rows invalidated (t3 t4), KV past 3 freed

An append whose text changes the tokenization of the previous tail is the same case. The
last token stays uncomputed until ``finish`` (``Sequence.partial``), so the output after
finish is the fresh request's on the final prompt, bit for bit.

KV policies (``kv_write`` / ``kv_read``, or the server defaults) are checked at open and
take effect at finish, once the prompt is final: the prompt is prefilled exactly until then.
A write policy that scores the prompt needs the queries of its last ``observation_tokens``
rows, so finish recomputes those rows (at most ``observation_tokens``) if they were already
computed; the compressed KV and the answer are then the fresh request's, bit for bit.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from streamkv.errors import InputStreamClosedError, InputStreamNotFoundError, InvalidRequestError, QueueFullError
from streamkv.inputs.source import ChatSource, InputSource, make_source
from streamkv.policies.read import ReadPolicy
from streamkv.policies.write import WritePolicy
from streamkv.sampling.params import SamplingParams, prompt_seed
from streamkv.sched.sequence import Sequence, SeqStatus

if TYPE_CHECKING:
    from streamkv.ops.core import EngineCore

_CLOSED_MEMORY = 4096  # finished/aborted ids remembered, so late appends get 409, not 404


@dataclass
class InputStream:
    """One streaming-input request while its input is open."""

    request_id: str
    seq: Sequence
    source: InputSource
    text: str
    last_activity: float
    computed_at_finish: int = 0
    appends: int = 0
    updates: int = 0
    write: WritePolicy | None = None  # applied at finish
    read: ReadPolicy | None = None
    fit_max_tokens: bool = False  # the input must leave room for all of params.max_tokens (HTTP's rule)

    @property
    def is_chat(self) -> bool:
        return isinstance(self.source, ChatSource)

    @property
    def tokens_invalidated(self) -> int:
        return self.seq.tokens_invalidated

    def info(self) -> dict[str, int]:
        return {"tokens": len(self.seq.tokens), "computed": self.seq.num_computed,
                "tokens_invalidated": self.tokens_invalidated}


@dataclass
class InputStats:
    opened: int = 0
    finished: int = 0
    expired: int = 0
    appends: int = 0
    updates: int = 0
    tokens_invalidated: int = 0


class InputStreams:
    """open / append / update / finish of streaming-input requests on one engine."""

    def __init__(self, engine: "EngineCore") -> None:
        self.engine = engine
        self.config = engine.config.inputs
        self._open: dict[str, InputStream] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()
        self.stats = InputStats()

    # --------------------------------------------------------------- operations
    def open(self, request_id: str, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
             params: SamplingParams | None = None, priority: int = 0, kv_write: Any = None,
             kv_read: Any = None, fit_max_tokens: bool = False) -> InputStream:
        """Queue a request whose input is still arriving; it prefills what it has. ``kv_write``
        / ``kv_read``: its KV policies (None: the server defaults), applied at finish.
        ``fit_max_tokens``: input that leaves less than ``params.max_tokens`` of the context is
        refused, as ``/v1/completions`` refuses such a prompt (False: the answer stops at the
        context, as ``Engine.add_request``'s does)."""
        self._reap()
        if len(self._open) >= self.config.max_input_streams:
            raise QueueFullError(f"{len(self._open)} input streams are open (limit "
                                 f"{self.config.max_input_streams})", 1.0)
        write, read = self.engine.kv_policies.resolve(kv_write, kv_read)
        source = make_source(prompt, messages, self.engine.tokenizer)
        fit = (params or SamplingParams()).max_tokens if fit_max_tokens else 0
        ids = self._ids(source, source.initial_text, final=False, fit=fit)
        seq = self.engine.add_request(request_id, ids, params, priority, partial=True)
        assert seq is not None  # partial requests never hit the response cache
        stream = InputStream(request_id, seq, source, source.initial_text, time.monotonic(), write=write, read=read,
                             fit_max_tokens=fit_max_tokens)
        self._open[request_id] = stream
        self.stats.opened += 1
        return stream

    def append(self, request_id: str, text: str) -> InputStream:
        stream = self._touched(request_id)
        self._set_text(stream, stream.text + _text(text), final=False, events=("input_appended",))
        stream.appends += 1
        self.stats.appends += 1
        return stream

    def update(self, request_id: str, text: str) -> tuple[InputStream, int, int]:
        """Replace the whole text; returns ``(stream, lcp, invalidated)``."""
        stream = self._touched(request_id)
        lcp, dropped = self._set_text(stream, _text(text), final=False, events=("input_updated",))
        stream.updates += 1
        self.stats.updates += 1
        return stream, lcp, dropped

    def finish(self, request_id: str, text: str | None = None) -> InputStream:
        """Complete the input: the template's closing tokens are added and generation starts.
        ``text``: a last piece, appended only together with the finish (refused, neither
        happens: a client retrying the same call must not get the piece twice)."""
        stream = self._touched(request_id)
        computed = stream.seq.num_computed
        self._set_text(stream, stream.text + _text(text) if text else stream.text, final=True,
                       events=("input_appended", "input_finished") if text else ("input_finished",))
        stream.computed_at_finish = computed
        if text:
            stream.appends += 1
            self.stats.appends += 1
        seq = stream.seq
        seq.write, seq.read, seq.read_from = stream.write, stream.read, len(seq.tokens)  # the answer's rows
        if self.engine.config.cache.seed_from_prompt and seq.params.seed is None and not seq.params.greedy:
            seq.params = replace(seq.params, seed=prompt_seed(seq.tokens))  # as a plain request's, now final
        seq.partial = False
        self._close(stream, "finished")
        self.stats.finished += 1
        return stream

    def get(self, request_id: str) -> InputStream:
        stream = self._open.get(request_id) if isinstance(request_id, str) else None
        if stream is not None and stream.seq.status is SeqStatus.FINISHED:  # aborted or failed
            self._close(stream, stream.seq.finish_reason or "aborted")
            stream = None
        if stream is None:
            state = self._closed.get(request_id) if isinstance(request_id, str) else None
            if state is not None:
                raise InputStreamClosedError(f"input stream {request_id!r} is closed ({state}); "
                                             f"it takes no more input")
            raise InputStreamNotFoundError(f"input stream {request_id!r} does not exist")
        return stream

    def _touched(self, request_id: str) -> InputStream:
        """The open stream a change is for: any change, refused ones too, shows the client is
        still there (reading its state does not: a stream only polled is abandoned)."""
        stream = self.get(request_id)
        stream.last_activity = time.monotonic()
        return stream

    def get_state(self, request_id: str) -> str | None:
        """``"open"``, the closed state (``"finished"``, ``"expired"``, ...) or None if unknown."""
        return "open" if request_id in self._open else self._closed.get(request_id)

    # -------------------------------------------------------------- housekeeping
    def maintain(self, now: float | None = None) -> list[str]:
        """Abort inputs idle longer than the TTL; returns their ids."""
        now = time.monotonic() if now is None else now
        self._reap()
        ttl = self.config.input_stream_ttl_s
        expired = [s for s in self._open.values() if now - s.last_activity > ttl]
        for stream in expired:
            self._close(stream, "expired")
            self.engine.abort(stream.request_id)
            self.stats.expired += 1
        return [s.request_id for s in expired]

    def num_idle(self) -> int:
        """Open inputs with nothing to compute until more input arrives (the loop may sleep).
        An aborted one not reaped yet is not counted: its request is gone, so counting it
        hid another request's work from ``Engine.has_unfinished`` (review)."""
        return sum(1 for s in self._open.values() if not s.seq.finished and not s.seq.has_work)

    @property
    def num_open(self) -> int:
        return len(self._open)

    # ------------------------------------------------------------------ helpers
    def _set_text(self, stream: InputStream, text: str, final: bool, events: tuple[str, ...]) -> tuple[int, int]:
        """Re-tokenize, keep the LCP, invalidate the rest, record ``events``; on error nothing changes."""
        ids = self._ids(stream.source, text, final, stream, stream.seq.params.max_tokens if stream.fit_max_tokens else 0)
        seq, ops = stream.seq, self.engine.seq_ops
        lcp = _common_prefix(seq.tokens, ids)
        # the last token is always recomputed (its logits give the first output token), as
        # for a fresh request, whose prefix-cache hit never covers its last token either
        keep = min(lcp, max(0, len(ids) - 1))
        cut = keep if not final or stream.write is None else min(keep, stream.write.observed_from(len(ids)))
        before = seq.num_computed
        dropped = ops.truncate(seq, cut)
        ops.append(seq, ids[cut:])
        dropped -= min(before, keep) - min(before, cut)  # rows recomputed for the write policy: not invalidated
        now = time.perf_counter()
        stream.text, stream.last_activity = text, time.monotonic()
        seq.tokens_invalidated += dropped
        self.stats.tokens_invalidated += dropped
        seq.last_input = now
        for name in events:
            seq.event(name, now)
        return lcp, dropped

    def _ids(self, source: InputSource, text: str, final: bool, stream: InputStream | None = None,
             fit: int = 0) -> list[int]:
        """Token ids of the rendered input, checked against the context (leaving room for
        ``fit`` generated tokens, at least one) and the KV pool (at finish, with the stream's
        write policy applied)."""
        rendered = source.render(text, final)
        ids = self.engine.tokenizer.encode(rendered, add_special_tokens=True) if rendered else []
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(f"the input would have {len(ids)} tokens but the context is {limit} "
                                      f"tokens (leave room for at least one generated token); "
                                      f"the stream keeps its earlier input")
        if len(ids) + fit > limit:
            raise InvalidRequestError(f"the input would have {len(ids)} tokens and the request asks for {fit} "
                                      f"completion tokens ({len(ids) + fit} in all) but the context is {limit} "
                                      f"tokens; the stream keeps its earlier input")
        kv = self.engine.kv
        if kv.blocks_for(len(ids) + 1) > self.engine.pool.num_blocks:
            raise InvalidRequestError(f"the input would have {len(ids)} tokens but the KV cache holds only "
                                      f"{self.engine.pool.num_blocks * kv.block_size}; the stream keeps its "
                                      f"earlier input")
        if final and not ids:
            raise InvalidRequestError("the input is empty; append text before finishing")
        if final and stream is not None:
            self.engine.check_write_fits(len(ids), stream.seq.params.max_tokens, stream.write)
        return ids

    def _close(self, stream: InputStream, state: str) -> None:
        self._open.pop(stream.request_id, None)
        self._closed[stream.request_id] = state
        while len(self._closed) > _CLOSED_MEMORY:
            self._closed.popitem(last=False)

    def _reap(self) -> None:
        for stream in [s for s in self._open.values() if s.seq.status is SeqStatus.FINISHED]:
            self._close(stream, stream.seq.finish_reason or "aborted")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _text(text: Any) -> str:
    if not isinstance(text, str):
        raise InvalidRequestError(f"text must be a string, got {type(text).__name__}")
    return text
