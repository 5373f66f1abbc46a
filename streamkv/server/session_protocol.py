"""Request bodies of the /v1/sessions routes (strict types; unknown fields ignored)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from streamkv.server.protocol import Number


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FlashSpec(Body):
    question: StrictStr
    max_tokens: StrictInt = 16
    temperature: Number = 0.0


class CreateSession(Body):
    """Fields map 1:1 onto :class:`streamkv.sessions.spec.SessionSpec`."""

    system: StrictStr = ""
    retention_tokens: StrictInt = 2048
    evict_tokens: StrictInt | None = None
    chat: StrictBool = True
    data_header: StrictStr = "Data:\n"
    record_format: StrictStr = "{record}\n"
    query_prefix: StrictStr = "\nQuestion: "
    query_suffix: StrictStr = ""
    max_queue_tokens: StrictInt = 16384
    overflow: Literal["drop_oldest", "reject", "block"] = "drop_oldest"
    ingest_batch_tokens: StrictInt = 512
    max_record_chars: StrictInt = 65536
    ready_exit_vocab: list[StrictStr] = []
    ready_exit_min_gap: Number = 3.0
    flash: Annotated[list[FlashSpec], Field(max_length=64)] = []


class PushData(Body):
    records: Annotated[list[StrictStr], Field(min_length=1, max_length=10000)]


class SessionQuery(Body):
    question: StrictStr
    max_tokens: StrictInt = 64
    temperature: Number = 0.0
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
