"""Router readiness as real processes: health is NOT_SERVING (overall and for
megaserve.v1.Generation) until every served model has a decode worker in the Redis view, goes
back to NOT_SERVING when the last one is gone (heartbeat TTL), and a router started while
Redis is down stays up until Redis and a worker appear. A Generate sent while no worker
exists waits for one up to `no_worker_wait_s`, then gets UNAVAILABLE.

The tests share one Redis and one decode worker id; each brings up what it needs itself.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megaserve.model import LoadedModel
from megaserve.offline import OfflineGenerator
from megaserve.sampling_params import SamplingParams
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from tests.redis_server import RedisServer
from tests.stack import Stack, make_chat_checkpoint, tokens_equal_report

MODEL = "tiny-chat"
SERVICE = "megaserve.v1.Generation"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEARTBEAT_TTL_S = 5.0  # the decode worker's key TTL (decode_service/config.py)
REFRESH_S = 0.2  # the routers' state_refresh_ms
SLACK_S = 3.0  # a loaded machine's scheduling, on top of the bound the issue states
SHORT_WAIT_S = 1.5  # r2's no_worker_wait_s
PROMPT = list(range(3, 40))
N = 12
LONG_PROMPT = [(i * 7) % 300 + 3 for i in range(400)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A checkpoint, a Redis that is not started yet (its port is fixed), and the configs:
    r1 waits long for a worker, r2 briefly."""
    tmp = tmp_path_factory.mktemp("readiness")
    ck = make_chat_checkpoint(tmp / "ck")
    rs = RedisServer(tmp)
    (tmp / "wait.yaml").write_text("no_worker_wait_s: 180\n")
    (tmp / "short.yaml").write_text(f"no_worker_wait_s: {SHORT_WAIT_S}\n")
    st = Stack(rs.url, ck)
    model = LoadedModel.load(str(ck), progress=False)
    gen = OfflineGenerator(model, page_size=16, max_context=512)
    want = gen.generate(PROMPT, N, SamplingParams(), ignore_eos=True).token_ids
    try:
        yield {"st": st, "rs": rs, "tmp": tmp, "want": want}
    finally:
        st.stop()
        rs.kill()


def _health(addr: str, service: str = SERVICE):
    """The router's health status for service, or None while it does not answer."""
    with grpc.insecure_channel(addr) as ch:
        try:
            req = health_pb2.HealthCheckRequest(service=service)
            return health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status
        except grpc.RpcError:
            return None


def _until(pred, what: str, timeout: float) -> float:
    """Polls pred; returns the seconds it took (a generous deadline, not a timing claim)."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


def _watch_until_serving(addr: str, timeout: float) -> float:
    """Watches the router's health (grpc.health.v1 Watch) until SERVING; monotonic time."""
    with grpc.insecure_channel(addr) as ch:
        req = health_pb2.HealthCheckRequest(service=SERVICE)
        for r in health_pb2_grpc.HealthStub(ch).Watch(req, timeout=timeout):
            if r.status == SERVING:
                return time.monotonic()
    raise AssertionError("health watch ended before SERVING")


def _generate(addr: str, timeout: float = 240.0, prompt=PROMPT, max_tokens=N):
    """(status code, token ids) of one greedy Generate of prompt."""
    req = pb.GenerateRequest(
        model=MODEL,
        prompt_token_ids=pb.TokenIds(ids=prompt),
        stopping=pb.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    with grpc.insecure_channel(addr) as ch:
        try:
            out = list(pbg.GenerationStub(ch).Generate(req, timeout=timeout))
        except grpc.RpcError as e:
            return e.code(), []
    return grpc.StatusCode.OK, [t for o in out for t in o.token_ids]


def _refused(addr: str, prompt: list[int]) -> tuple[grpc.StatusCode, str]:
    """(code, details) of a Generate of prompt with max_tokens unset, which must fail."""
    req = pb.GenerateRequest(model=MODEL, prompt_token_ids=pb.TokenIds(ids=prompt))
    with grpc.insecure_channel(addr) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pbg.GenerationStub(ch).Generate(req, timeout=240))
    return e.value.code(), e.value.details()


def _router(w, name: str, config: str):
    st = w["st"]
    if name not in st.procs or not st.procs[name].alive:
        st.router(name, "--config", str(w["tmp"] / config)).wait_ready()
    return st.procs[name]


