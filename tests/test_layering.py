"""Package layering: sessions, streaming inputs and the sequence operations depend on the
engine only through ``streamkv.ops.EngineCore`` (no import of ``streamkv.engine``, so no cycle)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "streamkv"
ALLOWED = {"streamkv.engine.outputs"}  # the output data contract (no engine code)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("package", ["sessions", "inputs", "ops", "sched", "kv", "spans"])
def test_no_import_of_the_engine(package):
    bad = {f"{p.relative_to(PKG)}: {m}" for p in (PKG / package).rglob("*.py") for m in _imports(p)
           if (m == "streamkv.engine" or m.startswith("streamkv.engine.")) and m not in ALLOWED}
    assert not bad, f"{package}/ imports the engine: {sorted(bad)}"


def test_the_check_sees_an_engine_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from streamkv.engine.engine import Engine\n")
    assert "streamkv.engine.engine" in _imports(f)
