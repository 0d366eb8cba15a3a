"""The prefill worker process: model, prefill engine, gRPC server, Redis heartbeat, SIGTERM."""

from __future__ import annotations

import asyncio
import sys

import structlog

from megaserve.errors import BackendError, MeshError
from megaserve.grpc_server import serve_until_signal
from megaserve.logs import announce
from megaserve.memory_plan import MemoryPlanError
from megaserve.model import LoadedModel, serving_dtype
from megaserve.registration import Heartbeat
from megaserve.security import TLSConfigError
from megaserve.state_keys import WorkerInfo
from megaserve.watchdog import StallConfigError, StallWatch, exit_process
from megaserve.worker_args import apply_cpu_nice
from prefill_service.config import WorkerConfig, add_arguments, config_from_args, prefill_backend
from prefill_service.engine import PrefillEngine
from prefill_service.server import create_server

__all__ = ["add_arguments", "main"]
log = structlog.get_logger("megaserve.prefill")


async def serve(cfg: WorkerConfig) -> None:
    parallel, dtype = cfg.engine.parallel, serving_dtype(cfg.dtype)
    # Several devices: params split as each process reads them, else host ones the runner splits.
    model = (
        LoadedModel.load_sharded(cfg.checkpoint, dtype, parallel) if parallel.devices > 1 else None
    )
    model = model or LoadedModel.load(
        cfg.checkpoint, dtype, progress=False, on_device=parallel.devices == 1
    )
    engine = PrefillEngine(model, cfg.engine)
    watch = engine.watch = StallWatch(cfg.stall)  # times the engine's calls; watched below
    if cfg.warm_up:  # before the health service exists: nothing reports SERVING meanwhile
        await asyncio.to_thread(engine.warm_up)
    server, port, health, servicer = await create_server(engine, f"{cfg.host}:{cfg.port}", cfg.tls)
    address = f"{cfg.advertise_host or cfg.host}:{port}"
    metrics_port = (
        servicer.metrics.serve(cfg.metrics_port) if cfg.metrics_port is not None else None
    )

    def info() -> WorkerInfo:
        s = engine.stats()
        return WorkerInfo(
            cfg.worker_id,
            "prefill",
            address,
            cfg.model_name or model.name,
            s["total_pages"],
            s["available_pages"],
            s["active"],
            s["queued"],
            s["page_size"],
            cfg.engine.max_context,
            model.cfg.vocab_size,
            tp=cfg.engine.parallel.tp,
            ep=cfg.engine.parallel.ep,
        )

    hb = (
        Heartbeat(
            cfg.redis_url, info, cfg.heartbeat_s, blocks=engine.alloc, alive=watch.alive
        ).start()
        if cfg.redis_url
        else None
    )
    watch.start(lambda why: exit_process("engine stuck; exiting", why, lambda: hb and hb.stop()))
    announce(f"READY prefill worker {cfg.worker_id} grpc={address} metrics={metrics_port}")
    log.info("serving", worker_id=cfg.worker_id, address=address, pages=engine.alloc.num_pages)

    async def stop() -> None:
        await server.stop(cfg.shutdown_grace_s)
        await servicer.channels.close()  # (the calls that pushed over them have ended)
        await asyncio.to_thread(engine.stop)  # not to exit inside a prefill call
        if hb:
            hb.stop(deregister=True)
        log.info("stopped", worker_id=cfg.worker_id)

    await serve_until_signal(health, stop, alive=watch.alive)


def main(a) -> int:
    from megaserve.logs import configure
    from megaserve.malloc import keep_large_buffers

    configure()
    apply_cpu_nice(a.cpu_nice)  # first: every thread the worker starts inherits it
    keep_large_buffers()  # KV push messages reuse freed heap memory (megaserve/malloc.py)
    try:
        cfg = config_from_args(a)  # before the model loads: a bad TLS file fails at once
        log.info("backend", backend="xla", why=prefill_backend(a.backend)[1])
    except (TLSConfigError, BackendError, MeshError, StallConfigError) as e:
        print(f"megaserve prefill-worker: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        asyncio.run(serve(cfg))
    # weights + pool + program temps exceed the device; a mesh the model cannot split into
    except (MemoryPlanError, MeshError) as e:
        print(f"megaserve prefill-worker: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
