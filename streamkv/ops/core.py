"""The engine as sessions and input streams see it: a structural interface, no import of it.

:class:`streamkv.engine.engine.Engine` satisfies :class:`EngineCore`; sessions and input
streams are handed the engine at construction and type against this protocol, so neither
package imports ``streamkv.engine`` (no import cycle between them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence as Seq

if TYPE_CHECKING:
    from streamkv.config import EngineConfig
    from streamkv.kv.block_pool import BlockPool
    from streamkv.kv.manager import KVManager
    from streamkv.policies.read import ReadPolicy
    from streamkv.runner.kv_ops import KVOps
    from streamkv.sampling.params import SamplingParams
    from streamkv.sched.scheduler import Scheduler
    from streamkv.sched.sequence import PriorityClass, Sequence
    from streamkv.ops.seq_ops import SeqOps


class EngineCore(Protocol):
    """What an engine offers the subsystems built on its sequences (all on its thread)."""

    config: "EngineConfig"
    tokenizer: Any
    max_model_len: int
    kv: "KVManager"
    pool: "BlockPool"
    scheduler: "Scheduler"
    kv_ops: "KVOps | None"
    seq_ops: "SeqOps"
    stats: Any
    sessions: Any
    kv_policies: Any  # the defaults; .resolve(kv_write, kv_read) -> (write, read) policies or InvalidRequestError

    def add_request(self, request_id: str, prompt: str | Seq[int], params: "SamplingParams | None" = None,
                    priority: int = 0, klass: "PriorityClass" = ..., partial: bool = False) -> "Sequence | None":
        """Queue a request (``partial``: its input may still change, see ``streamkv.inputs``)."""

    def add_fork_request(self, request_id: str, parent: "Sequence", num_tokens: int, suffix: Seq[int],
                         params: "SamplingParams | None" = None, priority: int = 0,
                         klass: "PriorityClass" = ..., read: "ReadPolicy | None" = None,
                         read_from: int | None = None) -> "Sequence":
        """Generate from a copy-on-write fork of ``parent``'s first ``num_tokens`` tokens (rows from
        ``read_from``, default ``num_tokens``, under ``read``)."""

    def check_write_fits(self, n_tokens: int, max_tokens: int, write: Any) -> None:
        """InvalidRequestError when a prompt of ``n_tokens`` (answer up to ``max_tokens``) under
        write policy ``write`` reaches a compression that can never fit the KV pool."""

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` names a live request."""

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV; False when unknown."""

    def fail(self, request_id: str, message: str, retry: bool = False) -> bool:
        """End a request with an error (``retry``: a retryable one); False when unknown."""

    def step(self) -> list[Any]:
        """Run one engine step."""

    def run_to_completion(self, request_ids: Seq[str]) -> dict[str, Any]:
        """Step until every listed request finished."""

    def drop_output(self, request_id: str) -> None:
        """Nobody will read ``request_id``'s output: abort it (if running) and forget it, at the next step."""
