"""`megaserve serve` under faults: its supervisor's policy (backoff, crash-loop give-up) with
fake processes and a fake clock, and the real stack losing a decode worker and then the
prefill worker (kill -9) under 24 streams: every stream completes exactly, the dead process is
back and registered within 60 s, and the stack answers exactly after."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from megaserve.state_keys import worker_key, workers_set
from megaserve.v1 import generation_pb2 as pb
from megaserve_app.client import stream_request
from megaserve_app.launch import worker_stats
from megaserve_app.supervise import GiveUp, RestartPolicy, Supervisor
from tests.conftest import FakeClock
from tests.serve_process import Served, Streams, descendants, make_requests, pid_of, warmup_of
from tests.stack import make_chat_checkpoint


class FakeProc:
    def __init__(self, address: str = "127.0.0.1:1", ready: bool = True):
        self.address, self.ready, self.returncode = address, ready, None
        self.lines = ["loading\n", "boom\n"]

    @property
    def alive(self) -> bool:
        return self.returncode is None

    def die(self, code: int = -9) -> None:
        self.returncode = code

    def kill9(self) -> None:
        self.die(-9)


class Harness:
    """A supervisor over one fake child 'd0'; each spawn is a new FakeProc on a new port."""

    def __init__(self, policy: RestartPolicy | None = None, registered=None):
        self.clock, self.logs, self.spawned = FakeClock(), [], []
        self.proc = FakeProc()
        self.sup = Supervisor(
            {"d0": self.proc},
            self._spawn,
            registered or (lambda name, address: True),
            policy or RestartPolicy(),
            clock=self.clock,
            log=self.logs.append,
        )

    def _spawn(self, name: str) -> FakeProc:
        self.proc = FakeProc(f"127.0.0.1:{2 + len(self.spawned)}")
        self.spawned.append((name, self.clock()))
        return self.proc

    def run_for(self, seconds: float, step: float = 0.25) -> None:
        end = self.clock() + seconds
        while self.clock() < end:
            self.sup.tick()
            self.clock.advance(step)


def test_backoff_doubles_then_a_crash_loop_gives_up():
    h = Harness()
    h.run_for(10)  # up for 10 s: under a minute, so this exit starts a streak
    waits = []
    for _ in range(5):
        h.proc.die(1)
        died = h.clock()
        h.sup.tick()
        assert h.logs[-2].startswith("d0 exited (exit 1); restarting in ")
        assert h.logs[-1] == "  [d0] loading\n  [d0] boom"  # an error exit: its last lines
        n = len(h.spawned)
        while len(h.spawned) == n:
            h.clock.advance(0.25)
            h.sup.tick()
        waits.append(h.spawned[-1][1] - died)
        h.sup.tick()  # ready and registered: back
        assert h.logs[-1].startswith("restarted d0 (exit 1) in ")
    assert waits == [1, 2, 4, 8, 16]
    h.proc.die(3)  # the sixth exit in a row without a minute up
    with pytest.raises(GiveUp) as e:
        h.sup.tick()
    assert e.value.name == "d0" and "crash loop" in e.value.why and "exit 3" in e.value.why
    assert e.value.tail == ["loading\n", "boom\n"]
    assert [name for name, _ in h.spawned] == ["d0"] * 5


def test_a_minute_up_resets_the_backoff_and_the_count():
    h = Harness()
    for _ in range(20):  # far more than max_exits in all, but each after 60 s of serving
        h.run_for(60)
        h.proc.die()
        h.sup.tick()
        assert h.logs[-1] == "d0 exited (exit -9); restarting in 1 s"
        h.run_for(1.5)
        assert h.logs[-1].startswith("restarted d0 (exit -9) in 1.")
    assert len(h.sup.restarts) == 20


def test_six_exits_within_a_minute_give_up_even_if_each_came_back():
    h = Harness(RestartPolicy(base_s=0.25, factor=1.0))
    with pytest.raises(GiveUp):
        for _ in range(6):
            h.run_for(5)  # up for 5 s each time
            h.proc.die()
            h.sup.tick()
    assert len(h.spawned) == 5


def test_dying_again_before_back_counts_and_the_time_runs_from_the_first_exit():
    h = Harness()
    h.proc.die(-9)
    h.sup.tick()
    h.clock.advance(1)
    h.sup.tick()  # spawned; it dies while loading
    h.proc.ready = False
    h.clock.advance(3)
    h.proc.die(1)
    h.sup.tick()
    assert h.logs[-2] == "d0 exited (exit 1); restarting in 2 s"
    h.run_for(2.5)
    assert h.logs[-1] == "restarted d0 (exit 1) in 6.2 s: grpc=127.0.0.1:3"
    assert h.sup.restarts == [("d0", 1, 6.25)]


def test_back_means_ready_and_registered_at_the_new_address():
    seen = {}
    h = Harness(registered=lambda name, address: seen.get(name) == address)
    h.proc.die()
    h.run_for(1.25)
    assert len(h.spawned) == 1 and not h.logs[-1].startswith("restarted")
    h.proc.ready = False
    seen["d0"] = h.proc.address
    h.run_for(5)
    assert not h.logs[-1].startswith("restarted")  # registered but not READY yet
    h.proc.ready = True
    h.sup.tick()
    assert h.logs[-1].startswith("restarted d0 (exit -9) in 6.")
    assert h.logs[-1].endswith("grpc=127.0.0.1:2")


def test_a_restart_that_never_comes_back_is_killed_and_retried():
    h = Harness(RestartPolicy(start_timeout_s=30))
    h.proc.die()
    h.run_for(1.25)
    h.proc.ready = False  # hangs while starting
    h.run_for(31)
    assert h.proc.returncode == -9 and "not back within 30 s" in h.logs[-2]
    assert h.logs[-1] == "d0 exited (exit -9); restarting in 2 s"


def test_a_child_that_cannot_be_restarted_gives_up():
    h = Harness()

    def fail(name):
        raise RuntimeError("redis-server did not start on port 6390")

    h.sup.spawn = fail
    h.proc.die(0)
    with pytest.raises(GiveUp) as e:
        h.run_for(2)
    assert e.value.name == "d0" and "could not be restarted" in e.value.why


def test_delay_is_capped():
    p = RestartPolicy(max_exits=10)
    assert [p.delay(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]


# -- the real stack -------------------------------------------------------------------------
class Restart:
    """Kills worker_id (-9) and, in the background, times until Redis has its record again
    at a new address (registered) after the old one's."""

    def __init__(self, served: Served, r, worker_id: str):
        self.r, self.worker_id = r, worker_id
        self.old = self.address()
        self.back: float | None = None
        self.mark = len(served.lines)
        os.kill(pid_of(served.p.pid, worker_id), signal.SIGKILL)
        self.t_kill = time.monotonic()
        threading.Thread(target=self._watch, daemon=True).start()

    def address(self) -> str | None:
        got = self.r.hget(worker_key(self.worker_id), "address")
        return got.decode() if got else None

    def _watch(self) -> None:
        while time.monotonic() - self.t_kill < 300:
            new = self.address()
            if new and new != self.old and self.r.sismember(workers_set(self.role), self.worker_id):
                self.back = time.monotonic() - self.t_kill
                return
            time.sleep(0.05)

    @property
    def role(self) -> str:
        return self.worker_id.split("-")[0]

    def wait(self, served: Served, timeout: float = 60.0) -> float:
        """Seconds from the kill to registered; asserts within timeout, and serve's line."""
        end = self.t_kill + timeout
        while self.back is None and time.monotonic() < end:
            time.sleep(0.05)
        assert self.back is not None, (self.worker_id, served.output()[-4000:])
        _, m = served.wait_line(
            rf"^restarted {self.worker_id} \(exit -9\) in ([\d.]+) s: grpc=(\S+)", 30, self.mark
        )
        assert m.group(2) == self.address()
        return self.back


