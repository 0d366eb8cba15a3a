"""What every megaserve gRPC server does the same way: health and reflection, SERVING once
started (NOT_SERVING while a worker's engine is stalled), and the shutdown sequence on
SIGTERM/SIGINT (NOT_SERVING, drain, stop)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


class Health(health.aio.HealthServicer):
    """The health service, knowing the names it reports for (overall "" and each service)."""

    def __init__(self, services: tuple[str, ...]):
        super().__init__()
        self.names = ("", *services)

    async def set_all(self, serving: bool) -> None:
        """Every name SERVING or NOT_SERVING (after a graceful shutdown began: no change)."""
        status = health_pb2.HealthCheckResponse
        for name in self.names:
            await self.set(name, status.SERVING if serving else status.NOT_SERVING)


async def start_serving(server, services: tuple[str, ...]) -> Health:
    """Adds health and reflection for `services` to a bound server, starts it, and reports
    SERVING overall and for each service. Returns the health servicer."""
    health_servicer = Health(services)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    await server.start()
    await health_servicer.set_all(True)
    return health_servicer


async def _follow(health_servicer: Health, alive: Callable[[], bool], poll_s: float) -> None:
    """Health follows `alive()`: NOT_SERVING while it is False (probes and clients see a
    worker whose engine is stuck as out of service), SERVING again once it is True."""
    serving = True
    while True:
        await asyncio.sleep(poll_s)
        now = alive()
        if now != serving:
            serving = now
            await health_servicer.set_all(now)


async def serve_until_signal(
    health_servicer: health.aio.HealthServicer,
    stop: Callable[[], Awaitable[None]],
    drain: Callable[[], Awaitable[None]] | None = None,
    alive: Callable[[], bool] | None = None,
    poll_s: float = 0.25,
) -> None:
    """Serves until SIGTERM or SIGINT (a Health following `alive()` if given), then: every
    service NOT_SERVING (load balancers stop sending), `drain()` if given (work in flight
    finishes), `stop()` (the server, with its grace period, and background tasks)."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    follow = asyncio.create_task(_follow(health_servicer, alive, poll_s)) if alive else None
    await stopping.wait()
    if follow:
        follow.cancel()
    await health_servicer.enter_graceful_shutdown()
    if drain is not None:
        await drain()
    await stop()
