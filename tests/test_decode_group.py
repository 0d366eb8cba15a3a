"""A multi-host decode group (two processes x two CPU devices, --tp 4, gloo) behind the router:
the tokens of one device and of transformers, KV imported from a prefill worker, and either
process killed with SIGKILL: the group leaves Redis, the other process exits, and the group's
streams finish on another decode worker with no token lost or repeated. Then the protocol in
one process: wire forms and chunking, idle ticks, the stall bound and the watchdog."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import numpy as np
import pytest
import redis

from megaserve.errors import MeshError
from megaserve.parallel.distributed import ADDRESS, PROCESS_ID, PROCESSES, GroupConfig
from megaserve.parallel.group import Call, Leader, decode, encode
from megaserve.parallel.step_channel import (
    CHUNK_BYTES,
    HEADER_BYTES,
    INLINE_BYTES,
    StepChannel,
    body_sizes,
)
from megaserve.runner.batch import TokenBatch
from megaserve.sampling_params import SamplingArrays, SamplingParams
from megaserve.state_keys import worker_key
from megaserve.v1 import generation_pb2 as pb
from megaserve_app.launch import Cluster, free_port
from tests.conftest import FIXTURES
from tests.redis_server import RedisServer
from tests.serve_process import Streams
from tests.stack import (
    disagg_generate,
    solo_generator,
    tokens_equal_report,
    wait_router_view,
    write_tokenizer,
)

FIX = FIXTURES / "tiny" / "llama_gqa2"  # 4 query / 2 KV heads: tp 4 stores each KV head twice
PS, CTX, CHUNK = 8, 160, 32
TIMEOUT_S = 4  # --group-timeout-s: JAX's heartbeat timeout; stall bounds T / 2 and 2T
TTL_S = 5.0  # a worker's Redis record outlives its last heartbeat by this (WorkerConfig)
N_TOKENS = 100  # per stream: still running when a process is killed
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=5)
PENALIZED = SamplingParams(temperature=0.7, seed=9, repetition_penalty=1.3)


def _start_group(st: Cluster, gid: str) -> list:
    """The group's leader (procs[gid + ".0"]) and follower (".1"), registered as gid."""
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2"}
    args = ("--tp", "4", "--group-timeout-s", str(TIMEOUT_S), "--max-running", "4")
    return [
        st.worker("decode", gid, *args, env={**env, "JAX_PROCESS_ID": str(i)}, name=f"{gid}.{i}")
        for i in (0, 1)
    ]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Redis, group g1, a one-device decode worker d1, a prefill worker p1 and router r1
    (least loaded; prompts of 32 uncached tokens or more prefill on p1)."""
    tmp = tmp_path_factory.mktemp("group")
    ck = tmp / "ck"  # the fixture with a tokenizer, for the router
    ck.mkdir()
    for f in FIX.iterdir():
        (ck / f.name).symlink_to(f)
    write_tokenizer(ck, pad_to=512)
    rs = RedisServer(tmp).start()
    (tmp / "lb.yaml").write_text("decode_policy: least_loaded\ndisagg_min_uncached_tokens: 32\n")
    args = ("--kv-budget-mb", "2", "--max-context", str(CTX), "--page-size", str(PS))
    st = Cluster(rs.url, str(ck), "gqa2", (*args, "--prefill-chunk", str(CHUNK)))
    try:
        procs = _start_group(st, "g1")
        procs += [
            st.worker(k, w, "--warm-up", "none") for k, w in (("decode", "d1"), ("prefill", "p1"))
        ]
        procs.append(st.router("r1", "--config", str(tmp / "lb.yaml")))
        for p in procs:
            p.wait_ready(timeout=300)
        st.wait_registered(["g1", "d1", "p1"])
        wait_router_view(st.procs["r1"].address, 2, 1)
        yield st, redis.Redis.from_url(rs.url)
    finally:
        st.stop()
        rs.kill()


@pytest.fixture(scope="module")
def solo():
    """One device, in this process: the tokens every request must give."""
    return solo_generator(FIX, PS, CTX, CHUNK)


def _ask(st, dec, rid, prompt, n, sp=GREEDY, pre=None):
    p_addr = st.procs[pre].address if pre else None
    return asyncio.run(disagg_generate(st.procs[dec].address, p_addr, rid, prompt, n, sp))


def test_group_gives_one_device_tokens(stack, solo):
    """transformers' greedy tokens, prefilled by the group itself and handed over from p1
    (page writes broadcast); seeded and penalized sampling as one device samples them; prompt
    log-probabilities as the one-device worker d1 scores them."""
    st, _ = stack
    ref = json.loads((FIX / "reference.json").read_text())
    prompt, want = ref["prompt_ids"], ref["greedy_ids"]
    assert _ask(st, "g1.0", "ref", prompt, len(want))[2] == want
    _, pr, toks = _ask(st, "g1.0", "ref-kv", prompt + [7] * 30, 12, pre="p1")
    assert (
        pr.pages_sent > 0
        and toks == solo.generate(prompt + [7] * 30, 12, ignore_eos=True).token_ids
    )
    for i, sp in enumerate((SAMPLED, PENALIZED)):
        got = _ask(st, "g1.0", f"sp{i}", prompt, 16, sp)[2]
        assert got == solo.generate(prompt, 16, sp, ignore_eos=True).token_ids, sp
    from megaserve.rpc import decode_pb2

    def scored(w):
        return st.procs[w].address, decode_pb2.GenerateRequest(
            request_id=f"lp-{w}", prompt_token_ids=prompt, logprobs=2, prompt_logprobs=True,
            prompt_top_n=2, stopping=decode_pb2.StoppingParams(max_tokens=4, ignore_eos=True),
        )  # fmt: skip

    group, one = (_unary_stream(*scored(w)) for w in ("g1.0", "d1"))
    assert [r.token_ids for r in group] == [r.token_ids for r in one]
    for a, b in zip(group[0].prompt_logprobs, one[0].prompt_logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert list(a.top_token_ids) == list(b.top_token_ids)


def _unary_stream(address, req) -> list:
    import grpc

    from megaserve.rpc import decode_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return list(decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=120))


def _cases(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 12..42 tokens (the long ones prefill on p1), greedy and seeded in turn."""
    out = []
    for i in range(n):
        prompt = [(7 * i + 3 * j + seed) % 500 + 3 for j in range(12 + 6 * i)]
        sp = GREEDY if i % 2 else SamplingParams(temperature=0.9, top_k=50, seed=seed + i)
        out.append((prompt, sp))
    return out


