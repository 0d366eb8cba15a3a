"""A peer's KV push whose chunks point at a transfer server that never answers (a pull that
would block for ever): each push is refused with the address named and its reservation
freed, Reserve and Release answer meanwhile, and SIGTERM still ends the worker. A real
decode-worker process (its stuck pull threads stay in it)."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import grpc

from decode_service import kv_service
from megaserve.kv import wire
from megaserve.model import LoadedModel
from megaserve.rpc import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.conftest import FIXTURES
from tests.test_decode_worker_process import _spawn

PUSHES = kv_service.PULL_THREADS + 3  # more than the pull threads (and the default executor's 6)
NOBODY = "127.0.0.1:1"


def _hostile_push(stub, dec, geo, rid: str, out: dict) -> None:
    prompt = [7 + len(rid)] * 30
    r = dec.Reserve(decode_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt), timeout=20)
    n = r.total_pages - r.cached_pages
    shape = [2, geo.num_layers, n, geo.page_size, geo.kv_heads, geo.head_dim]
    chunk = kv_transfer_pb2.KVChunk(
        layer_start=0,
        layer_end=geo.num_layers,
        page_index=list(range(r.cached_pages, r.total_pages)),
        shape=shape,
        pull=kv_transfer_pb2.PullRef(address=NOBODY, uuid=1),
    )
    msgs = [
        wire.header(rid, geo, r.cached_pages, n),
        kv_transfer_pb2.KVPush(chunk=chunk),
        wire.trailer(5),
    ]
    try:
        stub.Push(iter(msgs), timeout=kv_service.PULL_TIMEOUT_S + 60)
        out[rid] = ("OK", "")
    except grpc.RpcError as e:
        out[rid] = (e.code(), e.details())


def test_pulls_that_never_answer_are_refused_and_starve_nothing(redis_server):
    ck = FIXTURES / "tiny" / "llama_gqa2"
    cfg = LoadedModel.load(str(ck), progress=False).cfg
    geo = wire.PageGeometry(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, "float32")
    proc = _spawn("decode", "dw-pull", redis_server.url, "--max-context", "256")
    try:
        line = proc.stdout.readline()
        m = re.search(r"READY decode worker dw-pull grpc=(\S+)", line)
        assert m, line + proc.stderr.read()[-3000:]
        with grpc.insecure_channel(m.group(1)) as ch:
            dec = decode_pb2_grpc.DecodeStub(ch)
            stub = kv_transfer_pb2_grpc.KVTransferStub(ch)
            out: dict = {}
            pushes = [
                threading.Thread(target=_hostile_push, args=(stub, dec, geo, f"pull-{i}", out))
                for i in range(PUSHES)
            ]
            for t in pushes:
                t.start()
            time.sleep(2.0)  # every push has reserved and is waiting on its pull
            # Reserve and Release answer while the pulls are stuck.
            t0 = time.monotonic()
            dec.Reserve(
                decode_pb2.ReserveRequest(request_id="ok", prompt_token_ids=[1, 2]), timeout=5
            )
            dec.Release(decode_pb2.ReleaseRequest(request_id="ok"), timeout=5)
            assert time.monotonic() - t0 < 5
            for t in pushes:
                t.join(timeout=kv_service.PULL_TIMEOUT_S + 90)
            assert len(out) == PUSHES, out
            for rid, (code, details) in out.items():
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (rid, code, details)
                assert (
                    f"from '{NOBODY}' did not finish" in details and "reservation freed" in details
                )
            stats = dec.Stats(decode_pb2.StatsRequest(), timeout=5)
            assert (
                stats.reserved == 0 and stats.free_pages + stats.cached_pages == stats.total_pages
            )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # stuck pull threads do not hold the exit
        events = [json.loads(x) for x in proc.stderr.read().splitlines() if x.startswith("{")]
        assert [e for e in events if e["event"] == "stopped"]
    finally:
        if proc.poll() is None:
            proc.kill()
