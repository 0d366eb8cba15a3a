"""A follower process of a multi-host decode group (JAX_PROCESS_ID > 0): it builds the
leader's engine and runs only the calls process 0 broadcasts; no gRPC server, no Redis."""

from __future__ import annotations

import signal

import structlog

from decode_service.config import WorkerConfig
from decode_service.worker_engine import build_engine
from megaserve.logs import announce
from megaserve.parallel.group import PoolLost, follow
from megaserve.parallel.step_channel import StepChannel

log = structlog.get_logger("megaserve.decode")


def follow_leader(cfg: WorkerConfig) -> int:
    """Follows until the leader's STOP (0) or a call that lost the pool (1). When the leader
    dies, JAX's runtime ends this process (SIGABRT) within the group timeout."""
    _, engine = build_engine(cfg)
    g = cfg.group
    # The leader drains on SIGTERM and needs every follower meanwhile; its STOP ends this one.
    signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: following until the leader stops"))
    announce(f"READY decode follower {cfg.worker_id} process={g.process_id}/{g.processes}")
    log.info("following", worker_id=cfg.worker_id, process=g.process_id, processes=g.processes)
    try:
        calls = follow(engine, StepChannel())
    except PoolLost as e:
        log.error("group broken; exiting", why=str(e))
        return 1
    log.info("leader stopped the group", calls=calls)
    return 0
