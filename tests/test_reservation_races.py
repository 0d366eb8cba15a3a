"""A decode worker's reservation raced by the calls around it: a Generate call that saw the
reservation as its push failed, and a cancel that arrives as the KV commits. The engine thread
is held on a command so that each call lands in the window (a timing no client controls)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import pytest

from decode_service.engine import DecodeEngine, EngineConfig, wait_idle
from decode_service.sequence import Sequence
from decode_service.server import create_server
from megaserve.finish import FinishReason
from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.sampling_params import SamplingParams
from megaserve.server_thread import ServerThread
from tests.polling import until

PROMPT = list(range(3, 23))  # 20 tokens: two pages of 16


def _seq(rid: str, max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(PROMPT), SamplingParams(), max_tokens, frozenset())


def _hold(engine: DecodeEngine) -> threading.Event:
    """Holds the engine thread on a command until the returned event is set."""
    gate, held = threading.Event(), threading.Event()

    def block():
        held.set()
        gate.wait(30)

    engine._submit(block)
    assert held.wait(10)
    return gate


def _queued(engine: DecodeEngine, n: int) -> None:
    end = time.monotonic() + 10
    while engine._commands.qsize() < n:
        assert time.monotonic() < end, "the call never reached the engine"
        time.sleep(0.005)


@contextlib.contextmanager
def _served_and_held(tiny_model, reserve: str | None = None):
    """A started engine behind a real decode server (reserving `reserve` first), its thread
    held as by _hold: (engine, address, gate). On exit the hold ends, then both stop."""
    engine = DecodeEngine(tiny_model, EngineConfig(max_context=128))
    engine.start()
    servers = ServerThread(lambda: create_server(engine))
    gate = None
    try:
        if reserve is not None:
            engine.reserve(reserve, PROMPT, 60.0)
        gate = _hold(engine)
        yield engine, servers.addresses[0], gate
    finally:
        if gate is not None:
            gate.set()
        servers.stop()
        engine.stop()


def _all_free(engine: DecodeEngine) -> bool:
    return engine.idle and engine.alloc.num_used == 0 and not engine._sinks


def test_a_generate_call_whose_reservation_is_dropped_meanwhile_is_served_here(tiny_model):
    """The call saw the reservation; its push then failed (the drop is queued first): the
    call is served as one that came without a reservation, nothing is left behind."""
    engine = DecodeEngine(tiny_model, EngineConfig(max_context=128))
    engine.start()
    try:
        engine.reserve("r", PROMPT, 60.0)
        gate = _hold(engine)
        dropped = engine._submit(engine.reservations.drop, "r")
        events, out = [], {}

        def generate():
            try:
                engine.submit(_seq("r"), events.append)
            except BaseException as e:  # noqa: BLE001 (reported below)
                out["error"] = e

        t = threading.Thread(target=generate)
        t.start()
        _queued(engine, 2)  # the attach, after the drop
        gate.set()
        t.join(10)
        assert dropped.result(5) is True and "error" not in out, out
        wait_idle(engine, timeout=60)
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert sum(len(e.token_ids) for e in events) == 8
        assert _all_free(engine)
    finally:
        engine.stop()


def test_a_cancel_that_arrives_as_the_kv_commits_ends_the_request(tiny_model):
    """The commit is queued before the cancel: the request has started when the cancel is
    decided, so it is cancelled (ABORT, pages freed), not left to decode for nobody."""
    engine = DecodeEngine(tiny_model, EngineConfig(max_context=128))
    engine.start()
    try:
        res = engine.reserve("c", PROMPT, 60.0)
        events = []
        engine.submit(_seq("c", max_tokens=60), events.append)  # attached, waiting for KV
        gate = _hold(engine)
        engine._submit(engine.reservations.commit, res, 5, [])
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("known", engine.cancel("c")))
        t.start()
        _queued(engine, 2)  # the cancel, after the commit
        gate.set()
        t.join(10)
        assert out["known"] is True
        wait_idle(engine, timeout=60)
        assert events[-1].finish_reason is FinishReason.ABORT
        assert sum(len(e.token_ids) for e in events) < 60
        assert _all_free(engine)
        assert engine.cancel("c") is False  # gone: Release answers NOT_FOUND
    finally:
        engine.stop()


def test_a_generate_call_cancelled_while_it_attaches_leaves_nothing(tiny_model):
    """The decode server attaches off its event loop; a call cancelled while the attach waits
    for the engine thread cancels the request once the attach is in (before its lease)."""
    with _served_and_held(tiny_model, "g") as (engine, address, gate):

        async def main():
            async with grpc.aio.insecure_channel(address) as ch:
                call = decode_pb2_grpc.DecodeStub(ch).Generate(
                    decode_pb2.GenerateRequest(
                        request_id="g",
                        prompt_token_ids=PROMPT,
                        stopping=decode_pb2.StoppingParams(max_tokens=8),
                    )
                )
                await asyncio.to_thread(_queued, engine, 1)  # its attach waits
                call.cancel()

        asyncio.run(main())
        gate.set()
        wait_idle(engine, timeout=10)  # not the 60 s lease
        assert _all_free(engine)


def test_a_command_its_caller_cancelled_does_not_fail_the_step_that_serves_it(tiny_model):
    """A KV push cancelled while it awaits a page write cancels the write's Future; the
    engine still runs the write during a decode step, and the step's batch is unharmed."""
    engine = DecodeEngine(tiny_model, EngineConfig(max_context=256))
    engine.start()
    try:
        events = []
        engine.submit(_seq("victim", max_tokens=40), events.append)
        res = engine.reserve("pushed", PROMPT, 60.0)
        real, entered, gate = engine.runner.decode, threading.Event(), threading.Event()

        def decode(batch, sampling, n, want, serve_until):
            if not gate.is_set():
                entered.set()
                gate.wait(10)
            # The step lasts until the queued command is served: it runs inside the step.
            return real(
                batch,
                sampling,
                n,
                want,
                lambda done: serve_until(lambda: done() and engine._commands.empty()),
            )

        engine.runner.decode = decode
        assert entered.wait(30)
        engine.write_import(res, []).cancel()
        gate.set()
        engine.cancel("pushed")
        wait_idle(engine, timeout=60)
        assert engine.step_failures == 0
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert sum(len(e.token_ids) for e in events) == 40
    finally:
        gate.set()
        engine.stop()


