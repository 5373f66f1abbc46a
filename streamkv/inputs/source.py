"""How a streaming input's text becomes the prompt: plain text, or the last user message of a chat.

Every change re-renders and re-tokenizes the *whole* input, so the token ids always equal
what a fresh request on the same text would get (the LCP against the KV decides what is
recomputed). A chat's growing text is its last user message; while the input is open the
prompt stops where that message's text ends (the template's closing tokens and the
generation prompt come at finish)::

    open    <|im_start|>user\nThe crawler found: page one ...        (cut at the text's end)
    finish  <|im_start|>user\nThe crawler found: page one ...<|im_end|>\n<|im_start|>assistant\n
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from streamkv.errors import InvalidRequestError

_CUT = "\ue000streamkv-input-end\ue001"  # private-use marker: where the growing text ends


class InputSource(ABC):
    """Renders the current text of a streaming input to the prompt string."""

    initial_text: str = ""

    @abstractmethod
    def render(self, text: str, final: bool) -> str:
        """The prompt for ``text``; ``final`` adds what follows the text once input is complete."""


@dataclass(frozen=True)
class PromptSource(InputSource):
    """A plain prompt: the text itself."""

    initial_text: str = ""

    def render(self, text: str, final: bool) -> str:
        return text


@dataclass(frozen=True)
class ChatSource(InputSource):
    """A chat whose last message (role ``user``) is the growing text."""

    messages: tuple[tuple[str, str], ...]
    tokenizer: Any

    @property
    def initial_text(self) -> str:  # type: ignore[override]
        return self.messages[-1][1]

    def render(self, text: str, final: bool) -> str:
        msgs = [{"role": r, "content": c} for r, c in self.messages[:-1]]
        if final:
            return self.tokenizer.apply_chat_template(msgs + [{"role": "user", "content": text}],
                                                      add_generation_prompt=True)
        rendered = self.tokenizer.apply_chat_template(msgs + [{"role": "user", "content": text + _CUT}],
                                                      add_generation_prompt=False)
        cut = rendered.find(_CUT)
        if cut < 0:
            raise InvalidRequestError("the chat template drops the last user message's text; "
                                      "stream a plain prompt instead")
        return rendered[:cut]


def make_source(prompt: str | None, messages: list[dict[str, Any]] | None, tokenizer: Any) -> InputSource:
    """A source from exactly one of ``prompt`` / ``messages``; InvalidRequestError otherwise."""
    if (prompt is None) == (messages is None):
        raise InvalidRequestError("give exactly one of 'prompt' or 'messages'")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidRequestError("a streaming input's prompt must be a string")
        return PromptSource(prompt)
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    pairs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with string 'role' and 'content'")
        pairs.append((m["role"], m["content"]))
    if pairs[-1][0] != "user":
        raise InvalidRequestError("the last message of a streaming input must have role 'user' (its text grows)")
    source = ChatSource(tuple(pairs), tokenizer)
    source.render(source.initial_text, final=True)  # the template accepts these messages
    return source
