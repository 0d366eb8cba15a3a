"""kill -9 of a decode worker mid-generation: every in-flight request completes through the
router and its tokens equal an uninterrupted run (greedy and seeded); the same for a worker
frozen by SIGSTOP (its connections stay open: the router moves its requests once its
heartbeat expires), decode and prefill; Redis outages."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import grpc
import pytest

from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.sampling_params import SamplingParams
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from megaserve_app.launch import worker_stats
from tests.redis_server import RedisServer
from tests.router_stack import offline_reference
from tests.stack import Stack, make_chat_checkpoint, tokens_equal_report, wait_router_view

N_TOKENS = 400  # long enough that streams are still running when a worker is killed


@pytest.fixture
def stack(tmp_path):
    ck = make_chat_checkpoint(tmp_path / "ck")
    rs = RedisServer(tmp_path).start()
    (tmp_path / "lb.yaml").write_text(
        "decode_policy: least_loaded\ndisagg_min_uncached_tokens: 32\n"
    )
    st = Stack(rs.url, ck)
    try:
        router = st.up(("d1", "d2"), ("p1",), str(tmp_path / "lb.yaml"))
        yield st, router.address, ck, rs
    finally:
        st.stop()
        rs.kill()


class Stream(threading.Thread):
    """One public Generate call consumed in the background."""

    def __init__(self, addr, prompt, sp: SamplingParams, rid: str):
        super().__init__(daemon=True)
        self.addr, self.prompt, self.sp, self.rid = addr, prompt, sp, rid
        self.tokens: list[int] = []
        self.error: Exception | None = None
        self.finish = None

    def run(self):
        req = pb.GenerateRequest(
            request_id=self.rid,
            prompt_token_ids=pb.TokenIds(ids=self.prompt),
            sampling=pb.SamplingParams(
                temperature=self.sp.temperature, top_k=self.sp.top_k, seed=self.sp.seed
            ),
            stopping=pb.StoppingParams(max_tokens=N_TOKENS, ignore_eos=True),
        )
        try:
            with grpc.insecure_channel(self.addr) as ch:
                for r in pbg.GenerationStub(ch).Generate(req, timeout=300):
                    self.tokens += r.token_ids
                    self.finish = r.finish_reason
        except grpc.RpcError as e:
            self.error = e


def _running(addr) -> int:
    try:
        with grpc.insecure_channel(addr) as ch:
            s = decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.StatsRequest(), timeout=5)
            return s.running
    except grpc.RpcError:
        return -1


def _started(st, addr, cases, tag: str) -> tuple[list[Stream], str]:
    """The cases' streams, each past its 4th token; and the decode worker running the most."""
    streams = [Stream(addr, p, sp, f"{tag}-{i}") for i, (p, sp) in enumerate(cases)]
    for s in streams:
        s.start()
    end = time.monotonic() + 300
    while not all(len(s.tokens) >= 4 for s in streams):
        assert time.monotonic() < end, [(s.rid, len(s.tokens), s.error) for s in streams]
        time.sleep(0.01)
    busy = {w: _running(st.procs[w].address) for w in ("d1", "d2")}
    victim = max(busy, key=busy.get)
    assert busy[victim] > 0, busy
    return streams, victim


def test_kill9_decode_worker_mid_generation(stack):
    st, addr, ck, _ = stack
    cases = []
    for i in range(8):
        prompt = [(7 * i + j) % 300 + 3 for j in range(20 + 9 * i)]
        sp = SamplingParams() if i % 2 else SamplingParams(temperature=0.9, top_k=50, seed=100 + i)
        cases.append((prompt, sp))
    streams, victim = _started(st, addr, cases, "mig")
    before = {s.rid: len(s.tokens) for s in streams}  # just before the kill
    st.procs[victim].kill9()
    for s in streams:
        s.join(timeout=240)
    _, gen = offline_reference(ck)
    interrupted = [s for s in streams if before[s.rid] < N_TOKENS]
    assert interrupted, "every request finished before the kill; nothing was tested"
    for s, (prompt, sp) in zip(streams, cases):
        assert s.error is None, (s.rid, s.error)
        assert s.finish == pb.FINISH_REASON_LENGTH
        want = gen.generate(prompt, N_TOKENS, sp, ignore_eos=True).token_ids
        assert s.tokens == want, (s.rid, tokens_equal_report(s.tokens, want))
    events = _events(st.procs["r1"])
    on_victim = {
        e["request_id"].split("#")[0]
        for e in events
        if e.get("event") == "placed" and e.get("decode") == victim
    }
    migrated = {e["request_id"] for e in events if e.get("event") == "migrating"}
    ended_on = {e["request_id"]: e["decode"] for e in events if e.get("event") == "finished"}
    assert set(ended_on) == {s.rid for s in streams}, ended_on
    assert migrated <= on_victim, (migrated, on_victim)  # only the dead worker's moved
    # A victim request whose last token the router had from the victim before the kill needed
    # no move (the client may still have been reading it); every other one must have moved and
    # ended on the survivor.
    must_move = {r for r in on_victim if ended_on[r] != victim}
    assert must_move, ("no victim request was mid-run at the kill", before, on_victim)
    assert must_move <= migrated, ("victim requests were not migrated", must_move - migrated)
    assert all(ended_on[r] != victim for r in migrated), (migrated, ended_on)


