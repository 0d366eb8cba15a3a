"""session_affinity: a session's later turns go to the worker that holds its KV.

New sessions, and sessions whose worker is gone or busy, are placed by the fallback policy.
"""

from __future__ import annotations

from router.config import RouterConfig
from router.policies.base import Policy, RouteRequest
from router.worker_view import WorkerView


class SessionAffinity:
    name = "session_affinity"

    def __init__(self, cfg: RouterConfig, fallback: Policy):
        self.cfg, self.fallback = cfg, fallback

    def choose(self, workers: list[WorkerView], req: RouteRequest) -> WorkerView:
        if req.session is not None:
            for w in workers:
                if w.id == req.session.worker_id and w.kv_usage < 1.0:
                    return w
        return self.fallback.choose(workers, req)
