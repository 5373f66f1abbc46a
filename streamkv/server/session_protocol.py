"""Request bodies of the /v1/sessions routes (strict types; unknown fields ignored)."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from streamkv.server.protocol import GuidedFields, Number
from streamkv.sessions.flash import MAX_QUESTIONS, FlashQuestion
from streamkv.sessions.spec import SessionSpec


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


_SPEC = SessionSpec()  # the defaults of every create field come from the spec itself


def _session_policies_only(data: Any) -> Any:
    """A question (asked or flash) reads under its session's KV policies: one sent with it is a
    400, not ignored."""
    late = sorted(k for k in ("kv_read", "kv_write") if isinstance(data, dict) and k in data)
    if late:
        raise ValueError(f"{', '.join(late)} {'belong' if len(late) > 1 else 'belongs'} to the session (set at "
                         "create: kv_read, evict / "
                         "kv_write); a question reads under its session's policies")
    return data


class FlashSpec(GuidedFields):
    question: StrictStr
    max_tokens: StrictInt = FlashQuestion.max_tokens
    temperature: Number = FlashQuestion.temperature

    _no_kv_policies = model_validator(mode="before")(_session_policies_only)


class CreateSession(Body):
    """Fields map 1:1 onto :class:`streamkv.sessions.spec.SessionSpec` (which validates
    values), plus flash questions to register at creation."""

    id: StrictStr | None = None  # client-chosen (8-64 of [A-Za-z0-9_-]); default: a random one
    system: StrictStr = _SPEC.system
    retention_tokens: StrictInt = _SPEC.retention_tokens
    evict_tokens: StrictInt | None = _SPEC.evict_tokens
    chat: StrictBool = _SPEC.chat
    data_header: StrictStr = _SPEC.data_header
    record_format: StrictStr = _SPEC.record_format
    query_prefix: StrictStr = _SPEC.query_prefix
    query_suffix: StrictStr = _SPEC.query_suffix
    max_queue_tokens: StrictInt = _SPEC.max_queue_tokens
    overflow: StrictStr = _SPEC.overflow
    ingest_batch_tokens: StrictInt = _SPEC.ingest_batch_tokens
    max_record_chars: StrictInt = _SPEC.max_record_chars
    ready_exit_vocab: list[StrictStr] = list(_SPEC.ready_exit_vocab)
    ready_exit_min_gap: Number = _SPEC.ready_exit_min_gap
    kv_read: dict[str, Any] | None = None
    evict: StrictStr = _SPEC.evict
    kv_write: dict[str, Any] | None = None
    flash: Annotated[list[FlashSpec], Field(max_length=MAX_QUESTIONS)] = []


class PushData(Body):
    records: Annotated[list[StrictStr], Field(min_length=1, max_length=10000)]


class SessionQuery(GuidedFields):
    question: StrictStr
    max_tokens: StrictInt = 64
    temperature: Number = 0.0
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False  # with a structured output, always generated (never a flash/ready answer)

    _no_kv_policies = model_validator(mode="before")(_session_policies_only)
