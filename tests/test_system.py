"""System tests with real processes, a real Redis and real gRPC: chaos (kill -9 and restart
workers during a 200-request run), a Redis restart in the middle of a run, and a soak at steady
concurrency (resident memory and pool usage flat). The hostile-input corpus is in
tests/test_system_hostile.py."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import threading
import time

import grpc
import pytest

from megaserve_app.launch import worker_stats
from tests.polling import until
from tests.stack import counters_moved, decode_counters, tokens_equal_report, wait_router_view
from tests.system_stack import (
    DECODE,
    DISAGG_MIN,
    IDS,
    PREFILL,
    generate,
    system_stack,
    wait_pools_idle,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with system_stack(tmp_path_factory.mktemp("system")) as s:
        yield s


# -- chaos -------------------------------------------------------------------------------------
def _workload(n, seed=0):
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        prompt = [rng.randrange(3, 380) for _ in range(rng.randrange(8, 120))]
        seed_i = None if i % 2 else 1000 + i
        cases.append((f"chaos-{i}", prompt, rng.randrange(128, 380), seed_i))
    return cases


def _run(st, addr, cases, concurrency=8, rid_prefix=""):
    def one(c):
        rid, prompt, n, seed = c
        return generate(addr, prompt, n, seed, rid=rid_prefix + rid, timeout=300)

    with cf.ThreadPoolExecutor(concurrency) as ex:
        futs = [ex.submit(one, c) for c in cases]
        try:
            return [f.result() for f in futs]
        except grpc.RpcError:
            print(st.log_tails(60))  # shown with the failure: what every process last said
            raise


def _run_counted(st, addr, cases, concurrency=8, rid_prefix=""):
    """_run that first checks its long prompts (>= DISAGG_MIN tokens, all uncached: the
    workload's prompts are random and this stack saw none of them) took the prefill tier: the
    decode workers imported exactly that many requests' KV, and computed prompt tokens only
    for the short ones (their own prefill; preemption recomputes may add to it)."""
    long = [c for c in cases if len(c[1]) >= DISAGG_MIN]
    short = sum(len(c[1]) for c in cases if len(c[1]) < DISAGG_MIN)
    before = decode_counters(st, DECODE)
    got = _run(st, addr, cases, concurrency, rid_prefix)
    moved = counters_moved(before, decode_counters(st, DECODE))
    assert long and moved["imported_requests"] == len(long), (len(long), moved)
    assert moved["requests"] == len(cases), moved  # fault-free: one Generate per request
    assert moved["prefill_tokens"] >= short, (short, moved)
    return got


def _all_serving(st, addr, timeout=600.0) -> None:
    """Every worker (restarts included) ready and registered at its current address, and the
    router counting all of them."""
    for w in (*DECODE, *PREFILL):
        st.procs[w].wait_ready(timeout=timeout)
    st.wait_registered([*DECODE, *PREFILL], timeout=120)
    st.wait_addresses([*DECODE, *PREFILL])
    wait_router_view(addr, len(DECODE), len(PREFILL))


def _timed_ready(p, out: list) -> None:
    t = time.monotonic()
    p.wait_ready()
    out.append(time.monotonic() - t)


@pytest.mark.slow
def test_chaos_kill9_and_restart_workers(stack):
    st, addr, _ = stack
    cases = _workload(200)
    # Concurrency 4: the run outlasts several restarts, so kills keep coming.
    reference = _run_counted(st, addr, cases, concurrency=4, rid_prefix="ref-")  # fault-free
    kills, restarts = [], []
    stop = threading.Event()
    # Requests the decode workers imported from the prefill tier during the chaos run: each
    # decode process's count, read just before it is killed (a restart counts from 0).
    base = {w: worker_stats(st.procs[w].address).imported_requests for w in DECODE}
    imported = [0]

    def imported_since(w) -> int:
        try:
            return worker_stats(st.procs[w].address).imported_requests - base[w]
        except grpc.RpcError:
            return 0  # a lower bound

    def chaos():
        rng = random.Random(11)
        while not stop.wait(2.0):
            # Kill one worker whose role still has another live one (the tier stays up).
            def up(w):  # running and serving (a restarted worker is not up until READY)
                return st.procs[w].alive and bool(st.procs[w].ready_line)

            roles = {w: DECODE if w in DECODE else PREFILL for w in (*DECODE, *PREFILL)}
            victims = [w for w in roles if all(up(o) for o in roles[w])]
            if not victims:
                continue
            w = rng.choice(victims)
            if w in DECODE:
                imported[0] += imported_since(w)
                base[w] = 0
            st.procs[w].kill9()
            kills.append((time.monotonic(), w))
            kind = "decode" if w in DECODE else "prefill"
            p = st.worker(kind, w)  # restart at once; it rejoins when ready
            threading.Thread(target=_timed_ready, args=(p, restarts), daemon=True).start()

    t = threading.Thread(target=chaos, daemon=True)
    t0 = time.monotonic()
    t.start()
    try:
        got = _run(st, addr, cases, concurrency=4)
    finally:
        stop.set()
        t.join()
    elapsed = time.monotonic() - t0
    mismatches = [c[0] for c, a, b in zip(cases, got, reference) if a != b]
    print(f"chaos: {len(cases)} requests in {elapsed:.1f} s, {len(kills)} kills: "
          f"{[w for _, w in kills]}, restarts took {[round(x, 1) for x in restarts]} s, "
          f"mismatches: {len(mismatches)}")  # fmt: skip
    assert len(kills) >= 2 and {w[0] for _, w in kills} == {"d", "p"}, kills  # both tiers
    assert not mismatches, [
        tokens_equal_report(a, b) for c, a, b in zip(cases, got, reference) if c[0] in mismatches
    ][:3]
    _all_serving(st, addr)  # slow restarts on a loaded machine
    imported[0] += sum(imported_since(w) for w in DECODE)
    print(f"chaos: at least {imported[0]} requests took the prefill tier")
    # The prefill tier really served during the chaos (not everything co-located), so its
    # kills were kills of a tier in use.
    assert imported[0] > 0
    wait_pools_idle(st)


def test_redis_restart_mid_run(stack):
    st, addr, rs = stack
    _all_serving(st, addr)
    cases = _workload(80, seed=3)
    reference = _run_counted(st, addr, cases, rid_prefix="rref-")
    lock, started, finished = threading.Lock(), [0], [0]

    def one(c):
        rid, prompt, n, seed = c
        with lock:
            started[0] += 1
        try:
            return generate(addr, prompt, n, seed, rid="rr-" + rid, timeout=300)
        finally:
            with lock:
                finished[0] += 1

    box: dict = {}

    def run():
        try:
            with cf.ThreadPoolExecutor(8) as ex:
                box["got"] = list(ex.map(one, cases))
        except BaseException as e:  # re-raised below, in the test's thread, as it was
            box["error"] = e

    def run_failed() -> None:  # the run's own error, with its traceback, not a later symptom
        if "error" in box:
            print(st.log_tails(60))
            raise box["error"]

    t = threading.Thread(target=run, name="redis-restart-run")
    t.start()
    # Mid-run: some requests done, eight in flight, more queued.
    until(lambda: finished[0] >= 8 or not t.is_alive(), "8 requests finished", 300)
    run_failed()
    with lock:
        rs.kill()
        in_flight, done_at_kill = started[0] - finished[0], finished[0]
    assert in_flight > 0 and done_at_kill < len(cases), (in_flight, done_at_kill)
    # Served while Redis is down: requests in flight at the kill finish, new ones start.
    until(lambda: finished[0] >= done_at_kill + 8 or not t.is_alive(), "requests finishing", 300)
    run_failed()
    served_while_down = finished[0] - done_at_kill
    rs.start()  # empty: workers re-register and republish their blocks on the next beat
    t.join(timeout=600)
    if t.is_alive():
        print(st.log_tails(60))
        raise AssertionError(f"the run did not finish within 600 s ({finished[0]} done)")
    run_failed()
    print(f"redis restart: {in_flight} in flight at the kill, {served_while_down} finished "
          f"while Redis was down")  # fmt: skip
    assert served_while_down >= 8
    assert box["got"] == reference, [
        tokens_equal_report(a, b) for a, b in zip(box["got"], reference) if a != b
    ][:3]
    st.wait_registered([*DECODE, *PREFILL], timeout=120)  # back in the new, empty Redis
    wait_router_view(addr, len(DECODE), len(PREFILL))
    assert generate(addr, IDS, 6) == generate(addr, IDS, 6)


def _rss_mb(pid: int) -> float:
    if not os.path.exists(f"/proc/{pid}/status"):
        raise AssertionError(f"process {pid} died during the soak")
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.slow
def test_soak_memory_and_pool_flat(stack):
    """Steady concurrency for SOAK_S seconds: RSS per process and KV usage stay flat."""
    st, addr, _ = stack
    _all_serving(st, addr)
    soak_s = float(os.environ.get("MEGASERVE_SOAK_S", "90"))
    stop = threading.Event()
    done = [0]

    def client(i):
        rng = random.Random(i)
        while not stop.is_set():
            prompt = [rng.randrange(3, 380) for _ in range(rng.randrange(8, 100))]
            generate(
                addr, prompt, rng.randrange(8, 48), seed=rng.randrange(1000) if i % 2 else None
            )
            done[0] += 1

    samples: dict[str, list[float]] = {n: [] for n in st.procs}
    usage = []
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < soak_s:
        time.sleep(soak_s / 18)
        for n, p in st.procs.items():
            samples[n].append(_rss_mb(p.p.pid))
        s = [worker_stats(st.procs[w].address) for w in DECODE]
        usage.append(sum(x.total_pages - x.free_pages - x.cached_pages for x in s))
    stop.set()
    for t in threads:
        t.join(timeout=120)
    peak = {n: max(v) for n, v in samples.items()}
    print(f"soak: {done[0]} requests in {soak_s:.0f} s; peak RSS MB {peak}; used pages {usage}")
    for n, v in samples.items():
        third = len(v) // 3
        early, late = max(v[:third]), max(v[-third:])
        assert late - early < max(40.0, 0.1 * early), (n, v)  # no steady growth
    assert max(usage) <= 2 * 6 * 10 + 20, usage  # 6 clients' pages at most, never accumulating
    wait_pools_idle(st)
