"""``--help`` of every config flag states its default and its unit (or its choices)."""
from __future__ import annotations

import dataclasses

import pytest

from streamkv.cli import flag_help
from streamkv.config import EngineConfig
from streamkv.server.config import ServerConfig

FIELDS = [f for section in dataclasses.fields(EngineConfig) for f in dataclasses.fields(section.default_factory())] \
    + list(dataclasses.fields(ServerConfig))


@pytest.mark.parametrize("field", FIELDS, ids=[f.name for f in FIELDS])
def test_every_flag_says_its_default_and_unit(field):
    helptext, metavar = flag_help(field)
    assert "default" in helptext, f"--{field.name} does not state its default"
    if "bool" not in str(field.type):
        assert metavar, f"--{field.name} names no unit or choices (set metadata 'unit')"


def test_units_and_defaults_read_well():
    by_name = {f.name: f for f in FIELDS}
    assert flag_help(by_name["kv_cache_memory"]) == ("bytes of KV cache (sets the pool size) (default: 1073741824 "
                                                     "(1 GiB))", "BYTES")
    assert flag_help(by_name["dtype"])[1] == "{auto,float32,bfloat16}"
    assert flag_help(by_name["checkpoint_idle_s"])[1] == "SECONDS"
