"""Calling workers: channels and stubs, what a worker's error means for placement, and the
one disaggregated hand-off (Reserve on the decode worker, Prefill into it, Release on failure)
that the router, the benchmarks and the tests all use."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from megaserve.errors import NoCapacity
from megaserve.rpc import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from megaserve.status import Reason, error_metadata, reason_of
from router.frontend import RouterError
from router.worker_stream import rpc_error

# Codes that mean "this worker (or the path to it) failed", not "this request is bad".
WORKER_FAILED_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
}


# Options of the router's channels to workers. Sending: a long prompt's ids. Receiving: a
# first response that carries a long prompt's log-probabilities (~155 bytes a token at
# top-20: 4 MiB, gRPC's default, is ~26k tokens); one response over the limit would end the
# worker's whole GenerateStream, every request on it.
WORKER_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
]


class WorkerFailed(Exception):
    """A worker failed this attempt (it died, or its path did): place the request elsewhere."""

    def __init__(self, worker, why: str):
        super().__init__(f"{worker.id} ({worker.address}): {why}")
        self.worker = worker


def _kv_invalid(e: grpc.aio.AioRpcError) -> bool:
    """The decode worker refused the KV the prefill worker sent (a checksum mismatch, pages
    that do not fit its pool): a fault between the two workers, whatever the code (the
    request passed validation before any KV moved), and the sender's to answer for."""
    return error_metadata(e).get("decode_reason") == Reason.KV_TRANSFER_INVALID


def classify(worker, e: grpc.aio.AioRpcError, what: str) -> Exception:
    """A worker's error as WorkerFailed (try elsewhere), NoCapacity (full: try elsewhere,
    no breaker) or RouterError (the request's own fault)."""
    code = e.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RouterError(code, f"deadline exceeded during {what}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED or reason_of(e) == Reason.NO_CAPACITY:
        return NoCapacity(f"{worker.id}: {what}: {e.details()}", source=worker)
    if error_metadata(e).get("decode_reason") == Reason.RESERVATION_NOT_FOUND:
        # The decode worker let the reservation go before the KV came (stalled past the
        # lease, or restarted): its failure, not the request's; try again.
        return WorkerFailed(worker, f"{what}: reservation lost before the KV: {e.details()}")
    if _kv_invalid(e):
        return WorkerFailed(worker, f"{what}: the decode worker refused the KV: {e.details()}")
    if code in WORKER_FAILED_CODES:
        return WorkerFailed(worker, f"{what}: {code.name} {e.details()}")
    return RouterError(code, e.details() or f"{what} failed with {code.name}")


class WorkerClients:
    """One channel per worker address, shared by every request."""

    def __init__(self, channel_factory: Callable[[str], grpc.aio.Channel] | None = None):
        self._factory = channel_factory or (
            lambda addr: grpc.aio.insecure_channel(addr, options=WORKER_CHANNEL_OPTIONS)
        )
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self._factory(address)
        return ch

    def decode(self, address: str) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self.channel(address))

    def prefill(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        return prefill_pb2_grpc.PrefillStub(self.channel(address))

    async def release(self, address: str, request_id: str) -> None:
        """Frees a reservation or cancels a request; silent when it is already gone."""
        try:
            await self.decode(address).Release(
                decode_pb2.ReleaseRequest(request_id=request_id), timeout=5.0
            )
        except grpc.aio.AioRpcError:
            pass  # NOT_FOUND: already attached, finished or freed; UNAVAILABLE: worker gone

    async def forget(self, address: str) -> None:
        """Closes the channel to a worker that left the view (a pod replaced under a new
        address would otherwise keep one reconnecting for ever); one back gets a new one."""
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


class HandoffFailed(Exception):
    """A hand-off step failed; `at_decode` says whether the decode worker is to blame (its
    Reserve, or the KV push into it) rather than the prefill worker (its prefill, or KV the
    decode worker found invalid)."""

    def __init__(self, stage: str, error: grpc.aio.AioRpcError):
        super().__init__(f"{stage}: {error.code().name} {error.details()}")
        self.stage, self.error = stage, error

    @property
    def at_decode(self) -> bool:
        if _kv_invalid(self.error):
            return False  # the sender's pages: the decode worker stays usable co-located
        return self.stage in ("reserve", "kv push")


@dataclass(frozen=True)
class Handoff:
    reserve: decode_pb2.ReserveResponse
    prefill: prefill_pb2.PrefillResponse
    reserve_s: float  # Reserve round trip
    prefill_s: float  # Prefill round trip (compute and KV push)


async def handoff(
    clients: WorkerClients,
    decode_address: str,
    prefill_address: str,
    request_id: str,
    prompt: list[int],
    sampling: decode_pb2.SamplingParams | None = None,
    *,
    lease_ms: int = 60_000,
    transport: int = prefill_pb2.TRANSPORT_GRPC,
    resumed: int = 0,
    timeout: Callable[[], float | None] = lambda: None,
    on_first_token: Callable[[int, decode_pb2.ReserveResponse], None] | None = None,
) -> Handoff:
    """Reserves the prompt's pages on the decode worker and has the prefill worker compute
    the KV into that reservation; the caller then calls Decode.Generate with the same id.

    With `on_first_token`, the prefill is PrefillStream: on_first_token(token, reserve) runs
    as soon as the first token is sampled, before its KV is committed (the hand-off may still
    fail after it).

    On any failure after the Reserve, the reservation is released before this raises.
    Raises HandoffFailed for a worker's error; `timeout()` is asked before each call (it
    may raise, e.g. when the request's deadline has passed).
    """
    t0 = time.perf_counter()
    try:
        res = await clients.decode(decode_address).Reserve(
            decode_pb2.ReserveRequest(
                request_id=request_id, prompt_token_ids=prompt, lease_ms=lease_ms
            ),
            timeout=timeout(),
        )
    except grpc.aio.AioRpcError as e:
        raise HandoffFailed("reserve", e) from e
    t1 = time.perf_counter()
    req = prefill_pb2.PrefillRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling,
        decode_address=decode_address,
        cached_pages=res.cached_pages,
        page_size=res.page_size,
        transport=transport,
        resumed_tokens=resumed,
    )
    stub = clients.prefill(prefill_address)
    try:
        if on_first_token is None:
            pr = await stub.Prefill(req, timeout=timeout())
        else:
            pr = await _streamed(stub.PrefillStream(req, timeout=timeout()), on_first_token, res)
    except BaseException as e:
        # Give the pages back now rather than at the end of the lease.
        await clients.release(decode_address, request_id)
        if isinstance(e, grpc.aio.AioRpcError):
            # The push into the decode worker broke (it died or lost the reservation).
            stage = "kv push" if reason_of(e) == Reason.KV_HANDOFF_FAILED else "prefill"
            raise HandoffFailed(stage, e) from e
        raise
    return Handoff(res, pr, t1 - t0, time.perf_counter() - t1)


async def _streamed(call, on_first_token, reserve) -> prefill_pb2.PrefillResponse:
    """A PrefillStream call's PrefillResponse, with its first token handed on when it comes."""
    while (ev := await call.read()) is not grpc.aio.EOF:
        if ev.HasField("first_token"):
            on_first_token(ev.first_token.token, reserve)
        elif ev.HasField("done"):
            return ev.done
    # A broken prefill worker (the stream ended without its answer): fails as an error would.
    raise rpc_error(grpc.StatusCode.INTERNAL, "PrefillStream ended without a PrefillResponse")