def disaggregated(served: Served, prefix: str) -> int:
    return sum(1 for e in served.router_events("placed", prefix) if e.get("disaggregated"))


@pytest.mark.slow
def test_serve_survives_kill9_of_a_decode_then_the_prefill_worker(tmp_path):
    """Why this is long: one stack (its start is the expensive part) goes through both faults
    in order, each with its reference run, its kill, its restart and its check after."""
    import redis as redis_lib

    s = Served("--decode-workers", "2", "--prefill-workers", "1", "--no-demo", "--verbose")
    try:
        _, m = s.wait_line(r"^megaserve is serving \S+ at (\S+) \(up in ([\d.]+) s", 400)
        address, up_s = m.group(1), float(m.group(2))
        r = redis_lib.Redis.from_url(s.wait_line(r"^redis: (\S+)", 1)[1].group(1))
        print(f"\nstack up in {up_s:.1f} s at {address}")

        # 1. A decode worker dies with streams running on it.
        reqs = make_requests(seed=1)
        # First, the shapes: a cold compile cache stalls a worker for tens of seconds per new
        # program, past the reservation lease (60 s); every run after the first is warm.
        Streams(address, warmup_of(reqs), "warm-").join()
        ref = Streams(address, reqs, "ref1-")
        want = ref.join()
        print(f"reference: {ref.summary()}; {disaggregated(s, 'ref1-')} via the prefill tier")
        assert disaggregated(s, "ref1-") > 0
        run = Streams(address, reqs, "kill1-")
        run.wait(lambda: all(run.first))
        running = {
            w: worker_stats(r.hget(worker_key(w), "address").decode()).running
            for w in ("decode-0", "decode-1")
        }
        victim = max(running, key=running.get)
        unfinished = sum(d is None for d in run.done)
        kill = Restart(s, r, victim)
        assert running[victim] > 0 and unfinished > 0, (running, unfinished)
        got = run.join()
        migrated = {e["request_id"] for e in s.router_events("migrating", "kill1-")}
        print(f"kill -9 {victim} ({running[victim]} running there, {unfinished} of 24 streams "
              f"unfinished): {run.summary()}, {len(migrated)} migrated, 0 errors")  # fmt: skip
        assert [i for i in range(24) if got[i] != want[i]] == []
        assert migrated
        back = kill.wait(s)
        print(f"{victim} back and registered {back:.1f} s after the kill")
        # The stack answers exactly: 8 of them again, their first 16 tokens (a shorter
        # max_tokens samples the same tokens: keys are (seed, position)).
        short = [pb.GenerateRequest() for _ in range(8)]
        for q, r0 in zip(short, reqs):
            q.CopyFrom(r0)
            q.stopping.max_tokens = 16
        after = Streams(address, short, "after1-")
        assert after.join() == [w[:16] for w in want[:8]]
        on_victim = [e for e in s.router_events("placed", "after1-") if e["decode"] == victim]
        print(f"after: {after.summary()}; {len(on_victim)} placed on the restarted {victim}")

        # 2. The prefill worker dies with prompts in flight on it.
        # The kill lands while the prompts are in the prefill tier: shorter streams do, and
        # fewer long prompts (each falls back to a prefill on a busy decode worker).
        reqs2 = make_requests(seed=2, long_every=12, max_tokens=(16, 32))
        run2 = Streams(address, reqs2, "kill2-")
        run2.wait(lambda: disaggregated(s, "kill2-") > 0)
        long_started = sum(run2.first[i] is not None for i in range(0, 24, 12))
        kill = Restart(s, r, "prefill-0")
        got2 = run2.join()
        retried = s.router_events("retrying", "kill2-")
        print(f"kill -9 prefill-0 ({long_started} of 2 long prompts had a first token): "
              f"{run2.summary()}, {len(retried)} retries, 0 errors")  # fmt: skip
        back = kill.wait(s)
        print(f"prefill-0 back and registered {back:.1f} s after the kill")
        ref2 = Streams(address, reqs2, "ref2-")
        assert ref2.join() == got2  # the undisturbed run of the same requests
        fresh = make_requests(
            seed=3, n=2, long_every=1, max_tokens=(8, 8)
        )  # uncached: the restarted prefill tier
        first = Streams(address, fresh, "fresh-").join()
        assert disaggregated(s, "fresh-") > 0
        assert Streams(address, fresh, "again-").join() == first
    finally:
        rc = s.stop()
        (tmp_path / "serve.log").write_text(s.output(own_only=False))  # every process's lines
    assert rc == 0, s.output()[-3000:]
    assert "stopping (SIGTERM)" in s.output()


