"""Build a :class:`Tokenizer` from GGUF metadata (``tokenizer.ggml.*`` keys).

Supported ``tokenizer.ggml.model`` values: ``"gpt2"`` (byte-level BPE with merges) and
``"llama"`` (SentencePiece BPE with scores and byte fallback). The construction follows
llama.cpp's conventions and matches ``transformers``' GGUF tokenizer conversion.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from streamkv.errors import ModelLoadError
from streamkv.loading.gguf_file import GGUFFile
from streamkv.loading.token_bytes import SPIECE_SPACE, build_table, bytes_to_unicode
from streamkv.loading.tokenizer import Tokenizer

# llama.cpp token types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPECIAL_TYPES = frozenset({UNKNOWN, CONTROL, UNUSED})

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


def tokenizer_from_gguf(gguf: GGUFFile) -> Tokenizer:
    """Tokenizer described by ``gguf``'s metadata; :class:`ModelLoadError` if unusable."""
    kind = gguf.get("tokenizer.ggml.model")
    if kind is None:
        raise ModelLoadError(f"{gguf.path}: the GGUF file has no tokenizer (tokenizer.ggml.model)")
    tokens: list[str] = list(gguf.require("tokenizer.ggml.tokens"))
    types: list[int] = list(gguf.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelLoadError(f"{gguf.path}: tokenizer.ggml.token_type length differs from the vocabulary")
    if kind == "gpt2":
        spelled = _respell_byte_level(tokens)
        backend = _byte_level(spelled, gguf)
        scheme, add_bos_default = "byte_level", False
    elif kind == "llama":
        backend, spelled = _sentencepiece(tokens, gguf), tokens
        scheme, add_bos_default = "sentencepiece", True
    else:
        raise ModelLoadError(
            f"{gguf.path}: unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2', 'llama'")
    _add_special_tokens(backend, tokens, types, byte_level=kind == "gpt2")
    return _finish(gguf, backend, tokens, spelled, types, scheme, add_bos_default)


def _finish(gguf: GGUFFile, backend: Backend, tokens: list[str], spelled: list[str],
            types: list[int], scheme: str, add_bos_default: bool) -> Tokenizer:
    """Special ids, post-processor and byte table shared by both tokenizer kinds."""
    bos = _token_id(gguf, "tokenizer.ggml.bos_token_id", len(tokens))
    eos = [i for key in ("eos_token_id", "eot_token_id", "eom_token_id")
           if (i := _token_id(gguf, f"tokenizer.ggml.{key}", len(tokens))) is not None]
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False)) and bool(eos)
    _set_post_processor(backend, tokens, bos if add_bos else None, eos[0] if add_eos else None)
    special = {i for i, t in enumerate(types) if t in _SPECIAL_TYPES} | set(eos)
    special |= {bos} if bos is not None else set()
    literal = {i for i, t in enumerate(types) if t == USER_DEFINED}
    variables = {name: tokens[i] for name, key in (("bos_token", "bos"), ("eos_token", "eos"),
                                                    ("unk_token", "unknown"), ("pad_token", "padding"))
                 if (i := _token_id(gguf, f"tokenizer.ggml.{key}_token_id", len(tokens))) is not None}
    return Tokenizer(
        backend, bos_token_id=bos, eos_token_ids=eos,
        chat_template=gguf.get("tokenizer.chat_template"), special_ids=special,
        token_bytes_table=build_table(spelled, scheme, special, literal),
        template_variables=variables)


def _token_id(gguf: GGUFFile, key: str, vocab: int) -> int | None:
    """A token id from metadata, validated against the vocabulary size."""
    value = gguf.get(key)
    if value is None:
        return None
    if not 0 <= int(value) < vocab:
        raise ModelLoadError(f"{gguf.path}: {key}={value} is outside the vocabulary (size {vocab})")
    return int(value)


def _respell_byte_level(tokens: Sequence[str]) -> list[str]:
    """Tokens as byte-level spellings (a few files store some tokens as plain text)."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    return [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
            for t in tokens]


def _merges(gguf: GGUFFile) -> list[tuple[str, str]] | None:
    """``tokenizer.ggml.merges`` as pairs, or ``None`` when absent."""
    raw = gguf.get("tokenizer.ggml.merges")
    if raw is None:
        return None
    pairs = [tuple(m.split(" ", 1)) for m in raw]
    if any(len(p) != 2 for p in pairs):
        raise ModelLoadError(f"{gguf.path}: malformed tokenizer.ggml.merges entry")
    return pairs  # type: ignore[return-value]


def _byte_level(spelled: list[str], gguf: GGUFFile) -> Backend:
    """Byte-level BPE (GPT-2 style) over the byte-level ``spelled`` vocabulary, with the
    pre-tokenizer named by ``tokenizer.ggml.pre``."""
    merges = _merges(gguf)
    if merges is None:
        raise ModelLoadError(f"{gguf.path}: byte-level BPE tokenizer without tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(spelled)}
    backend = Backend(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False))
    pre = gguf.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(tokens: list[str], gguf: GGUFFile) -> Backend:
    """SentencePiece BPE: merges from the file or recovered from the token scores."""
    merges = _merges(gguf)
    if merges is None:
        scores = gguf.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(f"{gguf.path}: SentencePiece tokenizer without usable scores or merges")
        merges = merges_from_scores(tokens, [float(s) for s in scores])
    unk = gguf.get("tokenizer.ggml.unknown_token_id")
    backend = Backend(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, dropout=None,
                          fuse_unk=True, byte_fallback=True,
                          unk_token=tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None))
    prefix = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPIECE_SPACE, prepend_scheme="first" if prefix else "never", split=False)
    steps: list[Any] = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's highest-score-first pair merging.

    Every split of a token into two vocabulary tokens is a merge ranked by the merged
    token's score (ties: shorter left piece first), exactly as ``transformers`` does.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores)).items():
        local = [(token[:k], token[k:]) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((left, right, score) for left, right in local)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _add_special_tokens(backend: Backend, tokens: list[str], types: list[int], *,
                        byte_level: bool) -> None:
    """Register control tokens as special and user-defined ones as added tokens.

    Both then encode atomically. In a byte-level vocabulary a "control" token spelled
    outside the byte alphabet is a converter mislabel and is left alone (as transformers does).
    """
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types)
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=False)
    user = [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types)
            if kind == USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)


def _set_post_processor(backend: Backend, tokens: list[str], bos: int | None, eos: int | None) -> None:
    """Make ``encode(..., add_special_tokens=True)`` add BOS/EOS as the metadata asks."""
    if bos is None and eos is None:
        return
    single = ([tokens[bos]] if bos is not None else []) + ["$A"] + ([tokens[eos]] if eos is not None else [])
    pair = single + ["$B" if piece == "$A" else piece for piece in single]
    special = [(tokens[i], i) for i in dict.fromkeys(x for x in (bos, eos) if x is not None)]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
