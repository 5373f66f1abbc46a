"""Structured-output fields of the generation routes -> one ``GuidedSpec``, compiled before submit.

Accepted (at most one constraint per request):

    response_format  {"type": "text"}                                  no constraint
                     {"type": "json_object"}                           any JSON object
                     {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
    guided_json      a JSON schema (object or its text)                 vLLM's extras, on every route
    guided_regex     a regex
    guided_choice    a list of strings
    guided_grammar   an EBNF grammar (xgrammar's dialect; rule ``root``)

Compiling (xgrammar, cached per spec) happens here, off the event loop, so a bad schema is a
400 naming the problem before anything is queued, and the engine finds the grammar cached.
"""
from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from streamkv.errors import InvalidRequestError
from streamkv.sampling.grammar import GuidedSpec
from streamkv.server.errors import APIError

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guided_spec(req: Any) -> tuple[GuidedSpec | None, str | None]:
    """``(spec, the field it came from)`` of a request body (pydantic model or dict)."""
    get = req.get if isinstance(req, dict) else (lambda k: getattr(req, k, None))
    given = [k for k in ("response_format", *_GUIDED) if get(k) is not None]
    if len(given) > 1:
        raise APIError(400, f"give one structured-output constraint, got {given}", param=given[1])
    if not given:
        return None, None
    field, value = given[0], get(given[0])
    try:
        if field == "response_format":
            return _response_format(value), field
        if field == "guided_json":
            return GuidedSpec.json_schema(value), field
        if field == "guided_choice":
            return GuidedSpec.choice(value), field
        if not isinstance(value, str):
            raise InvalidRequestError(f"{field} must be a string")
        return GuidedSpec("regex" if field == "guided_regex" else "grammar", value), field
    except InvalidRequestError as exc:
        raise APIError(400, f"{field}: {exc}", param=field) from None


def _response_format(value: Any) -> GuidedSpec | None:
    if not isinstance(value, dict) or "type" not in value:
        raise InvalidRequestError('must be an object with a "type": "text", "json_object" or "json_schema"')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec.json_schema(None)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidRequestError('"json_schema" must be an object with a "schema" object '
                                      '({"name": ..., "schema": {...}, "strict": true})')
        return GuidedSpec.json_schema(spec["schema"])
    raise InvalidRequestError(f'type must be "text", "json_object" or "json_schema", got {kind!r}')


async def compile_guided(engine: Any, spec: GuidedSpec | None, field: str | None) -> None:
    """Compile ``spec`` with the engine's grammars (cached); a bad one is a 400 on ``field``."""
    if spec is None:
        return
    grammars = engine.engine.grammars
    if grammars is None:
        raise APIError(400, "structured outputs are not available with this runner", param=field)
    try:
        await run_in_threadpool(grammars.compile, spec)
    except InvalidRequestError as exc:
        raise APIError(400, f"{field}: {exc}", param=field) from None
