"""The decode worker as a real process: Redis registration, serving through a Redis outage,
Prometheus metrics, and a clean SIGTERM shutdown that deregisters."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import grpc
import redis

from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.state_keys import worker_key, workers_set
from tests.conftest import FIXTURES, REPO
from tests.polling import until
from tests.redis_server import free_port


def _generate(addr: str, rid: str, n: int = 4) -> list[int]:
    with grpc.insecure_channel(addr) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        req = decode_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=[1, 2, 3],
            stopping=decode_pb2.StoppingParams(max_tokens=n, ignore_eos=True),
        )
        return [t for r in stub.Generate(req, timeout=60) for t in r.token_ids]


def _spawn(kind: str, worker_id: str, redis_url: str, *extra: str) -> subprocess.Popen:
    """`megaserve {kind}-worker` on the tiny fixture model, as a real process."""
    cmd = [
        sys.executable,
        "-m",
        "megaserve_app.cli",
        f"{kind}-worker",
        "--checkpoint",
        str(FIXTURES / "tiny" / "llama_gqa2"),
        "--worker-id",
        worker_id,
        "--redis-url",
        redis_url,
        "--kv-budget-mb",
        "8",
        *extra,
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env
    )


def test_worker_process_lifecycle(redis_server):
    metrics_port = free_port()
    proc = _spawn(
        "decode",
        "dw1",
        redis_server.url,
        "--metrics-port",
        str(metrics_port),
        "--max-context",
        "256",
    )
    try:
        line = proc.stdout.readline()
        m = re.search(r"READY decode worker dw1 grpc=(\S+)", line)
        assert m, line + proc.stderr.read()[-3000:]
        addr = m.group(1)
        r = redis.Redis.from_url(redis_server.url)
        until(
            lambda: r.sismember(workers_set("decode"), "dw1"),
            "r.sismember(workers_set('decode'), 'dw1')",
        )
        assert r.hget(worker_key("dw1"), "address").decode() == addr
        assert len(_generate(addr, "p1")) == 4
        # Redis dies: the worker keeps serving; when Redis returns it re-registers.
        redis_server.kill()
        assert len(_generate(addr, "p2")) == 4
        redis_server.start()
        r = redis.Redis.from_url(redis_server.url)
        until(lambda: r.exists(worker_key("dw1")), "r.exists(worker_key('dw1'))")
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        assert "megaserve:time_to_first_token_seconds_count" in body
        assert re.search(r"megaserve:generation_tokens_total\{[^}]*\} 8\.0", body), body[:2000]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not r.exists(worker_key("dw1"))
        logs = proc.stderr.read()
        assert '"event": "finished"' in logs and '"request_id": "p1"' in logs
        # --warm-up all (the default): the whole set compiled before READY, none after.
        events = [json.loads(x) for x in logs.splitlines() if x.startswith("{")]
        compiled = [e for e in events if e["event"] == "programs compiled"]
        assert len(compiled) == 1 and compiled[0]["programs"] > 20, compiled
        names = {"decode", "prefill", "prefill_logprobs", "pick", "kv_write"}
        assert set(compiled[0]["by_name"]) == names
        assert [e for e in events if e["event"] == "memory plan"]
        assert not [e for e in events if "compiled while serving" in e["event"]], events
    finally:
        if proc.poll() is None:
            proc.kill()


def test_prefill_worker_process_registers_and_stops(redis_server):
    # Registration only: no request runs, so no program is compiled (the prefill worker's
    # warm-up runs in every `megaserve serve` test).
    proc = _spawn("prefill", "pw1", redis_server.url, "--warm-up", "none")
    try:
        line = proc.stdout.readline()
        assert "READY prefill worker pw1" in line, line + proc.stderr.read()[-2000:]
        r = redis.Redis.from_url(redis_server.url)
        until(
            lambda: r.sismember(workers_set("prefill"), "pw1"),
            "r.sismember(workers_set('prefill'), 'pw1')",
        )
        assert r.hget(worker_key("pw1"), "role") == b"prefill"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not r.exists(worker_key("pw1"))
    finally:
        if proc.poll() is None:
            proc.kill()
