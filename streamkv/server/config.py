"""Server settings (the HTTP layer's own frozen config)."""
from __future__ import annotations

from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
