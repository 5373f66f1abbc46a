"""What a session is made of: its spec (user-facing settings) and its token layout.

::

    stream  [ frozen ............ | r0 | r1 | r2 ...  (sliding, FIFO-evicted) ]
    query   [ stream snapshot      | prefix | question | suffix | answer ... ]  (a fork)

``frozen`` = chat-template opening with the system prompt, then ``data_header``;
``prefix`` / ``suffix`` = the query scaffold around each question (e.g. the end of the
user turn and the assistant marker). Every piece is tokenized on its own, so a session's
token ids are exactly the concatenation shown above (see :meth:`SessionLayout.query_ids`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from streamkv.policies.read import ReadPolicy, make_read_policy
from streamkv.policies.write import SnapStreamPolicy, WritePolicy, make_write_policy

OVERFLOW_POLICIES = ("drop_oldest", "reject", "block")
EVICT_MODES = ("oldest", "snapkv")
_SENTINEL = "\u2063STREAMKV-DATA\u2063"


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


@dataclass(frozen=True)
class SessionSpec:
    """Settings of one session; validated on construction (ValueError with the reason)."""

    system: str = ""
    retention_tokens: int = 2048
    evict_tokens: int | None = None
    chat: bool = True
    data_header: str = "Data:\n"
    record_format: str = "{record}\n"
    query_prefix: str = "\nQuestion: "
    query_suffix: str = ""
    max_queue_tokens: int = 16384
    overflow: str = "drop_oldest"
    ingest_batch_tokens: int = 512
    max_record_chars: int = 65536
    ready_exit_vocab: tuple[str, ...] = ()
    ready_exit_min_gap: float = 3.0
    # Read-time KV policy for questions and flash evaluations (None: exact attention). Its
    # answers are then no longer those of a stateless request on the same ids.
    kv_read: ReadPolicy | None = None
    # What leaves the window when it is full: ``oldest`` drops whole oldest records;
    # ``snapkv`` keeps a memory of the ``kv_write.budget_tokens`` evicted tokens that the newest
    # records' queries attend to most (SnapKV scores, the ``snapstream`` plug-in).
    evict: str = "oldest"
    kv_write: WritePolicy | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_read", make_read_policy(self.kv_read))
        if isinstance(self.ready_exit_vocab, (list, tuple)):
            object.__setattr__(self, "ready_exit_vocab", tuple(self.ready_exit_vocab))
        if not all(isinstance(w, str) and w.strip() for w in self.ready_exit_vocab):
            raise ValueError("ready_exit_vocab must be a list of non-empty strings")
        if not isinstance(self.ready_exit_min_gap, (int, float)) or isinstance(self.ready_exit_min_gap, bool) \
                or self.ready_exit_min_gap < 0:
            raise ValueError(f"ready_exit_min_gap must be a number >= 0, got {self.ready_exit_min_gap!r}")
        if not isinstance(self.system, str):
            raise ValueError("system must be a string")
        for name in ("retention_tokens", "max_queue_tokens", "ingest_batch_tokens", "max_record_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.evict_tokens is not None and (not isinstance(self.evict_tokens, int) or isinstance(self.evict_tokens, bool)
                                              or not 0 < self.evict_tokens <= self.retention_tokens):
            raise ValueError(f"evict_tokens must be in [1, retention_tokens], got {self.evict_tokens!r}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {self.overflow!r}")
        if "{record}" not in self.record_format:
            raise ValueError("record_format must contain '{record}'")
        try:
            self.record_format.format(record="x")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"record_format is not a valid format string: {exc}") from None
        object.__setattr__(self, "kv_write", _eviction_policy(self))

    @property
    def memory_budget(self) -> int:
        """Evicted tokens a ``snapkv`` session keeps (0: ``oldest``)."""
        return self.kv_write.budget if self.kv_write is not None else 0

    @property
    def record_window(self) -> int:
        """Tokens the window holds for records: the retention less the snapkv memory."""
        return self.retention_tokens - self.memory_budget

    @property
    def evict_chunk(self) -> int:
        """Tokens evicted at once (at least): amortizes the re-positioning copy."""
        return self.evict_tokens or max(1, self.retention_tokens // 4)

    @property
    def ready_exit(self) -> bool:
        """Ready-position early exit is on (opt-in: a non-empty fast-answer vocabulary)."""
        return bool(self.ready_exit_vocab)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ready_exit_vocab"] = list(self.ready_exit_vocab)
        out["kv_read"] = self.kv_read.to_dict() if self.kv_read is not None else None
        out["kv_write"] = self.kv_write.to_dict() if self.kv_write is not None else None
        return out


def _eviction_policy(spec: SessionSpec) -> WritePolicy | None:
    """The write policy a session evicts with (None for ``oldest``), from ``kv_write``.

    A session has no sinks or ring of its own to configure: its frozen prefix is the sink and
    its record window the recent part. So ``sink_tokens`` is 0 and ``window_tokens`` equals
    ``observation_tokens`` (those rows are the newest records); ``budget_tokens`` (default: a
    quarter of ``retention_tokens``) is the memory of evicted tokens, part of the retention.
    """
    if spec.evict not in EVICT_MODES:
        raise ValueError(f"evict must be one of {EVICT_MODES}, got {spec.evict!r}")
    raw: Any = spec.kv_write
    if spec.evict == "oldest":
        if raw is not None and make_write_policy(raw) is not None:
            raise ValueError('kv_write on a session configures its snapkv eviction: also send "evict": "snapkv"')
        return None
    if raw is None or isinstance(raw, dict):
        raw = {"policy": "snapstream", **(raw or {})}
        if raw["policy"] != "snapstream":
            make_write_policy(raw)  # an unknown policy or field: its own message first
            raise ValueError('"evict": "snapkv" needs a policy that scores tokens: kv_write {"policy": "snapstream", ...}')
        obs = raw.get("observation_tokens", SnapStreamPolicy.observation_tokens)
        if isinstance(obs, bool) or not isinstance(obs, int) or obs < 1:  # (before it becomes window_tokens)
            raise ValueError(f"kv_write snapstream: observation_tokens must be an integer >= 1, got {obs!r}")
        if raw.get("sink_tokens", 0) != 0:
            raise ValueError("kv_write on a session: sink_tokens does not apply (the frozen prefix is the sink)")
        if raw.get("window_tokens", obs) != obs:
            raise ValueError("kv_write on a session: window_tokens does not apply (the record window is the "
                             "recent part; the observed rows are the newest records)")
        raw.update(sink_tokens=0, window_tokens=obs)
        raw.setdefault("budget_tokens", max(1, spec.retention_tokens // 4))
    policy = make_write_policy(raw)
    if policy is None or not policy.observation:
        raise ValueError('"evict": "snapkv" needs a policy that scores tokens: kv_write {"policy": "snapstream", ...}')
    if policy.sink_tokens or policy.window_tokens != policy.observation:
        raise ValueError("kv_write on a session: sink_tokens must be 0 and window_tokens equal to observation_tokens")
    if not policy.observation <= policy.budget < spec.retention_tokens:
        raise ValueError(f"kv_write budget_tokens ({policy.budget}) must be at least observation_tokens "
                         f"({policy.observation}) and less than retention_tokens ({spec.retention_tokens})")
    return policy


@dataclass(frozen=True)
class SessionLayout:
    """Token ids of the fixed pieces of a session."""

    frozen: tuple[int, ...]
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def build(cls, spec: SessionSpec, tokenizer: Any) -> SessionLayout:
        opening, closing = _chat_pieces(spec, tokenizer) if spec.chat else (spec.system, "")
        frozen = tokenizer.encode(opening + spec.data_header, add_special_tokens=True)
        if not frozen:
            raise ValueError("the session's frozen prefix is empty: give a system prompt or a data header")
        prefix = tokenizer.encode(spec.query_prefix) if spec.query_prefix else []
        suffix = tokenizer.encode(spec.query_suffix + closing) if spec.query_suffix + closing else []
        return cls(tuple(frozen), tuple(prefix), tuple(suffix))

    def record_ids(self, spec: SessionSpec, tokenizer: _Tokenizer, record: str) -> list[int]:
        return tokenizer.encode(spec.record_format.format(record=record))

    def query_ids(self, tokenizer: _Tokenizer, question: str) -> list[int]:
        """Scaffold + question: what a query appends to the stream snapshot."""
        return list(self.prefix) + tokenizer.encode(question) + list(self.suffix)


def _chat_pieces(spec: SessionSpec, tokenizer: Any) -> tuple[str, str]:
    """Chat-template text before and after the user turn's content."""
    messages = ([{"role": "system", "content": spec.system}] if spec.system else []) + \
        [{"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not render the user turn verbatim; use chat=false")
    before, after = text.split(_SENTINEL)
    return before, after
