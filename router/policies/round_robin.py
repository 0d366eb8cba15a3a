"""round_robin: each request to the next worker in id order."""

from __future__ import annotations

import itertools

from router.policies.base import RouteRequest
from router.worker_view import WorkerView


class RoundRobin:
    name = "round_robin"

    def __init__(self, cfg=None):
        self._counter = itertools.count()

    def choose(self, workers: list[WorkerView], req: RouteRequest) -> WorkerView:
        ordered = sorted(workers, key=lambda w: w.id)
        return ordered[next(self._counter) % len(ordered)]
