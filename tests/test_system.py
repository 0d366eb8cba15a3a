"""System tests with real processes, a real Redis and real gRPC: a corpus of hostile public-API
requests, chaos (kill -9 and restart workers during a 200-request run), a Redis restart in the
middle of a run, and a soak at steady concurrency (resident memory and pool usage flat)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import threading
import time

import grpc
import pytest

from megaserve.rpc import decode_pb2
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from megaserve_app.launch import worker_stats
from tests.redis_server import RedisServer
from tests.stack import (
    Stack,
    counters_moved,
    decode_counters,
    make_chat_checkpoint,
    tokens_equal_report,
    wait_router_view,
)

MODEL = "tiny-chat"
DECODE, PREFILL = ("d1", "d2"), ("p1", "p2")
DISAGG_MIN = 40  # the router's disagg_min_uncached_tokens (lb.yaml below)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("system")
    ck = make_chat_checkpoint(tmp / "ck")
    rs = RedisServer(tmp).start()
    # Patient retries: while a killed worker restarts, requests wait for the other one. The
    # chaos kills a worker every few seconds, far above any real failure rate, so one long
    # request can lose several decode workers: a migration budget to match.
    (tmp / "lb.yaml").write_text(
        f"disagg_min_uncached_tokens: {DISAGG_MIN}\ncircuit_breaker_reset_s: 2.0\n"
        "retry_max_attempts: 10\nretry_max_delay_ms: 2000\nmax_migrations: 16\n"
    )
    (tmp / "logs").mkdir()
    st = Stack(rs.url, ck, log_dir=tmp / "logs")
    st.lb = str(tmp / "lb.yaml")
    try:
        router = st.up(DECODE, PREFILL, st.lb)
        yield st, router.address, rs
    finally:
        st.stop()
        rs.kill()


def wait_pools_idle(st, timeout=120.0) -> list[decode_pb2.StatsResponse]:
    """Every decode worker's pool fully free or cached, no request or reservation left."""
    end = time.monotonic() + timeout
    while True:
        stats = [worker_stats(st.procs[w].address) for w in DECODE]
        ok = all(
            s.running == 0
            and s.waiting == 0
            and s.reserved == 0
            and s.free_pages + s.cached_pages == s.total_pages
            for s in stats
        )
        if ok or time.monotonic() > end:
            assert ok, stats
            return stats
        time.sleep(0.2)


def generate(addr, prompt, max_tokens, seed=None, rid="", timeout=120):
    sampling = pb.SamplingParams(temperature=0.8, top_k=40, seed=seed) if seed is not None else None
    req = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=pb.TokenIds(ids=prompt),
        sampling=sampling,
        stopping=pb.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    with grpc.insecure_channel(addr) as ch:
        return [
            t for r in pbg.GenerationStub(ch).Generate(req, timeout=timeout) for t in r.token_ids
        ]


# -- the hostile corpus ---------------------------------------------------------------------
def _raw(addr, method: str, payload: bytes, timeout=30.0):
    """Sends raw bytes as a request: malformed messages no generated client would send."""
    with grpc.insecure_channel(addr) as ch:
        if method == "Generate":
            call = ch.unary_stream("/megaserve.v1.Generation/Generate")
            return list(call(payload, timeout=timeout))
        return ch.unary_unary(f"/megaserve.v1.Generation/{method}")(payload, timeout=timeout)


IDS = [5, 6, 7, 8]
OK_STOP = pb.StoppingParams(max_tokens=4)


def _req(**kw):
    kw.setdefault("model", MODEL)
    return pb.GenerateRequest(**kw)


