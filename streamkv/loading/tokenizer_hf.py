"""Build a :class:`Tokenizer` from a Hugging Face model directory.

Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (chat template, BOS/EOS,
added tokens), ``chat_template.jinja`` (transformers >= 4.50 saves the template there) and
``generation_config.json`` (EOS ids, possibly a list).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from streamkv.errors import ModelLoadError
from streamkv.loading.token_bytes import build_table
from streamkv.loading.tokenizer import Tokenizer


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    """A JSON object from ``path``; ``{}`` when optional and absent."""
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.parent}: {path.name} is missing")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def tokenizer_from_hf_dir(directory: Path, config: dict[str, Any]) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (``config`` is its config.json)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: tokenizer.json is missing (only fast-tokenizer "
                             "directories are supported, not tokenizer.model alone)")
    try:
        backend = Backend.from_file(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot parse tokenizer.json: {exc}") from exc
    spec = read_json(path)
    tok_config = read_json(directory / "tokenizer_config.json", required=False)
    gen_config = read_json(directory / "generation_config.json", required=False)
    added = backend.get_added_tokens_decoder()
    special = {i for i, tok in added.items() if tok.special}
    special |= {int(i) for i, tok in (tok_config.get("added_tokens_decoder") or {}).items()
                if isinstance(tok, dict) and tok.get("special")}
    bos = _token_ref(backend, tok_config.get("bos_token"), config.get("bos_token_id"))
    eos = _eos_ids(backend, config, tok_config, gen_config)
    special |= set(eos) | ({bos} if bos is not None else set())
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    tokens = [backend.id_to_token(i) for i in range(vocab_size)]
    literal = set(added) - special
    return Tokenizer(
        backend, bos_token_id=bos, eos_token_ids=eos,
        chat_template=_chat_template(directory, tok_config), special_ids=special,
        token_bytes_table=build_table(tokens, _byte_scheme(spec), special, literal),
        template_variables=_template_variables(tok_config))


def _token_text(value: Any) -> str | None:
    """A token given as a string or as an AddedToken dict (``{"content": ...}``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _token_ref(backend: Backend, token: Any, fallback_id: Any) -> int | None:
    """Id of a token given by text (tokenizer_config) or by id (config.json)."""
    text = _token_text(token)
    if text is not None and backend.token_to_id(text) is not None:
        return int(backend.token_to_id(text))
    if isinstance(fallback_id, list):
        fallback_id = fallback_id[0] if fallback_id else None
    return int(fallback_id) if isinstance(fallback_id, int) else None


def _ids(value: Any) -> list[int]:
    """An ``eos_token_id`` entry (int, list of ints or null) as a list."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _eos_ids(backend: Backend, config: dict[str, Any], tok_config: dict[str, Any],
             gen_config: dict[str, Any]) -> list[int]:
    """Every end-of-sequence id, deduplicated: generation config, config, tokenizer."""
    ids = _ids(gen_config.get("eos_token_id")) + _ids(config.get("eos_token_id"))
    text = _token_text(tok_config.get("eos_token"))
    if text is not None and backend.token_to_id(text) is not None:
        ids.append(int(backend.token_to_id(text)))
    return list(dict.fromkeys(ids))


def _chat_template(directory: Path, tok_config: dict[str, Any]) -> str | None:
    """The default chat template: ``chat_template.jinja`` or tokenizer_config's entry."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{jinja_file}: cannot read chat template: {exc}") from exc
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _template_variables(tok_config: dict[str, Any]) -> dict[str, str]:
    """Special token strings the chat template may reference (``bos_token``...)."""
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    return {n: text for n in names if (text := _token_text(tok_config.get(n))) is not None}


def _component_types(node: Any) -> set[str]:
    """Every ``"type"`` value inside a tokenizer.json component (recursing into sequences)."""
    found: set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            found.add(node["type"])
        for value in node.values():
            found |= _component_types(value)
    elif isinstance(node, list):
        for value in node:
            found |= _component_types(value)
    return found


def _byte_scheme(spec: dict[str, Any]) -> str:
    """How token strings spell bytes: ``byte_level``, ``sentencepiece`` or ``plain``."""
    decoder = _component_types(spec.get("decoder"))
    if "ByteLevel" in decoder:
        return "byte_level"
    model = spec.get("model") or {}
    if decoder & {"ByteFallback", "Metaspace"} or model.get("byte_fallback"):
        return "sentencepiece"
    if "ByteLevel" in _component_types(spec.get("pre_tokenizer")):
        return "byte_level"
    return "plain"
