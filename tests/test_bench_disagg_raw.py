"""`megaserve bench disagg --raw-only` end to end on the tiny model: every transport's push
lands, and the bare gRPC stream it is compared with carries exactly the same bytes."""

from __future__ import annotations

import asyncio

from megaserve.server_thread import ServerThread
from megaserve_app.bench import disagg, grpc_ceiling


def test_bare_stream_counts_every_byte():
    servers = ServerThread(grpc_ceiling.create_server)
    try:
        msgs = grpc_ceiling.payloads([1000, 3, 70_000])
        assert [len(m) for m in msgs] == [1000, 3, 70_000] and msgs[0] != msgs[2][:1000]
        assert asyncio.run(grpc_ceiling.stream_seconds(servers.addresses[0], msgs)) > 0
    finally:
        servers.stop()


def test_raw_transfer_rows(tiny_model):
    rows = disagg.bench_raw_transfer(tiny_model, tokens=64, rounds=1)
    assert [r["transport"] for r in rows] == ["grpc-bare-stream", "grpc", "jax-transfer"]
    cfg = tiny_model.cfg
    nbytes = 2 * cfg.num_layers * 64 * cfg.num_kv_heads * cfg.head_dim * 4  # K, V of 64 tokens
    assert {r["bytes"] for r in rows} == {nbytes}
    assert rows[0]["of_ceiling"] == 1.0
    for r in rows:
        assert r["GBps"] > 0 and r["ceiling_GBps"] == rows[0]["GBps"]
