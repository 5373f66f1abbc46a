"""streamkv's tokenizer: a ``tokenizers.Tokenizer`` plus the model's token metadata.

Built by :mod:`streamkv.loading.tokenizer_gguf` (GGUF metadata) or
:mod:`streamkv.loading.tokenizer_hf` (``tokenizer.json`` directories); never imports
``transformers``.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jinja2
import tokenizers

from streamkv.errors import InvalidRequestError, check_unicode
from streamkv.loading import chat_template


class Tokenizer:
    """Encode/decode text, expose exact token bytes and render the chat template.

    Attributes:
        vocab_size: number of token ids the tokenizer knows (including added tokens).
        bos_token_id: beginning-of-sequence id, if the model has one.
        eos_token_ids: every id that ends generation (deduplicated, in priority order).
        chat_template: the Jinja chat template source, if the model ships one.
        backend: the underlying ``tokenizers.Tokenizer``.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], chat_template: str | None,
                 special_ids: Collection[int], token_bytes_table: Sequence[bytes],
                 template_variables: Mapping[str, Any] | None = None) -> None:
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template or None
        self._special = frozenset(int(i) for i in special_ids)
        self._bytes = tuple(token_bytes_table)
        self._template_variables = dict(template_variables or {})
        self._compiled: jinja2.Template | None = None

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_ids={self.eos_token_ids}, chat_template={'yes' if self.chat_template else 'no'})")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``.

        Special tokens written in the text (e.g. ``<|im_start|>``) encode atomically.
        ``add_special_tokens`` adds what the model's metadata asks for (typically BOS).
        """
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a str, got {type(text).__name__}")
        check_unicode(text)
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """Exact raw bytes of one token; ``b""`` for special tokens and unknown ids."""
        if 0 <= token_id < len(self._bytes):
            return self._bytes[token_id]
        return b""

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special/control token (BOS, EOS, chat markers...)."""
        return token_id in self._special

    @property
    def special_ids(self) -> frozenset[int]:
        """All special/control token ids."""
        return self._special

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (as spelled in the vocabulary), or ``None``."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary spelling of ``token_id``, or ``None``."""
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True, **variables: Any) -> str:
        """Render ``messages`` with the model's chat template (like ``transformers``).

        Extra keyword arguments (e.g. ``tools``) are passed to the template.
        Raises :class:`InvalidRequestError` (a ``ValueError``) when the model has no chat
        template, when ``messages`` is malformed, or when the template rejects it.
        """
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; pass a plain prompt instead of chat messages")
        checked = chat_template.validate_messages(messages)
        if self._compiled is None:
            self._compiled = chat_template.compile_template(self.chat_template)
        return chat_template.render(
            self._compiled, checked, add_generation_prompt=add_generation_prompt,
            variables={**self._template_variables, **variables})
