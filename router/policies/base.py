"""The policy interface: pick one worker of a pool for a request."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from router.config import RouterConfig
from router.state import Session
from router.worker_view import WorkerView


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
    """The workers under the busy thresholds, or all of them when every one is busy.

    Busy: `running` or more requests, KV usage at the threshold, or more than
    balance_max_excess requests above the least loaded worker (which bounds how far a
    cache-hot worker can pull ahead of the others).
    """
    least = min(w.load for w in workers)
    ok = [
        w
        for w in workers
        if w.load < running
        and w.kv_usage < cfg.busy_threshold_kv_usage
        and w.load <= least + cfg.balance_max_excess
    ]
    return ok or workers


def tie_break(prompt: list[int], worker_id: str) -> bytes:
    """Rendezvous hash of (prompt's first block, worker): among equal costs a prefix lands on
    the same worker from every router, and different prefixes spread over the workers."""
    head = np.asarray(prompt[:16], np.int64).tobytes()
    return hashlib.blake2b(head + worker_id.encode(), digest_size=8).digest()
