"""The decode worker process: model, engine, gRPC server, Redis heartbeat, metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import sys

import structlog

from decode_service.config import WorkerConfig, add_arguments, config_from_args
from decode_service.engine import wait_idle
from decode_service.follower import follow_leader
from decode_service.kv_service import pulls_stuck
from decode_service.server import create_server
from decode_service.worker_engine import build_engine
from megaserve.errors import BackendError, MeshError
from megaserve.grpc_server import serve_until_signal
from megaserve.logs import announce
from megaserve.memory_plan import MemoryPlanError
from megaserve.parallel.group import lead
from megaserve.parallel.step_channel import StepChannel
from megaserve.registration import Heartbeat
from megaserve.security import TLSConfigError
from megaserve.state_keys import WorkerInfo
from megaserve.watchdog import StallConfigError, StallWatch, exit_process
from megaserve.worker_args import apply_cpu_nice

__all__ = ["add_arguments", "main"]
log = structlog.get_logger("megaserve.decode")


async def serve(cfg: WorkerConfig) -> None:
    # Warm-up before the health service exists: nothing reports SERVING meanwhile.
    model, engine = await asyncio.to_thread(build_engine, cfg)
    hb = None
    # A multi-host group's leader: each runner call is broadcast to the followers first.
    leader = (
        lead(engine, StepChannel(), cfg.group.timeout_s, lambda: hb and hb.stop(deregister=True))
        if cfg.group.multi
        else None
    )
    # Times the engine's iterations from the start; configured here, watched below.
    watch = engine.watch = StallWatch(cfg.stall)
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
            tp=cfg.engine.parallel.tp,
            ep=cfg.engine.parallel.ep,
        )

    def progressing() -> bool:
        return watch.alive() and (leader is None or leader.alive(engine.loop_at))

    hb = (
        Heartbeat(
            cfg.redis_url, info, cfg.heartbeat_s, cfg.heartbeat_ttl_s, engine.alloc, progressing
        ).start()
        if cfg.redis_url
        else None
    )
    watch.start(lambda why: exit_process("engine stuck; exiting", why, lambda: hb and hb.stop()))
    # One parseable line for launchers and tests.
    announce(f"READY decode worker {cfg.worker_id} grpc={address} metrics={metrics_port}")
    log.info("serving", worker_id=cfg.worker_id, address=address, pages=engine.alloc.num_pages)

    async def drain() -> None:
        # Refuse new work; running requests finish within the grace period.
        servicer.draining = True
        try:
            await asyncio.to_thread(wait_idle, engine, cfg.shutdown_grace_s)
        except TimeoutError:
            log.warning("grace period over; cancelling", live=engine.live_count)
        servicer.streams.close_idle()  # the routers' streams end now, not at the server's stop

    async def stop() -> None:
        await server.stop(1.0)
        engine.stop()
        if leader:
            leader.stop()
        if hb:
            hb.stop(deregister=True)
        log.info("stopped", worker_id=cfg.worker_id)

    await serve_until_signal(health, stop, drain, alive=progressing)


def main(a) -> int:
    from megaserve.logs import configure
    from megaserve.malloc import keep_large_buffers

    configure()
    apply_cpu_nice(a.cpu_nice)  # first: every thread the worker starts inherits it
    keep_large_buffers()  # KV push messages reuse freed heap memory (megaserve/malloc.py)
    try:
        cfg = config_from_args(a)  # before the model loads: a bad TLS file fails at once
    except (TLSConfigError, MeshError, StallConfigError) as e:
        print(f"megaserve decode-worker: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        if not cfg.group.leader:
            return follow_leader(cfg)
        asyncio.run(serve(cfg))
        if pulls_stuck():
            # A thread blocked in the jax transfer runtime aborts the interpreter's teardown
            # (SIGABRT): the worker stopped cleanly above, so it ends here.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    # --backend pallas it cannot take; no fit; a mesh the model cannot split into
    except (BackendError, MemoryPlanError, MeshError) as e:
        print(f"megaserve decode-worker: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
