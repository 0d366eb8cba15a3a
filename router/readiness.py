"""The router's readiness: health SERVING only while every model it serves has at least one
decode worker in the Redis view.

The view refreshes every `state_refresh_ms`; a worker whose heartbeat key expired (5 s TTL)
drops out of it, so a model that lost its last decode worker turns the router NOT_SERVING
within the TTL plus one refresh. A router started while Redis is down has an empty view and
stays NOT_SERVING until Redis and a worker are up. While Redis is unreachable the last view
is kept, and with it the status (the router serves on that view).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import structlog
from grpc_health.v1 import health_pb2

from router.state import ClusterState

log = structlog.get_logger("megaserve.router.readiness")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Readiness:
    """Sets `services` (and the overall "") SERVING or NOT_SERVING on `health` after every
    refresh of `state`; `serving` is the status last set."""

    def __init__(self, state: ClusterState, models: Iterable[str], health, services: tuple):
        self.state, self.models, self.health = state, tuple(models), health
        self.services = ("", *services)
        self.serving: bool | None = None  # nothing set yet
        self.since = time.monotonic()  # when `serving` last changed

    def missing(self) -> list[str]:
        """Served models with no decode worker in the view."""
        return [m for m in self.models if not self.state.pool("decode", m)]

    async def update(self) -> None:
        missing = self.missing()
        ready = not missing
        if ready == self.serving:
            return
        was, self.serving, self.since = self.serving, ready, time.monotonic()
        for name in self.services:
            await self.health.set(name, SERVING if ready else NOT_SERVING)
        if ready:
            log.info("ready: every model has a decode worker", models=list(self.models))
        elif was is not None:
            log.warning("not ready: no decode worker", models=missing)

    async def start(self) -> None:
        """NOT_SERVING until the view says otherwise; then follows every refresh."""
        await self.update()
        self.state.add_listener(self.update)
