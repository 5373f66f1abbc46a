"""Structured outputs: token masks from xgrammar (the grammar engine vLLM and SGLang use).

::

    request --> GuidedSpec (json | regex | choice | grammar)     hashable, tensor-free: rides in
                                                                 SamplingParams through the plan
    Grammars.compile(spec) --> xgrammar CompiledGrammar          per spec, cached (LRU)
    Sampler, each step:  matcher of each guided row, fed the row's output tokens so far
                         --> one bitmask [rows, ceil(V / 32)] --> logits = -inf where masked

A matcher is a pure function of (spec, output tokens): the sampler replays whatever output a
row has that its matcher has not seen (a recompute after preemption, a swap, a new runner
state) and starts over if the output shrank, so nothing else needs to know about grammars.
Masking only removes tokens; among the allowed ones the usual sampling runs unchanged, so a
greedy guided row picks the best allowed token and every other row in the batch is untouched.
"""
from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from threading import Lock
from typing import Any, Protocol

from streamkv.errors import InvalidRequestError, check_unicode

KINDS = ("json", "regex", "choice", "grammar", "tool_call")
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
MAX_SPEC_CHARS = 1 << 20


@dataclass(frozen=True)
class GuidedSpec:
    """What a guided row's output must match.

    ``json``: ``value`` is a JSON schema serialized (its key order kept), or ``""`` for any
    JSON object; ``regex``: the pattern; ``choice``: a JSON list of the allowed strings;
    ``grammar``: an EBNF grammar (xgrammar's dialect, GBNF-like, ``root`` rule);
    ``tool_call``: ``<tool_call>`` + JSON valid against the schema ``value`` + ``</tool_call>``
    (a forced tool call, ``streamkv.server.tools``).
    """

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"guided decoding kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str) or len(self.value) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"the {self.kind} constraint must be a string of at most {MAX_SPEC_CHARS} characters")
        if self.kind in ("regex", "grammar", "choice", "tool_call") and not self.value:
            raise InvalidRequestError(f"the {self.kind} constraint is empty")
        check_unicode(self.value, f"the {self.kind} constraint")

    @classmethod
    def json_schema(cls, schema: Any) -> GuidedSpec:
        """From a schema (a dict, or its JSON text); ``None``: any JSON object."""
        if schema is None:
            return cls("json", "")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema, ensure_ascii=False))  # key order kept: it is the field order

    @classmethod
    def choice(cls, options: Any) -> GuidedSpec:
        if not isinstance(options, (list, tuple)) or not options or \
                not all(isinstance(o, str) and o for o in options):
            raise InvalidRequestError("guided_choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}


class _Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def token_bytes(self, token_id: int) -> bytes: ...


class Grammars:
    """Compiles specs for one tokenizer and vocabulary (``vocab_size`` = the logits' width);
    the compiled grammars are cached, ``capacity`` of them. Thread-safe: request handlers
    compile (and so validate) before submitting; the sampler then finds them cached."""

    def __init__(self, tokenizer: _Tokenizer, vocab_size: int, capacity: int = 256) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._capacity = capacity
        self._compiled: OrderedDict[GuidedSpec, Any] = OrderedDict()
        self._lock = Lock()
        self._compiler: Any = None

    @staticmethod
    def xgrammar() -> Any:
        try:
            import xgrammar
        except ImportError:  # pragma: no cover - the dev extras install it
            raise InvalidRequestError("structured outputs need the xgrammar package (make install installs it; "
                                      "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi)") from None
        return xgrammar

    def _make_compiler(self) -> Any:
        xgr = self.xgrammar()
        n = self.vocab_size
        vocab = [self._tokenizer.token_bytes(i) for i in range(n)]  # b"" = special: never allowed mid-output
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=n,
                                 stop_token_ids=[t for t in self._tokenizer.eos_token_ids if t < n])
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: GuidedSpec) -> Any:
        """The compiled grammar of ``spec``; InvalidRequestError naming the problem."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
            if self._compiler is None:
                self._compiler = self._make_compiler()
            try:
                compiled = self._compile(spec)
            except (RuntimeError, ValueError, TypeError) as exc:
                msg = _XGR_PREFIX.sub("", str(exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise InvalidRequestError(f"invalid {_NAMES[spec.kind]}: {msg}") from None
            self._compiled[spec] = compiled
            if len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
            return compiled

    def _compile(self, spec: GuidedSpec) -> Any:
        c = self._compiler
        if spec.kind == "json":
            # compact JSON (no free whitespace: small models otherwise drift into blank lines); the
            # empty spec (json_object) is any JSON object
            return c.compile_json_schema(spec.value or '{"type": "object"}', any_whitespace=False, strict_mode=True)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "tool_call":
            grammar = self.xgrammar().Grammar
            return c.compile_grammar(grammar.concat(
                grammar.from_ebnf('root ::= "<tool_call>"'),
                grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True),
                grammar.from_ebnf('root ::= "</tool_call>"')))
        if spec.kind == "choice":
            options = json.loads(spec.value)
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
        return c.compile_grammar(spec.value)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(t for t in self._tokenizer.eos_token_ids if t < self.vocab_size)

    def matcher(self, spec: GuidedSpec) -> Any:
        return self.xgrammar().GrammarMatcher(self.compile(spec))

    def bitmask(self, rows: int) -> Any:
        return self.xgrammar().allocate_token_bitmask(rows, self.vocab_size)


_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "tool_call": "tool parameters schema"}


@dataclass
class _Matched:
    spec: GuidedSpec
    matcher: Any
    accepted: int = 0  # output tokens the matcher has consumed
    dead: bool = False  # the constraint admits no next token: the row may only end


class Guide:
    """The sampler's guided rows: one matcher per sequence, synced to its output each step."""

    def __init__(self, grammars: Grammars | None) -> None:
        self.grammars = grammars
        self._state: dict[int, _Matched] = {}
        self.seconds = 0.0  # spent filling masks and advancing matchers (benchmarks report it)
        self._batch: Any = None

    def release(self, seq_ids: Any) -> None:
        for sid in seq_ids:
            self._state.pop(sid, None)

    def mask(self, logits: Any, items: list[Any]) -> list[int]:
        """Set the disallowed logits of every guided row to -inf (in place on ``logits`` [N, V]);
        returns the guided rows."""
        rows = [i for i, it in enumerate(items) if it.params.guided is not None]
        if not rows:
            return rows
        t0 = time.perf_counter()
        if self.grammars is None:
            raise RuntimeError("a guided row reached a sampler without grammars")
        xgr = self.grammars.xgrammar()
        bitmask = self.grammars.bitmask(len(items))
        states = {i: self._sync(items[i]) for i in rows}
        live = [i for i in rows if not states[i].dead]
        if len(live) == 1:
            states[live[0]].matcher.fill_next_token_bitmask(bitmask, live[0])
        elif live:  # xgrammar's thread pool over the rows (a fill is µs, or ms inside a bounded string)
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([states[i].matcher for i in live], bitmask, live)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows, vocab_size=min(logits.shape[-1],
                                                                                      self.grammars.vocab_size))
        for i in rows:  # a dead end (e.g. a regex no token can continue): the row may only stop
            if states[i].dead or not bool(bitmask[i].any()):
                states[i].dead = True
                logits[i] = float("-inf")
                logits[i, list(self.grammars.stop_ids)] = 0.0
        self.seconds += time.perf_counter() - t0
        return rows

    def accept(self, rows: list[int], items: list[Any], tokens: list[int]) -> None:
        t0 = time.perf_counter()
        for i in rows:
            state = self._state[items[i].seq_id]
            if not state.dead and state.matcher.accept_token(tokens[i]):
                state.accepted += 1
            else:  # a dead end ended the row with a stop token the constraint did not allow
                state.dead = True
        self.seconds += time.perf_counter() - t0

    def _sync(self, item: Any) -> _Matched:
        """The row's matcher, having consumed exactly the row's output tokens so far."""
        spec = item.params.guided
        output = item.history[item.num_prompt:]
        state = self._state.get(item.seq_id)
        if state is None or state.spec != spec or state.accepted > len(output):
            state = self._state[item.seq_id] = _Matched(spec, self.grammars.matcher(spec))  # type: ignore[union-attr]
        for tok in output[state.accepted:]:
            if state.dead or not state.matcher.accept_token(int(tok)):
                state.dead = True  # an output the constraint cannot continue: it may only stop
                break
            state.accepted += 1
        return state
