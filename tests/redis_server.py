"""A real redis-server on a free port for tests (started, restarted and killed on demand)."""

from __future__ import annotations

from megaserve_app.launch import RedisProcess as RedisServer
from megaserve_app.launch import free_port

__all__ = ["RedisServer", "free_port"]
