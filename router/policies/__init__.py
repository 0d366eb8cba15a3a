"""Load-balancing policies behind one interface (`Policy.choose`), one module each."""

from __future__ import annotations

from router.config import RouterConfig
from router.policies.base import Policy, RouteRequest
from router.policies.kv_aware import KvAware
from router.policies.least_loaded import LeastLoaded
from router.policies.power_of_two import PowerOfTwo
from router.policies.round_robin import RoundRobin
from router.policies.session_affinity import SessionAffinity

__all__ = ["Policy", "RouteRequest", "make_policy"]

_SIMPLE = {c.name: c for c in (RoundRobin, LeastLoaded, PowerOfTwo, KvAware)}


def make_policy(name: str, cfg: RouterConfig) -> Policy:
    if name == "session_affinity":
        return SessionAffinity(cfg, make_policy(cfg.session_fallback_policy, cfg))
    if name not in _SIMPLE:
        raise ValueError(
            f"unknown policy {name!r}; known: {sorted(_SIMPLE) + ['session_affinity']}"
        )
    return _SIMPLE[name](cfg)
