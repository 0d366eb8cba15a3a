"""Per-worker circuit breakers: stop sending to a worker after repeated failures, probe later."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class _Breaker:
    failures: int = 0
    opened_at: float | None = None  # monotonic; None = closed
    probing: bool = False  # half-open: one request is testing the worker


class CircuitBreakers:
    """closed -> (N consecutive failures) -> open -> (reset_s) -> half-open -> closed | open."""

    def __init__(self, failures: int, reset_s: float):
        self.threshold, self.reset_s = failures, reset_s
        self._b: dict[str, _Breaker] = {}

    def allows(self, worker_id: str) -> bool:
        b = self._b.get(worker_id)
        if b is None or b.opened_at is None:
            return True
        return time.monotonic() - b.opened_at >= self.reset_s and not b.probing

    def chosen(self, worker_id: str) -> None:
        """A request goes to worker_id; if its breaker is open, that request is the probe."""
        b = self._b.get(worker_id)
        if b is not None and b.opened_at is not None:
            b.probing = True

    def success(self, worker_id: str) -> None:
        self._b.pop(worker_id, None)

    def failure(self, worker_id: str) -> None:
        b = self._b.setdefault(worker_id, _Breaker())
        b.failures += 1
        if b.probing or b.failures >= self.threshold:
            b.opened_at, b.probing = time.monotonic(), False

    def is_open(self, worker_id: str) -> bool:
        b = self._b.get(worker_id)
        return b is not None and b.opened_at is not None
