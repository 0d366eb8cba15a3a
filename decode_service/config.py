"""Everything a decode worker process is configured by, built once from the CLI."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from decode_service.engine import EngineConfig
from decode_service.scheduler import SchedulerConfig
from megaserve.parallel.distributed import GroupConfig
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


@dataclass(frozen=True)
class WorkerConfig:
    """One decode worker process."""

    checkpoint: str = "smollm2"
    dtype: str = "auto"  # --dtype: see megaserve.model.serving_dtype
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = field(default_factory=lambda: f"decode-{uuid.uuid4().hex[:8]}")
    redis_url: str | None = None
    metrics_port: int | None = None
    heartbeat_s: float = 0.5
    heartbeat_ttl_s: float = 5.0
    shutdown_grace_s: float = 10.0
    engine: EngineConfig = EngineConfig()
    model_name: str = ""  # advertised model name ("" = the checkpoint source)
    advertise_host: str = ""  # host peers dial ("" = host)
    tls: TLSConfig | None = None  # --tls-cert/--tls-key/--tls-ca (mTLS when a CA is given)
    warm_up: bool = True  # --warm-up all: every program compiled before SERVING
    # JAX_NUM_PROCESSES > 1: one of a multi-host group (process 0 serves, the others follow).
    group: GroupConfig = GroupConfig()
    stall: StallConfig = StallConfig()  # --stall-s / --stall-exit-s (megaserve/watchdog.py)


def add_arguments(p) -> None:
    add_common_arguments(p, max_context=2048)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="token budget of one iteration's prefill call, padding included, split over "
        "pieces of several prompts beside the decode step",
    )
    p.add_argument(
        "--shutdown-grace",
        type=grace_seconds,
        default=10.0,
        help="seconds running requests get to finish after SIGTERM",
    )
    p.add_argument(
        "--group-timeout-s",
        type=int,
        default=10,
        help="multi-host groups (JAX_NUM_PROCESSES > 1): JAX's heartbeat timeout (a dead "
        "process ends the others within it); a group call stuck half this long withdraws the "
        "leader's registration, twice this long ends the leader",
    )
    add_backend_argument(p)


def config_from_args(a) -> WorkerConfig:
    """TLSConfigError for unreadable TLS files, MeshError for a --tp/--ep the model cannot
    split or a bad JAX_* group variable (checked before any model loads; the tp x ep host
    devices are forced here, and a multi-host group is joined)."""
    group = GroupConfig.from_env(timeout_s=a.group_timeout_s)
    return WorkerConfig(
        checkpoint=a.checkpoint,
        dtype=a.dtype,
        host=a.host,
        port=a.port,
        worker_id=a.worker_id or f"decode-{uuid.uuid4().hex[:8]}",
        redis_url=a.redis_url,
        metrics_port=a.metrics_port,
        shutdown_grace_s=a.shutdown_grace,
        heartbeat_s=a.heartbeat_s,
        model_name=served_model_name(a),
        advertise_host=advertised_address(a, 0).rsplit(":", 1)[0],
        tls=TLSConfig.from_args(a),
        warm_up=a.warm_up == "all",
        group=group,
        stall=stall_from_args(a),
        engine=EngineConfig(
            page_size=a.page_size,
            kv_budget_bytes=None if a.kv_budget_mb is None else a.kv_budget_mb * 2**20,
            max_context=a.max_context,
            backend=a.backend,
            parallel=parallel_from_args(a, group),
            cpu_turns=a.cpu_turns or "",
            scheduler=SchedulerConfig(
                max_running=a.max_running, max_waiting=a.max_waiting, prefill_chunk=a.prefill_chunk
            ),
        ),
    )
