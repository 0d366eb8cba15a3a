"""Everything a prefill worker process is configured by, built once from the CLI."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from megaserve.security import TLSConfig
from megaserve.watchdog import StallConfig
from megaserve.worker_args import (
    add_backend_argument,
    add_common_arguments,
    advertised_address,
    grace_seconds,
    parallel_from_args,
    served_model_name,
    stall_from_args,
)
from prefill_service.engine import PrefillConfig


def prefill_backend(requested: str) -> tuple[str, str]:
    """(backend, why) of the prefill programs for a --backend value: XLA on every backend
    today (the megakernel is a decode step); `pallas` is refused until a Pallas prefill
    kernel exists (ragged paged attention)."""
    from megaserve.errors import BackendError

    if requested == "pallas":
        raise BackendError(
            "--backend pallas: the prefill tier has no Pallas kernel yet (its programs are "
            "XLA); use auto or xla"
        )
    return "xla", "requested" if requested == "xla" else "auto: prefill programs are XLA"


@dataclass(frozen=True)
class WorkerConfig:
    """One prefill worker process."""

    checkpoint: str = "smollm2"
    dtype: str = "auto"  # --dtype: see megaserve.model.serving_dtype (the decode tier's)
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = field(default_factory=lambda: f"prefill-{uuid.uuid4().hex[:8]}")
    redis_url: str | None = None
    metrics_port: int | None = None
    heartbeat_s: float = 0.5
    shutdown_grace_s: float = 5.0  # in-flight prefills get this long after SIGTERM
    engine: PrefillConfig = PrefillConfig()
    model_name: str = ""  # advertised model name ("" = the checkpoint source)
    advertise_host: str = ""  # host peers dial ("" = host)
    tls: TLSConfig | None = None  # serve TLS; KV pushes to decode workers present this cert
    warm_up: bool = True  # --warm-up all: every program compiled before SERVING
    stall: StallConfig = StallConfig()  # --stall-s / --stall-exit-s (megaserve/watchdog.py)


def add_arguments(p) -> None:
    add_common_arguments(p, max_context=4096)
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=PrefillConfig.chunk,
        help="token budget of one prefill call, padding included, split over the prompts in it",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=PrefillConfig.max_queued,
        help="prompts waiting for a batch row; beyond it RESOURCE_EXHAUSTED + retry-after-ms",
    )
    p.add_argument(
        "--shutdown-grace",
        type=grace_seconds,
        default=WorkerConfig.shutdown_grace_s,
        help="seconds prefill calls in flight get after SIGTERM; then the engine ends after "
        "the call it is in and fails the prompts it still holds",
    )
    add_backend_argument(p)


def config_from_args(a) -> WorkerConfig:
    """TLSConfigError for unreadable TLS files, BackendError for --backend pallas and
    MeshError for a --tp/--ep the model cannot split (all checked before any model loads;
    the tp x ep host devices are forced here)."""
    prefill_backend(a.backend)
    return WorkerConfig(
        checkpoint=a.checkpoint,
        dtype=a.dtype,
        host=a.host,
        port=a.port,
        worker_id=a.worker_id or f"prefill-{uuid.uuid4().hex[:8]}",
        redis_url=a.redis_url,
        metrics_port=a.metrics_port,
        heartbeat_s=a.heartbeat_s,
        model_name=served_model_name(a),
        advertise_host=advertised_address(a, 0).rsplit(":", 1)[0],
        tls=TLSConfig.from_args(a),
        warm_up=a.warm_up == "all",
        shutdown_grace_s=a.shutdown_grace,
        stall=stall_from_args(a),
        engine=PrefillConfig(
            page_size=a.page_size,
            kv_budget_bytes=None if a.kv_budget_mb is None else a.kv_budget_mb * 2**20,
            max_context=a.max_context,
            chunk=a.prefill_chunk,
            max_queued=a.max_queued,
            parallel=parallel_from_args(a),
            cpu_turns=a.cpu_turns or "",
        ),
    )
