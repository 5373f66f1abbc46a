"""What the routes share: the async engine, limits, metrics and names."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.outputs import RequestOutput
from streamkv.server.config import ServerConfig
from streamkv.server.generation import Limits
from streamkv.server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    model_name: str
    limits: Limits
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def observe(self, out: RequestOutput, request: Any = None) -> None:
        """Record a finished output in the metrics and in the request's access-log counts."""
        self.metrics.observe_request(len(out.prompt_token_ids), len(out.token_ids), out.metrics)
        if request is not None:
            st = request.state
            st.tokens_in = getattr(st, "tokens_in", 0) + len(out.prompt_token_ids)
            st.tokens_out = getattr(st, "tokens_out", 0) + len(out.token_ids)
