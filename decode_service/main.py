"""The decode worker process: model, engine, gRPC server, Redis heartbeat, metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid
from dataclasses import dataclass, field

import structlog
from grpc_health.v1 import health_pb2

from decode_service.engine import DecodeEngine, EngineConfig, wait_idle
from decode_service.scheduler import SchedulerConfig
from decode_service.server import SERVICE, create_server
from megaserve.model import LoadedModel
from megaserve.registration import Heartbeat
from megaserve.security import TLSConfig, TLSConfigError
from megaserve.state_keys import WorkerInfo
from megaserve.worker_args import add_common_arguments, advertised_address, served_model_name

log = structlog.get_logger("megaserve.decode")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a decode worker process is configured by (built once, from the CLI)."""

    checkpoint: str = "smollm2"
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


def add_arguments(p) -> None:
    add_common_arguments(p, max_context=2048)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--shutdown-grace", type=float, default=10.0)


def config_from_args(a) -> WorkerConfig:
    return WorkerConfig(
        checkpoint=a.checkpoint,
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
        engine=EngineConfig(
            page_size=a.page_size,
            kv_budget_bytes=a.kv_budget_mb * 2**20,
            max_context=a.max_context,
            scheduler=SchedulerConfig(
                max_running=a.max_running, max_waiting=a.max_waiting, prefill_chunk=a.prefill_chunk
            ),
        ),
    )


async def serve(cfg: WorkerConfig) -> None:
    model = LoadedModel.load(cfg.checkpoint, progress=False)
    engine = DecodeEngine(model, cfg.engine)
    engine.start()
    server, port, health, servicer = await create_server(engine, f"{cfg.host}:{cfg.port}", cfg.tls)
    address = f"{cfg.advertise_host or cfg.host}:{port}"
    metrics_port = (
        servicer.metrics.serve(cfg.metrics_port) if cfg.metrics_port is not None else None
    )

    def info() -> WorkerInfo:
        s = engine.stats()
        return WorkerInfo(
            cfg.worker_id,
            "decode",
            address,
            cfg.model_name or model.name,
            s["total_pages"],
            s["free_pages"] + s["cached_pages"],
            s["running"],
            s["waiting"],
            s["page_size"],
            cfg.engine.max_context,
            model.cfg.vocab_size,
        )

    hb = (
        Heartbeat(
            cfg.redis_url, info, cfg.heartbeat_s, cfg.heartbeat_ttl_s, blocks=engine.alloc
        ).start()
        if (cfg.redis_url)
        else None
    )
    # One parseable line for launchers and tests.
    print(f"READY decode worker {cfg.worker_id} grpc={address} metrics={metrics_port}", flush=True)
    log.info("serving", worker_id=cfg.worker_id, address=address, pages=engine.alloc.num_pages)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Graceful: refuse new work, let running requests finish within the grace period.
    servicer.draining = True
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        await asyncio.to_thread(wait_idle, engine, cfg.shutdown_grace_s)
    except TimeoutError:
        log.warning("grace period over; cancelling", live=len(engine._live))
    await server.stop(1.0)
    engine.stop()
    if hb:
        hb.stop(deregister=True)
    log.info("stopped", worker_id=cfg.worker_id)


def main(a) -> int:
    from megaserve.logs import configure

    configure()
    try:
        cfg = config_from_args(a)  # before the model loads: a bad TLS file fails at once
    except TLSConfigError as e:
        print(f"megaserve decode-worker: error: {e}", file=sys.stderr, flush=True)
        return 2
    asyncio.run(serve(cfg))
    return 0
