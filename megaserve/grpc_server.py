"""What every megaserve gRPC server does the same way: health and reflection, SERVING once
started, and the shutdown sequence on SIGTERM/SIGINT (NOT_SERVING, drain, stop)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


async def start_serving(server, services: tuple[str, ...]) -> health.aio.HealthServicer:
    """Adds health and reflection for `services` to a bound server, starts it, and reports
    SERVING overall and for each service. Returns the health servicer."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    await server.start()
    for name in ("", *services):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return health_servicer


async def serve_until_signal(
    health_servicer: health.aio.HealthServicer,
    stop: Callable[[], Awaitable[None]],
    drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serves until SIGTERM or SIGINT, then: every service NOT_SERVING (load balancers stop
    sending), `drain()` if given (work in flight finishes), `stop()` (the server, with its
    grace period, and background tasks)."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await health_servicer.enter_graceful_shutdown()
    if drain is not None:
        await drain()
    await stop()
