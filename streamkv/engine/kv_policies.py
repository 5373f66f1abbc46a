"""Per-request KV policies: a request's ``kv_write`` / ``kv_read`` over the server defaults,
and what each request reports about its KV (``RequestOutput.kv``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamkv.config import KVPolicyConfig
from streamkv.errors import InvalidRequestError
from streamkv.policies.read import ReadCount, ReadPolicy, make_read_policy, request_read_spec
from streamkv.policies.write import WritePolicy, make_write_policy
from streamkv.sched.sequence import Sequence

PolicySpec = dict[str, Any] | WritePolicy | ReadPolicy | None


@dataclass(frozen=True)
class KVPolicies:
    """The defaults (``--kv-write``, ``--kv-read``), parsed once."""

    write: WritePolicy | None = None
    read: ReadPolicy | None = None

    @classmethod
    def from_config(cls, config: KVPolicyConfig) -> KVPolicies:
        return cls(config.write_policy, config.read_policy)  # type: ignore[arg-type]

    def resolve(self, kv_write: PolicySpec, kv_read: PolicySpec) -> tuple[WritePolicy | None, ReadPolicy | None]:
        """A request's policies: its own (``{"policy": "none"}`` turns one off) or the defaults;
        raises InvalidRequestError naming the problem. Both may apply: the read policy then picks
        pages among the rows the write policy kept (its ring is always read)."""
        kv_read = request_read_spec(kv_read)
        write = self.write if kv_write is None else _parse("kv_write", make_write_policy, kv_write)
        read = self.read if kv_read is None else _parse("kv_read", make_read_policy, kv_read)
        return write, read


def _parse(name: str, make: Any, spec: PolicySpec) -> Any:
    """``make(spec)``; its ValueError as an InvalidRequestError whose message starts with ``name``."""
    try:
        return make(spec)
    except ValueError as exc:
        msg = str(exc)
        raise InvalidRequestError(msg if msg.startswith(name) else f"{name}: {msg}") from None


def kv_report(seq: Sequence, bytes_per_row: int) -> dict[str, Any] | None:
    """What a request with a KV policy kept and read::

        {"tokens_seen": N, "tokens_kept": K, "kv_bytes_read_per_token": B, "write": {...},
         "compressed": bool, "compress_ms": ms}                                      (kv_write)
        {"tokens_seen": N, "tokens_kept": N, "kv_bytes_read_per_token": B, "read": {...},
         "tokens_read_per_step": r, "pages_scored": s, "pages_picked": p, "attention_recall": x}  (kv_read)

    ``kv_bytes_read_per_token``: K and V bytes (every layer) one decode step reads: under a read
    policy averaged over the request's steps; under a write policy alone, of the rows held at the
    end (what every step in the compressed layout reads; an uncompressed one's earlier steps read
    fewer, one row less per token since); ``attention_recall``: the picked rows' share of the exact softmax mass,
    on sampled steps (None before one was sampled).
    """
    if seq.write is None and seq.read is None:
        return None
    seen = seq.num_computed
    kept = seq.kv_rows(seen)
    out: dict[str, Any] = {"tokens_seen": seen, "tokens_kept": kept, "kv_bytes_read_per_token": kept * bytes_per_row}
    if seq.write is not None:
        out["write"] = seq.write.to_dict()
        out["compressed"] = seq.compressed
        out["compress_ms"] = round(seq.compress_s * 1e3, 3)
    if seq.read is not None:
        out["read"] = seq.read.to_dict()
        r = seq.reads
        if r is not None and r.steps:
            out["tokens_read_per_step"] = round(r.rows_read / r.steps, 1)
            out["kv_bytes_read_per_token"] = round(r.rows_read / r.steps * bytes_per_row)
            out["pages_scored"], out["pages_picked"] = r.pages_scored, r.pages_picked
            out["attention_recall"] = round(r.recall_sum / r.recall_n, 4) if r.recall_n else None
    return out


@dataclass
class KVPolicyTotals:
    """Engine-wide sums over finished requests with a KV policy (Prometheus counters)."""

    tokens_seen: int = 0
    tokens_kept: int = 0
    compressions: int = 0
    compress_s: float = 0.0
    reads: ReadCount = field(default_factory=ReadCount)

    def add(self, seq: Sequence) -> None:
        if seq.write is not None:
            self.tokens_seen += seq.num_computed
            self.tokens_kept += seq.kv_rows(seq.num_computed)
            self.compressions += int(seq.compressed)
            self.compress_s += seq.compress_s
        if seq.reads is not None:
            self.reads.add(seq.reads)
