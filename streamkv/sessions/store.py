"""Durable session state under ``--session-dir``::

    <session_dir>/<session id>/
        spec.json          SessionSpec + creation time (written once)
        log.jsonl          one line per acknowledged push: {"version": v, "records": [...], "drops": {...}}
                           (flushed and fsync'ed before the push is acknowledged)
        kv.safetensors     K/V of the stream at some version (written atomically)
        kv.json            that snapshot's tokens, record spans, versions and counters
        flash.json         registered flash questions

Recovery = load the newest KV snapshot, then re-queue every logged push newer than it.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


@dataclass
class StoredSession:
    session_id: str
    spec: dict[str, Any]
    created: float
    pushes: list[tuple[int, list[str], dict[int, int]]]
    snapshot: dict[str, Any] | None
    flash: list[dict[str, Any]]


class SessionStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a path nobody can create: the flag's error, not a traceback
            raise ValueError(f"session_dir {str(root)!r} cannot be created: {exc.strerror or exc}") from None
        self._logs: dict[str, Any] = {}

    def _dir(self, session_id: str) -> Path:
        return self.root / session_id

    def create(self, session_id: str, spec: dict[str, Any], created: float) -> None:
        d = self._dir(session_id)
        d.mkdir(parents=True, exist_ok=True)
        _atomic_write(d / "spec.json", json.dumps({"id": session_id, "spec": spec, "created": created}))

    def log_push(self, session_id: str, version: int, records: list[str], drops: dict[int, int]) -> None:
        """Append one acknowledged push (its surviving records) and the queued records of
        older versions it displaced (``drops``: version -> count, oldest first)."""
        f = self._logs.get(session_id)
        if f is None:
            f = self._logs[session_id] = open(self._dir(session_id) / "log.jsonl", "a", encoding="utf-8")
        line = {"version": version, "records": records, "drops": {str(k): n for k, n in drops.items()}}
        f.write(json.dumps(line, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())

    def save_kv(self, session_id: str, k: torch.Tensor, v: torch.Tensor, meta: dict[str, Any],
                queries: torch.Tensor | None = None) -> None:
        """K/V of the stream (and the query window of a snapkv session, when it has one)."""
        d = self._dir(session_id)
        if not d.exists():
            return  # deleted meanwhile
        tmp = d / "kv.safetensors.tmp"
        tensors = {"k": k.contiguous(), "v": v.contiguous()}
        if queries is not None:
            tensors["q"] = queries.contiguous()
        save_file(tensors, str(tmp))
        os.replace(tmp, d / "kv.safetensors")
        _atomic_write(d / "kv.json", json.dumps(meta))

    def save_flash(self, session_id: str, questions: list[dict[str, Any]]) -> None:
        if self._dir(session_id).exists():
            _atomic_write(self._dir(session_id) / "flash.json", json.dumps(questions))

    def load_kv(self, session_id: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(k, v, queries or None)`` as :meth:`save_kv` wrote them."""
        tensors = load_file(str(self._dir(session_id) / "kv.safetensors"))
        return tensors["k"], tensors["v"], tensors.get("q")

    def delete(self, session_id: str) -> None:
        f = self._logs.pop(session_id, None)
        if f is not None:
            f.close()
        shutil.rmtree(self._dir(session_id), ignore_errors=True)

    def forget(self, session_id: str) -> None:
        """Close this process's handle on a session's log; its files stay (a migration's source)."""
        f = self._logs.pop(session_id, None)
        if f is not None:
            f.close()

    def last_logged_version(self, session_id: str) -> int:
        """The newest acknowledged push's version in the session's log (0 without one)."""
        pushes = _read_log(self._dir(session_id) / "log.jsonl")
        return max((v for v, _, _ in pushes), default=0)

    def exists(self, session_id: str) -> bool:
        return (self._dir(session_id) / "spec.json").is_file()

    def close(self) -> None:
        for f in self._logs.values():
            f.close()
        self._logs.clear()

    def load_all(self) -> list[StoredSession]:
        return [self._load(d) for d in sorted(p for p in self.root.iterdir() if (p / "spec.json").is_file())]

    def load_one(self, session_id: str) -> StoredSession | None:
        """One session's stored state, or None when the dir holds no such session."""
        return self._load(self._dir(session_id)) if self.exists(session_id) else None

    def _load(self, d: Path) -> StoredSession:
        head = json.loads((d / "spec.json").read_text())
        snapshot = None
        if (d / "kv.json").is_file() and (d / "kv.safetensors").is_file():
            snapshot = json.loads((d / "kv.json").read_text())
        flash = json.loads((d / "flash.json").read_text()) if (d / "flash.json").is_file() else []
        return StoredSession(head["id"], head["spec"], head["created"], _read_log(d / "log.jsonl"), snapshot, flash)


def _read_log(path: Path) -> list[tuple[int, list[str], dict[int, int]]]:
    if not path.is_file():
        return []
    pushes = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            break  # a torn last line (crash mid-write): that push was never acknowledged
        drops = {int(k): int(n) for k, n in item.get("drops", {}).items()}
        pushes.append((int(item["version"]), list(item["records"]), drops))
    return pushes


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
