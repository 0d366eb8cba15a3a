"""The router end-to-end tests' stack (two decode workers, one prefill worker, a router on a
real Redis), their in-process reference generator, and one Generate call two ways: its tokens
and text, or its status code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc

from megaserve.model import LoadedModel
from megaserve.offline import OfflineGenerator
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from megaserve_app.launch import worker_stats
from tests.redis_server import RedisServer
from tests.stack import Stack, make_chat_checkpoint

MODEL = "tiny-chat"
DISAGG_MIN = 48  # the router's disagg_min_uncached_tokens (lb.yaml below)
DECODE = ("d1", "d2")
IDS = {"prompt_token_ids": pb.TokenIds(ids=[5, 6, 7])}


@contextlib.contextmanager
def router_stack(tmp: Path) -> Iterator[tuple[Stack, str, Path, RedisServer]]:
    """(stack, router address, checkpoint, redis) up for the block, torn down after it."""
    ck = make_chat_checkpoint(tmp / "ck")
    rs = RedisServer(tmp).start()
    (tmp / "lb.yaml").write_text(
        "decode_policy: session_affinity\nsession_fallback_policy: kv_aware\n"
        f"disagg_min_uncached_tokens: {DISAGG_MIN}\n"
    )
    st = Stack(rs.url, ck)
    try:
        router = st.up(DECODE, ("p1",), str(tmp / "lb.yaml"))  # up: the router sees all three
        yield st, router.address, ck, rs
    finally:
        st.stop()
        rs.kill()


def offline_reference(ck: Path) -> tuple[LoadedModel, OfflineGenerator]:
    """The checkpoint loaded in-process, and a generator with the workers' page size."""
    model = LoadedModel.load(str(ck), progress=False)
    return model, OfflineGenerator(model, page_size=16, max_context=512)


def generate(addr, **kw):
    with grpc.insecure_channel(addr) as ch:
        out = list(
            pbg.GenerationStub(ch).Generate(pb.GenerateRequest(model=MODEL, **kw), timeout=120)
        )
    return [t for o in out for t in o.token_ids], "".join(o.text for o in out), out


def status_of(addr, timeout=30.0, **kw) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(addr) as ch:
        try:
            list(pbg.GenerationStub(ch).Generate(pb.GenerateRequest(**kw), timeout=timeout))
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def pools_idle(st) -> None:
    for w in DECODE:
        s = worker_stats(st.procs[w].address)
        assert s.running == 0 and s.waiting == 0 and s.reserved == 0, (w, s)
        assert s.free_pages + s.cached_pages == s.total_pages, (w, s)