def test_an_attach_the_engine_answered_too_late_is_undone_when_it_runs(tiny_model):
    """The Generate call's wait for its attach times out (the engine thread is stuck, here
    cut to 0.3 s from 30 s) after the KV committed: the attach still runs and starts the
    request, and the cancel queued behind it ends it; no pages or running slot are left."""
    engine = DecodeEngine(tiny_model, EngineConfig(max_context=128))
    engine.start()
    try:
        res = engine.reserve("late", PROMPT, 60.0)
        gate = _hold(engine)
        engine._submit(engine.reservations.commit, res, 5, [])  # the KV is in first
        engine._call = lambda fn, *a: engine._submit(fn, *a).result(timeout=0.3)
        try:
            with pytest.raises(TimeoutError):
                engine.submit(_seq("late", max_tokens=60), lambda e: None)
        finally:
            del engine._call
        gate.set()
        wait_idle(engine, timeout=30)
        until(lambda: _all_free(engine) and not engine.sched.running, "the request undone", 30)
    finally:
        gate.set()
        engine.stop()


def test_release_answers_while_the_engine_thread_is_busy(tiny_model):
    """Release of a reservation while the engine thread is inside a long call (a prefill):
    answered within its wait, not after the call; the drop happens when the engine gets to it."""
    with _served_and_held(tiny_model, "rel") as (engine, address, gate):
        with grpc.insecure_channel(address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            stub.Release(decode_pb2.ReleaseRequest(request_id="rel"), timeout=20)
            # Answered while the engine is still held (a Release that waited for the decision
            # would answer only once the hold ends, the reservation gone by then).
            assert "rel" in engine.reservations
            gate.set()
            until(lambda: "rel" not in engine.reservations, "the release decided", 10)
            with pytest.raises(grpc.RpcError) as e:  # gone now
                stub.Release(decode_pb2.ReleaseRequest(request_id="rel"), timeout=20)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert _all_free(engine)


def test_a_release_that_arrives_before_its_queued_reserve_undoes_it(tiny_model):
    """The router's Reserve waits behind a long engine call; its client leaves and the router's
    Release arrives meanwhile: the cancel is queued behind the reserve and undoes it (answered
    NOT_FOUND at once, the reservation would hold its pages for its whole lease)."""
    with _served_and_held(tiny_model) as (engine, address, gate):
        reserving = threading.Thread(target=engine.reserve, args=("late", PROMPT, 60.0))
        reserving.start()
        _queued(engine, 1)
        with grpc.insecure_channel(address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            stub.Release(decode_pb2.ReleaseRequest(request_id="late"), timeout=20)
        gate.set()
        reserving.join(10)
        until(lambda: "late" not in engine.reservations and _all_free(engine), "undone", 10)
