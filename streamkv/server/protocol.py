"""Request bodies of the OpenAI and Anthropic routes (pydantic, strict types).

Known fields are type-checked strictly (a string where a number belongs is a 400, not a
coercion); unknown fields are ignored, as the official SDKs may send newer ones.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictInt, StrictFloat]
MAX_N = 8


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class GuidedFields(_Body):
    """Structured-output fields (``streamkv.server.structured``): OpenAI's response_format and
    vLLM's guided_* extras; generation routes, session queries and flash questions take them."""

    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None


class _Sampling(GuidedFields):
    """Fields shared by completions and chat completions (OpenAI names, plus vLLM-style extras)."""

    model: StrictStr | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    priority: StrictInt = 0
    kv_write: dict[str, Any] | None = None  # streamkv: write-time KV policy ({"policy": "snapstream", ...})
    kv_read: dict[str, Any] | None = None   # streamkv: read-time KV policy ({"policy": "quest", ...})


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ToolCallFunction(_Body):
    name: StrictStr
    arguments: StrictStr


class ToolCallIn(_Body):
    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: calls it made
    tool_call_id: StrictStr | None = None       # tool: the call this result answers


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None


class AnthropicBlock(_Body):
    type: Literal["text"]
    text: StrictStr


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[AnthropicBlock] = ""
    is_error: StrictBool = False


AnyBlock = Annotated[Union[AnthropicBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: StrictStr | list[AnyBlock]


class MessagesRequest(_Body):
    model: StrictStr
    max_tokens: StrictInt
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: StrictStr | list[AnthropicBlock] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    kv_write: dict[str, Any] | None = None
    kv_read: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None        # [{"name", "description", "input_schema"}]
    tool_choice: dict[str, Any] | None = None        # {"type": "auto" | "any" | "tool" | "none", "name"}


class TokenizeRequest(_Body):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt]


def message_text(content: str | list[TextPart] | list[Any] | None) -> str:
    """The text parts of a message (tool blocks are rendered by ``streamkv.server.tools``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content if part.type == "text")
