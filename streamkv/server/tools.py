"""Tool calling on the chat routes, in one documented generic format.

The embedded model's chat template has no tool syntax, so tools are rendered the way Hermes /
Qwen-style templates do, into the system message, and calls are written as tags::

    system:     <the request's system text>\\n\\n# Tools\\n<TOOLS_PREAMBLE>\\n<tools>[{function}, ...]</tools>
    assistant:  <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
    tool:       (role "tool") the result text

``tool_choice``:
  ``none``       tools are not rendered, nothing is parsed
  ``auto``       rendered; ``<tool_call>`` blocks in the output become tool calls
  ``required``   rendered; the output is constrained (xgrammar) to one call of one of the tools,
                 its arguments valid against that tool's parameter schema
  named          the same, for the named function only
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from streamkv.errors import InvalidRequestError
from streamkv.sampling.grammar import GuidedSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOLS_PREAMBLE = ("You may call one or more functions to help with the user query. To call one, reply with "
                  f'{OPEN}{{"name": <function name>, "arguments": <arguments object>}}{CLOSE}. '
                  "The functions:")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(re.escape(OPEN) + r"\s*(\{.*?\})\s*" + re.escape(CLOSE), re.S)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def parse_tools(tools: Any, param: str = "tools") -> list[Tool]:
    """OpenAI ``tools`` ([{"type": "function", "function": {...}}]) -> tools (InvalidRequestError)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError(f"{param} must be a list")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise InvalidRequestError(f'{param}[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        out.append(make_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{param}[{i}].function"))
    return _unique(out, param)


def make_tool(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(f"{where}.name must match [A-Za-z0-9_-]{{1,64}}, got {name!r}")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.description must be a string")
    params = parameters if parameters is not None else {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise InvalidRequestError(f"{where}.parameters must be a JSON schema object")
    return Tool(name, description or "", params)


def _unique(tools: list[Tool], param: str) -> list[Tool]:
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"{param} has duplicate function names")
    return tools


def resolve_choice(choice: Any, tools: list[Tool]) -> str | Tool | None:
    """``tool_choice`` -> "none" | "auto" | "required" | the named tool (None: no tools)."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools")
        return None
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    for t in tools:
        if t.name == name:
            return t
    raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                              f'{{"name": <one of {[t.name for t in tools]}>}}}}, got {choice!r}')


def system_text(system: str, tools: list[Tool]) -> str:
    listing = json.dumps([t.spec() for t in tools], ensure_ascii=False)
    return (system + "\n\n" if system else "") + f"# Tools\n{TOOLS_PREAMBLE}\n<tools>{listing}</tools>"


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (``arguments``: an object, or its JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise InvalidRequestError(f"the arguments of a {name!r} tool call are not valid JSON") from None
    return OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CLOSE


def constraint(choice: str | Tool | None, tools: list[Tool]) -> GuidedSpec | None:
    """The grammar of a forced call (``required`` or named): one ``<tool_call>`` whose JSON is
    ``{"name": <a tool>, "arguments": <valid for it>}``."""
    if choice is None or choice in ("none", "auto"):
        return None
    chosen = [choice] if isinstance(choice, Tool) else tools
    options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"]} for t in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return GuidedSpec("tool_call", json.dumps(schema, ensure_ascii=False))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}

    def anthropic(self) -> dict[str, Any]:
        return {"type": "tool_use", "id": self.id.replace("call_", "toolu_", 1), "name": self.name,
                "input": json.loads(self.arguments)}


def parse_calls(text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of an output: each well-formed ``<tool_call>`` naming a known tool
    becomes a call and leaves the content; anything else stays text."""
    known = {t.name for t in tools}
    calls: list[ToolCall] = []

    def take(m: re.Match[str]) -> str:
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return m.group(0)
        if not isinstance(obj, dict) or obj.get("name") not in known or not isinstance(obj.get("arguments", {}), dict):
            return m.group(0)
        calls.append(ToolCall("call_" + secrets.token_hex(12), obj["name"],
                              json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
        return ""

    content = _CALL.sub(take, text)
    return content.strip() if calls else content, calls


def held_back(text: str) -> int:
    """How many trailing characters of streamed ``text`` might begin a ``<tool_call>`` (or be
    inside one) and so must wait before being sent as content."""
    start = text.find(OPEN)
    if start >= 0:
        return len(text) - start
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


def render(messages: list[dict[str, Any]], tools: list[Tool], choice: str | Tool | None) -> list[dict[str, str]]:
    """Template messages (role, content strings) of a chat whose messages may carry tool calls
    (``{"role": "assistant", "content": ..., "tool_calls": [(name, arguments), ...]}``); the tools
    go into the system message unless ``choice`` is ``none``."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        calls = m.get("tool_calls") or []
        if calls:
            content += "".join(call_text(name, args) for name, args in calls)
        out.append({"role": m["role"], "content": content})
    if tools and choice not in (None, "none"):
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": system_text(out[0]["content"], tools)}
        else:
            out.insert(0, {"role": "system", "content": system_text("", tools)})
    return out


# ------------------------------------------------------------------ Anthropic shape
def anthropic_tools(tools: Any, choice: Any) -> tuple[list[Tool], str | Tool | None]:
    """Anthropic ``tools`` ([{"name", "description", "input_schema"}]) and ``tool_choice``
    ({"type": "auto" | "any" | "tool" | "none", "name"}) in the OpenAI terms above."""
    if tools is None:
        if choice is not None:
            raise InvalidRequestError("tool_choice needs tools")
        return [], None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list")
    parsed = _unique([make_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]")
                      if isinstance(t, dict) else make_tool(None, None, None, f"tools[{i}]")
                      for i, t in enumerate(tools)], "tools")
    kind = (choice or {"type": "auto"}).get("type") if isinstance(choice or {}, dict) else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if kind != "tool" else \
        {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise InvalidRequestError(f'tool_choice.type must be "auto", "any", "tool" or "none", got {kind!r}')
    return parsed, resolve_choice(mapped, parsed)


def anthropic_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Anthropic messages (string or blocks) -> :func:`render` messages: ``tool_use`` blocks
    become calls of the assistant turn, each ``tool_result`` a "tool" turn before the user's text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text = "".join(b.text for b in m.content if b.type == "text")
        for b in m.content:
            if b.type == "tool_result":
                result = b.content if isinstance(b.content, str) else "".join(p.text for p in b.content)
                out.append({"role": "tool", "content": ("error: " if b.is_error else "") + result})
        calls = [(b.name, b.input) for b in m.content if b.type == "tool_use"]
        if text or calls or not any(b.type == "tool_result" for b in m.content):
            out.append({"role": m.role, "content": text, "tool_calls": calls})
    return out
