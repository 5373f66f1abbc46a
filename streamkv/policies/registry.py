"""Building a KV policy from its JSON object: one parser for the read and write registries."""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable

from streamkv.errors import is_int_in

# any token count a policy takes: past every context (a larger one was accepted, never applied,
# and echoed back in the report as a JSON integer many clients cannot represent)
MAX_TOKENS = 1 << 24


def check_count(where: str, name: str, value: Any) -> None:
    """ValueError naming ``where`` and ``name`` unless ``value`` is a token count: an int (not a
    bool) in [0, MAX_TOKENS]."""
    if not is_int_in(value, 0, MAX_TOKENS):
        raise ValueError(f"{where}: {name} must be an integer in [0, {MAX_TOKENS}], got {value!r}")


def build_policy(field: str, registry: dict[str, Callable[..., Any] | None], spec: dict[str, Any] | Any,
                 example: str) -> Any:
    """``registry[spec["policy"]](**rest)``, or None for a ``none`` entry; ValueError (starting with
    ``field``) for anything but an object naming a known policy with known fields."""
    if not isinstance(spec, dict):
        raise ValueError(f"{field} must be an object like {{\"policy\": \"{example}\", ...}}, got {spec!r}")
    params = dict(spec)
    name = params.pop("policy", None)
    if not isinstance(name, str) or name not in registry:  # (a list or object is not even hashable)
        raise ValueError(f"{field}.policy must be one of {sorted(registry)}, got {name!r}")
    cls = registry[name]
    if cls is None:
        if params:
            raise ValueError(f"{field}: policy 'none' takes no fields, got {sorted(params)}")
        return None
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"{field}: unknown fields {unknown} for policy {name!r}; known: {sorted(known)}")
    return cls(**params)