INVALID = grpc.StatusCode.INVALID_ARGUMENT
CORPUS: list[tuple[str, object, grpc.StatusCode]] = [
    # (name, request: a GenerateRequest or raw bytes for Generate, the status code)
    ("no input", _req(), INVALID),
    ("empty prompt", _req(prompt=""), INVALID),
    ("unknown model", _req(model="nope", prompt="hi"), grpc.StatusCode.NOT_FOUND),
    ("model name with NUL", _req(model="tiny\x00chat", prompt="hi"), grpc.StatusCode.NOT_FOUND),
    ("empty chat", _req(chat=pb.Chat()), INVALID),
    ("bad role", _req(chat=pb.Chat(messages=[pb.ChatMessage(role="root", content="x")])), INVALID),
    ("empty role", _req(chat=pb.Chat(messages=[pb.ChatMessage(content="x")])), INVALID),
    ("empty id list", _req(prompt_token_ids=pb.TokenIds()), INVALID),
    ("id = vocab", _req(prompt_token_ids=pb.TokenIds(ids=[384])), INVALID),
    ("id = int32 max", _req(prompt_token_ids=pb.TokenIds(ids=[2**31 - 1])), INVALID),
    ("id = int32 min", _req(prompt_token_ids=pb.TokenIds(ids=[-(2**31)])), INVALID),
    ("100k ids", _req(prompt_token_ids=pb.TokenIds(ids=[5] * 100_000)), INVALID),
    ("1 MB prompt text", _req(prompt="word " * 200_000), INVALID),
    (
        "5 MB prompt (over the message limit)",
        _req(prompt="x" * 5_000_000),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ),  # fmt: skip
    (
        "huge chat",
        _req(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="y " * 300_000)])),
        INVALID,
    ),  # fmt: skip
    (
        "max_tokens int32 max",
        _req(
            prompt_token_ids=pb.TokenIds(ids=IDS), stopping=pb.StoppingParams(max_tokens=2**31 - 1)
        ),
        INVALID,
    ),  # fmt: skip
    (
        "negative max_tokens",
        _req(prompt_token_ids=pb.TokenIds(ids=IDS), stopping=pb.StoppingParams(max_tokens=-5)),
        INVALID,
    ),  # fmt: skip
    (
        "temperature inf",
        _req(prompt="hi", sampling=pb.SamplingParams(temperature=float("inf"))),
        INVALID,
    ),  # fmt: skip
    ("temperature -1", _req(prompt="hi", sampling=pb.SamplingParams(temperature=-1)), INVALID),
    ("top_p nan", _req(prompt="hi", sampling=pb.SamplingParams(top_p=float("nan"))), INVALID),
    ("top_p 2", _req(prompt="hi", sampling=pb.SamplingParams(top_p=2)), INVALID),
    ("top_k -1", _req(prompt="hi", sampling=pb.SamplingParams(top_k=-1)), INVALID),
    ("min_p -0.1", _req(prompt="hi", sampling=pb.SamplingParams(min_p=-0.1)), INVALID),
    ("presence 5", _req(prompt="hi", sampling=pb.SamplingParams(presence_penalty=5)), INVALID),
    ("frequency -3", _req(prompt="hi", sampling=pb.SamplingParams(frequency_penalty=-3)), INVALID),
    (
        "repetition 11",
        _req(prompt="hi", sampling=pb.SamplingParams(repetition_penalty=11)),
        INVALID,
    ),
    ("seed 2**64-1", _req(prompt="hi", sampling=pb.SamplingParams(seed=2**64 - 1)), INVALID),
    ("17 stop strings", _req(prompt="hi", stopping=pb.StoppingParams(stop=["a"] * 17)), INVALID),
    ("empty stop string", _req(prompt="hi", stopping=pb.StoppingParams(stop=[""])), INVALID),
    (
        "1k-char stop string",
        _req(prompt="hi", stopping=pb.StoppingParams(stop=["z" * 1000])),
        INVALID,
    ),
    ("stop token -1", _req(prompt="hi", stopping=pb.StoppingParams(stop_token_ids=[-1])), INVALID),
    (
        "100 stop tokens",
        _req(prompt="hi", stopping=pb.StoppingParams(stop_token_ids=[1] * 100)),
        INVALID,
    ),  # fmt: skip
    ("request_id 10k chars", _req(request_id="r" * 10_000, prompt="hi"), INVALID),
    # Raw bytes: invalid UTF-8, wrong wire types, truncation, garbage.
    ("invalid UTF-8 in prompt", b"\x12\x03\xff\xfe\xfd", INVALID),  # field 3 = prompt
    ("invalid UTF-8 in stop string", b"\x1a\x02hi\x3a\x04\x12\x02\xc3\x28", INVALID),
    ("invalid UTF-8 in model", b"\x12\x02\xff\xff\x1a\x02hi", INVALID),
    (
        "invalid UTF-8 in chat content",
        b"\x2a\x0b\x0a\x09\x0a\x04user\x12\x01\x80",
        INVALID,
    ),  # fmt: skip
    ("wrong wire type for prompt", b"\x18\x05", INVALID),  # field 3 as varint
    ("truncated message", b"\x1a\x10hi", INVALID),
    ("random garbage", bytes(random.Random(1).getrandbits(8) for _ in range(64)), INVALID),
    ("length overflow", b"\x1a\xff\xff\xff\xff\x0f", INVALID),
]


