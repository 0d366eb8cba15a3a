"""power_of_two: sample two workers at random, take the less loaded (no herding on stale load)."""

from __future__ import annotations

import random

from router.policies.base import RouteRequest
from router.worker_view import WorkerView


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, cfg=None, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def choose(self, workers: list[WorkerView], req: RouteRequest) -> WorkerView:
        if len(workers) == 1:
            return workers[0]
        a, b = self.rng.sample(workers, 2)
        return min((a, b), key=lambda w: (w.load, w.kv_usage))
