"""Errors between tiers: a gRPC status code plus a machine-readable reason.

The reason travels as a `google.rpc.ErrorInfo` (domain "megaserve") in the status details
(`grpc-status-details-bin` trailing metadata, the standard rich-status encoding), so callers
branch on `reason_of(error)`, never on message text. Message text is for people.

A refusal for capacity (RESOURCE_EXHAUSTED) also carries a hint: the trailing metadata entry
`retry-after-ms` (integer milliseconds) says when a retry may find room (`retry_after_ms_of`).
"""

from __future__ import annotations

import enum

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from megaserve.errors import DuplicateRequest, NoCapacity, RequestError

DOMAIN = "megaserve"
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata: integer milliseconds
# What a worker suggests when its queue is full: about the time a slot frees up.
DEFAULT_RETRY_AFTER_MS = 1000


class Reason(enum.StrEnum):
    """Why a tier refused or failed a call; one per distinct caller reaction."""

    INVALID_REQUEST = "INVALID_REQUEST"  # the request is bad: do not retry it anywhere
    DUPLICATE_REQUEST_ID = "DUPLICATE_REQUEST_ID"  # the id is already reserved or running here
    NO_CAPACITY = "NO_CAPACITY"  # full now (pages, queue): retry later or elsewhere
    DRAINING = "DRAINING"  # the worker is shutting down: go elsewhere
    UNKNOWN_REQUEST = "UNKNOWN_REQUEST"  # no live request or reservation with this id
    RELEASED = "RELEASED"  # the request was released (cancelled) by a Release call
    RESERVATION_NOT_FOUND = "RESERVATION_NOT_FOUND"  # KV for a reservation that is gone
    KV_TRANSFER_INVALID = "KV_TRANSFER_INVALID"  # a chunk or header failed validation
    KV_TRANSFER_INCOMPLETE = "KV_TRANSFER_INCOMPLETE"  # the push ended before every cell came
    # A prefill worker's push into the decode worker's reservation failed: the decode side
    # (or the path to it) is at fault, not the prefill worker.
    KV_HANDOFF_FAILED = "KV_HANDOFF_FAILED"
    # The worker's step computing this request failed (the worker goes on serving): another
    # worker, or this one later, may succeed.
    STEP_FAILED = "STEP_FAILED"


def rich_status(code: grpc.StatusCode, reason: Reason, message: str, **metadata: str):
    """A grpc.Status carrying `ErrorInfo(reason, domain, metadata)` in its details."""
    info = error_details_pb2.ErrorInfo(reason=reason.value, domain=DOMAIN, metadata=metadata)
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(info)
    return rpc_status.to_status(status)


async def abort(
    context,
    code: grpc.StatusCode,
    reason: Reason,
    message: str,
    *,
    retry_after_ms: int | None = None,
    **metadata: str,
):
    """Ends an aio RPC with code, message and a machine-readable reason; `retry_after_ms`
    adds the `retry-after-ms` trailing metadata entry (a refusal's retry hint)."""
    s = rich_status(code, reason, message, **metadata)
    trailing = tuple(s.trailing_metadata)
    if retry_after_ms is not None:
        trailing += ((RETRY_AFTER_KEY, str(max(int(retry_after_ms), 0))),)
    await context.abort(s.code, s.details, trailing_metadata=trailing)


def retry_after_ms_of(error: grpc.RpcError) -> int | None:
    """The `retry-after-ms` hint a tier attached to `error`, or None."""
    try:
        metadata = error.trailing_metadata() or ()
    except Exception:  # a call that never got trailers
        return None
    for key, value in metadata:
        if key == RETRY_AFTER_KEY:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None


def _error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    try:
        metadata = error.trailing_metadata() or ()
    except Exception:  # a call that never got trailers
        return None
    for key, value in metadata:
        if key != rpc_status.GRPC_DETAILS_METADATA_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info) and info.domain == DOMAIN:
                return info
    return None


def reason_of(error: grpc.RpcError) -> Reason | None:
    """The ErrorInfo reason a megaserve tier attached to `error`, or None (e.g. a transport
    failure, or a peer that sent no details)."""
    info = _error_info(error)
    try:
        return Reason(info.reason) if info else None
    except ValueError:
        return None


def error_metadata(error: grpc.RpcError) -> dict[str, str]:
    """The ErrorInfo metadata a megaserve tier attached (e.g. a hand-off's `decode_reason`)."""
    info = _error_info(error)
    return dict(info.metadata) if info else {}


def status_for(error: Exception) -> tuple[grpc.StatusCode, Reason]:
    """The code and reason a worker answers for one of the shared error types."""
    if isinstance(error, DuplicateRequest):
        return grpc.StatusCode.ALREADY_EXISTS, Reason.DUPLICATE_REQUEST_ID
    if isinstance(error, NoCapacity):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.NO_CAPACITY
    if isinstance(error, RequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_REQUEST
    raise TypeError(f"no status for {type(error).__name__}: {error}")


async def abort_for(context, error: Exception, retry_after_ms: int = DEFAULT_RETRY_AFTER_MS):
    """Ends an aio RPC for a DuplicateRequest / NoCapacity / RequestError; a NoCapacity
    refusal carries the `retry-after-ms` hint."""
    code, reason = status_for(error)
    hint = retry_after_ms if isinstance(error, NoCapacity) else None
    await abort(context, code, reason, str(error), retry_after_ms=hint)