def _status(addr, item) -> tuple[grpc.StatusCode, str]:
    try:
        if isinstance(item, bytes):
            _raw(addr, "Generate", item)
        else:
            with grpc.insecure_channel(
                addr, options=[("grpc.max_send_message_length", 16 << 20)]
            ) as ch:
                list(pbg.GenerationStub(ch).Generate(item, timeout=60))
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_hostile_corpus(stack):
    st, addr, _ = stack
    assert len(CORPUS) >= 40
    results = {}
    for name, item, _ in CORPUS:
        results[name] = _status(addr, item)
    wrong = {n: r for (n, _, w), r in zip(CORPUS, results.values()) if r[0] != w}
    assert not wrong, wrong
    # Messages name the value (spot checks), and nothing crashed.
    assert "2147483647" in results["id = int32 max"][1]
    assert "'nope'" in results["unknown model"][1]
    assert "UTF-8" in results["invalid UTF-8 in stop string"][1]
    # Deadlines of 1 ms, duplicates and cancellation floods.
    got = _status_deadline(addr, 0.001)
    assert got in (grpc.StatusCode.DEADLINE_EXCEEDED,)
    cancel_flood(addr, 40)
    duplicate_ids(addr)
    assert all(p.alive for p in st.procs.values()), {n: p.alive for n, p in st.procs.items()}
    wait_pools_idle(st)
    assert generate(addr, IDS, 8) == generate(addr, IDS, 8)  # still serving, deterministically


def _status_deadline(addr, timeout):
    with grpc.insecure_channel(addr) as ch:
        try:
            req = _req(
                prompt_token_ids=pb.TokenIds(ids=IDS * 20),
                stopping=pb.StoppingParams(max_tokens=64),
            )
            list(pbg.GenerationStub(ch).Generate(req, timeout=timeout))
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def cancel_flood(addr, n):
    """n streams cancelled at random points (before, at and after the first token)."""
    rng = random.Random(5)
    with grpc.insecure_channel(addr) as ch:
        stub = pbg.GenerationStub(ch)
        calls = []
        for i in range(n):
            ids = [(i * 7 + j) % 300 + 3 for j in range(30 + i)]
            req = _req(prompt_token_ids=pb.TokenIds(ids=ids),
                       stopping=pb.StoppingParams(max_tokens=200, ignore_eos=True))  # fmt: skip
            calls.append(stub.Generate(req, timeout=60))
        for c in calls:
            k = rng.choice([0, 1, 3])
            try:
                for _ in range(k):
                    next(c)
            except (StopIteration, grpc.RpcError):
                pass
            c.cancel()


def duplicate_ids(addr):
    with grpc.insecure_channel(addr) as ch:
        stub = pbg.GenerationStub(ch)
        req = _req(request_id="same", prompt_token_ids=pb.TokenIds(ids=IDS * 5),
                   stopping=pb.StoppingParams(max_tokens=100, ignore_eos=True))  # fmt: skip
        first = stub.Generate(req, timeout=60)
        next(first)
        codes = []
        for _ in range(5):
            try:
                list(stub.Generate(req, timeout=60))
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
        assert codes == [grpc.StatusCode.ALREADY_EXISTS] * 5
        assert len([t for r in first for t in r.token_ids]) == 99


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


def _until(pred, what: str, timeout: float = 300.0) -> None:
    """Polls pred until true; a generous deadline, not a timing claim."""
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.02)


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
    _until(lambda: finished[0] >= 8 or not t.is_alive(), "8 requests finished")
    run_failed()
    with lock:
        rs.kill()
        in_flight, done_at_kill = started[0] - finished[0], finished[0]
    assert in_flight > 0 and done_at_kill < len(cases), (in_flight, done_at_kill)
    # Served while Redis is down: requests in flight at the kill finish, new ones start.
    _until(lambda: finished[0] >= done_at_kill + 8 or not t.is_alive(), "requests finishing")
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
