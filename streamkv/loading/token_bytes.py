"""Exact raw bytes of every token, precomputed once per tokenizer.

Incremental detokenization needs the bytes a token stands for, not its display string:
byte-level BPE spells bytes with printable stand-in characters (the GPT-2 byte<->unicode
map) and SentencePiece writes spaces as ``'▁'`` and unknown bytes as ``<0xNN>`` tokens.
"""
from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from functools import cache

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
SPIECE_SPACE = "\u2581"


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character that spells it."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


@cache
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of :func:`bytes_to_unicode`."""
    return {c: b for b, c in bytes_to_unicode().items()}


@cache
def _byte_level_tables() -> tuple[dict[int, str], dict[int, None]]:
    """``str.translate`` tables: each stand-in character to the Latin-1 character of its byte
    (so ``.encode("latin-1")`` gives the bytes), and each stand-in character deleted (what is
    left of a token is what is not byte-level spelled)."""
    decoder = unicode_to_bytes()
    return {ord(c): chr(b) for c, b in decoder.items()}, dict.fromkeys(map(ord, decoder))


def _byte_level_token(token: str) -> bytes:
    """Bytes of one byte-level BPE token (literal UTF-8 if it is not byte-level spelled)."""
    to_latin1, drop = _byte_level_tables()
    if token.translate(drop):  # a character outside the byte alphabet: literal text
        return token.encode("utf-8")
    return token.translate(to_latin1).encode("latin-1")


def _sentencepiece_token(token: str) -> bytes:
    """Bytes of one SentencePiece token (``▁`` is a space, ``<0xNN>`` one raw byte)."""
    match = _BYTE_TOKEN.match(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace(SPIECE_SPACE, " ").encode("utf-8")


def build_table(tokens: Sequence[str | None], scheme: str, special_ids: Collection[int],
                literal_ids: Collection[int] = ()) -> tuple[bytes, ...]:
    """Bytes of every token id.

    ``scheme`` is ``"byte_level"``, ``"sentencepiece"`` or ``"plain"`` (UTF-8 of the token
    string). Special tokens and holes map to ``b""``; ``literal_ids`` (added, non-special
    tokens whose string is literal text) map to their UTF-8 encoding.
    """
    decode = {"byte_level": _byte_level_token, "sentencepiece": _sentencepiece_token,
              "plain": lambda t: t.encode("utf-8")}.get(scheme)
    if decode is None:
        raise ValueError(f"unknown token byte scheme {scheme!r}")
    special, literal = frozenset(special_ids), frozenset(literal_ids)
    table: list[bytes] = []
    for token_id, token in enumerate(tokens):
        if token is None or token_id in special:
            table.append(b"")
        elif token_id in literal:
            table.append(token.encode("utf-8"))
        else:
            table.append(decode(token))
    return tuple(table)
