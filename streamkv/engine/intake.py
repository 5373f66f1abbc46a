"""Prompt checks of the engine's intake (a mixin of ``Engine``): what ``add_request`` and the
session, input-stream and span paths refuse before anything is queued. Each raises
``InvalidRequestError`` with the reason; none changes the engine."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence as Seq

from streamkv.errors import InvalidRequestError

if TYPE_CHECKING:
    from streamkv.kv.block_pool import BlockPool
    from streamkv.kv.manager import KVManager
    from streamkv.policies.write import WritePolicy


class PromptChecks:
    """Needs ``tokenizer``, ``bundle`` (``vocab_size``), ``max_model_len``, ``kv`` and ``pool``."""

    tokenizer: Any
    bundle: Any
    max_model_len: int
    kv: "KVManager"
    pool: "BlockPool"

    def tokenize_prompt(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise InvalidRequestError("prompt must be a string or a list of token ids") from None
        if any(isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt token ids must be integers")
        return None, ids

    def check_prompt(self, prompt: str | Seq[int]) -> list[int]:
        """Tokenize and validate a prompt exactly as :meth:`add_request` will (thread-safe:
        reads only immutable engine facts); raises InvalidRequestError."""
        _, ids = self.tokenize_prompt(prompt)
        self._validate_ids(ids)
        return ids

    def _validate_ids(self, ids: list[int], allow_empty: bool = False) -> None:
        if not ids and not allow_empty:
            raise InvalidRequestError("prompt is empty")
        vocab = self.bundle.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but the context is {self.max_model_len} tokens "
                f"(the prompt must leave room for at least one generated token)")
        if self.kv.blocks_for(len(ids) + 1) > self.pool.num_blocks:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but the KV cache holds only "
                f"{self.pool.num_blocks * self.pool.block_size}; raise --kv-cache-memory")

    def check_write_fits(self, n_tokens: int, max_tokens: int, write: "WritePolicy | None") -> None:
        """A prompt of ``n_tokens`` (answer up to ``max_tokens``) under the write policy ``write``
        (None: nothing to check) must fit the pool where it peaks, if it gets there: the chunk
        reaching the compression point holds the point's blocks and the kept rows' new ones at
        once (Sequence.extra_blocks). One that never can would wait for free blocks forever,
        ahead of everything queued after it."""
        if write is None or write.point(n_tokens) > n_tokens + max_tokens - 1:  # never compresses
            return
        need = self.kv.blocks_for(write.point(n_tokens)) + write.layout_blocks(self.pool.block_size)
        if need > self.pool.num_blocks:
            raise InvalidRequestError(
                f"kv_write: compressing this {n_tokens}-token prompt holds up to {need} KV blocks at once "
                f"(the prompt's and the {write.capacity} kept rows' copies) but the KV cache has "
                f"{self.pool.num_blocks}; raise --kv-cache-memory or lower the policy's budget", param="kv_write")
