"""Options of a cluster deployment (plain data: no Ray import)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specdecode.cluster.routing import DEFAULT_PREFIX_CHARS
from specdecode.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_POOL_GB


@dataclass
class ClusterConfig:
    # ---- the engine of each replica (the `specdecode serve` options) ----
    model: str
    dtype: str = "bf16"
    device: str | None = None
    max_model_len: int | None = None
    speculative_config: dict[str, Any] | None = None
    quantization: str = "auto"
    seed: int = 0
    max_num_seqs: int = 8
    max_waiting: int = 64
    served_model_name: str | None = None
    api_key: str | None = None
    default_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    enable_prefix_caching: bool = True
    prefix_cache_gb: float = DEFAULT_POOL_GB
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    """0: whole prompts at once (no chunked prefill)."""
    # ---- replicas ----
    replicas: int = 1
    """Replicas at start (the fixed count without autoscaling)."""
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    """Autoscaling target of requests in flight per replica (default: max_num_seqs, a full running batch)."""
    replica_threads: int = 1
    replica_gpus: float = 0.0
    drain_timeout_s: float = 30.0  # a replica's graceful shutdown: its requests in flight get this long to finish
    max_queued_requests: int | None = None
    """Requests the ingress holds for a replica slot when every replica is full (default: max_waiting); more:
    a 429 (Ray Serve's back-pressure)."""
    # ---- routing ----
    route_prefix_chars: int = DEFAULT_PREFIX_CHARS
    route_saturation: int | None = None
    """Requests in flight at which a key's replica counts as saturated (default: max_num_seqs)."""
    health_check_period_s: float = 5.0
    app_name: str = "specdecode"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        checks = {"replicas": self.replicas, "replica_threads": self.replica_threads,
                  "max_num_seqs": self.max_num_seqs, "max_waiting": self.max_waiting,
                  "route_prefix_chars": self.route_prefix_chars}
        for name, value in checks.items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.replica_gpus < 0:
            raise ValueError(f"--replica-gpus must be >= 0, got {self.replica_gpus}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            lo = self.min_replicas if self.min_replicas is not None else self.replicas
            hi = self.max_replicas if self.max_replicas is not None else max(self.replicas, lo)
            self.min_replicas, self.max_replicas = lo, hi
        if self.autoscaling:
            assert self.min_replicas is not None and self.max_replicas is not None
            if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
                raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got "
                                 f"{self.min_replicas} and {self.max_replicas}")
            self.replicas = min(max(self.replicas, self.min_replicas), self.max_replicas)

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    @property
    def saturation(self) -> int:
        return self.route_saturation if self.route_saturation is not None else self.max_num_seqs

    @property
    def max_ongoing_requests(self) -> int:
        """What Ray Serve sends one replica at most: its batch plus its queue (beyond it the engine 429s)."""
        return self.max_num_seqs + self.max_waiting

    @property
    def queued_requests(self) -> int:
        """Ray Serve's `max_queued_requests` of the engine deployment: requests the ingress's handle holds while no
        replica has room."""
        return self.max_queued_requests if self.max_queued_requests is not None else self.max_waiting

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