def _streams(st, prefix: str, cases) -> Streams:
    reqs = [
        pb.GenerateRequest(
            model="gqa2",
            prompt_token_ids=pb.TokenIds(ids=p),
            sampling=pb.SamplingParams(temperature=sp.temperature, top_k=sp.top_k, seed=sp.seed),
            stopping=pb.StoppingParams(max_tokens=N_TOKENS, ignore_eos=True),
        )
        for p, sp in cases
    ]
    return Streams(st.procs["r1"].address, reqs, prefix)


def _router_events(st, event: str, prefix: str) -> list[dict]:
    out = []
    for line in list(st.procs["r1"].lines):
        if line.startswith("{") and f'"{event}"' in line:
            rec = json.loads(line)
            if rec.get("event") == event and rec.get("request_id", "").startswith(prefix):
                out.append(rec)
    return out


def _until(pred, t0: float, bound: float, what: str) -> float:
    """Seconds from t0 until pred() holds; AssertionError naming `what` past t0 + bound."""
    while not pred():
        assert time.monotonic() - t0 < bound, f"{what}: not within {bound} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def _kill_mid_stream(stack, solo, gid: str, victim: str, prefix: str) -> None:
    """Streams through the router, some on group gid; SIGKILL its process `victim` (".0" the
    leader, ".1" the follower): the other process exits non-zero, the group's record leaves
    Redis, and every stream finishes with one device's tokens, the group's ones migrated."""
    st, r = stack
    cases = _cases(6, seed=len(prefix))
    streams = _streams(st, prefix, cases)

    def going() -> bool:  # the group's streams have started (the others may still compile)
        on = {e["request_id"].split("#")[0] for e in _router_events(st, "placed", prefix)
              if e.get("decode") == gid}  # fmt: skip
        return bool(on) and all(len(streams.tokens[int(i[len(prefix) :])]) >= 4 for i in on)

    streams.wait(lambda: streams.errors or going())
    assert not streams.errors, streams.errors
    other = st.procs[f"{gid}.{1 - int(victim[-1])}"]
    t0 = time.monotonic()
    st.procs[gid + victim].kill9()
    # JAX's runtime ends the other process within the group timeout (at once if the leader,
    # its coordinator, died). A stuck leader withdraws its record after half of it; a dead
    # one's record expires after the TTL.
    t_exit = _until(lambda: other.returncode is not None, t0, TIMEOUT_S + 4, "other exits")
    assert other.returncode != 0
    bound = (TTL_S if victim == ".0" else TIMEOUT_S / 2) + 3
    t_gone = _until(lambda: not r.exists(worker_key(gid)), t0, bound, "record gone")
    print(f"{gid}{victim} killed: the other process exited after {t_exit:.1f} s (exit "
          f"{other.returncode}), the record left Redis after {t_gone:.1f} s")  # fmt: skip
    got = streams.join()
    for i, ((prompt, sp), toks) in enumerate(zip(cases, got)):
        want = solo.generate(prompt, N_TOKENS, sp, ignore_eos=True).token_ids
        assert toks == want, (i, tokens_equal_report(toks, want))
    on_group = {e["request_id"].split("#")[0] for e in _router_events(st, "placed", prefix)
                if e.get("decode") == gid}  # fmt: skip
    moved = {e["request_id"] for e in _router_events(st, "migrating", prefix)}
    ended = {e["request_id"]: e["decode"] for e in _router_events(st, "finished", prefix)}
    assert moved and moved <= on_group, (moved, on_group)
    assert all(ended[m] != gid for m in moved), ended


