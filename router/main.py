"""The router process: tokenizers, Redis-backed cluster view, public gRPC server, SIGTERM."""

from __future__ import annotations

import asyncio
import signal

import structlog

from megaserve.checkpoint import load_tokenizer
from router.config import RouterConfig
from router.server import create_server
from router.state import ClusterState

log = structlog.get_logger("megaserve.router")


def add_arguments(p) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="public gRPC port (0 = any free)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--config", help="load-balancing YAML (default: router/loadbalancer.yaml)")
    p.add_argument(
        "--checkpoint",
        action="append",
        help="a model to serve (its tokenizer is loaded here; workers run the weights); "
        "NAME=SPEC names it. Repeatable. Default: smollm2",
    )


def load_models(specs: list[str] | None) -> dict:
    out = {}
    for spec in specs or ["smollm2"]:
        name, _, path = spec.rpartition("=") if "=" in spec else (None, "", spec)
        info = load_tokenizer(path, name or None)
        out[info.name] = info
    return out


async def serve(a) -> None:
    cfg = RouterConfig.from_yaml(a.config) if a.config else RouterConfig()
    models = load_models(a.checkpoint)
    state = ClusterState(a.redis_url, cfg.state_refresh_ms / 1000, cfg.session_ttl_s)
    server, port, health, servicer = await create_server(models, state, cfg, f"{a.host}:{a.port}")
    print(f"READY router {servicer.router_id} grpc={a.host}:{port}", flush=True)
    log.info("serving", port=port, models=sorted(models), redis=a.redis_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health.enter_graceful_shutdown()
    await server.stop(5.0)  # streams in flight get a grace period
    await servicer.dispatcher.close()
    await state.stop()


def main(a) -> int:
    from megaserve.logs import configure

    configure()
    try:
        asyncio.run(serve(a))
    except ValueError as e:  # a bad config file or checkpoint
        print(f"megaserve router: error: {e}", flush=True)
        return 2
    return 0