@contextlib.contextmanager
def _frozen(proc):
    """SIGSTOP proc for the block (its sockets stay open, nothing answers), SIGCONT after."""
    proc.p.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.p.send_signal(signal.SIGCONT)


def _events(proc, event: str | None = None) -> list[dict]:
    """proc's JSON log records (those of `event` only, when given)."""
    recs = [json.loads(x) for x in proc.lines if x.startswith("{")]
    return [e for e in recs if event is None or e.get("event") == event]


GONE = "worker gone; its requests move"


def test_frozen_decode_worker_requests_move(stack):
    st, addr, ck, _ = stack
    _, gen = offline_reference(ck)
    cases = [([(5 * i + j) % 300 + 3 for j in range(12 + i)], SamplingParams()) for i in range(4)]
    cases[1] = (cases[1][0], SamplingParams(temperature=0.9, top_k=50, seed=7))
    streams, victim = _started(st, addr, cases, "frz")
    with _frozen(st.procs[victim]):
        for s in streams:
            s.join(timeout=240)
        assert not [s.rid for s in streams if s.is_alive()], "requests stuck on the frozen worker"
        gone = _events(st.procs["r1"], GONE)
    assert [e["address"] for e in gone] == [st.procs[victim].address], gone
    for s, (prompt, sp) in zip(streams, cases):
        assert s.error is None, (s.rid, s.error)
        want = gen.generate(prompt, N_TOKENS, sp, ignore_eos=True).token_ids
        assert s.tokens == want, (s.rid, tokens_equal_report(s.tokens, want))
    moved = _events(st.procs["r1"], "migrating")
    assert moved and all("left the view" in e["error"] for e in moved), moved


def test_frozen_prefill_worker_hand_off_moves(stack):
    st, addr, ck, _ = stack
    _, gen = offline_reference(ck)
    prompt = [(3 * j) % 300 + 3 for j in range(80)]  # over disagg_min_uncached_tokens (32)
    s = Stream(addr, prompt, SamplingParams(), "frz-p")
    with _frozen(st.procs["p1"]):
        s.start()  # placed through p1 (still in the view): Reserve on a decode worker, then p1
        s.join(timeout=240)
        assert not s.is_alive(), "the request is stuck on the frozen prefill worker"
        gone = _events(st.procs["r1"], GONE)
    assert [e["address"] for e in gone] == [st.procs["p1"].address], gone
    assert s.error is None, s.error
    assert s.tokens == gen.generate(prompt, N_TOKENS, SamplingParams(), ignore_eos=True).token_ids
    retried = _events(st.procs["r1"], "retrying")
    assert retried and "gone mid-hand-off" in retried[0]["error"], retried
    # The frozen hand-off's reservation was given back on the decode worker.
    for w in ("d1", "d2"):
        assert worker_stats(st.procs[w].address).reserved == 0


def test_router_serves_through_a_redis_outage(stack):
    st, addr, ck, rs = stack
    prompt = list(range(3, 40))
    _, gen = offline_reference(ck)
    want = gen.generate(prompt, 16, SamplingParams(), ignore_eos=True).token_ids

    def ask(rid):
        with grpc.insecure_channel(addr) as ch:
            req = pb.GenerateRequest(
                request_id=rid,
                prompt_token_ids=pb.TokenIds(ids=prompt),
                stopping=pb.StoppingParams(max_tokens=16, ignore_eos=True),
            )
            return [
                t for r in pbg.GenerationStub(ch).Generate(req, timeout=60) for t in r.token_ids
            ]

    assert ask("before") == want
    rs.kill()
    # The router has seen the outage (it says so) before the requests served without Redis.
    _until_logged(st.procs["r1"], "redis unreachable; serving on the last known view", 1)
    assert [ask(f"during-{i}") for i in range(4)] == [want] * 4
    rs.start()  # empty: workers re-register on their next heartbeat, the router catches up
    # Live again (the first time was at start), the workers registered anew and in its view.
    _until_logged(st.procs["r1"], "redis reachable; worker view live", 2)
    st.wait_registered(["d1", "d2", "p1"])
    wait_router_view(addr, 2, 1)
    assert ask("after") == want


def _until_logged(proc, needle: str, count: int, timeout: float = 120.0) -> None:
    """Until proc's output holds needle `count` times; a generous deadline, no timing claim."""
    end = time.monotonic() + timeout
    while "".join(proc.lines).count(needle) < count:
        assert time.monotonic() < end, f"{proc.name} did not log {needle!r} {count}x in {timeout} s"
        time.sleep(0.05)
