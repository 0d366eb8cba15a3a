"""The router's load-balancing configuration: one frozen dataclass, loaded from YAML."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

POLICIES = ("round_robin", "least_loaded", "power_of_two", "kv_aware", "session_affinity")
DEFAULTS_FILE = Path(__file__).with_name("loadbalancer.yaml")


@dataclass(frozen=True)
class RouterConfig:
    """Every knob of placement and resilience; defaults equal router/loadbalancer.yaml."""

    prefill_policy: str = "round_robin"
    decode_policy: str = "kv_aware"
    session_fallback_policy: str = "kv_aware"
    prefill_load_scale: float = 8.0
    busy_threshold_running: int = 64
    busy_threshold_kv_usage: float = 0.95
    balance_max_excess: int = 8
    balance_max_share: float = 1.5
    balance_window: int = 64
    disagg_min_uncached_tokens: int = 256
    prefill_busy_threshold_running: int = 16
    transport: str = "grpc"
    session_ttl_s: float = 600.0
    retry_max_attempts: int = 3
    retry_base_delay_ms: float = 50.0
    retry_max_delay_ms: float = 1000.0
    max_migrations: int = 4
    circuit_breaker_failures: int = 3
    circuit_breaker_reset_s: float = 5.0
    state_refresh_ms: float = 200.0
    # Blocks this router sends to a worker are written to Redis at once, so the other routers
    # count them (in flight, not yet in the worker's published set) too.
    share_placements: bool = True
    reservation_lease_ms: int = 60000
    # Decode calls go over one long-lived GenerateStream per worker (per-call gRPC costs paid
    # once); false: one Generate call per request.
    worker_streams: bool = True
    # A worker absent from the view this long (its heartbeat expired: frozen, partitioned) is
    # gone: its requests in flight fail over (migrate) instead of waiting on it.
    worker_gone_s: float = 2.0
    # A Generate whose model has no healthy decode worker waits this long for one (never past
    # its deadline) before UNAVAILABLE.
    no_worker_wait_s: float = 30.0
    # Public requests one router holds at once; more are refused at once (RESOURCE_EXHAUSTED
    # with a retry-after-ms hint of retry_after_ms).
    max_inflight_requests: int = 256
    retry_after_ms: int = 1000

    def __post_init__(self):
        for name in ("prefill_policy", "decode_policy", "session_fallback_policy"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(f"{name}={getattr(self, name)!r}: not one of {POLICIES}")
        if self.session_fallback_policy == "session_affinity":
            raise ValueError("session_fallback_policy cannot itself be session_affinity")
        if self.transport not in ("grpc", "jax_transfer"):
            raise ValueError(f"transport={self.transport!r}: not 'grpc' or 'jax_transfer'")
        if not 0 < self.busy_threshold_kv_usage <= 1:
            raise ValueError(
                f"busy_threshold_kv_usage={self.busy_threshold_kv_usage} not in (0, 1]"
            )
        if self.balance_max_share < 1:
            raise ValueError(f"balance_max_share={self.balance_max_share} must be >= 1")
        for name in (
            "retry_max_attempts",
            "circuit_breaker_failures",
            "balance_window",
            "max_inflight_requests",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int | float) and v < 0:
                raise ValueError(f"{f.name}={v} must be >= 0")

    @classmethod
    def from_yaml(cls, path: str | Path) -> RouterConfig:
        """Reads a YAML mapping of knobs; unknown keys and wrong types are errors."""
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read load-balancing config {str(path)!r}: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of knobs, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(fields)}")
        out = {}
        for k, v in data.items():
            want = type(getattr(cls(), k))
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, want) or isinstance(v, bool) != (want is bool):
                raise ValueError(f"{path}: {k}={v!r} should be a {want.__name__}")
            out[k] = v
        return cls(**out)
