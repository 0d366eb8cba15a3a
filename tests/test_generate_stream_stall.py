"""A decode worker whose engine thread does not answer a request's wait (a long compile): on
the router's stream, as on the request's own Generate call, a worker failure (retried
elsewhere), never the client's DEADLINE_EXCEEDED."""

from __future__ import annotations

import time

import grpc
import pytest

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.server import create_server as create_decode
from megaserve.server_thread import ServerThread
from router.workers import WorkerFailed, classify
from tests.polling import until
from tests.test_generate_stream import _req, _run, _tokens, _Worker


@pytest.fixture(scope="module")
def workers(tiny_model):
    """The first fields as test_generate_stream's fixture: (engine, address, ...)."""
    dec = DecodeEngine(tiny_model, EngineConfig(max_context=128))
    dec.start()
    servers = ServerThread(lambda: create_decode(dec))
    yield dec, servers.addresses[0], None, None, None, None
    servers.stop()
    dec.stop()


def test_an_engine_that_does_not_answer_is_not_a_deadline(workers):
    """A request's wait for a stalled engine thread (an attach, here cut to 0.3 s from 30 s)
    raises TimeoutError inside Generate: on the stream, as on its own call, the request ends
    as a worker failure (retried elsewhere), not DEADLINE_EXCEEDED (the client's), and its
    reservation is freed."""
    dec, addr, _, _, _, _ = workers
    until(lambda: dec.idle, "idle before")

    async def fn(streamed, per_call):
        errors = []
        for calls, rid in ((streamed, "stalled-s"), (per_call, "stalled-c")):
            dec.reserve(rid, [1, 2], 60.0)
            dec._call = lambda fn, *a: dec._submit(fn, *a).result(timeout=0.3)
            try:
                dec._submit(time.sleep, 1.0)  # the engine thread is busy (a long compile)
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await _tokens(calls, addr, _req(rid, [1, 2]))  # no deadline at all
            finally:
                del dec._call
            errors.append(ei.value)
        return errors

    stream_e, call_e = _run(fn)
    assert stream_e.code() == call_e.code() == grpc.StatusCode.UNKNOWN, stream_e
    for e in (stream_e, call_e):
        assert isinstance(classify(_Worker(addr), e, "decode"), WorkerFailed)
    until(lambda: dec.idle, "the reservations freed")
