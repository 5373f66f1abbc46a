"""Rendering of Hugging Face style Jinja chat templates in a sandbox.

The environment mirrors ``transformers``' ``apply_chat_template``: an immutable sandbox with
``trim_blocks``/``lstrip_blocks``, loop controls, a ``tojson`` filter that does not escape
HTML, ``raise_exception`` and ``strftime_now`` globals, and a no-op ``{% generation %}`` tag.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from streamkv.errors import InvalidRequestError


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` and render the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        """Parse the block into a call that returns its body."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template; :class:`InvalidRequestError` if it is not valid Jinja."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidRequestError(f"the model's chat template is not valid Jinja: {exc}") from exc


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages: a list of dicts, each with string ``role`` and ``content``."""
    if not isinstance(messages, list):
        raise InvalidRequestError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}")
    checked: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise InvalidRequestError(f"messages[{i}] has no {key!r} key")
            if not isinstance(message[key], str):
                raise InvalidRequestError(
                    f"messages[{i}][{key!r}] must be a str, got {type(message[key]).__name__}")
        checked.append(dict(message))
    return checked


def render(template: jinja2.Template, messages: list[dict[str, Any]], *,
           add_generation_prompt: bool, variables: Mapping[str, Any]) -> str:
    """Render ``template``; template errors become :class:`InvalidRequestError`."""
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **variables)
    except Exception as exc:  # raise_exception(), or a template bug meeting odd input
        raise InvalidRequestError(
            f"chat template rejected the messages: {type(exc).__name__}: {exc}") from exc
