"""The policy interface: pick one worker of a pool for a request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from router.config import RouterConfig
from router.state import Session, WorkerView


@dataclass(frozen=True)
class RouteRequest:
    """What placement may look at."""

    prompt: list[int]  # token ids the worker will hold KV for
    session: Session | None = None  # the session's last placement, if any
    max_tokens: int = 0  # output tokens asked for (for page accounting)


class Policy(Protocol):
    name: str

    def choose(self, workers: list[WorkerView], req: RouteRequest) -> WorkerView:
        """One of `workers` (never empty); must not block."""
        ...


def not_busy(workers: list[WorkerView], cfg: RouterConfig, running: int) -> list[WorkerView]:
    """The workers under both busy thresholds, or all of them when every one is busy."""
    ok = [w for w in workers if w.load < running and w.kv_usage < cfg.busy_threshold_kv_usage]
    return ok or workers
