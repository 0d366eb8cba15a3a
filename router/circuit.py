"""Per-worker circuit breakers: stop sending to a worker after repeated failures, probe later."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from router.absence import Absences


@dataclass
class _Breaker:
    failures: int = 0
    opened_at: float | None = None  # monotonic; None = closed
    probing: bool = False  # half-open: one request is testing the worker
    probe_at: float = 0.0  # when that probe was sent (monotonic)


class CircuitBreakers:
    """closed -> (N consecutive failures) -> open -> (reset_s) -> half-open -> closed | open."""

    def __init__(self, failures: int, reset_s: float, clock: Callable[[], float] = time.monotonic):
        self.threshold, self.reset_s = failures, reset_s
        self.clock = clock  # seconds, monotonic; tests inject a fake one
        self._b: dict[str, _Breaker] = {}
        self._absent = Absences()  # breakers' worker ids missing from the view

    def allows(self, worker_id: str) -> bool:
        b = self._b.get(worker_id)
        if b is None or b.opened_at is None:
            return True
        now = self.clock()
        if now - b.opened_at < self.reset_s:
            return False
        # One probe at a time; one that never reports back (its try failed elsewhere, or the
        # client left) stops blocking the worker after reset_s.
        return not b.probing or now - b.probe_at >= self.reset_s

    def chosen(self, worker_id: str) -> None:
        """A request goes to worker_id; if its breaker is open, that request is the probe."""
        b = self._b.get(worker_id)
        if b is not None and b.opened_at is not None:
            b.probing, b.probe_at = True, self.clock()

    def abandon(self, worker_id: str) -> None:
        """The probe's try ended without a verdict on this worker (another worker failed, the
        client left): the next request may probe at once."""
        b = self._b.get(worker_id)
        if b is not None:
            b.probing = False

    def success(self, worker_id: str) -> None:
        self._b.pop(worker_id, None)

    def failure(self, worker_id: str) -> None:
        b = self._b.setdefault(worker_id, _Breaker())
        b.failures += 1
        if b.probing or b.failures >= self.threshold:
            b.opened_at, b.probing = self.clock(), False

    def follow_view(self, worker_ids: Iterable[str], grace_s: float) -> None:
        """Drops the breaker of a worker absent from the view (worker_ids) for grace_s: a
        worker's id is new each time it starts (even on the same address), so a breaker
        opened by one that died would otherwise be kept for ever, one per restart. One back
        within the grace (a heartbeat late, Redis restarted empty) keeps its breaker."""
        for wid in self._absent.follow(self._b, set(worker_ids), self.clock(), grace_s):
            del self._b[wid]

    def __len__(self) -> int:
        return len(self._b)

    def is_open(self, worker_id: str) -> bool:
        b = self._b.get(worker_id)
        return b is not None and b.opened_at is not None
