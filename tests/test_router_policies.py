"""Placement policies, the load-balancing config and circuit breakers on synthetic worker
views; then kv_aware vs round_robin on a shared-prefix workload with real processes."""

from __future__ import annotations

import random
import time

import pytest

from megaserve.kv.block_hash import block_hashes
from megaserve.state_keys import WorkerInfo, block_hex
from router.circuit import CircuitBreakers
from router.config import DEFAULTS_FILE, RouterConfig
from router.policies import RouteRequest, make_policy
from router.policies.power_of_two import PowerOfTwo
from router.state import Session
from router.worker_view import WorkerView
from tests.conftest import FakeClock

PS = 16


def view(wid, running=0, free=1000, total=1000, blocks=(), page_size=PS) -> WorkerView:
    info = WorkerInfo(wid, "decode", f"{wid}:1", "m", total, free, running, 0, page_size, 512, 100)
    return WorkerView(info, frozenset(blocks))


def hexes(prompt, n=None):
    return [block_hex(h) for h in block_hashes(prompt[: len(prompt) - 1], PS)][:n]


PROMPT = list(range(1, 101))  # 6 full blocks of 16 in prompt[:-1]


def test_round_robin_cycles_in_id_order():
    p = make_policy("round_robin", RouterConfig())
    ws = [view("b"), view("a"), view("c")]
    assert [p.choose(ws, RouteRequest(PROMPT)).id for _ in range(6)] == list("abcabc")


def test_least_loaded_prefers_fewest_requests_then_free_kv():
    p = make_policy("least_loaded", RouterConfig())
    assert p.choose([view("a", 3), view("b", 1), view("c", 2)], RouteRequest(PROMPT)).id == "b"
    assert p.choose([view("a", 1, free=10), view("b", 1, free=900)], RouteRequest(PROMPT)).id == "b"
    w = view("a", 0)
    w.inflight = 5  # this router's own requests count before the heartbeat shows them
    assert p.choose([w, view("b", 2)], RouteRequest(PROMPT)).id == "b"


def test_power_of_two_never_picks_the_worst_of_two():
    p = PowerOfTwo(rng=random.Random(0))
    ws = [view("a", 9), view("b", 0)]
    assert {p.choose(ws, RouteRequest(PROMPT)).id for _ in range(20)} == {"b"}
    ws3 = [view("a", 9), view("b", 0), view("c", 5)]
    assert "a" not in {p.choose(ws3, RouteRequest(PROMPT)).id for _ in range(200)}


def test_kv_aware_cost_and_busy_filters():
    cfg = RouterConfig(prefill_load_scale=1.0)
    p = make_policy("kv_aware", cfg)
    cached = view("a", blocks=hexes(PROMPT, 4), free=990)  # 4 of 6 blocks, 10 pages busy
    cold = view("b", free=1000)
    # cost a = 1.0 * (6 - 4) + 10 = 12 ; cost b = 6 + 0 = 6 -> b (the cache does not pay)
    assert p.cost(cached, RouteRequest(PROMPT)) == 12 and p.cost(cold, RouteRequest(PROMPT)) == 6
    assert p.choose([cached, cold], RouteRequest(PROMPT)).id == "b"
    cheap = view("a", blocks=hexes(PROMPT), free=998)  # all 6 blocks, 2 pages busy: cost 2
    assert p.choose([cheap, cold], RouteRequest(PROMPT)).id == "a"
    # A scaled-up prefill cost favours the cache more.
    p3 = make_policy("kv_aware", RouterConfig(prefill_load_scale=3.0))
    assert p3.choose([cached, cold], RouteRequest(PROMPT)).id == "a"  # 6+10=16 < 18
    # Busy workers are skipped while another is free, used when all are busy.
    busy = view("a", running=64, blocks=hexes(PROMPT))
    assert p.choose([busy, cold], RouteRequest(PROMPT)).id == "b"
    full = view("a", blocks=hexes(PROMPT), free=10)
    assert p.choose([full, cold], RouteRequest(PROMPT)).id == "b"
    assert p.choose([busy], RouteRequest(PROMPT)).id == "a"
    # The prefix must match from the first block: a later block alone is no hit.
    tail_only = view("c", blocks=hexes(PROMPT)[1:])
    assert tail_only.cached_prefix_blocks(PROMPT) == 0


def test_optimistic_blocks_expire():
    w = view("a")
    w.expect_blocks(PROMPT)
    assert w.cached_prefix_blocks(PROMPT) == 6
    w.optimistic = {k: time.monotonic() - 1 for k in w.optimistic}
    assert w.cached_prefix_blocks(PROMPT) == 0


def test_session_affinity_sticks_and_falls_back():
    cfg = RouterConfig(decode_policy="session_affinity", session_fallback_policy="least_loaded")
    p = make_policy("session_affinity", cfg)
    ws = [view("a", 5), view("b", 0)]
    assert p.choose(ws, RouteRequest(PROMPT, Session("a", 100))).id == "a"
    assert p.choose(ws, RouteRequest(PROMPT, Session("gone", 100))).id == "b"
    assert p.choose(ws, RouteRequest(PROMPT)).id == "b"


def test_config_file_defaults_and_errors(tmp_path):
    assert RouterConfig.from_yaml(DEFAULTS_FILE) == RouterConfig()
    f = tmp_path / "lb.yaml"
    f.write_text("decode_policy: least_loaded\nprefill_load_scale: 2\n")
    c = RouterConfig.from_yaml(f)
    assert c.decode_policy == "least_loaded" and c.prefill_load_scale == 2.0
    for text, needle in [
        ("decode_polcy: kv_aware\n", "unknown keys ['decode_polcy']"),
        ("decode_policy: fastest\n", "decode_policy='fastest'"),
        ("retry_max_attempts: many\n", "retry_max_attempts='many'"),
        ("busy_threshold_kv_usage: 1.5\n", "busy_threshold_kv_usage=1.5"),
        ("- a\n- b\n", "expected a mapping"),
        ("transport: carrier_pigeon\n", "carrier_pigeon"),
    ]:
        f.write_text(text)
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            RouterConfig.from_yaml(f)


