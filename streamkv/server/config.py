"""Server settings (the HTTP layer's own frozen config)."""
from __future__ import annotations

from dataclasses import dataclass, field

from streamkv.config import check_types


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"unit": "ADDRESS", "help": "address to bind"})
    port: int = field(default=8000, metadata={"unit": "PORT", "help": "port to bind"})
    api_key: str | None = field(default=None, metadata={"unit": "KEY", "help": "require 'Authorization: Bearer KEY' "
                                                                 "(default: $STREAMKV_API_KEY)"})
    served_model_name: str | None = field(default=None, metadata={"unit": "NAME", "help": "model id reported by /v1/models"})
    max_waiting: int = field(default=256, metadata={"unit": "REQUESTS", "help": "waiting requests before 429"})
    max_body_bytes: int = field(default=4 << 20, metadata={"unit": "BYTES", "help": "largest request body (413 above)"})
    shutdown_timeout: float = field(default=10.0, metadata={"unit": "SECONDS", "help": "seconds to finish in-flight work on "
                                                                      "SIGINT/SIGTERM"})
    gc_freeze: bool = field(default=True, metadata={"help": "after loading, freeze the loaded objects out of Python's "
                                                    "garbage collector, so a full collection no longer pauses the "
                                                    "engine for ~0.1 s"})
    switch_interval: float = field(default=0.0005, metadata={
        "unit": "SECONDS", "help": "the interpreter's thread switch interval (sys.setswitchinterval; CPython's is "
                                   "0.005): a shorter one hands the engine thread the GIL back sooner when HTTP "
                                   "threads are busy"})

    def __post_init__(self) -> None:
        check_types(self)  # NaN and strings too: NaN as shutdown_timeout aborted every request at once
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if not 1e-6 <= self.switch_interval <= 1.0:  # NaN fails both comparisons
            raise ValueError(f"switch_interval must be in [1e-6, 1] seconds, got {self.switch_interval}")
