"""Keys that left a set and for how long: what a worker's absence from the view means after a
grace (a heartbeat late, a Redis restarted empty), shared by the worker watch and breakers."""

from __future__ import annotations

from collections.abc import Iterable


class Absences:
    """When each tracked key was first missing from the present set; `follow` returns (and
    forgets) those missing for a grace. A key back in time, or no longer tracked, is cleared."""

    def __init__(self):
        self._since: dict = {}  # key -> when it was first missing (the caller's clock)

    def follow(self, tracked: Iterable, present: set, now: float, grace_s: float) -> list:
        """The tracked keys absent from present for grace_s by now."""
        tracked = set(tracked)
        for k in [k for k in self._since if k in present or k not in tracked]:
            del self._since[k]
        for k in tracked - present:
            self._since.setdefault(k, now)
        gone = [k for k, t in self._since.items() if now - t >= grace_s]
        for k in gone:
            del self._since[k]
        return gone

    def __len__(self) -> int:
        return len(self._since)
