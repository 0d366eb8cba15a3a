"""A disaggregated request's first token reaches the router's client from the prefill worker
(PrefillStream) before its KV is committed on the decode worker; the decode stream then
brings the rest, every token once, equal to one-worker decoding. A client that leaves after
that first token, or a hand-off that fails after it, leaks nothing."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from decode_service.engine import DecodeEngine, EngineConfig, wait_idle
from decode_service.server import create_server as create_decode
from megaserve.errors import ReservationGone
from megaserve.offline import OfflineGenerator
from megaserve.rpc import decode_pb2
from megaserve.sampling_params import SamplingParams
from megaserve.server_thread import ServerThread
from megaserve.state_keys import WorkerInfo
from prefill_service.engine import PrefillConfig, PrefillEngine
from prefill_service.server import create_server as create_prefill
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.frontend import Job
from router.state import ClusterState
from router.worker_view import WorkerView

N = 6  # tokens per request


@pytest.fixture(scope="module")
def stack(tiny_model):
    dec = DecodeEngine(tiny_model, EngineConfig(max_context=256))
    dec.start()
    pre = PrefillEngine(tiny_model, PrefillConfig(chunk=32, max_context=256))
    servers = ServerThread(lambda: create_decode(dec), lambda: create_prefill(pre))
    yield dec, servers.addresses, servers.results[1][3]
    servers.stop()
    dec.stop()


@pytest.fixture
def held_commit(stack):
    """The decode worker's KV commits wait for `gate`; `fail` (a count) makes the next ones
    raise ReservationGone instead (the worker lost the reservation)."""
    dec = stack[0]
    real = dec.commit_import
    gate, fail = threading.Event(), {"left": 0}

    def commit(*args):
        assert gate.wait(60), "the test never opened the gate"
        if fail["left"]:
            fail["left"] -= 1
            raise ReservationGone("reservation lost (test)")
        return real(*args)

    dec.commit_import = commit
    yield gate, fail
    gate.set()
    dec.commit_import = real


def _dispatcher(addresses) -> Dispatcher:
    d_addr, p_addr = addresses
    state = ClusterState(None)
    state.workers = {
        w: WorkerView(WorkerInfo(w, role, addr, "m", 64, 64, 0, 0, 16, 256, 96))
        for w, role, addr in (("d", "decode", d_addr), ("p", "prefill", p_addr))
    }
    return Dispatcher(state, RouterConfig(disagg_min_uncached_tokens=1, retry_base_delay_ms=1))


def _job(rid: str, prompt: list[int]) -> Job:
    sp = decode_pb2.SamplingParams(temperature=0.0)
    return Job(rid, SimpleNamespace(name="m"), prompt, sp, N, (), (), True, "")


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 90, 40).tolist()


def _reference(tiny_model, prompt: list[int]) -> list[int]:
    gen = OfflineGenerator(tiny_model, max_context=256)
    return gen.generate(prompt, N, SamplingParams(), ignore_eos=True).token_ids


def _nothing_left(stack) -> None:
    dec, _, prefill = stack
    wait_idle(dec)
    assert len(dec.reservations) == 0
    dec.alloc.check_invariants()
    assert dec.alloc.all_free_or_cached()
    assert prefill.inflight == 0


def _first_then_rest(stack, gate, rid: str, prompt: list[int]):
    """Runs one request through a Dispatcher: (its first chunk, taken while the decode
    worker's commit is held, then the chunks after the gate opens, the dispatcher's stats)."""

    async def main():
        disp = _dispatcher(stack[1])
        try:
            async with contextlib.aclosing(disp.run(_job(rid, prompt), None)) as chunks:
                first = await asyncio.wait_for(anext(chunks), 60)
                gate.set()
                return first, [c async for c in chunks], dict(disp.stats)
        finally:
            await disp.close()

    return asyncio.run(main())


def test_first_token_comes_before_the_kv_commits(stack, held_commit, tiny_model):
    gate, _ = held_commit
    prompt = _prompt(1)
    # The decode worker's commit is held: the first token can only be the prefill's.
    first, rest, _ = _first_then_rest(stack, gate, "ahead", prompt)
    assert len(first.token_ids) == 1 and first.finish_reason is None and first.worker_id == "d"
    tokens = first.token_ids + [t for c in rest for t in c.token_ids]
    assert tokens == _reference(tiny_model, prompt)
    assert rest[-1].finish_reason is not None
    _nothing_left(stack)


def test_client_leaving_after_the_first_token_leaks_nothing(stack, held_commit):
    gate, _ = held_commit

    async def main():
        disp = _dispatcher(stack[1])
        try:
            async with contextlib.aclosing(disp.run(_job("leaves", _prompt(2)), None)) as chunks:
                await asyncio.wait_for(anext(chunks), 60)
            # Gone before the KV committed: the hand-off is stopped and the pages released.
            gate.set()
            await disp.drain()
        finally:
            await disp.close()

    asyncio.run(main())
    _nothing_left(stack)


def test_hand_off_failing_after_the_first_token_migrates(stack, held_commit, tiny_model):
    gate, fail = held_commit
    fail["left"] = 1  # the held commit fails: the request moves on with its first token
    prompt = _prompt(3)
    first, rest, stats = _first_then_rest(stack, gate, "fails", prompt)
    tokens = first.token_ids + [t for c in rest for t in c.token_ids]
    assert tokens == _reference(tiny_model, prompt)  # every position once
    assert stats["migrations"] == 1, stats
    _nothing_left(stack)


def test_generate_waits_on_the_reservation_while_the_kv_is_on_its_way(
    stack, held_commit, tiny_model
):
    gate, _ = held_commit
    dec, prompt = stack[0], _prompt(4)

    def waiting() -> bool:  # a Generate call attached to a reservation not yet committed
        return any(r.waiter is not None for r in list(dec.reservations.open.values()))

    async def main():
        disp = _dispatcher(stack[1])
        try:
            async with contextlib.aclosing(disp.run(_job("waits", prompt), None)) as chunks:
                first = await asyncio.wait_for(anext(chunks), 60)
                # The commit is held, yet the decode call is already there: the sequence
                # starts at the commit, not after the PrefillResponse comes back.
                for _ in range(3000):
                    if waiting():
                        break
                    await asyncio.sleep(0.01)
                attached = waiting()
                gate.set()
                return attached, first.token_ids + [t async for c in chunks for t in c.token_ids]
        finally:
            await disp.close()

    attached, tokens = asyncio.run(main())
    assert attached
    assert tokens == _reference(tiny_model, prompt)
    _nothing_left(stack)
