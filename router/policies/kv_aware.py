"""kv_aware: the lowest cost = prefill_load_scale x uncached prompt blocks + active decode blocks.

Uncached blocks are the prompt's full blocks the worker lacks (what it would have to prefill
or receive); active blocks measure the decode load it already carries. Busy workers (past
a threshold) are skipped while any other worker is free. So that a worker holding every hot
prefix cannot take all traffic while the rest idle, a worker that got more than
balance_max_share x its fair share of the last balance_window placements (and more than
balance_max_excess placements above that share: a few placements are no trend) also counts
as busy, and a prefix no worker holds yet goes to the worker caching the fewest blocks (as
SGLang's cache-aware router sends it to the smallest radix tree), then the fewest recent
placements: prefixes, and the traffic that follows each one, spread evenly. (Recent
placements alone let a worker whose prefixes happened to be busy early lose every new prefix
to the other, however many prefixes it ends up serving.)
"""

from __future__ import annotations

from collections import Counter, deque

from router.config import RouterConfig
from router.policies.base import RouteRequest, not_busy, tie_break
from router.worker_view import WorkerView


class KvAware:
    name = "kv_aware"

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.recent: deque[str] = deque(maxlen=cfg.balance_window)
        self.counts: Counter[str] = Counter()

    def cost(self, w: WorkerView, req: RouteRequest) -> float:
        ps = w.info.page_size
        prompt_blocks = len(req.prompt) // ps
        uncached = max(prompt_blocks - w.cached_prefix_blocks(req.prompt), 0)
        return self.cfg.prefill_load_scale * uncached + w.active_pages

    def over_share(self, w: WorkerView, n_workers: int) -> bool:
        fair = (len(self.recent) + 1) / n_workers
        bound = max(self.cfg.balance_max_share * fair, fair + self.cfg.balance_max_excess)
        return self.counts[w.id] + 1 > bound

    def choose(self, workers: list[WorkerView], req: RouteRequest) -> WorkerView:
        pool = not_busy(workers, self.cfg, self.cfg.busy_threshold_running)
        if len(workers) > 1:
            pool = [w for w in pool if not self.over_share(w, len(workers))] or pool
        if any(w.cached_prefix_blocks(req.prompt) for w in pool):
            best = min(pool, key=lambda w: (self.cost(w, req), w.load, tie_break(req.prompt, w.id)))
        else:  # a prefix no one holds: where it lands decides where its later hits go, so
            # spread new prefixes over the workers with the fewest recent placements
            best = min(
                pool,
                key=lambda w: (
                    w.cached_blocks,
                    self.counts[w.id],
                    self.cost(w, req),
                    tie_break(req.prompt, w.id),
                ),
            )
        if len(self.recent) == self.recent.maxlen:
            self.counts[self.recent[0]] -= 1
        self.recent.append(best.id)
        self.counts[best.id] += 1
        return best
