"""What the engine hands back for each request."""
from __future__ import annotations

from dataclasses import dataclass, field

from streamkv.sched.plan import TokenLogprobs


@dataclass
class RequestOutput:
    """Cumulative state of one request plus what is new since the previous output.

    ``finish_reason`` is ``"stop"`` (stop token or string), ``"length"`` (max_tokens or
    context), ``"abort"`` or ``"error"`` (see ``error``), or None while running.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_str: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    retry: bool = False  # an "error" for want of room (KV blocks): the same request may succeed later
    metrics: dict[str, float] = field(default_factory=dict)
    # telemetry: ``(event, seconds since arrival)`` in order: queued, scheduled, kv_resident,
    # input_appended, input_updated, preempted_swap, preempted_recompute, swapped_in, finished
    events: list[tuple[str, float]] = field(default_factory=list)
    cached: bool = False  # answered from the response cache, without model work
    kv: dict | None = None  # with a KV policy: tokens seen / kept, bytes per token (``engine/kv_policies.py``)