def test_follower_killed(stack, solo):
    _kill_mid_stream(stack, solo, "g1", ".1", "fk-")


def test_leader_killed(stack, solo):
    st, _ = stack
    for p in _start_group(st, "g2"):
        p.wait_ready(timeout=300)
    st.wait_registered(["g2"])
    wait_router_view(st.procs["r1"].address, 2, 1)  # d1 and g2 (g1 is gone)
    _kill_mid_stream(stack, solo, "g2", ".0", "lk-")


# -- the protocol in one process (no JAX runtime): wire forms, channel, leader, config -------
class _Wire:
    """Both ends of a StepChannel in one process: what process 0 broadcasts, the others get;
    `gate` cleared: a broadcast blocks (a member that does not follow)."""

    def __init__(self):
        self.sent, self.kinds, self.gate = [], [], threading.Event()
        self.gate.set()

    def tx(self, x):
        self.gate.wait()
        self.sent.append(x.copy())
        if x.size == HEADER_BYTES:
            self.kinds.append(int(x[:8].view(np.int64)[0]))
        return x

    def rx(self, x):
        got = self.sent.pop(0)
        assert got.shape == x.shape
        return got


def _flat(x) -> list:
    """A call argument as arrays and scalars, for exact comparison."""
    if isinstance(x, TokenBatch):
        return [x.tokens, x.num_new, x.num_cached, *(c.pages for c in x.caches)]
    if isinstance(x, SamplingArrays):
        return [*x.columns.values(), x.counts, x.seen]
    return [x]


def test_wire_forms_round_trip_through_the_channel():
    w = _Wire()
    tx, rx = StepChannel(w.tx), StepChannel(w.rx)
    batch = TokenBatch.from_rows([([5, 6, 7], 0, [1, 2]), ([9], 4, [3])])
    hist = [([1, 2], [3, 3]), ([4], [])]
    pen = SamplingArrays.build([PENALIZED, GREEDY], hist, 512)  # sparse on the wire
    big = np.arange(5000, dtype=np.float32)  # past the header: a bucket of its own
    huge = np.arange(300_000, dtype=np.float32)  # past a chunk: two chunks
    for args in ((batch, pen, 1, True), (np.arange(3, dtype=np.int32), big, big), (huge,)):
        tx.send(Call.DECODE, encode(args))
        kind, payload = rx.receive()
        got = [a for x in decode(payload) for a in _flat(x)]
        want = [a for x in args for a in _flat(x)]
        assert kind == Call.DECODE and len(got) == len(want)
        for a, b in zip(got, want):
            assert np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b)
    assert not w.sent and len(encode((batch, pen, 1, True))) < INLINE_BYTES
    assert body_sizes(len(encode((huge,)))) == [CHUNK_BYTES] * 2


def test_leader_ticks_withdraws_and_exits(monkeypatch):
    """Idle: TICKs. A failed call: re-raised after a TICK that shows the group still follows.
    A stuck broadcast: alive() turns False after stall_s, the process exits after exit_s."""
    exits, fatal = [], []
    monkeypatch.setattr(os, "_exit", exits.append)
    w = _Wire()
    leader = Leader(StepChannel(w.tx), 0.3, 0.8, lambda: fatal.append(1), lambda: False, 0.1)
    leader.start()
    _until(lambda: Call.TICK in w.kinds, time.monotonic(), 5, "idle tick")
    with pytest.raises(ValueError):
        leader.run(Call.PREFILL, _bad_request, 1)
    assert w.kinds[-2:] == [Call.PREFILL, Call.TICK] and leader.alive(time.monotonic())
    w.gate.clear()  # the next tick never completes
    t0 = time.monotonic()
    _until(lambda: not leader.alive(time.monotonic()), t0, 5, "stalled")
    _until(lambda: exits, t0, 5, "watchdog exit")
    assert exits[0] == 1 and fatal and time.monotonic() - t0 >= 0.8
    w.gate.set()
    leader.stop()


def _bad_request(_):
    raise ValueError("a request the runner refuses (the followers' call raises alike)")


def test_group_config_from_env():
    env = {ADDRESS: "10.0.0.1:8482", PROCESSES: "2", PROCESS_ID: "1"}
    g = GroupConfig.from_env(env)
    assert (g.multi, g.leader, g.local_devices(16)) == (True, False, 8)
    assert GroupConfig.from_env({}) == GroupConfig() and not GroupConfig().multi
    with pytest.raises(MeshError, match="do not split over 2 processes"):
        g.local_devices(3)
    for bad, msg in (
        ({PROCESSES: "2"}, "needs JAX_COORDINATOR_ADDRESS"),
        ({**env, PROCESS_ID: "2"}, r"must be in \[0, JAX_NUM_PROCESSES=2\)"),
        ({**env, PROCESSES: "two"}, "JAX_NUM_PROCESSES"),
    ):
        with pytest.raises(MeshError, match=msg):
            GroupConfig.from_env(bad)
