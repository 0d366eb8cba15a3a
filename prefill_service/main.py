"""The prefill worker process: model, prefill engine, gRPC server, Redis heartbeat, SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid

import structlog
from grpc_health.v1 import health_pb2

from megaserve.model import LoadedModel
from megaserve.registration import Heartbeat
from megaserve.security import TLSConfig, TLSConfigError
from megaserve.state_keys import WorkerInfo
from megaserve.worker_args import add_common_arguments, advertised_address, served_model_name
from prefill_service.engine import PrefillConfig, PrefillEngine
from prefill_service.server import SERVICE, create_server

log = structlog.get_logger("megaserve.prefill")


def add_arguments(p) -> None:
    add_common_arguments(p, max_context=4096)
    p.add_argument("--prefill-chunk", type=int, default=256)


async def serve(a, tls: TLSConfig | None = None) -> None:
    cfg = PrefillConfig(
        page_size=a.page_size,
        kv_budget_bytes=a.kv_budget_mb * 2**20,
        max_context=a.max_context,
        chunk=a.prefill_chunk,
    )
    model = LoadedModel.load(a.checkpoint, progress=False)
    engine = PrefillEngine(model, cfg)
    server, port, health, servicer = await create_server(engine, f"{a.host}:{a.port}", tls)
    if a.metrics_port is not None:
        servicer.metrics.serve(a.metrics_port)
    address = advertised_address(a, port)
    name = served_model_name(a)
    worker_id = a.worker_id or f"prefill-{uuid.uuid4().hex[:8]}"

    def info() -> WorkerInfo:
        al = engine.alloc
        return WorkerInfo(
            worker_id,
            "prefill",
            address,
            name,
            al.num_pages - 1,
            al.num_available,
            len(engine._active),
            engine._queue.qsize(),
            al.page_size,
            cfg.max_context,
            model.cfg.vocab_size,
        )

    hb = (
        Heartbeat(a.redis_url, info, a.heartbeat_s, blocks=engine.alloc).start()
        if a.redis_url
        else None
    )
    print(f"READY prefill worker {worker_id} grpc={address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(5.0)  # in-flight prefills get the grace period
    if hb:
        hb.stop(deregister=True)
    log.info("stopped", worker_id=worker_id)


def main(a) -> int:
    from megaserve.logs import configure

    configure()
    try:
        tls = TLSConfig.from_args(a)  # before the model loads: a bad TLS file fails at once
    except TLSConfigError as e:
        print(f"megaserve prefill-worker: error: {e}", file=sys.stderr, flush=True)
        return 2
    asyncio.run(serve(a, tls))
    return 0