def test_circuit_breaker_opens_probes_and_closes():
    clock = FakeClock()
    b = CircuitBreakers(failures=2, reset_s=5.0, clock=clock)
    b.failure("w")
    assert b.allows("w")
    b.failure("w")
    assert not b.allows("w") and b.is_open("w")
    clock.advance(4.75)
    assert not b.allows("w")  # still open just before reset_s
    clock.advance(0.25)
    assert b.allows("w")  # half-open at reset_s: one probe
    b.chosen("w")
    assert not b.allows("w")  # only one
    b.failure("w")  # the probe failed: open again, from now
    assert not b.allows("w")
    clock.advance(4.75)
    assert not b.allows("w")
    clock.advance(0.25)
    b.chosen("w")
    b.success("w")
    assert b.allows("w") and not b.is_open("w")


def test_circuit_breaker_probe_without_a_verdict_does_not_block_forever():
    clock = FakeClock()
    b = CircuitBreakers(failures=1, reset_s=5.0, clock=clock)
    b.failure("w")
    clock.advance(5.0)
    b.chosen("w")  # the probe's try then fails at another worker (a prefill)
    assert not b.allows("w")
    b.abandon("w")
    assert b.allows("w")  # the next request probes at once
    b.chosen("w")  # this probe's client vanishes: nothing is reported at all
    clock.advance(4.75)
    assert not b.allows("w")
    clock.advance(0.25)
    assert b.allows("w")  # a silent probe stops blocking after reset_s
    b.abandon("w")
    b.failure("w")  # a failure after an abandon still reopens
    assert not b.allows("w") and b.is_open("w")


def test_kv_aware_beats_round_robin_on_shared_prefixes(tmp_path):
    """Real Redis, two decode workers, one then two routers, the tiny chat model."""
    from megaserve_app.bench.router import Workload, bench_policies
    from tests.stack import make_chat_checkpoint

    ck = make_chat_checkpoint(tmp_path / "ck")
    wl = Workload(n_systems=8, users_per_system=8, system_tokens=160, user_tokens=12,
                  max_tokens=16, concurrency=2)  # fmt: skip
    # The tiny model finishes a request in ~20 ms: heartbeats and state refreshes are made as
    # frequent, relative to a request, as the defaults are for a real model's requests.
    rows = bench_policies(
        str(ck),
        ["round_robin", "kv_aware"],
        wl,
        worker_args=("--kv-budget-mb", "8", "--max-context", "512", "--heartbeat-s", "0.05"),
        router_config={"state_refresh_ms": 20},
    )
    rr, kv, kv2 = rows
    assert (rr["policy"], kv["policy"], kv2["routers"]) == ("round_robin", "kv_aware", 2)
    # 8 prefixes of 10 full blocks: round robin computes each prefix on both workers.
    assert kv["hit_rate"] > rr["hit_rate"] + 0.05, (kv, rr)
    assert abs(kv2["hit_rate"] - kv["hit_rate"]) <= 0.05, (kv2, kv)
    # No worker gets more than its share plus a bounded excess.
    assert kv["max_over_fair"] <= 1.5 and kv2["max_over_fair"] <= 1.5, (kv, kv2)


def test_balance_bound_overrides_the_cache():
    cfg = RouterConfig(balance_max_excess=2)
    p = make_policy("kv_aware", cfg)
    hot = view("a", running=3, blocks=hexes(PROMPT))
    assert p.choose([hot, view("b", running=1)], RouteRequest(PROMPT)).id == "a"  # within 2
    hot = view("a", running=4, blocks=hexes(PROMPT))
    assert p.choose([hot, view("b", running=1)], RouteRequest(PROMPT)).id == "b"  # 3 > 2


def test_a_few_placements_are_no_trend_for_the_share_bound():
    """Early in the window a worker that took the last few requests is not over its share
    (balance_max_excess above fair): a prefix's followers keep their cache hit."""
    p = make_policy("kv_aware", RouterConfig(balance_max_share=1.5, balance_max_excess=8))
    hot, cold = view("a", blocks=hexes(PROMPT)), view("b")
    # The (k+1)-th of k placements on "a" is over the bound once k + 1 > (k + 1) / 2 + 8.
    assert [p.choose([hot, cold], RouteRequest(PROMPT)).id for _ in range(16)] == ["a"] * 16
    # Past fair + excess (and 1.5 x fair) the bound sends the next one elsewhere.
    assert p.choose([hot, cold], RouteRequest(PROMPT)).id == "b"


def test_a_new_prefix_goes_to_the_worker_caching_the_fewest_blocks():
    """Even when that worker had more recent placements: the prefixes, and the traffic that
    follows each, spread evenly (SGLang's cache-aware router: the smallest radix tree)."""
    p = make_policy("kv_aware", RouterConfig())
    other = list(range(5000, 5101))
    big = view("a", blocks=hexes(other) + hexes([7] + other))  # two prefixes' blocks
    small = view("b", blocks=hexes(other))
    for _ in range(3):  # b took the last placements (its one prefix was busy)
        p.choose([view("a"), view("b", blocks=hexes(PROMPT))], RouteRequest(PROMPT))
    assert p.counts["b"] == 3 and p.counts["a"] == 0
    assert p.choose([big, small], RouteRequest(list(range(9000, 9100)))).id == "b"
