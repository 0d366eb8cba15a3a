"""--redis-url through Sentinel: real redis-server processes (a primary, a replica and three
Sentinels, quorum 2), the primary killed with SIGKILL, the clients following the promoted
replica; the URL parser and the router's logged fallback for duplicate-id checks."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis
from structlog.testing import capture_logs

from megaserve import redis_conn
from megaserve.redis_conn import RedisURLError, SentinelURL, parse_sentinel_url
from megaserve.registration import Heartbeat
from megaserve.state_keys import WorkerInfo, session_key, worker_key
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from megaserve_app.launch import free_port, redis_binary
from router.state import ClusterState
from tests.polling import until, until_async
from tests.stack import Stack, make_chat_checkpoint, wait_router_view

SERVICE = "megaserve"


def _ask(call, *args):
    """call(*args), or None if Redis is unreachable or refuses."""
    try:
        return call(*args)
    except redis.RedisError:
        return None


class Sentinels:
    """A primary, its replica and three Sentinels on free ports under one directory."""

    def __init__(self, d: Path, n_sentinels: int = 3, quorum: int = 2):
        self.d, self.binary, self.procs = d, redis_binary(), []
        d.mkdir(parents=True, exist_ok=True)
        self.primary_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports, self.quorum = [free_port() for _ in range(n_sentinels)], quorum

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0)

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.d / f"{name}.log", "ab")  # noqa: SIM115 (the child owns it)
        p = subprocess.Popen([self.binary, *args], stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def _server(self, name: str, port: int, *extra: str) -> subprocess.Popen:
        (self.d / name).mkdir(exist_ok=True)
        return self._spawn(
            name,
            *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.d / name)),
            *("--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0", *extra),
        )

    def start(self) -> Sentinels:
        self.primary = self._server("primary", self.primary_port)
        until(lambda: _ask(self.client(self.primary_port).ping), what="primary up")
        self._server(
            "replica", self.replica_port, "--replicaof", "127.0.0.1", str(self.primary_port)
        )
        until(lambda: self.link_up(self.replica_port), what="replica in sync")
        for i, port in enumerate(self.sentinel_ports):
            conf = self.d / f"sentinel-{i}.conf"  # Sentinel rewrites its config: one each
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.d}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} {self.quorum}\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
            )
            self._spawn(f"sentinel-{i}", str(conf), "--sentinel")
        # Every Sentinel knows the replica and the other Sentinels: a failover can happen.
        for port in self.sentinel_ports:
            until(lambda p=port: self.sentinel_ready(p), what=f"sentinel {port} ready")
        return self

    def link_up(self, port: int) -> bool:
        info = _ask(self.client(port).info, "replication") or {}
        return info.get("master_link_status") == "up"

    def sentinel_ready(self, port: int) -> bool:
        s = self.client(port)
        master, replicas = _ask(s.sentinel_master, SERVICE), _ask(s.sentinel_slaves, SERVICE)
        n = len(self.sentinel_ports) - 1
        return bool(master and replicas) and master["num-other-sentinels"] == n

    def settled_primary_port(self) -> int:
        """The primary's port once every Sentinel names the same one: they learn of a
        failover one by one (hello messages), so one may still name the dead primary."""
        ports = self.sentinel_ports
        ask = [self.client(p).sentinel_get_master_addr_by_name for p in ports]
        named = lambda: len(got := {_ask(a, SERVICE) for a in ask}) == 1 and None not in got  # noqa: E731
        return int(until(named, what="the Sentinels agreeing") and _ask(ask[0], SERVICE)[1])

    def kill_primary(self) -> None:
        self.primary.kill()  # SIGKILL
        self.primary.wait()

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.kill()  # a no-op on one already reaped
            p.wait()


@pytest.fixture
def sentinels(tmp_path):
    s = Sentinels(tmp_path / "redis").start()
    yield s
    s.stop()


class Refreshes:
    """Which of some keys were written on a server since the first look: a key's PTTL only
    falls while nobody writes it, so a rise (or a reappearance) is a heartbeat landing there."""

    def __init__(self, r: redis.Redis, keys: list[str]):
        self.r, self.last, self.at = r, {k: None for k in keys}, {}

    def poll(self) -> bool:
        now = time.monotonic()
        for k, prev in self.last.items():
            ttl = _ask(self.r.pttl, k)
            if ttl is None:
                continue
            if prev is not None and k not in self.at and (ttl > prev or prev < 0 <= ttl):
                self.at[k] = now
            self.last[k] = ttl
        return len(self.at) == len(self.last)


# --- the URL -----------------------------------------------------------------------------


def test_sentinel_url_forms():
    assert parse_sentinel_url("redis+sentinel://h1:26380,h2/mymaster/3") == SentinelURL(
        (("h1", 26380), ("h2", 26379)), "mymaster", 3
    )
    assert parse_sentinel_url(
        "redis+sentinel://:p%40ss@[::1]:5000/m/?sentinel_password=sp"
    ) == SentinelURL((("::1", 5000),), "m", 0, None, "p@ss", "sp")
    assert parse_sentinel_url("redis+sentinel://u:p@h/m").username == "u"


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://h/",
        "redis+sentinel:///m",
        "redis+sentinel://h:port/m",
        "redis+sentinel://h:0/m",
        "redis+sentinel://h/m/db",
        "redis+sentinel://h/m/0/x",
        "redis+sentinel://h,/m",
        "redis+sentinel://::1/m",
        "redis+sentinel://h/m?ssl=true",
        "sentinel://h/m",
        "redis://h:port/0",
        "127.0.0.1:6379",
    ],
)
def test_bad_urls_fail_naming_the_url(url):
    with pytest.raises(RedisURLError, match="bad Redis URL"):
        redis_conn.validate(url)
    with pytest.raises(argparse.ArgumentTypeError):
        redis_conn.url_argument(url)


def test_bad_url_is_a_usage_error_of_router_and_workers(capsys):
    """The router's and the workers' --redis-url refuse it at parse time, password redacted."""
    from megaserve.worker_args import add_common_arguments
    from router.main import add_arguments

    for add in (add_arguments, lambda p: add_common_arguments(p, 512)):
        p = argparse.ArgumentParser(prog="megaserve x")
        add(p)
        assert p.parse_args(["--redis-url", "redis+sentinel://h1,h2:26380/m/1"]).redis_url
        with pytest.raises(SystemExit) as e:
            p.parse_args(["--redis-url", "redis+sentinel://:hunter2@h1:x/m"])
        err = capsys.readouterr().err
        assert e.value.code == 2
        assert "argument --redis-url: bad Redis URL 'redis+sentinel://:***@h1:x/m'" in err
        assert "hunter2" not in err


def test_plain_urls_are_redis_py_clients():
    c = redis_conn.sync_client("redis://127.0.0.1:1/2", timeout=0.5)
    kw = c.connection_pool.connection_kwargs
    assert (type(c), kw["port"], kw["db"], kw["socket_timeout"]) == (redis.Redis, 1, 2, 0.5)
    a = redis_conn.async_client("redis://127.0.0.1:1/0", timeout=0.5)
    assert a.connection_pool.connection_kwargs["socket_connect_timeout"] == 0.5


# --- the router's duplicate-id check without Redis ------------------------------------------


def test_claim_without_redis_is_logged_rate_limited():
    async def main():
        state = ClusterState(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
        with capture_logs() as logs:
            assert await state.claim("a", "r", 30)
            assert await state.claim("b", "r", 30)
            assert not await state.claim("a", "r", 30)  # its own ids are still checked
        await state.stop()
        return [e for e in logs if e["log_level"] == "warning"]

    warned = asyncio.run(main())
    assert len(warned) == 1, warned  # the second fallback within the window is only counted
    assert "duplicate request ids checked on this router only" in warned[0]["event"]


# --- failover ------------------------------------------------------------------------------


def _info():
    return WorkerInfo("d0", "decode", "127.0.0.1:5000", "tiny", 100, 90, 1, 0, 16)


def test_clients_follow_a_failover(sentinels):
    """In process: the heartbeat (sync) and the router's view (asyncio) reach the promoted
    replica after the primary is killed."""
    url, new = sentinels.url, sentinels.client(sentinels.replica_port)
    hb = Heartbeat(url, _info, interval=0.1, ttl=5).start()

    async def main():
        state = ClusterState(url, refresh_s=0.1)
        await state.start()
        await until_async(lambda: "d0" in state.workers, "the router's view has d0")
        assert await state.claim("before", "r", 30)
        t0 = time.monotonic()
        sentinels.kill_primary()
        await until_async(lambda: not sentinels.link_up(sentinels.replica_port), "replica sees it")
        beats = Refreshes(new, [worker_key("d0")])
        await until_async(lambda: not state.redis_ok, "the router notices")
        await until_async(beats.poll, "a heartbeat on the new primary")
        await until_async(lambda: state.redis_ok and "d0" in state.workers, "the view is live")
        assert await state.claim("after", "r", 30)
        assert new.get("megaserve:inflight:after").startswith(b"r#")  # on the new primary
        assert sentinels.settled_primary_port() == sentinels.replica_port
        took = time.monotonic() - t0
        await state.stop()
        return took

    try:
        took = asyncio.run(main())
    finally:
        hb.stop()
    print(f"in-process clients followed the failover in {took:.1f} s")


class Load:
    """Requests one after another on `n` threads until stopped; every outcome recorded."""

    PROMPT = list(range(3, 70))  # over disagg_min_uncached_tokens: the prefill tier too

    def __init__(self, address: str, n: int = 2):
        self.address, self.results, self._stop = address, [], threading.Event()
        self._next, self._lock = 0, threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def next_id(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def _run(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = pbg.GenerationStub(ch)
            while not self._stop.is_set():
                i = self.next_id()
                start = time.monotonic()
                req = pb.GenerateRequest(
                    request_id=f"load-{i}",
                    session_id=f"load-{i}",
                    prompt_token_ids=pb.TokenIds(ids=self.PROMPT[i % 7 :]),
                    stopping=pb.StoppingParams(max_tokens=8, ignore_eos=True),
                )
                try:
                    n = sum(len(r.token_ids) for r in stub.Generate(req, timeout=120))
                    error = None if n == 8 else f"{n} tokens"
                except grpc.RpcError as e:
                    error = f"{e.code()}: {e.details()}"
                self.results.append((i, start, time.monotonic(), error))

    def done_since(self, t: float) -> int:
        return sum(1 for _, start, _, err in self.results if start > t and err is None)

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=180)


@pytest.mark.slow
def test_stack_follows_a_failover(tmp_path, sentinels):
    """Workers and router on the Sentinel URL; the primary is killed mid-load: heartbeats land
    on the promoted replica, the router's view goes live there, and no request fails."""
    ck = make_chat_checkpoint(tmp_path / "ck")
    (tmp_path / "lb.yaml").write_text("disagg_min_uncached_tokens: 16\n")
    st = Stack(sentinels.url, ck, log_dir=tmp_path)
    load = None
    try:
        procs = [st.worker("decode", "d1"), st.worker("prefill", "p1")]
        procs.append(st.router("r1", "--config", str(tmp_path / "lb.yaml")))
        for p in procs:
            p.wait_ready()
        primary = sentinels.client(sentinels.primary_port)
        until(lambda: primary.exists(worker_key("d1"), worker_key("p1")) == 2, what="registered")
        router = st.procs["r1"].address
        wait_router_view(router, 1, 1)
        load = Load(router).start()
        until(lambda: load.done_since(0) >= 4, timeout=180, what="requests before the kill")

        t0 = time.monotonic()
        first_after = load.next_id()  # ids from here on started after the kill
        sentinels.kill_primary()
        new = sentinels.client(sentinels.replica_port)
        until(lambda: not sentinels.link_up(sentinels.replica_port), what="replica sees it")
        beats = Refreshes(new, [worker_key("d1"), worker_key("p1")])
        views = []

        def router_wrote() -> bool:
            ids = [i for i, _, _, err in load.results if i > first_after and err is None]
            return any(new.exists(session_key(f"load-{i}")) for i in ids)

        with grpc.insecure_channel(router) as ch:
            models = pbg.GenerationStub(ch)

            def followed():
                m = models.ListModels(pb.ListModelsRequest(), timeout=30).models
                views.append([(x.decode_workers, x.prefill_workers) for x in m])
                return beats.poll() and router_wrote()

            until(followed, timeout=120, what="workers and router on the new primary")
        took = time.monotonic() - t0
        switched = sentinels.settled_primary_port()
        after = time.monotonic()
        until(lambda: load.done_since(after) >= 4, timeout=180, what="requests after it")
        load.stop()
        failed = [r for r in load.results if r[3] is not None]
        assert not failed, failed
        assert switched == sentinels.replica_port
        # The view never emptied, and it is live again on the new primary (not the last one).
        assert all(v == [(1, 1)] for v in views), views
        r1 = st.procs["r1"]
        until(
            lambda: "".join(r1.lines).count("redis reachable; worker view live") >= 2,
            "both refreshes live",
        )
        # Claims during the failover fell back to the router's own ids, and it said so.
        assert "duplicate request ids checked on this router only" in "".join(r1.lines)
        heartbeats = {k: round(t - t0, 1) for k, t in beats.at.items()}
        print(
            f"failover: primary killed -> heartbeats on the new primary {heartbeats} s, "
            f"router serving through it {took:.1f} s; {len(load.results)} requests, 0 failed"
        )
    except BaseException:
        print(st.log_tails())
        raise
    finally:
        if load:
            load.stop()
        st.stop()