def _ensure_serving(w) -> str:
    """Redis, decode worker d1 and router r1 up, r1 SERVING; r1's address."""
    if w["rs"].proc is None or w["rs"].proc.poll() is not None:
        w["rs"].start()
    st = w["st"]
    if "d1" not in st.procs or not st.procs["d1"].alive:
        st.worker("decode", "d1").wait_ready()
    r1 = _router(w, "r1", "wait.yaml")
    _until(lambda: _health(r1.address) == SERVING, "r1 SERVING", 120)
    return r1.address


def test_router_without_redis_or_workers_stays_up_then_serves(world):
    w, st = world, world["st"]
    r1, r2 = _router(w, "r1", "wait.yaml"), _router(w, "r2", "short.yaml")
    # Redis is down: both routers are up and answer health, NOT_SERVING overall and for the API.
    for r in (r1, r2):
        assert r.alive
        assert (_health(r.address, ""), _health(r.address)) == (NOT_SERVING, NOT_SERVING)
    # No worker ever appears for r2 within its bound: UNAVAILABLE after it.
    t0 = time.monotonic()
    assert _generate(r2.address) == (grpc.StatusCode.UNAVAILABLE, [])
    assert time.monotonic() - t0 >= SHORT_WAIT_S
    with ThreadPoolExecutor(4) as ex:
        waiting = ex.submit(_generate, r1.address)  # sent before any worker exists
        # max_tokens left at 0 ("up to the context") and no context known yet: the worker's
        # (512) decides once it is there, not a default the long prompt would not fit with.
        to_context = ex.submit(_generate, r1.address, 240.0, LONG_PROMPT, 0)
        too_long = ex.submit(_refused, r1.address, LONG_PROMPT + LONG_PROMPT[:112])
        watch = ex.submit(_watch_until_serving, r1.address, 240.0)
        w["rs"].start()
        assert _health(r1.address) == NOT_SERVING  # Redis alone is not enough
        d1 = st.worker("decode", "d1")
        d1.wait_ready()
        ready_at = time.monotonic()
        serving_at = watch.result(240)
        # The client that waited for SERVING succeeds on its first call.
        code, ids = _generate(r1.address)
        assert code == grpc.StatusCode.OK and ids == w["want"], tokens_equal_report(ids, w["want"])
        # The request that arrived while there was no worker waited for it and completed.
        code, ids = waiting.result(240)
        assert code == grpc.StatusCode.OK and ids == w["want"], (code, ids)
        code, ids = to_context.result(240)
        assert (code, len(ids)) == (grpc.StatusCode.OK, 512 - len(LONG_PROMPT))
        code, details = too_long.result(240)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt is 512 tokens; the context limit of 'tiny-chat' is 512" in details, details
    assert _health(r1.address, "") == SERVING
    _until(lambda: _health(r2.address) == SERVING, "r2 SERVING", 60)
    print(f"\nworker READY -> router SERVING: {max(serving_at - ready_at, 0.0):.2f} s")


def test_last_decode_worker_gone_not_serving_then_back(world):
    w, st = world, world["st"]
    addr = _ensure_serving(w)
    st.procs["d1"].kill9()  # no deregistration: the heartbeat key expires
    bound = HEARTBEAT_TTL_S + REFRESH_S + SLACK_S
    gone = _until(lambda: _health(addr) == NOT_SERVING, "NOT_SERVING after kill -9", bound)
    assert _health(addr, "") == NOT_SERVING
    st.worker("decode", "d1").wait_ready()
    back = _until(lambda: _health(addr) == SERVING, "SERVING with d1 back", 60)
    assert _generate(addr) == (grpc.StatusCode.OK, w["want"])
    print(f"\nkill -9 -> NOT_SERVING {gone:.2f} s; worker READY again -> SERVING {back:.2f} s")


def test_router_start_to_serving_with_a_worker_up(world):
    w, st = world, world["st"]
    _ensure_serving(w)
    t0 = time.monotonic()
    r3 = st.router("r3", "--config", str(w["tmp"] / "wait.yaml"))
    r3.wait_ready()
    listening = time.monotonic() - t0
    total = _until(lambda: _health(r3.address) == SERVING, "r3 SERVING", 120) + listening
    assert _generate(r3.address) == (grpc.StatusCode.OK, w["want"])
    print(f"\nrouter start -> READY {listening:.2f} s -> SERVING {total:.2f} s")
