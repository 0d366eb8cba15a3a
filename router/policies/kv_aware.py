"""kv_aware: the lowest cost = prefill_load_scale x uncached prompt blocks + active decode blocks.

Uncached blocks are the prompt's full blocks the worker lacks (what it would have to prefill
or receive); active blocks measure the decode load it already carries. Busy workers (past
either threshold) are skipped while any other worker is free.
"""

from __future__ import annotations

from router.config import RouterConfig
from router.policies.base import RouteRequest, not_busy
from router.state import WorkerView


class KvAware:
    name = "kv_aware"

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg

    def cost(self, w: WorkerView, req: RouteRequest) -> float:
        ps = w.info.page_size
        prompt_blocks = len(req.prompt) // ps
        uncached = max(prompt_blocks - w.cached_prefix_blocks(req.prompt), 0)
        return self.cfg.prefill_load_scale * uncached + w.active_pages

    def choose(self, workers: list[WorkerView], req: RouteRequest) -> WorkerView:
        pool = not_busy(workers, self.cfg, self.cfg.busy_threshold_running)
        return min(pool, key=lambda w: (self.cost(w, req), w.load, w.id))