def _generate(address: str, prompt: list[int], n: int = 12) -> list[int]:
    req = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt),
        stopping=pb.StoppingParams(max_tokens=n, ignore_eos=True),
    )
    return [t for r in stream_request(address, req, timeout=120) for t in r.token_ids]


def test_serve_restarts_its_router_on_its_port_and_its_redis(tmp_path):
    """The tiny model: kill -9 the router, then the private Redis; each is back (the router on
    the same public port, Redis on its port, the workers re-registered) and answers exactly."""
    ck = make_chat_checkpoint(tmp_path / "ck")
    s = Served("--checkpoint", str(ck), "--kv-budget-mb", "8", "--max-context", "512", "--no-demo")
    try:
        _, m = s.wait_line(r"^megaserve is serving \S+ at (\S+)", 240)
        address = m.group(1)
        prompt = [(i * 11) % 370 + 5 for i in range(40)]
        want = _generate(address, prompt)
        for name, marker in (("router", "megaserve_app.cli router "), ("redis", "redis-server")):
            mark = len(s.lines)
            pids = [p for p, c in descendants(s.p.pid).items() if marker in c]
            assert len(pids) == 1, (name, pids)
            os.kill(pids[0], signal.SIGKILL)
            _, m = s.wait_line(
                rf"^restarted {name} \(exit -9\) in ([\d.]+) s: (\w+)=(\S+)", 120, mark
            )
            print(f"\n{name} back in {float(m.group(1)):.1f} s at {m.group(3)}")
            same = (
                address if name == "router" else s.wait_line(r"^redis: redis://([^/]+)/", 1)[1][1]
            )
            assert m.group(3) == same  # the same port
            assert _health_serving(address, 60)
            assert _generate(address, prompt) == want
    finally:
        rc = s.stop()
    assert rc == 0, s.output()[-3000:]


def _health_serving(address: str, timeout: float) -> bool:
    """The router's grpc.health.v1 says SERVING within timeout (workers back in its view)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with grpc.insecure_channel(address) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
        time.sleep(0.2)
    return False
