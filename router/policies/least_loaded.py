"""least_loaded: the worker with the fewest running + queued requests (then most free KV)."""

from __future__ import annotations

from router.policies.base import RouteRequest
from router.worker_view import WorkerView


class LeastLoaded:
    name = "least_loaded"

    def __init__(self, cfg=None):
        pass

    def choose(self, workers: list[WorkerView], req: RouteRequest) -> WorkerView:
        return min(workers, key=lambda w: (w.load, w.kv_usage, w.id))
